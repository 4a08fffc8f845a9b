"""Decode baselines from other CPU runtimes, built for one shape: ONNX Runtime's
Attention operator (ONNX opset 23) and OpenVINO's ScaledDotProductAttention (opset 13).
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
