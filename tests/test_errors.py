"""Every bad argument raises ValueError or TypeError naming the argument and shapes."""
import numpy as np
import pytest

import fastattn

f32 = np.float32


def _qkv(Lq=4, Lk=5, D=8, Dv=8, H=2, dtype=f32):
    return (np.ones((H, Lq, D), dtype), np.ones((H, Lk, D), dtype), np.ones((H, Lk, Dv), dtype))


CASES = [
    # (description, kwargs builder, exception, message regex)
    ("int q", lambda q, k, v: dict(q=q.astype(np.int32), k=k, v=v), TypeError, r"q has dtype int32"),
    ("complex q", lambda q, k, v: dict(q=q.astype(complex), k=k, v=v), TypeError, r"q has dtype complex"),
    ("float16 q", lambda q, k, v: dict(q=q.astype(np.float16), k=k, v=v), TypeError, r"float16"),
    ("mixed dtypes", lambda q, k, v: dict(q=q, k=k.astype(np.float64), v=v), TypeError,
     r"unsupported dtype combination q float32, k float64, v float32"),
    ("object q", lambda q, k, v: dict(q=np.array([[object()]]), k=k, v=v), TypeError, r"q has dtype object"),
    ("1-D", lambda q, k, v: dict(q=q[0, 0], k=k[0, 0], v=v[0, 0]), ValueError, r"2-D.*q\(8,\)"),
    ("5-D", lambda q, k, v: dict(q=q[None, None], k=k[None, None], v=v[None, None]), ValueError,
     r"4-D.*q\(1, 1, 2, 4, 8\)"),
    ("ndim mismatch", lambda q, k, v: dict(q=q, k=k[0], v=v), ValueError, r"q is 3-D but k is 2-D.*k\(5, 8\)"),
    ("D mismatch", lambda q, k, v: dict(q=q, k=k[..., :7], v=v), ValueError,
     r"q has D=8 but k has D=7 .*q\(2, 4, 8\), k\(2, 5, 7\)"),
    ("Lk mismatch", lambda q, k, v: dict(q=q, k=k, v=v[:, :4]), ValueError, r"k has Lk=5 but v has Lk=4.*v\(2, 4, 8\)"),
    ("batch mismatch", lambda q, k, v: dict(q=np.stack([q, q]), k=np.stack([k, k, k]), v=np.stack([v, v, v])),
     ValueError, r"q has B=2 but k has B=3"),
    ("batch mismatch k/v", lambda q, k, v: dict(q=np.stack([q, q]), k=np.stack([k, k]), v=np.stack([v])),
     ValueError, r"k has B=2 but v has B=1"),
    ("heads not a multiple", lambda q, k, v: dict(q=np.concatenate([q, q[:1]]), k=k, v=v), ValueError,
     r"q has Hq=3 heads, which is not a multiple of the Hkv=2 .*q\(3, 4, 8\), k\(2, 5, 8\)"),
    ("kv heads mismatch", lambda q, k, v: dict(q=q, k=k, v=v[:1]), ValueError, r"k has Hkv=2 but v has Hkv=1"),
    ("bshd D mismatch", lambda q, k, v: dict(q=q, k=k[..., :7], v=v, layout="bshd"), ValueError,
     r"q has D=8 but k has D=7 \(q, k, v are \(\.\.\., L, H, D\)"),
    ("bshd Lk mismatch", lambda q, k, v: dict(q=q, k=k, v=v[:1], layout="bshd"), ValueError,
     r"k has Lk=2 but v has Lk=1"),
    ("causal string", lambda q, k, v: dict(q=q, k=k, v=v, causal="upper"), ValueError, r"causal must be"),
    ("causal int", lambda q, k, v: dict(q=q, k=k, v=v, causal=1), ValueError, r"causal must be"),
    ("scale nan", lambda q, k, v: dict(q=q, k=k, v=v, scale=float("nan")), ValueError, r"scale must be finite"),
    ("scale inf", lambda q, k, v: dict(q=q, k=k, v=v, scale=np.inf), ValueError, r"scale must be finite"),
    ("scale str", lambda q, k, v: dict(q=q, k=k, v=v, scale="1"), TypeError, r"scale must be a real number"),
    ("threads 0", lambda q, k, v: dict(q=q, k=k, v=v, num_threads=0), ValueError, r"num_threads must be >= 1"),
    ("threads -2", lambda q, k, v: dict(q=q, k=k, v=v, num_threads=-2), ValueError, r"num_threads"),
    ("threads float", lambda q, k, v: dict(q=q, k=k, v=v, num_threads=2.0), TypeError, r"num_threads"),
    ("return_lse str", lambda q, k, v: dict(q=q, k=k, v=v, return_lse="yes"), TypeError, r"return_lse"),
    ("out shape", lambda q, k, v: dict(q=q, k=k, v=v, out=np.empty((2, 4, 7), f32)), ValueError,
     r"out has shape \(2, 4, 7\), expected \(2, 4, 8\)"),
    ("out dtype", lambda q, k, v: dict(q=q, k=k, v=v, out=np.empty((2, 4, 8))), TypeError, r"out has dtype float64"),
    ("out list", lambda q, k, v: dict(q=q, k=k, v=v, out=[0.0]), TypeError, r"out must be a numpy array"),
    ("out read-only", lambda q, k, v: dict(q=q, k=k, v=v, out=np.broadcast_to(np.empty(8, f32), (2, 4, 8))),
     ValueError, r"out is read-only"),
    ("out non-contiguous", lambda q, k, v: dict(q=q, k=k, v=v, out=np.empty((2, 4, 16), f32)[..., ::2]),
     ValueError, r"out must have a contiguous last axis"),
    ("out overlaps q", lambda q, k, v: dict(q=q, k=k, v=v, out=q), ValueError, r"out overlaps q"),
]


@pytest.mark.parametrize("desc,build,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_arguments(desc, build, exc, match):
    kw = build(*_qkv())
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with pytest.raises(exc, match=match):
        fastattn.attention(q, k, v, **kw)


def test_non_array_inputs_are_converted():
    """Anything np.asarray accepts works (a list of floats becomes float64)."""
    q = [[1.0, 0.0], [0.0, 1.0], [2.0, 1.0]]
    out = fastattn.attention(q, q, q)
    assert out.dtype == np.float64
    a = np.array(q)
    np.testing.assert_array_equal(out, fastattn.attention(a, a, a))
    with pytest.raises(TypeError, match="q has dtype"):
        fastattn.attention([["a"]], q, q)
