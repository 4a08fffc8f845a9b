#!/usr/bin/env bash
# One prepared run for a machine met once (more cores, or instructions the usual one
# lacks: AVX-512, AVX512-BF16, AMX): what the CPU is, an in-place build, the FMA and
# bf16 peaks, then the phases asked for, each on a deadline so the run ends inside its
# budget with every finished phase's log written:
#   tests     the suite under every kernel the CPU runs (pytest-xdist)
#   bf16      bench/test_bf16.py (the default bfloat16 path; float16 too)
#   pairs     its prefill cases with AMX turned off (the AVX512-BF16 pair path)
#   scaling   bench/test_scaling.py (1 thread to all)
#   prefill   bench/test_prefill.py's interleaved cases (PyTorch, ONNX Runtime, OpenVINO)
#   avx2      the same on the avx2 kernel (AVX-512 turned off)
#   backward  bench/test_backward.py's interleaved cases
#   blocks    bench/test_blocks.py (query blocks of 64, 192, 384 rows against the planner's)
#   sanitize  a build under ASan + UBSan and .ci/sanitize-short.txt's tests under it,
#             natively (the CI machine may lack AVX-512 and AMX)
#
#     bash bench/machine_check.sh [OUTDIR]     # or OUT=dir; BUDGET_S (default 540);
#                                              # PHASES (default "tests bf16 scaling prefill backward")
#
# Logs (at most 8 files): machine.txt, build.log and one NAME.log a phase.  Run from the
# repository root.  Tests that need the network or another package's exact version
# (the newcomer's pip install, the README's mypy, transformers, JAX, Dask) are left to CI.
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

NX=$((NCPU > 4 ? NCPU - 2 : 2))   # xdist workers
B="$PY -m pytest -q -s -p no:cacheprovider"
sanitize() {   # (run by phase, under its timeout)
    local src=/tmp/fastattn-sanitized
    . .ci/sanitizer-env.sh   # FA_SAN_FLAGS, fa_sanitizer_env (as .ci/sanitize)
    rm -rf "$src" && mkdir -p "$src/logs"
    tar --exclude=./build --exclude=./.git --exclude='./fastattn/_kernels*.so' --exclude=./fastattn/_kernels.c \
        -cf - . | tar -C "$src" -xf -
    (cd "$src" && CFLAGS="$FA_SAN_FLAGS" LDFLAGS="$FA_SAN_FLAGS" FASTATTN_JAX_FFI=0 $PY setup.py build_ext --inplace > build.log 2>&1) ||
        { echo "sanitized build failed"; tail -30 "$src/build.log"; return 1; }
    echo "sanitized build done at $(($(date +%s) - T0)) s"
    mapfile -t tests < <(grep -v '^#' .ci/sanitize-short.txt | grep .)
    (cd "$src" && fa_sanitizer_env "$src/logs" &&
        FASTATTN_GUARD_CASES=1500 OMP_NUM_THREADS=2 PYTHONPATH="$src" $PY -m pytest -q -rf -n $NX -p no:cacheprovider "${tests[@]}")
    local rc=$? n
    n=$(ls "$src/logs" | wc -l)
    echo "sanitizer reports: $n"
    for f in "$src"/logs/*; do [ -f "$f" ] && { echo "--- $f"; head -60 "$f"; }; done
    [ "$n" = 0 ] && return $rc || return 1
}
export -f sanitize
export PY T0 NX
for ph in ${PHASES:-tests bf16 scaling prefill backward}; do
    case $ph in
    tests) phase tests 60 200 env OMP_NUM_THREADS=2 $PY -m pytest -q -rf -n $NX -p no:cacheprovider tests/ \
        --ignore=tests/test_newcomer.py --ignore=tests/test_readme.py --ignore=tests/test_transformers.py \
        --ignore=tests/test_jax.py --ignore=tests/test_dask.py ;;
    bf16) phase bf16 60 150 env OMP_PROC_BIND=true $B bench/test_bf16.py --bench-threads 2 ;;
    pairs) phase pairs 40 90 env OMP_PROC_BIND=true FASTATTN_DISABLE_CPU_FEATURES=AMX \
        $B bench/test_bf16.py -k prefill --bench-threads 2 ;;
    scaling) phase scaling 30 80 env OMP_PROC_BIND=true $B bench/test_scaling.py ;;
    prefill) phase prefill 60 130 env OMP_PROC_BIND=true $B bench/test_prefill.py -k interleaved --bench-threads 2 ;;
    avx2) phase avx2 40 100 env OMP_PROC_BIND=true FASTATTN_DISABLE_CPU_FEATURES=AVX512F \
        $B bench/test_prefill.py -k "interleaved and not openvino" --bench-threads 2 ;;
    backward) phase backward 40 90 env OMP_PROC_BIND=true $B bench/test_backward.py -k interleaved --bench-threads 2 ;;
    blocks) phase blocks 30 70 env OMP_PROC_BIND=true $B bench/test_blocks.py --bench-threads 2 ;;
    # (the sanitized build alone takes ~4 minutes on 2 cores, ~1 on 16)
    sanitize) phase sanitize 150 $((NCPU >= 8 ? 240 : 900)) bash -c sanitize ;;
    *) echo "unknown phase $ph" ;;
    esac
    [ -f "$O/$ph.log" ] || continue   # (skipped, or unknown)
    case $ph in
    tests | sanitize) tail -4 "$O/$ph.log" ;;
    *) sed -n '/^\(bfloat16\|thread scaling\|prefill, inter\|gradients vs\|query blocks\)/,/^$/p' "$O/$ph.log" ;;
    esac
done
stamp "done"
