"""show_config(): what was built, where it was imported from, and what runs."""
from __future__ import annotations

import os
import platform
import sys
from typing import IO, Any

import numpy as np

from . import _kernels


def config() -> dict[str, Any]:
    """The build and run-time configuration as a dict."""
    info = _kernels.build_info()
    pkg = sys.modules[__package__ or "fastattn"]
    return {
        "fastattn": pkg.__version__,
        "path": os.path.dirname(os.path.abspath(str(pkg.__file__))),
        "extension": os.path.abspath(str(_kernels.__file__)),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "machine": platform.machine(),
        "build": info["build"],
        "openmp": info["openmp"],
        "threads": _kernels.max_threads(),
        "kernel": _kernels.current_kernel(),
        "kernel_reason": _kernels.kernel_reason(),
        "kernels_supported": _kernels.supported_kernels(),
        "l2_bytes": info["l2_bytes"],
        "l2_source": info["l2_source"],
        "bf16": _bf16_line(info),
    }


def _bf16_line_arm(info: dict[str, Any]) -> str:
    """_bf16_line on AArch64: the BFDOT path."""
    kern, bk = _kernels.current_kernel(), _kernels.bf16_kernel()
    if info.get("bf16_bfdot"):
        cpu = "this CPU has FEAT_BF16 (BFDOT)" + (", SVE's too" if info.get("bf16_sve") else ", not SVE's")
    else:
        cpu = "this CPU has no FEAT_BF16 (BFDOT)"
    if bk:
        return (f"the {kern} kernel takes both products on BFDOT pairs ({bk}: float32 sums, "
                "rounded to odd as the instruction does without FEAT_EBF16; float32 softmax, P "
                "rounded to bfloat16; the backward's five products too); "
                f"{cpu}; FASTATTN_DISABLE_CPU_FEATURES=BF16 turns it off")
    if "bfdot" not in _kernels.bf16_paths_built():
        why = f"{cpu}, but this build has no BFDOT kernel (its compiler lacked +bf16)"
    elif "bfdot" in _kernels.bf16_paths():
        why = (f"{cpu}; BFDOT is off here (FASTATTN_DISABLE_CPU_FEATURES=BF16, or the {kern} "
               "kernel has no BFDOT on this CPU)")
    else:
        why = cpu
    return f"the {kern} kernel reads bfloat16 and computes in float32 (converted in registers); {why}"


def _lower_switch(kernels: list[str]) -> str:
    """The FASTATTN_DISABLE_CPU_FEATURES value that turns this machine's SIMD kernels off."""
    return "NEON" if "neon" in kernels else "AVX512F,AVX2"


def _bf16_line(info: dict[str, Any]) -> str:
    """How bfloat16 q, k, v compute, and why."""
    if "neon" in _kernels.supported_kernels():
        return _bf16_line_arm(info)
    have = [n for n, k in (("AVX512-BF16", "bf16_avx512"), ("AMX-BF16", "bf16_amx")) if info.get(k)]
    cpu = f"this CPU has {' and '.join(have)}" if have else "this CPU has no AVX512-BF16 or AMX-BF16"
    if info.get("bf16_amx_refused"):
        cpu += " (and AMX-BF16, whose tile data Linux refused this process)"
    pair_kernels = ("avx2", "avx512") if _kernels.bf16_emulated() else ("avx512",)
    path, kern = _kernels.bf16_path(), _kernels.current_kernel()
    if path == "amx-bf16" and kern in pair_kernels:
        how = (f"the {kern} kernel takes both products on AMX tiles (tdpbf16ps, 16 x 16 float32 "
               "tiles, float32 softmax in AVX-512, P rounded to bfloat16; the backward on AMX "
               "tiles too, its five products, W, dS and dout rounded to bfloat16)")
        if _kernels.bf16_emulated():
            how += ", the tiles a software model and AVX-512 from SIMDe: a test build, not for speed"
        return f"{how}; {cpu}; FASTATTN_DISABLE_CPU_FEATURES=AMX turns the tiles off"
    if path == "avx512-bf16" and kern in pair_kernels:
        how = (f"the {kern} kernel takes both products on AVX512-BF16 pairs "
               "(vdpbf16ps, float32 sums and softmax, P rounded to bfloat16)")
        if _kernels.bf16_emulated():
            how += ", emulated by SIMDe: a test build, not for speed"
        off = "FASTATTN_DISABLE_CPU_FEATURES=AVX512_BF16 turns it off"
        if "amx-bf16" in _kernels.bf16_paths():
            off += (" (the AMX model runs only where a test selects it)" if _kernels.bf16_emulated()
                    else " (the AMX tiles are off: FASTATTN_DISABLE_CPU_FEATURES=AMX)")
        return f"{how}; {cpu}; {off}"
    if "avx512-bf16" in _kernels.bf16_paths() and info.get("bf16_pairs_slow") and kern == "avx512":
        why = (f"{cpu}, whose vdpbf16ps runs at half the float32 FMA rate on Intel's cores, so the "
               "pairs are not the default here")
    elif "avx512-bf16" in _kernels.bf16_paths():
        why = (f"{cpu}, whose pairs are off here (FASTATTN_DISABLE_CPU_FEATURES=AVX512_BF16, "
               "or a kernel other than avx512)")
    elif info.get("bf16_avx512"):
        why = f"{cpu}, but this build has no AVX512-BF16 kernel (its compiler lacked -mavx512bf16)"
    else:
        why = cpu
    return (f"the {_kernels.current_kernel()} kernel reads bfloat16 and computes in float32 "
            f"(converted in registers); {why}")


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 and n % 2**20 == 0 else f"{n // 1024} KiB"


def show_config(file: IO[str] | None = None) -> None:
    """Print how this fastattn was built and what it runs on this machine.

    The lines name the version and where the package was imported from, the compiled
    extension, the build (compiler, flags), whether OpenMP is on, the default thread
    count, the SIMD kernel in use and why it was chosen, the L2 cache size that bounds
    the block sizes and where it was read, how bfloat16 inputs compute, and the kernels
    this CPU can run.

    Parameters
    ----------
    file : file-like, optional
        Where to write; default ``sys.stdout``.

    See Also
    --------
    fastattn.bench.fma_peak : The machine's measured FMA peak.

    Notes
    -----
    ``fastattn`` (the command) and ``python -m fastattn`` print the same lines before
    their self-check.  The kernel can be forced lower with the environment variable
    ``FASTATTN_DISABLE_CPU_FEATURES`` (read at import).

    Examples
    --------
    >>> import io
    >>> import fastattn
    >>> buf = io.StringIO()
    >>> fastattn.show_config(file=buf)
    >>> buf.getvalue().splitlines()[0].startswith("fastattn " + fastattn.__version__)
    True
    """
    c = config()
    lines = [
        f"fastattn {c['fastattn']}  (python {c['python']}, numpy {c['numpy']}, {c['machine']})",
        f"  imported: {c['path']}",
        f"  library:  {c['extension']}",
        f"  build:    {c['build']}",
        f"  openmp:   {'yes' if c['openmp'] else 'no (serial kernel)'}",
        f"  threads:  {c['threads']} (default; OMP_NUM_THREADS or num_threads= to change)",
        f"  kernel:   {c['kernel']} -- {c['kernel_reason']}",
        f"  L2 cache: {_size(c['l2_bytes'])} per core, from {c['l2_source']} (bounds the block sizes)",
        f"  bfloat16: {c['bf16']}",
        f"  can run:  {', '.join(c['kernels_supported'])}"
        f"  (FASTATTN_DISABLE_CPU_FEATURES={_lower_switch(c['kernels_supported'])} forces a lower one)",
    ]
    print("\n".join(lines), file=file or sys.stdout)
