"""Baselines from other CPU runtimes, built for one shape: ONNX Runtime's Attention
operator (ONNX opset 23), OpenVINO's ScaledDotProductAttention (opset 13), and for
decoding llama.cpp's flash attention (make_ggml: ggml's flash_attn_ext through the
ggml-python package, ``pip install ggml-python``, which builds ggml from source).
Each ``make_*`` returns a function of (q, k, v) that runs one call on the given
number of threads, or raises ImportError when the runtime is not installed
(``pip install onnxruntime onnx openvino``).  Lq > 1 gets a bottom-right causal mask
(each new query sees the cache and its own prefix), as fastattn's ``causal=True``,
unless causal=False (prefill without a mask)."""
import numpy as np


def _mask(Lq, Lk):
    return np.tril(np.ones((Lq, Lk), bool), Lk - Lq)


def make_onnxruntime(B, Hq, Hkv, Lq, Lk, D, threads, causal=None):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    masked = Lq > 1 if causal is None else bool(causal)
    inputs = ["Q", "K", "V"] + (["M"] if masked else [])
    node = helper.make_node("Attention", inputs, ["Y"])
    vi = [helper.make_tensor_value_info("Q", TensorProto.FLOAT, [B, Hq, Lq, D]),
          helper.make_tensor_value_info("K", TensorProto.FLOAT, [B, Hkv, Lk, D]),
          helper.make_tensor_value_info("V", TensorProto.FLOAT, [B, Hkv, Lk, D])]
    if masked:
        vi.append(helper.make_tensor_value_info("M", TensorProto.BOOL, [Lq, Lk]))
    graph = helper.make_graph([node], "decode", vi,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    # the lowest IR version that carries opset 23, not onnx's own newest: an ONNX Runtime
    # older than the onnx package refuses a model of a newer IR (seen: onnx 1.23 writes
    # IR 14, ONNX Runtime 1.30 reads up to 13)
    opsets = [helper.make_opsetid("", 23)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # ONNX Runtime's pool spins after each run, and more than the bench's 30 ms pause:
    # the next library's call then shares its cores with those threads (fastattn
    # measured 2.5x slower right after an ORT call, B32 H8 L64, 2 threads).  Without
    # the spin, ORT's own calls take the same time (5.7 ms either way there).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    extra = {"M": _mask(Lq, Lk)} if masked else {}
    return lambda q, k, v: sess.run(None, dict(Q=q, K=k, V=v, **extra))[0]


def make_openvino(B, Hq, Hkv, Lq, Lk, D, threads, causal=None):
    import openvino as ov
    import openvino.opset13 as ops
    q = ops.parameter([B, Hq, Lq, D], np.float32)
    k = ops.parameter([B, Hkv, Lk, D], np.float32)
    v = ops.parameter([B, Hkv, Lk, D], np.float32)
    params = [q, k, v]
    if Hkv != Hq:  # SDPA wants one K/V head per query head: repeat inside the graph
        rep = ops.constant(np.array([1, Hq // Hkv, 1, 1], np.int64))
        ks = ops.unsqueeze(k, ops.constant(np.array([2], np.int64)))
        vs = ops.unsqueeze(v, ops.constant(np.array([2], np.int64)))
        shape = ops.constant(np.array([B, Hq, Lk, D], np.int64))
        k_in = ops.reshape(ops.tile(ks, ops.constant(np.array([1, 1, Hq // Hkv, 1, 1], np.int64))), shape, False)
        v_in = ops.reshape(ops.tile(vs, ops.constant(np.array([1, 1, Hq // Hkv, 1, 1], np.int64))), shape, False)
        del rep
    else:
        k_in, v_in = k, v
    if (Lq > 1 if causal is None else causal):
        m = ops.constant(_mask(Lq, Lk))
        y = ops.scaled_dot_product_attention(q, k_in, v_in, m)
    else:
        y = ops.scaled_dot_product_attention(q, k_in, v_in)
    core = ov.Core()
    compiled = core.compile_model(ov.Model([y], params), "CPU",
                                  {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()
    return lambda q, k, v: req.infer([q, k, v])[0]


GGML_CACHES = ("float32", "float16", "bfloat16", "int8", "int4")  # int8: q8_0, int4: q4_0


def make_ggml(q, k, v, threads, cache="float32"):
    """llama.cpp's CPU flash attention (ggml's ``ggml_flash_attn_ext``, from the
    ``ggml-python`` package, which builds ggml from source) for one decode shape: q
    (B, Hq, 1, D) float32 against k, v (B, Hkv, Lk, D) float32 stored in ggml's cache
    type for `cache` (F32, F16, BF16, Q8_0 for int8, Q4_0 for int4: quantized by ggml's
    own quantize_chunk from the same float32 values), no mask (one query sees every
    key).  Returns a function of no arguments that runs one call on `threads` threads
    and returns the output as (B, Hq, 1, D) float32; ImportError without ggml-python.

    ggml's tensors are (ne0 fastest): q [D, 1, Hq, B], k and v [D, Lk, Hkv, B] (NumPy's
    C-order (B, H, L, D) as it is), the result [D, Hq, 1, B].  The context and the graph
    are built once; each call is one ggml_graph_compute_with_ctx."""
    import ctypes

    import ggml
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Lq != 1:
        raise ValueError("make_ggml: one query a sequence (decode)")
    gtype = {"float32": ggml.GGML_TYPE_F32, "float16": ggml.GGML_TYPE_F16, "bfloat16": ggml.GGML_TYPE_BF16,
             "int8": ggml.GGML_TYPE_Q8_0, "int4": ggml.GGML_TYPE_Q4_0}[cache]
    row = ggml.ggml_row_size(gtype, D)
    mem = 2 * B * Hkv * Lk * row + q.nbytes + q.nbytes + 16 * 2**20  # k, v, q, out, overhead
    params = ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False)
    ctx = ggml.ggml_init(params)
    tq = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, 1, Hq, B)
    ctypes.memmove(ggml.ggml_get_data(tq), np.ascontiguousarray(q, np.float32).ctypes.data, q.nbytes)
    kv = []
    for x in (k, v):
        t = ggml.ggml_new_tensor_4d(ctx, gtype, D, Lk, Hkv, B)
        src = np.ascontiguousarray(x, np.float32)
        dst = ggml.ggml_get_data(t)
        if cache == "float32":
            ctypes.memmove(dst, src.ctypes.data, src.nbytes)
        elif cache == "float16":
            h = src.astype(np.float16)
            ctypes.memmove(dst, h.ctypes.data, h.nbytes)
        elif cache == "bfloat16":  # round to nearest even, as ml_dtypes and ggml do
            import ml_dtypes
            h = src.astype(ml_dtypes.bfloat16)
            ctypes.memmove(dst, h.ctypes.data, h.nbytes)
        else:
            rows = B * Hkv * Lk
            ggml.ggml_quantize_chunk(gtype, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), dst, 0,
                                     rows, D, None)
        kv.append(t)
    out = ggml.ggml_flash_attn_ext(ctx, tq, kv[0], kv[1], None, 1.0 / np.sqrt(D), 0.0, 0.0)
    ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
    graph = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(graph, out)
    res = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                shape=(B, 1, Hq, D))

    def call():
        ggml.ggml_graph_compute_with_ctx(ctx, graph, threads)
        return res.transpose(0, 2, 1, 3).copy()
    import weakref
    weakref.finalize(call, ggml.ggml_free, ctx)  # the context lives as long as the function
    return call
