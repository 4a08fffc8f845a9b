"""fastattn: exact attention for CPUs, called from NumPy.

``fastattn.attention(q, k, v, ...)`` computes ``softmax(scale * q k^T) v`` with a
cache-blocked, OpenMP-parallel online softmax in C and SIMD micro-kernels chosen
for this CPU at import; ``fastattn.reference`` is the float64 NumPy oracle every
result is checked against.
"""
import os as _os

from . import _kernels
from ._api import attention, attention_weights, merge, varlen_attention
from ._config import show_config

__version__ = "0.1.0"
__all__ = ["attention", "attention_weights", "merge", "varlen_attention", "show_config",
           "reference", "__version__"]

_kernels.select_kernel(_os.environ.get("FASTATTN_DISABLE_CPU_FEATURES", ""))

from . import reference  # noqa: E402
