"""The guard-page sweep: seeded calls of every public function with every array it
reads or writes placed against inaccessible pages (tests/guardpages.py), checked
against the float64 oracle.

`cases(n, seed)` draws the calls as plain dicts: the function (attention, with stats,
attention_weights, attention_backward, key_mass, varlen_attention, merge), the CPU
kernel (each one this machine runs, in turn), the dtypes (float32, float64, float16
and bfloat16 caches, 16-bit q), the layout and rank, GQA, the memory layout of each
array (contiguous, strided rows, swapped axes, a reversed L axis), the variants and
their combinations (causal both ways, windows, masks and biases of every broadcast
shape, ALiBi, softcap, dropout, seqlens_k, q_offset/k_offset), Lq != Lk both ways, L = 0 / 1 and lengths
off every block grid, decode shapes for the split-KV path, 1-3 threads, out=.

`run(case)` performs one call twice, with every array flush against the guard page
after it and then against the one before it, and returns None or what went wrong.
A stray read or write is a SIGSEGV: `python guard_sweep.py N SEED FIRST` runs cases
FIRST.. in this process, printing "start i" before each and "ok i" / "fail i: why"
after, so the parent (tests/test_guard_pages.py) knows which call killed it, reports
it, and starts a new worker after it.
"""
import json
import os
import sys
import traceback

import numpy as np

import fastattn
from fastattn import _kernels, reference

from guardpages import guarded

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency of fastattn
    BF16 = None
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

FUNCTIONS = ["attention"] * 6 + ["stats", "weights", "weights", "backward", "backward",
                                 "backward", "key_mass", "varlen", "merge"]
LENGTHS = [0, 1, 1, 2, 7, 15, 16, 17, 31, 33, 41, 63, 64, 65, 100, 150, 193, 300]
DECODE_LK = [513, 700, 1025, 1100]
DIMS = [1, 3, 8, 16, 24, 64]
WINDOWS = [(6, 3), (0, 0), (None, 2), (4, None), (40, 0), (0, 5), (2 ** 40, 0), (3, -1), (-1, 1)]
HOWS = ["contig"] * 3 + ["rows", "swapped", "reversed"]


def _dtypes_for(fn, r):
    """(q dtype, k/v dtype) names for function fn."""
    opts = [("f32", "f32")] * 4 + [("f64", "f64")] * 3
    if fn in ("attention", "stats", "key_mass"):
        opts += [("f32", "f16"), ("f16", "f16")]
    if BF16 is not None and fn != "stats":
        opts += [("bf16", "bf16")] + ([("f32", "bf16")] if fn in ("attention", "key_mass") else [])
    return opts[r.integers(len(opts))]


def cases(n, seed, offsets=True):
    """n calls, the same for the same (n, seed); without q_offset/k_offset when not
    `offsets` (and otherwise the same calls)."""
    r = np.random.default_rng(seed)
    ro = np.random.default_rng([seed, 7])
    rs = np.random.default_rng([seed, 11])  # sinks (newer than ab_bits' older builds)
    kernels = _kernels.supported_kernels()
    # bfloat16 q/k/v on the avx512 kernel alternate between the bfloat16 paths
    paths = _kernels.bf16_paths() if hasattr(_kernels, "bf16_paths") else ["float32"]
    out = []
    for i in range(n):
        fn = FUNCTIONS[r.integers(len(FUNCTIONS))]
        dq, dkv = _dtypes_for(fn, r)
        c = dict(i=i, fn=fn, kernel=kernels[i % len(kernels)], dq=dq, dkv=dkv,
                 seed=int(r.integers(2 ** 31)), threads=int(r.choice([1, 2, 3])),
                 bf16_path=paths[i // len(kernels) % len(paths)])
        c["nd"] = 3 if fn == "varlen" else int(r.choice([2, 3, 4, 4, 4]))
        c["layout"] = "bshd" if fn == "varlen" else str(r.choice(["bhsd", "bhsd", "bshd"]))
        Hkv = int(r.choice([1, 1, 2, 3])) if c["nd"] > 2 else 1
        G = int(r.choice([1, 1, 2, 4])) if c["nd"] > 2 else 1
        B = int(r.choice([1, 2, 3])) if c["nd"] == 4 else 1
        Lq, Lk = int(r.choice(LENGTHS)), int(r.choice(LENGTHS))
        if r.random() < 0.15:  # decoding against a cache longer than one key chunk
            Lq, Lk = int(r.choice([1, 1, 2, 4, 8])), int(r.choice(DECODE_LK))
        if r.random() < 0.2:  # more queries than keys by far
            Lq, Lk = int(r.choice([150, 300])), int(r.choice([1, 7, 41]))
        D, Dv = int(r.choice(DIMS)), int(r.choice(DIMS + [5, 19]))
        c.update(B=B, Hkv=Hkv, Hq=Hkv * G, Lq=Lq, Lk=Lk, D=D, Dv=Dv)
        c["how"] = [str(r.choice(HOWS)) for _ in range(6)]  # q, k, v, dout, out, lse
        kw = {}
        if r.random() < 0.5:
            kw["causal"] = [True, "top-left", "bottom-right"][r.integers(3)]
        if r.random() < 0.4:
            kw["window"] = list(WINDOWS[r.integers(len(WINDOWS))])
        if r.random() < 0.2 and fn != "varlen":
            c["mask"] = _bshape(r, c)
        if r.random() < 0.2 and fn != "varlen":
            c["bias"] = _bshape(r, c)
        if r.random() < 0.2:
            c["alibi"] = [c["Hq"]] if c["nd"] < 4 or fn == "varlen" or r.random() < 0.5 \
                else [B, c["Hq"]]
        if r.random() < 0.2:
            kw["softcap"] = float(r.choice([1.0, 5.0, 30.0]))
        if r.random() < 0.15 and fn in ("attention", "weights", "backward", "varlen") \
                and dkv != "f16":
            kw["dropout_p"] = float(r.choice([0.1, 0.5]))
            kw["seed"] = int(r.integers(2 ** 40))
        # positions in a longer sequence, from their own stream (`offsets` False leaves
        # the other draws as they were, for tests/ab_bits.py against older builds)
        qo, ko = int(ro.choice([0, 3, 17, 200, 5000, -9])), int(ro.choice([0, 5, 64, 300, -4]))
        if ro.random() < 0.2 and offsets and fn not in ("varlen", "merge") \
                and kw.get("causal") != "top-left":
            kw["q_offset"] = qo
            if ro.random() < 0.7:
                kw["k_offset"] = ko
        if rs.random() < 0.2 and offsets and fn in ("attention", "stats", "weights", "backward"):
            c["sinks"] = True
        if r.random() < 0.25 and c["nd"] == 4 and fn not in ("varlen", "merge"):
            c["seqlens_k"] = [int(x) for x in r.integers(0, Lk + 1, B)]
        if fn in ("attention", "varlen") and r.random() < 0.5:
            kw["return_lse"] = True
        if fn == "attention" and r.random() < 0.25 and dq != "f16":
            c["out"] = True
        if fn == "varlen":
            nseq = int(r.integers(1, 5))
            c["lq"] = [int(x) for x in r.choice(LENGTHS[:14], nseq)]
            c["lk"] = [int(x) for x in r.choice(LENGTHS[:14], nseq)]
        if fn == "merge":
            c["parts"] = int(r.integers(1, 4))
        c["kw"] = kw
        out.append(c)
    return out


def _bshape(r, c):
    """A mask/bias shape broadcastable to the logits' (of the call's rank)."""
    full = [c["B"], c["Hq"], c["Lq"], c["Lk"]][4 - c["nd"]:]
    return [f if r.random() < 0.6 else 1 for f in full]


def _dt(name):
    return {"f32": F32, "f64": F64, "f16": F16, "bf16": BF16}[name]


def _user(c, b, h, l, d):
    shape = (b, h, l, d)[4 - c["nd"]:]
    if c["layout"] == "bshd" and c["nd"] > 2:
        shape = shape[:-3] + (shape[-2], shape[-3], shape[-1])
    return shape


def _tol(c):
    """Relative error allowed against the oracle, by q's dtype (16-bit K/V with a
    float32 q are held to float32's: the oracle sees the same 16-bit values)."""
    return {"f64": 1e-10, "f32": 2e-4, "f16": 3e-3, "bf16": 3e-2}[c["dq"]]


def _err(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        return f"shape {x.shape} != {ref.shape}"
    if not ref.size:
        return 0.0
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), fin) or not np.array_equal(x[~fin], ref[~fin]):
        return "non-finite entries differ"
    # relative to the largest reference value, or absolute below 1 (a broadcast bias's
    # gradient is a sum of terms that cancel: relative to it, rounding looks huge)
    scale = max(float(np.max(np.abs(ref[fin]), initial=0.0)), 1.0)
    return float(np.max(np.abs(x[fin] - ref[fin]), initial=0.0)) / scale


def _inputs(c):
    """The call's arrays as ordinary NumPy arrays (the values of the guarded copies)."""
    r = np.random.default_rng(c["seed"])
    dq, dkv = _dt(c["dq"]), _dt(c["dkv"])
    B, Hq, Hkv, Lq, Lk, D, Dv = (c[x] for x in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "Dv"))
    if c["fn"] == "varlen":
        Lq, Lk = sum(c["lq"]), sum(c["lk"])
    a = {"q": r.standard_normal(_user(c, B, Hq, Lq, D)).astype(dq),
         "k": r.standard_normal(_user(c, B, Hkv, Lk, D)).astype(dkv),
         "v": r.standard_normal(_user(c, B, Hkv, Lk, Dv)).astype(dkv)}
    if "mask" in c:
        m = r.random(c["mask"]) > 0.3
        a["mask"] = m
    if "bias" in c:
        a["bias"] = r.standard_normal(c["bias"]).astype(F64 if dq == F64 else F32)
    if "alibi" in c:
        a["alibi_slopes"] = r.uniform(0.01, 0.5, c["alibi"]).astype(F64 if dq == F64 else F32)
    if "seqlens_k" in c:
        a["seqlens_k"] = np.array(c["seqlens_k"], np.int64)
    if c.get("sinks"):
        a["sinks"] = np.random.default_rng([c["seed"], 11]).normal(0, 2, Hq).astype(
            F64 if dq == F64 else F32)
    if c["fn"] == "backward":
        a["dout"] = r.standard_normal(_user(c, B, Hq, Lq, Dv)).astype(dq)
    if c["fn"] == "varlen":
        a["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(c["lq"])]).astype(np.int64)
        a["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(c["lk"])]).astype(np.int64)
    return a


HOW_OF = {"q": 0, "k": 1, "v": 2, "dout": 3, "out": 4, "lse": 5}
VARIANT_ARRAYS = ("mask", "bias", "alibi_slopes", "sinks", "seqlens_k")


def _variants(arrays, oracle=False):
    """The call's variant arrays among `arrays` (for the oracle: without seqlens_k,
    which it does not take; _per_sequence_oracle does that part)."""
    names = VARIANT_ARRAYS[:4] if oracle else VARIANT_ARRAYS
    return {n: arrays[n] for n in names if n in arrays}


def _compare(pairs, tol, what=""):
    """None if every (result, oracle) pair agrees within tol, else the first that does not."""
    for name, x, ref in pairs:
        e = _err(x, ref)
        if isinstance(e, str) or e > tol:
            return f"{what}{name}: error {e} against the oracle (tolerance {tol})"
    return None


def _padded_oracle(c, a, ref_fn, drop):
    """The per-sequence oracle of a (..., Lk)-shaped result (weights, key mass): keys
    past seqlens_k[b] are 0.  `drop`: axes of q's shape the result does not have."""
    def one(q, k, v, n, kw1):
        full = np.zeros(q.shape[:q.ndim - drop] + (c["Lk"],))
        full[..., :n] = ref_fn(q, k, **kw1)
        return full
    return np.stack(_per_sequence_oracle(c, a, one))


def _f64(a):
    """The arrays for the oracle: floats as float64 (the same values)."""
    return {n: x.astype(F64) if x.dtype.kind in "fV" else x for n, x in a.items()}


def _guard(c, a, place):
    return {n: guarded(x, place, c["how"][HOW_OF[n]] if n in HOW_OF else "contig")
            for n, x in a.items()}


def _per_sequence_oracle(c, a, fn):
    """The oracle with seqlens_k: each sequence b alone on its first seqlens_k[b] keys
    (its mask, bias and slopes broadcast to the full logits and sliced)."""
    B, Hq, Lq, Lk = c["B"], c["Hq"], c["Lq"], c["Lk"]
    sw = (lambda x: x.swapaxes(1, 2)) if c["layout"] == "bshd" else (lambda x: x)
    q, k, v = (sw(np.asarray(a[n], np.float64)) for n in ("q", "k", "v"))
    full = (B, Hq, Lq, Lk)
    mask = np.broadcast_to(a["mask"], full) if "mask" in a else None
    bias = np.broadcast_to(a["bias"], full) if "bias" in a else None
    al = np.broadcast_to(a["alibi_slopes"], (B, Hq)) if "alibi_slopes" in a else None
    res = []
    for b, n in enumerate(c["seqlens_k"]):
        kw = dict(c["kw"], mask=None if mask is None else mask[b, :, :, :n],
                  bias=None if bias is None else bias[b, :, :, :n],
                  alibi_slopes=None if al is None else al[b],
                  **({"sinks": a["sinks"]} if "sinks" in a else {}))
        for name in ("return_lse", "dropout_p", "seed", "layout"):  # (the arrays are bhsd here)
            kw.pop(name, None)
        res.append(fn(q[b], k[b, :, :n], v[b, :, :n], n, kw))
    return res


def _place(x, place, how, writable=False):
    """x in guarded memory at `place`, or x itself when place is None (plain arrays)."""
    return x if place is None else guarded(x, place, how, writable)


def call(c, g, place):
    """Case c's call (c as `prepare` returns it) on the arrays g: guarded ones with
    `place`, or the plain ones with place None.  Returns its outputs as a list of
    (name, array)."""
    fn, kw, th, nat = c["fn"], dict(c["kw"]), c["threads"], g["native"]
    if fn in ("attention", "stats"):
        want_lse = kw.pop("return_lse", False)
        args = _variants(g)
        if c.get("out"):
            oshape = nat["q"].shape[:-1] + (nat["v"].shape[-1],)
            args["out"] = _place(np.full(oshape, np.nan, nat["q"].dtype), place, c["how"][4], True)
        res = fastattn.attention(g["q"], g["k"], g["v"], return_lse=want_lse,
                                 return_stats=fn == "stats", num_threads=th, **kw, **args)
        res = res if isinstance(res, tuple) else (res,)
        if "out" in args and res[0] is not args["out"]:
            raise AssertionError("out= was not returned")
        named = [("out", res[0])] + ([("lse", res[1])] if want_lse else [])
        if fn == "stats":
            named += [("entropy", res[-1].entropy), ("max_weight", res[-1].max_weight)]
        return named
    if fn == "weights":
        return [("weights", fastattn.attention_weights(g["q"], g["k"], num_threads=th, **kw,
                                                       **_variants(g)))]
    if fn == "key_mass":
        kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
        return [("key_mass", fastattn.key_mass(g["q"], g["k"], num_threads=th, **kw, **_variants(g)))]
    if fn == "backward":  # out and lse from the forward on the plain arrays, then placed
        out, lse = fastattn.attention(nat["q"], nat["k"], nat["v"], return_lse=True, **kw,
                                      **_variants(nat))
        grads = fastattn.attention_backward(
            g["dout"], g["q"], g["k"], g["v"], _place(out, place, c["how"][4]),
            _place(lse, place, c["how"][5]), num_threads=th, return_dbias="bias" in c,
            return_dsinks="sinks" in g, **kw, **_variants(g))
        return [("fwd_out", out), ("fwd_lse", lse)] + list(zip(_grad_names(c), grads))
    if fn == "varlen":
        want_lse = kw.pop("return_lse", False)
        res = fastattn.varlen_attention(g["q"], g["k"], g["v"], g["cu_seqlens_q"], g["cu_seqlens_k"],
                                        return_lse=want_lse, num_threads=th, **kw,
                                        **{n: g[n] for n in ("alibi_slopes",) if n in g})
        return list(zip(("out", "lse"), res if isinstance(res, tuple) else (res,)))
    # merge: partials over disjoint key ranges of the plain arrays, placed, merged
    ax = -3 if c["layout"] == "bshd" and c["nd"] > 2 else -2
    cuts = np.linspace(0, nat["k"].shape[ax], c["parts"] + 1).astype(int)
    outs, lses = [], []
    for p in range(c["parts"]):
        sl = [slice(None)] * nat["k"].ndim
        sl[ax] = slice(cuts[p], cuts[p + 1])
        o, l = fastattn.attention(nat["q"], nat["k"][tuple(sl)], nat["v"][tuple(sl)],
                                  return_lse=True, layout=c["layout"])
        outs.append(_place(o, place, c["how"][4]))
        lses.append(_place(l, place, c["how"][5]))
    return list(zip(("out", "lse"), fastattn.merge(outs, lses, layout=c["layout"])))


def _oracle_pairs(c, res, a):
    """(name, result, oracle value) for the outputs of `call` that the oracle gives."""
    fn, kw, got = c["fn"], dict(c["kw"]), dict(res)
    kw.pop("return_lse", None)
    sw = (lambda x: x.swapaxes(1, 2)) if c["layout"] == "bshd" else (lambda x: x)
    if fn in ("attention", "stats") and "seqlens_k" in c:
        refs = _per_sequence_oracle(c, a, lambda q, k, v, n, kw1: reference.attention(
            q, k, v, return_lse=True, **kw1))
        pairs = [("lse", got["lse"], np.stack([r[1] for r in refs]))] if "lse" in got else []
        if "dropout_p" not in kw:  # (the per-sequence oracle has no dropout: the lse holds)
            pairs.append(("out", sw(np.asarray(got["out"], F64)), np.stack([r[0] for r in refs])))
        return pairs
    if fn in ("attention", "stats"):
        extra = _variants(a, oracle=True)
        ro, rl = reference.attention(a["q"], a["k"], a["v"], return_lse=True, **kw, **extra)
        pairs = [("out", got["out"], ro)] + ([("lse", got["lse"], rl)] if "lse" in got else [])
        if fn == "stats":
            ent, _, mx = reference.attention_stats(a["q"], a["k"], **kw, **extra)
            pairs += [("entropy", got["entropy"], ent), ("max_weight", got["max_weight"], mx)]
        return pairs
    if fn in ("weights", "key_mass"):
        ref_fn, drop = (reference.attention_weights, 1) if fn == "weights" else (reference.key_mass, 2)
        if fn == "key_mass":
            kw = {n: x for n, x in kw.items() if n not in ("dropout_p", "seed")}
        if "seqlens_k" not in c:
            return [(fn, got[fn], ref_fn(a["q"], a["k"], **kw, **_variants(a, oracle=True)))]
        if "dropout_p" in kw:  # (no per-sequence oracle with dropout)
            return []
        return [(fn, got[fn], _padded_oracle(c, a, ref_fn, drop))]
    if fn == "backward":
        if "seqlens_k" in c:  # (checked bitwise against the plain call instead, in run)
            return []
        ref = reference.attention_backward(
            a["dout"], a["q"], a["k"], a["v"], got["fwd_out"].astype(F64),
            got["fwd_lse"].astype(F64), return_dbias="bias" in c, return_dsinks="sinks" in a,
            **kw, **_variants(a, oracle=True))
        return [(n, got[n], r) for n, r in zip(_grad_names(c), ref)]
    if fn == "varlen":
        ref = reference.varlen_attention(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                         return_lse=True, **kw,
                                         **{n: a[n] for n in ("alibi_slopes",) if n in a})
        return [(n, got[n], r) for n, r in zip(("out", "lse"), ref) if n in got]
    ro, rl = reference.attention(a["q"], a["k"], a["v"], return_lse=True, layout=c["layout"])
    return [("out", got["out"], ro), ("lse", got["lse"], rl)]


def _grad_names(c):
    """The names of attention_backward's results for case c."""
    return ["dq", "dk", "dv"] + ["dbias"] * ("bias" in c) + ["dsinks"] * bool(c.get("sinks"))


def _case_tol(c):
    if c["fn"] == "backward":
        return {"bf16": 3e-2, "f64": 1e-9}.get(c["dq"], 1e-3)
    if c["fn"] == "key_mass":
        return 1e-9 if c["dq"] == "f64" else 1e-3
    return _tol(c)


def prepare(c):
    """The case ready to call: its kernel set, its keywords as the functions take them,
    its arrays (native dtypes) and the oracle's float64 copies."""
    _kernels.set_kernel(c["kernel"])
    if hasattr(_kernels, "set_bf16_path"):
        _kernels.set_bf16_path(c.get("bf16_path", "float32"))
    nat = _inputs(c)
    c = dict(c, kw=dict(c["kw"]))
    if c["fn"] not in ("varlen", "merge"):
        c["kw"]["layout"] = c["layout"]
    if "window" in c["kw"]:
        c["kw"]["window"] = tuple(c["kw"]["window"])
    return c, nat, _f64(nat)


def run(c):
    """One case, with its arrays flush against the page after them, then against the
    page before them; None if both calls passed, else what went wrong."""
    c, nat, a = prepare(c)
    for place in ("end", "start"):
        g = _guard(c, nat, place)
        g["native"] = nat
        res = call(c, g, place)
        if c["fn"] == "backward" and "seqlens_k" in c:
            plain = call(c, dict(nat, native=nat), None)
            same = all(np.array_equal(np.asarray(x, F64), np.asarray(y, F64), equal_nan=True)
                       for (_, x), (_, y) in zip(res, plain))
            why = None if same else "gradients differ from the same call on plain arrays"
        else:
            why = _compare(_oracle_pairs(c, res, a), _case_tol(c), c["fn"] + " ")
        if why:
            return f"[{place}] {why}"
    return None


def describe(c):
    return json.dumps(c, sort_keys=True)


def main(argv):
    n, seed, first = (int(x) for x in argv[:3])
    import faulthandler
    faulthandler.enable()
    for c in cases(n, seed)[first:]:
        print(f"start {c['i']}", flush=True)
        try:
            why = run(c)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            why = "raised " + traceback.format_exc().strip().splitlines()[-1]
        print(f"ok {c['i']}" if why is None else f"fail {c['i']}: {why}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    sys.exit(main(sys.argv[1:]))
