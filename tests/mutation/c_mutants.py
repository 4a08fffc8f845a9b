"""Scripted C-level mutants: each plants one plausible kernel/driver bug in a scratch
copy of the repository, builds it, and runs the fast part of the test suite there.
A mutant is killed when that run fails.

    python tests/mutation/c_mutants.py [--keep] [--only NAME ...]

Takes about 1 minute per mutant on 2 cores (the build dominates).  Writes a table
to stdout; tests/README.md records the last result.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = ["tests/test_oracle.py", "tests/test_variants.py", "tests/test_decode.py",
         "tests/test_threads.py", "tests/test_out.py", "tests/test_f16_variants.py"]

# (name, file, text to find (must occur exactly once), replacement, the bug it stands for)
MUTANTS = [
    ("skip-rescale", "src_c/kern_products.h",
     "for (int r = 0; r < R; r++) rescale |= alpha[r] != (FA_T)1;",
     "for (int r = 0; r < R; r++) rescale |= 0;",
     "P.V never rescales the running output when a row's max grows"),
    ("qk-feature-tail", "src_c/kernels_tmpl.h",
     "            if (tail) a = FA_VFMA(FA_VLOAD(q + full), FA_KV_LOADU_N(ki + full, tail), a);",
     "            if (tail > 1) a = FA_VFMA(FA_VLOAD(q + full), FA_KV_LOADU_N(ki + full, tail - 1), a);",
     "the decode dot product drops the last feature of a D that is not a multiple of the vector"),
    ("pv-value-tail", "src_c/kern_products.h",
     "        int tail = (int)(w % FA_VL);",
     "        int tail = (int)(w % FA_VL); if (tail > 1) tail--;",
     "P.V writes one value column too few in the last partial vector"),
    ("window-block-edge", "src_c/fa_plan.c",
     "right >= 0 ? it->q0 + it->nq - 1 + diag + right + 1 : Lk, Lk, &it->kv0, &it->kv1);",
     "right >= 0 ? it->q0 + it->nq - 1 + diag + right : Lk, Lk, &it->kv0, &it->kv1);",
     "the key range of a query block stops one key short of the causal/window edge"),
    ("copy-head-stride", "src_c/fa_plan.c",
     "    const char *k = (const char *)p->k + (size_t)((b * p->k_sb + g * p->k_sh + koff * p->k_sl) * (int64_t)item);",
     "    const char *k = (const char *)p->k + (size_t)((b * p->k_sb + g * p->v_sh + koff * p->k_sl) * (int64_t)item);",
     "strided K/V copied with v's head stride (wrong when D != Dv)"),
    ("split-chunk-tail", "src_c/fa_forward.c",
     "it.kv1 < (c + 1) * chunk ? it.kv1 : (c + 1) * chunk, it.Lk, &it.kv0, &it.kv1);",
     "it.kv1 < (c + 1) * chunk ? it.kv1 : (c + 1) * chunk - 1, it.Lk, &it.kv0, &it.kv1);",
     "split-KV decoding skips the last key of every chunk but the last"),
    ("threads-ignored", "src_c/fa_forward.c",
     "    int nth = p->num_threads > 0 ? p->num_threads : fa_max_threads();",
     "    int nth = fa_max_threads();",
     "the driver ignores num_threads (results identical, so only the thread counter sees it)"),
    ("lse-without-log", "src_c/kernels_tmpl.h",
     ": sc.m[r] + (FA_T)log((double)sc.l[r]);",
     ": sc.m[r];",
     "lse written as the row max, without log(sum)"),
    ("gqa-group", "src_c/fa_plan.c",
     "    fa_item_make(p, pl, b, (u % per_qb) / pl->nhc, u % pl->nhc, qb, it);",
     "    fa_item_make(p, pl, b, (u % per_qb) / pl->nhc, 0, qb, it);",
     "GQA: every head chunk of a group computes the first chunk's query heads"),
]


def run(name, path, old, new, keep, log):
    work = tempfile.mkdtemp(prefix=f"fa-cmut-{name}-")
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
        for f in files:
            os.makedirs(os.path.dirname(os.path.join(work, f)) or work, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(work, f))
        for f in TESTS:  # new test files may not be committed yet
            if os.path.exists(os.path.join(ROOT, f)):
                shutil.copy2(os.path.join(ROOT, f), os.path.join(work, f))
        src = open(os.path.join(work, path)).read()
        if src.count(old) != 1:
            return "stale", f"the text to mutate occurs {src.count(old)} times in {path}"
        open(os.path.join(work, path), "w").write(src.replace(old, new))
        b = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work,
                           capture_output=True, text=True)
        if b.returncode:
            return "build-failed", b.stderr[-2000:]
        tests = [t for t in TESTS if os.path.exists(os.path.join(work, t))]
        t = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                           cwd=work, capture_output=True, text=True)
        log.write(f"==== {name}\n{t.stdout[-3000:]}\n")
        if t.returncode == 0:
            return "SURVIVED", ""
        first = next((ln for ln in t.stdout.splitlines() if ln.startswith("FAILED")), "")
        return "killed", first
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    killed = total = 0
    with open(os.path.join(tempfile.gettempdir(), "fa-cmut.log"), "w") as log:
        for name, path, old, new, what in MUTANTS:
            if args.only and name not in args.only:
                continue
            t0 = time.time()
            status, detail = run(name, path, old, new, args.keep, log)
            total += 1
            killed += status == "killed"
            print(f"{name:<20} {status:<12} {time.time() - t0:5.0f}s  {what}\n    {detail[:200]}", flush=True)
    print(f"C mutants killed: {killed}/{total}")
    return 0 if killed == total else 1


if __name__ == "__main__":
    sys.exit(main())
