"""Bit-for-bit A/B of two builds of fastattn: the digest of every output of a few
hundred calls that cover every path (the guard-page sweep's calls, tests/guard_sweep.py:
prefill, decode and split-KV, varlen, weights, backward, key mass, stats, merge, every
variant and combination, every dtype pair, both layouts, strided views, 1-3 threads,
each CPU kernel this machine runs), recorded under one build and compared with another.

    python tests/ab_bits.py record before.json [--cases 600] [--seed 7] [--no-offsets]
    (rebuild)
    python tests/ab_bits.py record after.json
    python tests/ab_bits.py compare before.json after.json   # exit 1 if any bit differs

Run it from outside the source tree (or with an in-place build), so that the fastattn
imported is the build under test; the file records which one it was.  A re-layout of
the code must leave every digest unchanged.
"""
import argparse
import hashlib
import json
import sys

import numpy as np

import fastattn
import guard_sweep


def digest(x):
    """sha256 of an output's dtype, shape and bytes."""
    x = np.ascontiguousarray(x)
    h = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
    h.update(x.tobytes())
    return h.hexdigest()


def record(n, seed, offsets=True):
    """{case index: {output name: digest}} for cases 0..n-1 of the sweep's (n, seed)
    (without q_offset/k_offset when not `offsets`: builds before them)."""
    out = {}
    for c in guard_sweep.cases(n, seed, offsets):
        c2, nat, _ = guard_sweep.prepare(c)
        res = guard_sweep.call(c2, dict(nat, native=nat), None)
        out[str(c["i"])] = {name: digest(x) for name, x in res}
    return out


def compare(a, b):
    """The cases whose outputs differ between two recordings (or that one lacks)."""
    bad = []
    for i in sorted(set(a) | set(b), key=int):
        if a.get(i) != b.get(i):
            names = sorted(set(a.get(i, {})) | set(b.get(i, {})))
            bad.append((i, [n for n in names if a.get(i, {}).get(n) != b.get(i, {}).get(n)]))
    return bad


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("file")
    r.add_argument("--cases", type=int, default=600)
    r.add_argument("--seed", type=int, default=7)
    r.add_argument("--no-offsets", action="store_true",
                   help="leave out q_offset/k_offset (to compare with a build before them)")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        doc = {"fastattn": fastattn.__file__, "cases": args.cases, "seed": args.seed,
               "offsets": not args.no_offsets, "kernels": fastattn._kernels.supported_kernels(),
               "digests": record(args.cases, args.seed, not args.no_offsets)}
        with open(args.file, "w") as f:
            json.dump(doc, f, indent=0, sort_keys=True)
        outputs = sum(len(d) for d in doc["digests"].values())
        print(f"recorded {outputs} outputs of {args.cases} calls (seed {args.seed}) of "
              f"{doc['fastattn']} into {args.file}")
        return 0
    docs = []
    for path in (args.a, args.b):
        with open(path) as f:
            docs.append(json.load(f))
    calls = [(d["cases"], d["seed"], d.get("offsets", True)) for d in docs]
    if calls[0] != calls[1]:
        print("the two recordings are of different calls (cases/seed/offsets differ)")
        return 2
    bad = compare(docs[0]["digests"], docs[1]["digests"])
    cases = guard_sweep.cases(*calls[0])
    for i, names in bad[:50]:
        print(f"case {i}: {', '.join(names)} differ: {guard_sweep.describe(cases[int(i)])}")
    total = sum(len(d) for d in docs[0]["digests"].values())
    print(f"{len(bad)} of {len(docs[0]['digests'])} calls differ ({total} outputs compared)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
