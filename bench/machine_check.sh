#!/usr/bin/env bash
# One prepared run for a machine met once (more cores, or instructions the usual one
# lacks: AVX-512, AVX512-BF16, AMX): what the CPU is, an in-place build, the FMA and
# bf16 peaks, the test suite under every kernel the CPU runs (pytest-xdist), then the
# bf16 bench, the thread scaling, the prefill and backward benches, each on a deadline
# so the run ends inside its budget with every finished phase's log written.
#
#     bash bench/machine_check.sh [OUTDIR]        # or OUT=dir; BUDGET_S (default 540)
#
# Logs (at most 8 files): machine.txt, build.log, tests.log, bf16.log, scaling.log,
# prefill.log, backward.log.  Run from the repository root.  Tests that need the
# network or another package's exact version (the newcomer's pip install, the README's
# mypy, transformers, JAX, Dask) are left to CI.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-${1:-/tmp/fastattn-machine-check}}
mkdir -p "$O"
PY=${PYTHON:-python3}
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-540}))
left() { echo $((DEADLINE - $(date +%s))); }
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
NCPU=$(nproc)

{
    lscpu
    echo "flags: $(grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx2\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "nproc: $NCPU"
    $PY -VV
    gcc --version | head -1
    $PY -c "import numpy; print('numpy', numpy.__version__)"
    $PY -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
} > "$O/machine.txt" 2>&1
stamp "machine: $(grep -m1 'Model name' "$O/machine.txt")"

FASTATTN_JAX_FFI=0 $PY setup.py build_ext --inplace > "$O/build.log" 2>&1 ||
    { stamp "build failed"; tail -40 "$O/build.log"; exit 1; }
export PYTHONPATH=$PWD
stamp "built"

$PY - >> "$O/machine.txt" 2>&1 <<EOF
import fastattn
from fastattn import bench, _kernels
fastattn.show_config()
print("kernels:", _kernels.supported_kernels(), "bf16 paths:", _kernels.bf16_paths())
for t in sorted({1, 2, $NCPU}):
    line = [f"T{t}:", *(f"{dt} {bench.fma_peak(dt, t):.0f}" for dt in ("float32", "float64"))]
    for p in _kernels.bf16_paths():
        if p != "float32":
            line.append(f"{p} {bench.bf16_peak(t, path=p):.0f}")
    print("peaks GFLOP/s", *line)
EOF
grep "peaks\|kernels:" "$O/machine.txt"

# phase NAME MIN_SECONDS MAX_SECONDS COMMAND...: run when at least MIN_SECONDS are left,
# for at most MAX_SECONDS (or what is left)
phase() {
    local name=$1 need=$2 cap=$3
    shift 3
    local l
    l=$(left)
    if [ "$l" -lt "$need" ]; then
        stamp "$name: skipped ($l s left, needs $need)"
        return
    fi
    [ "$l" -lt "$cap" ] && cap=$l
    stamp "$name: up to $cap s"
    timeout "$cap" "$@" > "$O/$name.log" 2>&1
    stamp "$name: rc $?"
}

phase tests 60 200 env OMP_NUM_THREADS=2 $PY -m pytest -q -rf -n $((NCPU > 4 ? NCPU - 2 : 2)) \
    -p no:cacheprovider tests/ --ignore=tests/test_newcomer.py --ignore=tests/test_readme.py \
    --ignore=tests/test_transformers.py --ignore=tests/test_jax.py --ignore=tests/test_dask.py
tail -3 "$O/tests.log"
export OMP_PROC_BIND=true
B="$PY -m pytest -q -s -p no:cacheprovider"
phase bf16 60 130 $B bench/test_bf16.py --bench-threads 2
phase scaling 30 80 $B bench/test_scaling.py
phase prefill 60 130 $B bench/test_prefill.py -k interleaved --bench-threads 2
phase backward 40 90 $B bench/test_backward.py -k interleaved --bench-threads 2
for f in bf16 scaling prefill backward; do
    [ -f "$O/$f.log" ] && sed -n '/^\(bfloat16\|thread scaling\|prefill, inter\|gradients vs\)/,$p' "$O/$f.log" | head -40
done
stamp "done"
