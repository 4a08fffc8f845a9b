# The README's Python examples, verbatim and in order (tests/test_readme.py checks
# that they match README.md, type-checks this file with mypy and runs it).
# Regenerate after editing the README:  python tests/test_readme.py --write

# ---- README block
import numpy as np
import fastattn

rng = np.random.default_rng(0)
q = rng.standard_normal((1, 8, 1024, 64), dtype=np.float32)   # (B, Hq, Lq, D)
k = rng.standard_normal((1, 2, 1024, 64), dtype=np.float32)   # (B, Hkv, Lk, D): 4 query heads a K/V head
v = rng.standard_normal((1, 2, 1024, 64), dtype=np.float32)   # (B, Hkv, Lk, Dv)

out = fastattn.attention(q, k, v, causal=True)                 # (1, 8, 1024, 64)
out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)   # lse: (1, 8, 1024)
out_w = fastattn.attention(q, k, v, window=(255, 0), alibi_slopes=np.full(8, 0.1),
                           mask=rng.random(1024) > 0.1)        # sliding window, ALiBi, key mask

# gradients from the forward's out and lse
dq, dk, dv = fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)

# the float64 oracle every result is checked against
ref = fastattn.reference.attention(q[:, :1], k[:, :1], v[:, :1], causal=True)
fastattn.show_config()    # compiler, OpenMP, threads, which CPU kernel runs and why
