"""The cffi binding: devices, buffers, graphs, op checks, and numerics against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from pyggspec.ggml import buffer, context, device, sched
from pyggspec.ggml.context import GraphError
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.testing.gdn_reference import gated_delta_rule


@pytest.fixture(scope="module")
def cpu():
    backend = device.cpu_device().open(n_threads=2)
    yield backend
    backend.close()


def run_graph(cpu, build, inputs: dict[str, np.ndarray], n_tensors: int = 64):
    """Build a graph with ``build(ctx, ins) -> outputs``, run on CPU, return numpy outputs."""
    ctx = context.Context(n_tensors, graph_size=256)
    ins = {}
    for name, arr in inputs.items():
        t = ctx.input(GGMLType.F32 if arr.dtype == np.float32 else GGMLType.I32,
                      tuple(reversed(arr.shape)), name)
        ins[name] = t
    outs = build(ctx, ins)
    graph = sched.Graph(ctx, outs, size=256)
    s = sched.BackendScheduler([cpu], graph_size=256)
    s.alloc(graph)
    for name, arr in inputs.items():
        ins[name].set(arr)
    s.compute(graph)
    res = [o.get() for o in outs]
    s.close()
    ctx.close()
    return res


def test_cpu_device_listed():
    infos = device.list_devices()
    assert any(i.type == "cpu" for i in infos)
    cpu = device.cpu_device()
    _free, total = cpu.memory()
    assert total > 0
    assert "CPU" in device.backends_available()


def test_rpc_backend_compiled_in():
    assert device.has_rpc(), "llama-cpp-python lacks the RPC backend: run ./install.sh"


def test_unknown_device_is_clear_error():
    from pyggspec.errors import DeviceError

    with pytest.raises(DeviceError, match="no such device"):
        device.get_device("NOPE9")


def test_matmul_add_norm_match_numpy(cpu):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 16)).astype(np.float32)  # ggml [16, 8]: 8 rows of 16
    x = rng.standard_normal((3, 16)).astype(np.float32)  # ggml [16, 3]
    b = rng.standard_normal((8,)).astype(np.float32)

    def build(ctx, ins):
        y = ctx.add(ctx.mul_mat(ins["w"], ins["x"]), ins["b"]).named("y")
        n = ctx.rms_norm(ins["x"], 1e-6).named("n")
        return [y, n]

    y, n = run_graph(cpu, build, {"w": w, "x": x, "b": b})
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5)
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(n, ref, rtol=1e-5, atol=1e-5)


def test_views_topk_argmax(cpu):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 50)).astype(np.float32)

    def build(ctx, ins):
        am = ctx.argmax(ins["x"])
        tk = ctx.cont(ctx.argsort_top_k(ins["x"], 5))
        row1 = ctx.view(ins["x"], (50,), (), offset=50 * 4)
        return [am, tk, ctx.cont(ctx.scale(row1, 2.0))]

    am, tk, row1 = run_graph(cpu, build, {"x": x})
    assert list(am) == list(x.argmax(-1))
    for r in range(2):
        assert set(tk[r]) == set(np.argsort(-x[r])[:5])
    np.testing.assert_allclose(row1, 2 * x[1], rtol=1e-6)


@pytest.mark.parametrize("K", [1, 3])
def test_gated_delta_net_matches_reference(cpu, K):
    rng = np.random.default_rng(2)
    B, T, H, Hk, S = 2, 4, 4, 2, 8
    q = rng.standard_normal((B, T, Hk, S)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, S)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, S)).astype(np.float32)
    g = -np.abs(rng.standard_normal((B, T, H, 1))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H, 1))))).astype(np.float32)
    state = (0.1 * rng.standard_normal((B, H, S, S))).astype(np.float32)

    def build(ctx, ins):
        return [ctx.gated_delta_net(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"],
                                    ins["state"], n_snapshots=K)]

    (res,) = run_graph(cpu, build, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state})
    out_ref, states_ref = gated_delta_rule(q, k, v, g[..., 0], beta[..., 0], state)
    flat = res.reshape(-1, S * H)
    n_out = T * B
    out = flat[:n_out].reshape(B, T, H, S)
    np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-5)
    snaps = flat[n_out:].reshape(K, B, H, S, S)
    for slot in range(min(K, T)):
        np.testing.assert_allclose(snaps[slot], states_ref[:, T - 1 - slot], rtol=1e-4,
                                   atol=1e-5)


def test_bad_shapes_raise_instead_of_abort():
    ctx = context.Context(16)
    a = ctx.new_tensor("f32", (4, 3))
    b = ctx.new_tensor("f32", (5, 2))
    with pytest.raises(GraphError, match="mul_mat"):
        ctx.mul_mat(a, b)
    with pytest.raises(GraphError, match="broadcast"):
        ctx.add(a, b)
    with pytest.raises(GraphError, match="reshape"):
        ctx.reshape(a, (5,))
    with pytest.raises(GraphError, match="view"):
        ctx.view(a, (4, 4), (16,))
    with pytest.raises(GraphError, match="ids must be i32"):
        ctx.get_rows(a, b)
    ctx.close()
    assert ctx.closed


def test_context_full_is_an_error():
    ctx = context.Context(2)
    ctx.new_tensor("f32", (4,))
    ctx.new_tensor("f32", (4,))
    with pytest.raises(GraphError, match="full"):
        ctx.new_tensor("f32", (4,))
    ctx.close()


def test_buffer_roundtrip_and_close():
    ctx = context.Context(4)
    t = ctx.new_tensor("f32", (6, 2), "w")
    buf = buffer.Buffer.for_context(ctx, device.cpu_device(), "test")
    assert buf.size >= 48
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    t.set(data)
    np.testing.assert_array_equal(t.get(), data)
    with pytest.raises(ValueError, match="overflows"):
        t.set(np.zeros(13, dtype=np.float32))
    with pytest.raises(TypeError):
        t.set(np.zeros(12, dtype=np.float64))
    buf.close()
    buf.close()  # idempotent
    ctx.close()


def test_graph_cache_reuses_and_evicts():
    built = []

    class Entry:
        def __init__(self, key):
            self.key = key
            self.closed = False
            built.append(self)

        def close(self):
            self.closed = True

    cache = sched.GraphCache(capacity=2)
    e1 = cache.get(("decode", 1), Entry)
    assert cache.get(("decode", 1), Entry) is e1
    cache.get(("prefill", 32), Entry)
    cache.get(("verify", 4), Entry)
    assert e1.closed and len(cache) == 2
    assert cache.hits == 1 and cache.misses == 3


def test_rpc_server_shows_up_as_device(rpc_device):
    names = [d.name for d in device.devices()]
    assert rpc_device.name in names and rpc_device.is_rpc
    assert any(i.name == rpc_device.name for i in device.list_devices())
    _free, total = rpc_device.memory()
    assert total > 0
    # a tensor round trip through the remote device's memory
    ctx = context.Context(2)
    t = ctx.new_tensor("f32", (8,), "r")
    buf = buffer.Buffer.for_context(ctx, rpc_device, "rpc-test")
    data = np.arange(8, dtype=np.float32)
    t.set(data)
    np.testing.assert_array_equal(t.get(), data)
    buf.close()
    ctx.close()
