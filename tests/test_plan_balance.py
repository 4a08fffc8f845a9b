"""fastattn.bench.plan_balance: the forward's schedule, simulated from its own plan.

The per-thread work adds up to the flops of the visible (query, key) pairs, counted
here from the definitions of causal and window (semantics.md); the schedule keeps every
thread busy to >= 0.9 on the bench's shapes at 16, 64 and 128 threads; and the smaller
query blocks that many threads get change no bits."""
import numpy as np
import pytest

import fastattn
from fastattn import bench


def visible_pairs(Lq, Lk, causal=False, window=None, seqlen=None):
    """Visible (i, j) pairs of one head from semantics 5 and 12: bottom-right diagonal
    a = i + L - Lq (top-left: a = i), causal hides j > a, the window keeps a - left <= j
    <= a + right, seqlens_k keeps j < L."""
    L = Lk if seqlen is None else seqlen
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    a = i if causal == "top-left" else i + L - Lq
    vis = (j < L) & (i >= 0)  # (Lq, Lk)
    if causal:
        vis &= j <= a
    if window is not None:
        left, right = window
        if left is not None:
            vis &= j >= a - left
        if right is not None:
            vis &= j <= a + right
    return int(vis.sum())


BENCH_SHAPES = [  # (q shape, k shape, causal): bench/test_prefill.py's, and decoding's
    ((1, 8, 4096, 64), (1, 8, 4096, 64), False),
    ((1, 8, 4096, 64), (1, 8, 4096, 64), True),
    ((1, 8, 2048, 128), (1, 8, 2048, 128), False),
    ((4, 16, 256, 64), (4, 16, 256, 64), False),
    ((8, 32, 128, 64), (8, 32, 128, 64), False),
    ((32, 8, 64, 64), (32, 8, 64, 64), False),
    ((1, 16, 512, 64), (1, 16, 512, 64), True),
    ((1, 1, 8192, 64), (1, 1, 8192, 64), False),
    ((1, 1, 16384, 64), (1, 1, 16384, 64), True),
    ((1, 32, 1, 128), (1, 32, 8192, 128), False),
    ((8, 32, 1, 128), (8, 32, 2048, 128), False),
    ((1, 32, 1, 128), (1, 8, 8192, 128), False),
    ((1, 32, 4, 128), (1, 32, 8192, 128), True),
]


@pytest.mark.parametrize("threads", [16, 64, 128])
@pytest.mark.parametrize("qs,ks,causal", BENCH_SHAPES,
                         ids=[f"{q}x{k}{' causal' if c else ''}" for q, k, c in BENCH_SHAPES])
def test_bench_shapes_balance(kernel, qs, ks, causal, threads):
    bal, work, items = bench.plan_balance(qs, ks, causal=causal, num_threads=threads,
                                          kernel=kernel, return_work=True)
    assert bal >= 0.9, (bal, items)
    B, Hq, Lq, D = qs
    assert work.sum() == pytest.approx(2 * (D + ks[3]) * B * Hq * visible_pairs(Lq, ks[2], causal))


@pytest.mark.parametrize("case", [
    dict(q=(2, 4, 300, 40), k=(2, 2, 333, 40), v=(2, 2, 333, 24)),
    dict(q=(2, 4, 300, 40), k=(2, 4, 333, 40), causal=True),
    dict(q=(1, 3, 500, 16), k=(1, 3, 200, 16), causal="top-left"),
    dict(q=(1, 3, 200, 16), k=(1, 3, 500, 16), window=(37, 5)),
    dict(q=(1, 2, 64, 16), k=(1, 2, 700, 16), causal=True, window=(100, None)),
    dict(q=(3, 2, 1, 32), k=(3, 2, 3000, 32), seqlens_k=[3000, 17, 1200]),  # split-KV
    dict(q=(2, 300, 4, 32), k=(2, 300, 4, 32), layout="bshd"),  # head-major segments
    dict(q=(2, 4, 4, 32), k=(2, 1, 900, 32), causal=True),  # heads stacked in an item
])
@pytest.mark.parametrize("threads", [1, 2, 5, 64])
def test_work_adds_up_to_the_visible_pairs(kernel, case, threads):
    c = dict(case)
    qs, ks, vs = c.pop("q"), c.pop("k"), c.pop("v", None)
    bal, work, items = bench.plan_balance(qs, ks, v_shape=vs, num_threads=threads, kernel=kernel,
                                          return_work=True, **c)
    if c.get("layout") == "bshd":  # the shapes were given (B, L, H, D)
        qs, ks = (qs[0], qs[2], qs[1], qs[3]), (ks[0], ks[2], ks[1], ks[3])
    B, Hq, Lq, D = qs
    Dv = (vs or ks)[-1]
    sk = c.get("seqlens_k") or [None] * B
    pairs = sum(Hq * visible_pairs(Lq, ks[2], c.get("causal", False), c.get("window"), s) for s in sk)
    assert work.shape == (threads,) and items >= 1
    assert work.sum() == pytest.approx(2 * (D + Dv) * pairs)
    assert 0 < bal <= 1
    if threads == 1:
        assert bal == 1.0
    if "seqlens_k" not in c:  # (a chunk past a sequence's keys has no work)
        assert (work > 0).sum() == min(threads, items)


def test_more_threads_than_items():
    """One item (B1 H1 L16, below the smallest block): one thread works, the others
    wait: balance 1/T."""
    bal, work, items = bench.plan_balance((1, 1, 16, 64), (1, 1, 16, 64), num_threads=8,
                                          return_work=True)
    assert items == 1 and bal == pytest.approx(1 / 8) and (work > 0).sum() == 1


def test_many_threads_cut_smaller_blocks_without_changing_bits(rng):
    """B1 H8 L4096 has 176 items of 192 rows: at 128 threads some threads would run two
    and the others one (0.69).  The plan cuts 1024 smaller blocks instead, and a
    forward over smaller blocks has the same bits."""
    _, _, items2 = bench.plan_balance((1, 8, 4096, 64), (1, 8, 4096, 64), num_threads=2,
                                      return_work=True)
    bal, _, items = bench.plan_balance((1, 8, 4096, 64), (1, 8, 4096, 64), num_threads=128,
                                       return_work=True)
    assert items > items2 and bal >= 0.9
    q, k, v = (rng.standard_normal((1, 3, 400, 40)).astype(np.float32) for _ in range(3))
    _, _, few = bench.plan_balance(q.shape, k.shape, num_threads=1, return_work=True)
    _, _, many = bench.plan_balance(q.shape, k.shape, num_threads=32, return_work=True)
    assert many > few
    for causal in (False, True):
        one = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=1)
        lots = fastattn.attention(q, k, v, causal=causal, return_lse=True, num_threads=32)
        assert np.array_equal(one[0], lots[0]) and np.array_equal(one[1], lots[1])


def test_errors():
    q = (1, 4, 64, 32)
    with pytest.raises(ValueError, match=r"q_shape \(1, 4, 64, 32\), k_shape \(1, 3, 64, 32\)"):
        bench.plan_balance(q, (1, 3, 64, 32))  # 4 heads over 3
    with pytest.raises(ValueError, match="k_shape"):
        bench.plan_balance(q, (1, 4, 64, 16))  # D differs
    with pytest.raises(ValueError, match="3-D or 4-D"):
        bench.plan_balance((4, 32), (4, 32))
    with pytest.raises(ValueError, match="3-D or 4-D"):
        bench.plan_balance((1, 4, -1, 32), q)
    with pytest.raises(TypeError, match="q_shape must be a tuple of ints"):
        bench.plan_balance((1, 4, 64.0, 32), q)
    with pytest.raises(TypeError, match="k_shape must be a tuple of ints"):
        bench.plan_balance(q, 5)
    with pytest.raises(ValueError, match="same number of dimensions"):
        bench.plan_balance(q, (4, 64, 32))
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        bench.plan_balance(q, q, num_threads=0)
    with pytest.raises(TypeError, match="num_threads"):
        bench.plan_balance(q, q, num_threads=2.5)
    with pytest.raises(ValueError, match="causal must be"):
        bench.plan_balance(q, q, causal="diagonal")
    with pytest.raises(ValueError, match="layout"):
        bench.plan_balance(q, q, layout="sbhd")
    with pytest.raises(ValueError, match="seqlens_k must be 1 ints"):
        bench.plan_balance(q, q, seqlens_k=[1, 2])
    with pytest.raises(ValueError, match=r"seqlens_k must be in \[0, 64\]"):
        bench.plan_balance(q, q, seqlens_k=[65])
    with pytest.raises(ValueError, match="dtype"):
        bench.plan_balance(q, q, dtype="float16")
    with pytest.raises(ValueError, match="kernel must be one of"):
        bench.plan_balance(q, q, kernel="sse9")
    assert bench.plan_balance((3, 64, 32), (3, 64, 32), num_threads=1) == 1.0  # 3-D: B = 1
