"""A port model of the forward's hot loops, as compiled, for CPUs we may not have.

    python bench/mca_model.py                       # the table, for the built extension
    python bench/mca_model.py --blocks 192x64 --D 64 --measured 0.77
    python bench/mca_model.py --show fa_qk_tile_f32_avx512   # a loop's body, as fed to llvm-mca
    python bench/mca_model.py --so ARM64.so --kernel sve256 --bf16   # an arm64 kernel's BFDOT tiles

It disassembles the installed extension (``objdump``), finds each hot function's
innermost loops (a backward branch with no other backward branch inside), picks the
loop the kernel spends its time in (the products: the loop with the most FMAs, the
6 x 4 register tile's 24; the softmax: the loop with the most ``vscalefps``; AMX: the
loop with the most ``tdpbf16ps``) and runs ``llvm-mca`` (LLVM 19: Debian's llvm-19)
on it for each CPU model.

Two corrections make the model usable, both measured rather than assumed:

* LLVM 19's ``sapphirerapids`` and ``icelake-server`` models put every 512-bit FMA,
  max and add on one port (p0 or p5), so they predict half the FMA rate this project
  measures on those Xeons (``fastattn.bench.fma_peak``: 64 float32 flops a cycle a
  core, two 512-bit FMA ports).  The Intel rows therefore use the
  ``skylake-avx512`` model, whose 512-bit port map (FMA, add, max on p0 and p5;
  shuffles, compares into masks on p5; loads on p2/p3) is the one Sapphire and
  Emerald Rapids kept for 512-bit work.  The LLVM ``sapphirerapids`` figure is
  printed beside it, to show the difference.
* LLVM 19's ``znver4`` model charges a broadcast from memory (``vbroadcastss m32,
  zmm``) one cycle of the FP1 pipe, which the FMAs need: it predicts the 6 x 4
  products at 80% of the peak, where the kernel measured them at 97-98% on a Zen 4
  (bench/NOTEBOOK.md, "Where a block's time goes").  The Zen 4 rows model a memory
  broadcast as the plain load it costs there (the loop fed to llvm-mca has
  ``vmovups`` in its place; the loads' count and ports are unchanged).
* Each CPU's FMA peak is the model's own: the cycles of a loop of 24 independent
  FMAs (``llvm-mca`` on it, the same way), so a predicted fraction is "the FMA work
  of the loop at the model's peak over the loop's modelled cycles".

The forward's prediction for a query block x key block (``--blocks``, ``--D``):
QK^T and P.V each do bq*bk*D/16 vector FMAs in the 24-FMA loop, and the softmax
bq*bk/16 vectors in its loop; predicted fraction of the peak = FMA cycles at the
peak / (QK^T + softmax + P.V modelled cycles).  What the model leaves out: the
tiles' prologues and epilogues (accumulator loads, stores, the column max, alpha),
folds, Q packing, and memory (everything is assumed in L1).  ``--measured`` (a
fraction of the measured FMA peak) prints the unmodelled remainder.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

MCA_CANDIDATES = ("llvm-mca-19", "/usr/lib/llvm-19/bin/llvm-mca")
# (label, model passed to -mcpu)
CPUS = (("Intel SPR/EMR (skx ports)", "skylake-avx512"),
        ("LLVM sapphirerapids", "sapphirerapids"),
        ("AMD Zen 4", "znver4"))
# per model: memory broadcasts fed to llvm-mca as plain loads (see above)
BCAST_AS_LOAD = {"znver4"}
BCAST = re.compile(r"^vbroadcastss\s+(\S*\(.*\)),(%zmm\d+)$")
QK, PV, SM = "QK^T register tile", "P.V register tile", "softmax (exp, sums, P store)"
LOOPS = ((QK, "fa_qk_tile_f32_avx512", "vfmadd"),
         (PV, "fa_pv_tile_f32_avx512", "vfmadd"),
         (SM, "fa_softmax_tile_f32_avx512", "vscalefps"),
         ("AMX row block: tile products", "fa_qblock_rows_amx", "tdpbf16ps"),
         ("AMX row block: softmax", "fa_qblock_rows_amx", "vscalefps"))
PEAK_LOOP = "".join(f"vfmadd231ps %zmm30, %zmm31, %zmm{i}\n" for i in range(24))

INSN = re.compile(r"^\s*([0-9a-f]+):\s+(.*?)\s*$")
BRANCH = re.compile(r"^(j[a-z]+)\s+([0-9a-f]+)\b")
# AArch64 (the NEON kernel of an arm64 build): conditional branches, compare-and-branch,
# test-and-branch, their target last
BRANCH_ARM = re.compile(r"^(b\.[a-z]+|b|cbn?z\s+[wx]\d+,|tbn?z\s+[wx]\d+,\s*#\d+,)\s*([0-9a-f]+)\b")
# The arm64 kernel's loops and the CPUs modelled for them (LLVM 19's scheduling models);
# the products' 5 x 4 tile is 20 fmla; the softmax's loop is the one with the most shl
# (one a vector: the exp's 2^n, 4 vectors of 4 logits a step; gcc writes most of the
# polynomial's steps as fmls, so counting fmla would not find it reliably).
ARM_CPUS = (("Neoverse V1", "neoverse-v1"), ("Neoverse V2", "neoverse-v2"),
            ("Neoverse N1", "neoverse-n1"), ("Apple M1", "apple-m1"))
ARM_LOOPS = ((QK, "fa_qk_tile_f32_neon", "fmla"),
             (PV, "fa_pv_tile_f32_neon", "fmla"),
             (SM, "fa_softmax_tile_f32_neon", "shl"))
# the SVE kernels (--kernel sve256 / sve128): 8 and 4 lanes, each modelled on the CPUs
# with its vector length (Neoverse V1: 256 bits; V2 and N2: 128); the softmax's loop by
# its fexpa (one a vector: the exp's 2^N)
SVE_CPUS = {"sve256": (("Neoverse V1", "neoverse-v1"),),
            "sve128": (("Neoverse V2", "neoverse-v2"), ("Neoverse N2", "neoverse-n2"))}
SVE_LANES = {"sve256": 8, "sve128": 4}


# --bf16: the bfloat16 pair kernels' products (BFDOT, kernels_arm_bf16.h) of an arm64
# kernel, the 5 x 4 tiles' 20 bfdot a step; each BFDOT does two multiply-adds a lane
QK_DP, PV_DP = "QK^T pair tile (bfdot)", "P.V pair tile (bfdot)"


def bf16_loops(kernel):
    return ((QK_DP, f"fa_qk_tile_dp_bdp_{kernel}", "bfdot"),
            (PV_DP, f"fa_pv_tile_dp_bdp_{kernel}", "bfdot"))


def bf16_peak_loop(kernel):
    if kernel == "neon":
        return "".join(f"bfdot v{i}.4s, v30.8h, v31.8h\n" for i in range(24))
    return "".join(f"bfdot z{i}.s, z30.h, z31.h\n" for i in range(24))


def sve_loops(kernel):
    return ((QK, f"fa_qk_tile_f32_{kernel}", "fmla"),
            (PV, f"fa_pv_tile_f32_{kernel}", "fmla"),
            (SM, f"fa_softmax_tile_f32_{kernel}", "fexpa"))


SVE_PEAK_LOOPS = ("".join(f"fmla z{i}.s, p0/m, z30.s, z31.s\n" for i in range(24)),)
# (two forms, the model's peak the faster: LLVM 19's apple-m1 model issues fmla by
# element on three units and the plain vector form on two)
ARM_PEAK_LOOPS = ("".join(f"fmla v{i}.4s, v30.4s, v31.4s\n" for i in range(24)),
                  "".join(f"fmla v{i}.4s, v30.4s, v31.s[{i % 4}]\n" for i in range(24)))


def find_mca():
    for c in MCA_CANDIDATES:
        if shutil.which(c) or os.path.exists(c):
            return shutil.which(c) or c
    sys.exit("llvm-mca from LLVM 19 not found: apt-get install llvm-19")


def objdump_for(so):
    """objdump for the extension's machine: the host's, or the AArch64 cross binutils'."""
    with open(so, "rb") as f:
        head = f.read(20)
    if head[18:20] == b"\xb7\x00":  # ELF e_machine EM_AARCH64
        for c in ("aarch64-linux-gnu-objdump", "llvm-objdump-19", "/usr/lib/llvm-19/bin/llvm-objdump"):
            if shutil.which(c) or os.path.exists(c):
                return shutil.which(c) or c
        sys.exit("no objdump for AArch64: apt-get install binutils-aarch64-linux-gnu")
    return "objdump"


def disassemble(so, symbol):
    """[(address, text)] of one function (AT&T syntax on x86, no raw bytes)."""
    objdump = objdump_for(so)
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", f"--disassemble={symbol}", so],
                         check=True, capture_output=True, text=True).stdout
    comment = "//" if objdump != "objdump" else "#"  # ('#' is AArch64's immediate)
    insns = []
    for line in out.splitlines():
        m = INSN.match(line)
        if m and m.group(2) and not m.group(2).startswith("("):
            insns.append((int(m.group(1), 16), re.sub(r"\s*<[^>]*>", "", m.group(2)).split(comment)[0].strip()))
    return insns


def innermost_loops(insns):
    """Each innermost loop as a list of instruction texts, its back branch last."""
    spans = []
    for i, (addr, text) in enumerate(insns):
        m = BRANCH.match(text) or BRANCH_ARM.match(text)
        if m and int(m.group(2), 16) <= addr:
            start = next((j for j, (a, _) in enumerate(insns) if a == int(m.group(2), 16)), None)
            if start is not None:
                spans.append((start, i))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[t for _, t in insns[a:b + 1]] for a, b in inner]


def pick(loops, key):
    """The loop with the most instructions starting with `key` (ties: the shortest)."""
    scored = [(sum(t.startswith(key) for t in body), -len(body), body) for body in loops]
    scored = [s for s in scored if s[0] > 0]
    return max(scored, key=lambda s: (s[0], s[1]))[2] if scored else None


def mca_source(body):
    """The loop as llvm-mca input: a label, the body, the back branch to the label."""
    lines = [".Lloop:"]
    for t in body:
        m = BRANCH.match(t) or BRANCH_ARM.match(t)
        lines.append(f"{m.group(1)} .Lloop" if m else t)
    return "\n".join(lines) + "\n"


def mca_cycles(mca, cpu, src, iterations=400):
    """Modelled cycles an iteration, and the busiest resources (name, cycles an iteration)."""
    if cpu in BCAST_AS_LOAD:
        src = "\n".join(BCAST.sub(r"vmovups \1,\2", line) for line in src.splitlines()) + "\n"
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write(src)
        path = f.name
    try:
        triple = [] if cpu in dict(CPUS).values() else ["-mtriple=aarch64-linux-gnu"]  # (x86 models: the host's triple)
        r = subprocess.run([mca, *triple, f"-mcpu={cpu}", f"-iterations={iterations}", "-resource-pressure",
                            "-timeline=false", path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "llvm-mca failed"
    total = int(re.search(r"Total Cycles:\s+(\d+)", r.stdout).group(1))
    names = dict(re.findall(r"^\[([\d.]+)\]\s+-\s+(\S+)", r.stdout, re.M))
    m = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", r.stdout)
    busy = []
    if m:
        keys = re.findall(r"\[([\d.]+)\]", m.group(1))
        vals = m.group(2).split()
        busy = sorted(((names.get(k, k), float(v)) for k, v in zip(keys, vals) if v != "-"),
                      key=lambda kv: -kv[1])[:3]
    return total / iterations, busy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", help="the extension (default: the installed fastattn._kernels)")
    ap.add_argument("--blocks", default="192x64", help="query x key block of the forward prediction")
    ap.add_argument("--D", type=int, default=64, help="head size of the forward prediction")
    ap.add_argument("--measured", type=float, help="measured forward, a fraction of the FMA peak")
    ap.add_argument("--show", help="print the picked loop of this symbol and exit")
    ap.add_argument("--kernel", choices=("neon", "sve256", "sve128"), default="neon",
                    help="which kernel of an arm64 build to model (default neon)")
    ap.add_argument("--bf16", action="store_true",
                    help="model that arm64 kernel's bfloat16 pair products (BFDOT) instead")
    args = ap.parse_args(argv)
    so = args.so
    if not so:
        import fastattn._kernels as k
        so = k.__file__
    mca = find_mca()
    arm = objdump_for(so) != "objdump"
    # per machine: the CPUs, the loops, the peak loop, the FMA mnemonics, the lanes of
    # a float32 vector and the mnemonic counted once a vector in the softmax's loop
    cpus, loops, peak_loops = (ARM_CPUS, ARM_LOOPS, ARM_PEAK_LOOPS) if arm else (CPUS, LOOPS, (PEAK_LOOP,))
    fma_ops, lanes, sm_vec = (("fmla",), 4, "shl") if arm else (("vfmadd", "vfmsub", "vfnmadd"), 16, "vscalefps")
    if arm and args.kernel != "neon":  # an SVE kernel, on the CPUs with its vector length
        cpus = SVE_CPUS[args.kernel]
        loops, peak_loops, fma_ops = sve_loops(args.kernel), SVE_PEAK_LOOPS, ("fmla", "fmad")
        lanes, sm_vec = SVE_LANES[args.kernel], "fexpa"
    if arm and args.bf16:
        return model_bf16(mca, so, args.kernel, cpus, args.blocks, args.D)
    bodies = {}
    for label, sym, key in loops:
        # (gcc may move a function's main loop into a split-off part: sym.part.0)
        body = pick([lp for name in (sym, sym + ".part.0") for lp in innermost_loops(disassemble(so, name))], key)
        if body:
            bodies[label] = (sym, key, body)
    if args.show:
        for label, (sym, key, body) in bodies.items():
            if sym == args.show:
                print(mca_source(body))
        return 0
    peak = {}
    for name, cpu in cpus:
        c = min(mca_cycles(mca, cpu, loop)[0] for loop in peak_loops)
        peak[cpu] = 24 / c  # vector FMAs a cycle in this model
    print(f"extension: {so}\nllvm-mca: {mca}\n")
    print(f"model FMA peak ({lanes * 32}-bit FMAs a cycle): " +
          ", ".join(f"{n} {peak[c]:.2f}" for n, c in cpus))
    rows, fma_count = {}, {}
    print(f"\n{'loop':32} {'insns':>5} {'FMA':>4}  " + "  ".join(f"{n:>28}" for n, _ in cpus))
    for label, (sym, key, body) in bodies.items():
        src = mca_source(body)
        nfma = fma_count[label] = sum(t.startswith(fma_ops) for t in body)
        cells = []
        for name, cpu in cpus:
            cyc, busy = mca_cycles(mca, cpu, src)
            rows[(label, cpu)] = cyc
            if cyc is None:
                cells.append(f"{'(' + busy[:24] + ')':>28}")
                continue
            top = ",".join(f"{n.replace('Port', 'p').replace('SKX', '').replace('SPR', '').replace('Zn4', '')}"
                           f" {v:.0f}" for n, v in busy[:2])
            frac = f" {nfma / peak[cpu] / cyc:4.0%}" if label != SM and not label.startswith("AMX") else ""
            cells.append(f"{cyc:6.1f} cy{frac} [{top}]".rjust(28))
        print(f"{label:32} {len(body):5d} {nfma:4d}  " + "  ".join(cells))
    bq, bk = (int(x) for x in args.blocks.lower().split("x"))
    D = args.D
    if all(n in bodies for n in (QK, PV, SM)):
        kern = args.kernel if arm else "avx512"
        print(f"\nforward, float32 {kern}, blocks {bq} x {bk}, D = Dv = {D} (one tile, all in L1):")
        vec_per_iter = sum(t.startswith(sm_vec) for t in bodies[SM][2])
        for name, cpu in cpus:
            cq, cp, cs = (rows[(n, cpu)] for n in (QK, PV, SM))
            if None in (cq, cp, cs):
                continue
            print(f"  {name:28} softmax: {cs / vec_per_iter * 16 / lanes:5.1f} cycles per 16 logits")
            fmas = bq * bk * D / lanes  # vector FMAs of each product
            cyc_qk, cyc_pv = fmas / fma_count[QK] * cq, fmas / fma_count[PV] * cp
            cyc_sm = bq * bk / lanes / vec_per_iter * cs
            ideal = 2 * fmas / peak[cpu]
            total = cyc_qk + cyc_pv + cyc_sm
            line = (f"  {name:28} QK^T {cyc_qk / total:5.1%}, softmax {cyc_sm / total:5.1%}, "
                    f"P.V {cyc_pv / total:5.1%} of the cycles; predicted {ideal / total:5.1%} of the peak")
            if args.measured is not None:
                line += f" (measured {args.measured:.1%}: {ideal / total - args.measured:+.1%} unmodelled)"
            print(line)
    return 0


def model_bf16(mca, so, kernel, cpus, blocks, D):
    """The BFDOT tiles of an arm64 kernel: each loop's cycles, its fraction of the
    model's BFDOT rate, and the multiply-adds a cycle it does against the float32
    tiles' peak (the same kernel's FMLA rate in the same model); then a block's
    predicted time on pairs against its float32 time (the same softmax loop; the
    pairs' packing of P and V, and everything the float32 prediction leaves out, left
    out of both)."""
    if kernel == "neon":  # the CPUs with FEAT_BF16 that run neon (Apple's; the Neoverse ones run SVE)
        cpus = (("Neoverse V1", "neoverse-v1"), ("Neoverse V2", "neoverse-v2"), ("Neoverse N2", "neoverse-n2"),
                ("Apple M2", "apple-m2"))
    fmla_peak = {cpu: 24 / min(mca_cycles(mca, cpu, loop)[0]
                               for loop in (SVE_PEAK_LOOPS if kernel != "neon" else ARM_PEAK_LOOPS))
                 for _, cpu in cpus}
    dp_peak = {cpu: 24 / mca_cycles(mca, cpu, bf16_peak_loop(kernel))[0] for _, cpu in cpus}
    print(f"extension: {so}\nllvm-mca: {mca}\n")
    print(f"{kernel}: vector instructions a cycle in each model, FMLA / BFDOT: " +
          ", ".join(f"{n} {fmla_peak[c]:.2f} / {dp_peak[c]:.2f}" for n, c in cpus))
    print(f"\n{'loop':32} {'insns':>5} {'DOT':>4}  " + "  ".join(f"{n:>40}" for n, _ in cpus))
    bodies = {}
    for label, sym, key in bf16_loops(kernel):
        # (gcc folds the forward's and the backward's identical tile functions into one,
        # the other name an alias that objdump's --disassemble does not find: try both)
        names = (sym, sym + ".part.0", sym.replace("_bdp_", "_bbw_"))
        body = pick([lp for name in names for lp in innermost_loops(disassemble(so, name))], key)
        if not body:
            print(f"{label:32} (no loop found in {sym})")
            continue
        src = mca_source(body)
        ndot = sum(t.startswith("bfdot") for t in body)
        cells = []
        for name, cpu in cpus:
            cyc, busy = mca_cycles(mca, cpu, src)
            if cyc is None:
                cells.append(f"{'(' + busy[:36] + ')':>40}")
                continue
            frac = ndot / dp_peak[cpu] / cyc
            # multiply-adds a cycle against the float32 tiles' FMLA peak: 2 a lane a BFDOT
            gain = 2 * ndot / cyc / fmla_peak[cpu]
            cells.append(f"{cyc:6.1f} cy {frac:4.0%} of BFDOT, {gain:.2f}x FMLA peak".rjust(40))
        print(f"{label:32} {len(body):5d} {ndot:4d}  " + "  ".join(cells))
        bodies[label] = (src, ndot)
    lanes = SVE_LANES.get(kernel, 4)
    f32 = {}
    for label, sym, key in (sve_loops(kernel) if kernel != "neon" else ARM_LOOPS):
        body = pick([lp for name in (sym, sym + ".part.0") for lp in innermost_loops(disassemble(so, name))], key)
        if body:
            count = sum(t.startswith(("fmla", "fmad")) for t in body) if label != SM else \
                sum(t.startswith("fexpa" if kernel != "neon" else "shl") for t in body)
            f32[label] = (mca_source(body), count)
    if len(bodies) < 2 or len(f32) < 3:
        return 0
    bq, bk = (int(x) for x in blocks.lower().split("x"))
    print(f"\nblock {bq} x {bk}, D = Dv = {D}, on pairs against float32 (the same softmax; P and V packing not modelled):")
    for name, cpu in cpus:
        cyc = {lab: mca_cycles(mca, cpu, src)[0] for lab, (src, _) in list(bodies.items()) + list(f32.items())}
        if None in cyc.values():
            continue
        fmas = bq * bk * D / lanes  # vector FMAs of each float32 product; half as many BFDOTs
        sm = bq * bk / lanes / f32[SM][1] * cyc[SM]
        t32 = fmas / f32[QK][1] * cyc[QK] + fmas / f32[PV][1] * cyc[PV] + sm
        t16 = fmas / 2 / bodies[QK_DP][1] * cyc[QK_DP] + fmas / 2 / bodies[PV_DP][1] * cyc[PV_DP] + sm
        print(f"  {name:28} float32 {t32:8.0f} cycles, pairs {t16:8.0f}: {t32 / t16:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
