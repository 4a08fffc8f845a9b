# The README's Python examples, verbatim and in order (tests/test_readme.py checks
# that they match README.md, type-checks this file with mypy and runs it).
# Regenerate after editing the README:  python tests/test_readme.py --write

# ---- README block
import numpy as np
import fastattn

rng = np.random.default_rng(0)
q = rng.standard_normal((1, 8, 4096, 64), dtype=np.float32)   # (B, Hq, Lq, D)
k = rng.standard_normal((1, 8, 4096, 64), dtype=np.float32)   # (B, Hkv, Lk, D)
v = rng.standard_normal((1, 8, 4096, 64), dtype=np.float32)   # (B, Hkv, Lk, Dv)

out = fastattn.attention(q, k, v, causal=True)                 # (1, 8, 4096, 64)
out, lse = fastattn.attention(q, k, v, return_lse=True)        # lse: (1, 8, 4096)
out = fastattn.attention(q, k, v, window=(255, 0), alibi_slopes=np.full(8, 0.1),
                         mask=rng.random(4096) > 0.1)          # a key-padding mask
w = fastattn.attention_weights(q[:, :, :16], k, causal=True)   # (1, 8, 16, 4096), rows sum to 1

# attention over two halves of the keys, combined exactly (no causal: it aligns on Lk)
o1, l1 = fastattn.attention(q, k[:, :, :2048], v[:, :, :2048], return_lse=True)
o2, l2 = fastattn.attention(q, k[:, :, 2048:], v[:, :, 2048:], return_lse=True)
out, lse = fastattn.merge([o1, o2], [l1, l2])                  # = attention(q, k, v, return_lse=True)

# the float64 oracle every result is checked against
ref = fastattn.reference.attention(q[:, :1], k[:, :1], v[:, :1], causal=True)
fastattn.show_config()    # compiler, OpenMP, threads, which CPU kernel runs and why

# ---- README block
from fastattn import geometry

gq, gk, gv = (rng.standard_normal((4, 256, 64)) for _ in range(3))   # (H, L, D), float64
prof = geometry.entropy_profile(gq, gk, causal=True)   # .entropy, .effective_support,
                                                       # .max_weight, .n_visible: (4, 256)
row = fastattn.attention_weights(gq, gk, causal=True)[0, 100, :101]   # head 0, query 100
keys, coords, rest = geometry.simplex_coordinates(row, top_k=5)       # 5 largest + the rest
points_2d, output_2d = geometry.barycentre_projection(row, gv[0, :101])  # = row @ points_2d

# ---- README block
B, H, D, T = 1, 32, 128, 8192
k_cache = np.zeros((B, H, T, D), np.float16)      # preallocated once, filled as tokens arrive
v_cache = np.zeros((B, H, T, D), np.float16)

def decode_step(q, t):                             # q: (B, H, 1, D) float32, t tokens cached
    return fastattn.attention(q, k_cache[:, :, :t], v_cache[:, :, :t], causal=True)

# ---- README block
kq = fastattn.QuantizedKV(np.zeros((B, H, T, D), np.int8), np.zeros((B, H, T, D // 32), np.float32))
vq = fastattn.QuantizedKV(np.zeros((B, H, T, D), np.int8), np.zeros((B, H, T, D // 32), np.float32))

def decode_step_int8(q, k_new, v_new, t):          # k_new, v_new: (B, H, 1, D) float32
    fastattn.quantize_kv(k_new, out=kq[:, :, t:t + 1])
    fastattn.quantize_kv(v_new, out=vq[:, :, t:t + 1])
    return fastattn.attention(q, kq[:, :, :t + 1], vq[:, :, :t + 1], causal=True)

q_step, k_new, v_new = np.random.default_rng(0).standard_normal((3, B, H, 1, D), dtype=np.float32)
o_step = decode_step_int8(q_step, k_new, v_new, 0) # the first token: (B, H, 1, D)
