"""The block plan of fastattn.dask, in pure Python (no dask): the chunk offsets, which
(query chunk, key chunk) blocks of a problem exist, where each block's call places
its queries and keys in the whole sequence (:func:`plan_block`), the kv head chunks a GQA split needs
(:func:`kv_partition`) and the fixed merge tree over key chunks (:func:`tree`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["starts", "Plan", "band", "plan_block", "kv_partition", "tree"]

# fastattn.attention's causal argument of each causal code
_CAUSAL_ARG: Dict[int, Union[bool, str]] = {0: False, 1: True, 2: "top-left"}


def starts(chunks: Sequence[int]) -> List[int]:
    """The offset of each chunk along its axis, and the axis length last."""
    out = [0]
    for c in chunks:
        out.append(out[-1] + int(c))
    return out


@dataclass(frozen=True)
class Plan:
    """How one block (query rows q0..q1-1, keys k0..k1-1 of the whole problem) is
    computed by one fastattn.attention call on the block's arrays.

    keys: how many of the block's keys to pass (a trailing part that every row of
        the block is denied by causal/window is cut off: this changes no bit);
    causal, window: the arguments of that call;
    positions: None for the whole problem (the user's own call), else
        ``(q_offset, k_offset, alibi_shift)`` of fastattn._api.attention_block: where
        the block's first query and key sit, so that the kernel applies causal, the
        window and ALiBi as on the whole problem (no mask or bias is made for them).
    """
    keys: int
    causal: Union[bool, str]
    window: Optional[Tuple[Optional[int], Optional[int]]]
    positions: Optional[Tuple[int, int, int]]


def band(causal: int, wl: int, wr: int) -> Tuple[Optional[int], Optional[int]]:
    """The (left, right) extent of the visible band around a row's diagonal from
    causal (0 none, 1 bottom-right, 2 top-left) and the window (-1 = unbounded);
    None = unbounded."""
    left = wl if wl >= 0 else None
    right = wr if wr >= 0 else None
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def plan_block(q0: int, q1: int, k0: int, k1: int, Lq: int, Lk: int, causal: int,
               wl: int, wr: int, alibi: bool) -> Optional[Plan]:
    """The call for query rows [q0, q1) against keys [k0, k1) of a problem of Lq
    queries and Lk keys, or None when causal/window hide every key of the block from
    every row (such a block is never scheduled; a block with no keys is None too).

    Query i sits at position i + off and key j at j, off = Lk - Lq (bottom-right,
    also the alignment of a window without causal) or 0 (top-left): the diagonal of
    block row t = i - q0 is block key t + d, d = q0 + off - k0.  ALiBi measures from
    the bottom-right diagonal whatever the convention: Lk - Lq - off keys right of it.
    """
    lq, lk = q1 - q0, k1 - k0
    off = 0 if causal == 2 else Lk - Lq
    d = q0 + off - k0
    left, right = band(causal, wl, wr)
    if lk <= 0:
        return None
    if lq > 0:
        if right is not None and lq - 1 + d + right < 0:
            return None          # every key is right of every row's band
        if left is not None and d - left > lk - 1:
            return None          # every key is left of every row's band
    window = (None if wl < 0 else wl, None if wr < 0 else wr)
    if (q0, q1, k0, k1) == (0, Lq, 0, Lk):  # the whole problem: the user's own call
        return Plan(lk, _CAUSAL_ARG[causal], window, None)
    kk = lk if right is None else max(1, min(lk, lq + d + right))  # cut keys no row sees
    shift = Lk - Lq - off if alibi else 0
    return Plan(kk, bool(causal), window, (q0 + off, k0, shift))


def kv_partition(q_head_chunks: Sequence[int], Hkv: int, G: int) -> Tuple[int, ...]:
    """Chunks of the kv head axis such that the kv heads each q head chunk reads
    (h // G for its heads h) are whole kv chunks: one-to-one when every q head chunk
    boundary is a multiple of G, finer otherwise."""
    bounds = {0, Hkv}
    for h0, h1 in zip(starts(q_head_chunks)[:-1], starts(q_head_chunks)[1:]):
        if h1 > h0:
            bounds.add(h0 // G)
            bounds.add(-(-h1 // G))
    b = sorted(bounds)
    return tuple(y - x for x, y in zip(b[:-1], b[1:])) or (Hkv,)


def tree(keys: List[Any], split_every: int) -> List[List[List[Any]]]:
    """The merge tree over `keys` in order: a list of levels, each a list of groups of
    consecutive items of the level below (a lone last item is passed up unmerged)."""
    levels = []
    cur = list(keys)
    while len(cur) > 1:
        groups = [cur[i:i + split_every] for i in range(0, len(cur), split_every)]
        levels.append(groups)
        cur = groups
    return levels
