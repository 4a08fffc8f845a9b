"""The GIL is released while the kernels run: another Python thread keeps running
during a long fastattn call.

`run_with_ticker` runs one call in the main thread while a second thread spins in a
pure-Python loop that records time stamps.  If the call holds the GIL, the ticker is
frozen for (almost) the whole call: the largest gap between stamps is about the
call's duration.  If the GIL is released, the ticker keeps going and the gaps stay at
a few milliseconds (scheduling noise on a loaded machine).  One call must be long
(a loop of short calls would let the ticker run between them even with the GIL
held), so each test first times a small problem and scales its batch so that the
single call takes about TARGET_S on this machine and kernel, with num_threads=1.

The helper is itself tested on stand-ins that do and do not hold the GIL, so that
this check cannot silently become vacuous.
"""
import math
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

import fastattn
from fastattn import _kernels

TARGET_S = 0.2      # how long the measured call should take
MIN_CALL_S = 0.1    # below this the measurement is not trusted
MAX_GAP_FRAC = 0.3  # the ticker may stall at most this fraction of the call
TICK_S = 1e-3       # the ticker records a stamp at most every TICK_S (bounded memory)


@dataclass
class Progress:
    duration: float   # seconds the call took
    ticks: int        # stamps the other thread recorded during the call
    max_gap: float    # longest stretch during the call with no stamp
    result: object

    @property
    def released(self):
        return self.max_gap <= MAX_GAP_FRAC * self.duration and self.ticks >= 10

    def __str__(self):
        return (f"call {self.duration * 1e3:.0f} ms, other thread: {self.ticks} stamps, "
                f"longest stall {self.max_gap * 1e3:.0f} ms "
                f"({self.max_gap / self.duration:.0%} of the call)")


def run_with_ticker(fn):
    """Run fn() in this thread while another Python thread records time stamps."""
    stamps = []
    started, stop = threading.Event(), threading.Event()
    clock = time.perf_counter

    def ticker():
        append, is_set = stamps.append, stop.is_set
        last = clock()
        append(last)
        started.set()
        while not is_set():
            now = clock()
            if now - last >= TICK_S:
                append(now)
                last = now

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # hand the GIL over quickly when it is free
    th = threading.Thread(target=ticker, daemon=True)
    try:
        th.start()
        started.wait()
        t0 = clock()
        result = fn()
        t1 = clock()
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    inside = [t for t in stamps if t0 <= t <= t1]
    points = [t0] + inside + [t1]
    max_gap = max(b - a for a, b in zip(points, points[1:]))
    return Progress(t1 - t0, len(inside), max_gap, result)


def calibrated(build, target=TARGET_S, max_n=512):
    """build(n) -> a zero-argument call whose cost grows linearly with n; returns the
    call for the n that takes about `target` seconds here (after one warm-up)."""
    f = build(1)
    f()
    t0 = time.perf_counter()
    f()
    t = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(max_n, math.ceil(1.2 * target / t)))
    return build(n)


def assert_runs_without_gil(fn, attempts=3):
    """Passes if, in one of `attempts` runs, the other thread kept going through the
    call.  Retrying only absorbs scheduling noise on a loaded machine: with the GIL
    held the other thread is frozen for the whole call on every run."""
    seen = []
    for _ in range(attempts):
        p = run_with_ticker(fn)
        seen.append(p)
        if p.duration >= MIN_CALL_S and p.released:
            return p
    assert max(p.duration for p in seen) >= MIN_CALL_S, \
        "call too short to judge: " + "; ".join(map(str, seen))
    raise AssertionError("another Python thread was stalled during the call (GIL held?): "
                         + "; ".join(map(str, seen)))


# ------------------------------------------------------------------ the helper itself

def _object_reduce(n):
    # an object-dtype loop in C (big-int additions, little memory): holds the GIL throughout
    a = np.full(2_000 * n, 10**20000, dtype=object)
    return lambda: np.add.reduce(a)


def _builtin_sum(n):
    r = range(n * 100_000)
    return lambda: sum(r)             # the builtin's C loop: holds the GIL throughout


@pytest.mark.parametrize("build", [_object_reduce, _builtin_sum], ids=["np-object-reduce", "sum"])
def test_helper_detects_a_call_that_holds_the_gil(build):
    fn = calibrated(build)
    before = sys.getswitchinterval()
    p = run_with_ticker(fn)
    assert sys.getswitchinterval() == before
    assert p.duration >= MIN_CALL_S, str(p)
    assert not p.released, f"the helper missed a GIL-holding call: {p}"
    assert p.max_gap >= 0.7 * p.duration, str(p)


def test_helper_sees_progress_when_the_gil_is_free():
    p = run_with_ticker(lambda: time.sleep(TARGET_S))
    assert p.released, str(p)


def test_helper_with_a_pure_python_loop_in_the_main_thread():
    """Python bytecode in the main thread hands the GIL over every switch interval: the
    ticker makes progress (so a stall in the checks below is the kernel's doing)."""
    def loop():
        end = time.perf_counter() + TARGET_S
        while time.perf_counter() < end:
            pass
    p = run_with_ticker(loop)
    assert p.released, str(p)


# ------------------------------------------------------------------ fastattn

def _rng():
    return np.random.default_rng(7)


def _batch(a, n):
    """`a` (1, ...) repeated n times along the batch axis as a zero-stride view: the
    work grows with n, the memory does not (the kernel reads such views in place)."""
    return np.broadcast_to(a, (n,) + a.shape[1:])


def _prefill(n):
    """Plain float32 bhsd call: the compiled fast path (_kernels.attention_common)."""
    q = _batch(_rng().standard_normal((1, 8, 512, 64)).astype(np.float32), n)
    return lambda: fastattn.attention(q, q, q, causal=False, num_threads=1)


def _prefill_variants_bshd(n):
    """The checked Python path: bshd, GQA, bias, softcap, return_lse."""
    rng = _rng()
    q = _batch(rng.standard_normal((1, 384, 8, 64)).astype(np.float32), n)
    k = _batch(rng.standard_normal((1, 384, 2, 64)).astype(np.float32), n)
    bias = rng.standard_normal(384).astype(np.float32)
    return lambda: fastattn.attention(q, k, k, layout="bshd", bias=bias, softcap=5.0,
                                      causal="top-left", return_lse=True, num_threads=1)


def _decode(n):
    """Lq = 8 against 8192 float16 keys (split-KV), MQA, out= and lse."""
    rng = _rng()
    q = _batch(rng.standard_normal((1, 8, 8, 64)).astype(np.float32), n)
    k = _batch(rng.standard_normal((1, 1, 8192, 64)).astype(np.float16), n)
    out = np.empty((n, 8, 8, 64), np.float32)
    return lambda: fastattn.attention(q, k, k, causal=True, out=out, return_lse=True,
                                      num_threads=1)


def _decode_f64(n):
    rng = _rng()
    q = _batch(rng.standard_normal((1, 16, 2, 64)), n)
    k = _batch(rng.standard_normal((1, 2, 8192, 64)), n)
    return lambda: fastattn.attention(q, k, k, num_threads=1)


def _weights(n):
    """Long feature axis: much work per weight written (the output is Lq x Lk)."""
    q = _batch(_rng().standard_normal((1, 2, 256, 1024)).astype(np.float32), n)
    return lambda: fastattn.attention_weights(q, q, causal=True, num_threads=1)


def _varlen(n):
    lens = np.resize([700, 300, 1000, 500], 4 * n)
    total = int(lens.sum())
    x = np.broadcast_to(_rng().standard_normal((total, 1, 64)).astype(np.float32), (total, 4, 64))
    cu = np.concatenate([[0], np.cumsum(lens)])
    return lambda: fastattn.varlen_attention(x, x, x, cu, cu, causal=True, return_lse=True,
                                             num_threads=1)


CALLS = {"attention-prefill-fast-path": _prefill,
         "attention-prefill-checked-path": _prefill_variants_bshd,
         "attention-decode-f16-out": _decode,
         "attention-decode-f64": _decode_f64,
         "attention_weights": _weights,
         "varlen_attention": _varlen}


@pytest.mark.parametrize("what", list(CALLS))
def test_kernel_call_releases_the_gil(kernel, what):
    assert_runs_without_gil(calibrated(CALLS[what]))


def _merge_parts(n, P=2, Dv=1):
    """Dv = 1: the merge's work is per row (an exp per part), not per byte copied."""
    rng = _rng()
    rows = 262144 * n
    outs = rng.standard_normal((P, rows, Dv)).astype(np.float32)
    lses = rng.standard_normal((P, rows)).astype(np.float32)
    return outs, lses, np.empty((rows, Dv), np.float32), np.empty(rows, np.float32)


def test_merge_kernel_releases_the_gil():
    """_kernels.merge (what fastattn.merge runs after stacking its inputs)."""
    def build(n):
        O, L, out, lse = _merge_parts(n)
        return lambda: _kernels.merge(O, L, out, lse)
    assert_runs_without_gil(calibrated(build, max_n=32))


def test_merge_releases_the_gil():
    def build(n):
        O, L, _, _ = _merge_parts(n)
        outs, lses = list(O), list(L)
        return lambda: fastattn.merge(outs, lses)
    assert_runs_without_gil(calibrated(build, max_n=32))


def test_kernel_result_is_right_while_another_thread_runs(kernel):
    """The call measured above computes the same answer with the ticker running."""
    q = _rng().standard_normal((2, 4, 300, 32)).astype(np.float32)
    want = fastattn.attention(q, q, q, causal=True, num_threads=1)
    p = run_with_ticker(lambda: fastattn.attention(q, q, q, causal=True, num_threads=1))
    np.testing.assert_array_equal(p.result, want)
