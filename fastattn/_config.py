"""show_config(): what was built and what runs."""

import platform
import sys

import numpy as np

from . import _kernels


def config():
    """The build and run-time configuration as a dict."""
    info = _kernels.build_info()
    return {
        "fastattn": __import__("fastattn").__version__,
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
    }


def show_config(file=None):
    """Print the build (compiler, OpenMP), the CPU kernel in use and why, and the
    default thread count (OpenMP's: OMP_NUM_THREADS or threadpoolctl)."""
    c = config()
    lines = [
        f"fastattn {c['fastattn']}  (python {c['python']}, numpy {c['numpy']}, {c['machine']})",
        f"  build:    {c['build']}",
        f"  openmp:   {'yes' if c['openmp'] else 'no (serial kernel)'}",
        f"  threads:  {c['threads']} (default; OMP_NUM_THREADS or num_threads= to change)",
        f"  kernel:   {c['kernel']} -- {c['kernel_reason']}",
        f"  L2 cache: {c['l2_bytes'] // 1024} KiB per core (bounds the block sizes)",
        f"  can run:  {', '.join(c['kernels_supported'])}"
        "  (FASTATTN_DISABLE_CPU_FEATURES=AVX512F,AVX2 forces a lower one)",
    ]
    print("\n".join(lines), file=file or sys.stdout)
