"""Type aliases of the public API (fastattn ships py.typed)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike
Array = npt.NDArray[Any]
FloatArray = npt.NDArray[np.floating[Any]]
Causal = Union[bool, Literal["bottom-right", "top-left"], None]
Window = Optional[Tuple[Optional[int], Optional[int]]]
Layout = Literal["bhsd", "bshd"]

__all__ = ["ArrayLike", "Array", "FloatArray", "Causal", "Window", "Layout"]
