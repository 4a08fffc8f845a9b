"""fastattn: exact attention for CPUs, called from NumPy.

``fastattn.attention(q, k, v, ...)`` computes ``softmax(scale * q k^T) v`` with a
cache-blocked, OpenMP-parallel online softmax in C and SIMD micro-kernels chosen
for this CPU at import; ``fastattn.reference`` is the float64 NumPy oracle every
result is checked against.
"""
import os as _os


def _source_tree_error(exc: ImportError) -> ImportError:
    """The ImportError to raise when the compiled extension cannot be imported.

    The usual cause: Python found this source folder (``python -m fastattn`` or
    ``python -c "import fastattn"`` typed in the clone's root puts the current
    directory first on sys.path) instead of the installed package, and the source
    folder has no built ``_kernels`` extension.
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    in_source = _os.path.exists(_os.path.join(root, "setup.py")) and \
        _os.path.isdir(_os.path.join(root, "src_c"))
    if not in_source:
        return ImportError(f"fastattn: cannot import the compiled extension fastattn._kernels "
                           f"from {here} ({exc}); reinstall fastattn (pip install fastattn)")
    return ImportError(
        f"fastattn: importing fastattn from its source tree ({here}), which has no built "
        f"extension (fastattn._kernels). Python looks in the current directory first, so in "
        f"the clone's root the source folder shadows an installed fastattn. Either run from "
        f"another directory (or use the `fastattn` command, which `pip install .` puts on your "
        f"PATH), or build the extension in place with `pip install -e .`. (Original error: {exc})")


try:
    from . import _kernels
except ImportError as _exc:
    raise _source_tree_error(_exc) from None
from ._api import AttentionStats, attention, attention_backward, attention_weights, key_mass
from ._varlen import merge, varlen_attention
from ._cache import dequantize_kv, quantize_kv
from ._qkv import QuantizedKV
from ._kvcache import KVCache
from ._config import show_config

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_weights", "key_mass", "AttentionStats", "merge", "varlen_attention", "show_config",
           "QuantizedKV", "quantize_kv", "dequantize_kv", "KVCache",
           "reference", "__version__"]

_kernels.select_kernel(_os.environ.get("FASTATTN_DISABLE_CPU_FEATURES", ""))

from . import reference  # noqa: E402
