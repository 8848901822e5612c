"""inspect predicts what run allocates: every component per device; compute buffers are
ggml's own sizing of the worst-case graphs, reserved at startup and never grown."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.sampling import SamplingParams
from pyggspec.sampling.graph import SharedRevid
from pyggspec.testing import cached_model, qwen35_0_8b


def _zero_weights(self):
    """TensorEntry.data stand-in: zeros in the planned type (only shapes matter here)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    if self.qtype in (QT.F32, QT.F16):
        return np.zeros(self.shape, np.float32 if self.qtype == QT.F32 else np.float16)
    return np.zeros(quants.quant_shape_to_byte_shape(self.shape, self.qtype), np.uint8)


@pytest.fixture(scope="module")
def paths(models):
    """tiny dense / MoE (f32, 16k context), the same split into trunk + MTP file, and real
    Qwen3.5-0.8B widths and vocabulary with 4 layers (q8_0 zeros: written in a second)."""
    from pyggspec.testing import writer

    kw = {"dtype": "f32", "agreement": 0.8, "tied_embeddings": False, "context_length": 16384}
    out = {a: models.get(a, **kw) for a in ("dense", "moe")}
    out["split"] = models.split("dense", **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer.TensorEntry, "data", _zero_weights)
        # a directory of its own: these bytes are not what the spec's digest names
        out["0.8b"] = cached_model(qwen35_0_8b(dtype="q8_0", n_layer=4),
                                   models.root / "zero-weights")
    return out


def _inspect(path, n_ctx, n_par, ub, n_max, rollback, mtp=None, ngl=0, device=None) -> dict:
    args = ["inspect", str(path), "--ctx", str(n_ctx), "--parallel", str(n_par), "-ub",
            str(ub), "--spec-draft-n-max", str(n_max), "--json", "-ngl", str(ngl)]
    if device:
        args += ["--device", device]
    if rollback:
        args += ["--spec-rollback", rollback]
    if mtp is not None:
        args += ["--mtp", str(mtp)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["memory"]


def _engine(make_engine, path, n_ctx, n_par, ub, n_max, rollback, mtp=None, **kw) -> Engine:
    spec = ({"spec_type": "draft-mtp", "spec": SpecConfig(n_max=n_max, rollback=rollback or
                                                          "auto")} if n_max else {})
    kw.setdefault("n_gpu_layers", 0)
    return make_engine(path, mtp_path=mtp, n_ctx=n_ctx, n_parallel=n_par, n_ubatch=ub,
                       repack=False, **spec, **kw)


# model, ctx, parallel, ubatch, n_max, rollback
GRID = [
    ("dense", 512, 1, 512, 0, None),
    ("dense", 8192, 4, 512, 6, "snapshot"),
    ("dense", 1024, 2, 64, 3, "checkpoint"),
    ("moe", 2048, 3, 128, 1, "snapshot"),
    ("moe", 8192, 2, 256, 4, "checkpoint"),
    ("split", 4096, 3, 512, 2, "snapshot"),
    ("0.8b", 512, 1, 512, 0, None),
    ("0.8b", 4096, 4, 512, 3, "snapshot"),
    ("0.8b", 8192, 2, 256, 6, "checkpoint"),
    ("0.8b", 2048, 3, 128, 1, "snapshot"),
]


@pytest.mark.parametrize("arch,n_ctx,n_par,ub,n_max,rollback", GRID)
def test_inspect_predicts_reserved_compute(paths, make_engine, arch, n_ctx, n_par, ub, n_max,
                                           rollback):
    """inspect (nothing loaded) predicts every component the engine allocates at startup;
    compute within 5% per device (it is the same ggml sizing of the same graphs)."""
    path, mtp = (paths[arch], None) if arch != "split" else paths[arch]
    pred = _inspect(path, n_ctx, n_par, ub, n_max, rollback, mtp)
    assert "compute_estimated" not in pred
    with _engine(make_engine, path, n_ctx, n_par, ub, n_max, rollback, mtp) as e:
        got = e.memory()
        plan = e.memory_plan.to_dict()
    for comp in ("kv", "mtp_kv", "recurrent", "snapshots", "checkpoints"):
        assert pred.get(comp) == got.get(comp) == plan.get(comp), comp
    assert plan["compute"] == got["compute"]  # the engine reserved what it planned
    assert set(pred["compute"]) == set(got["compute"])
    for dev, n in got["compute"].items():
        assert n > 0
        assert pred["compute"][dev] == pytest.approx(n, rel=0.05), dev
    weights = sum(got["weights"].values())
    # inspect also counts a grafted MTP block the engine leaves unloaded without speculation
    pred_total = pred["total_bytes"] - sum(pred["weights"].values()) + weights
    assert pred_total == pytest.approx(got["total_bytes"], rel=0.05)


def _mixed_run(e: Engine, n_max: int) -> None:
    """Long prompts up to the context, gaps in the live slots, speculation and rollback."""
    n_ctx, n_par = e.n_ctx, e.n_parallel
    vocab = min(e.n_vocab, 1000) - 300

    def prompt(n: int) -> list[int]:
        return [300 + i % vocab for i in range(n)]

    last, hidden = n_par - 1, bool(n_max)
    e.decode({0: prompt(n_ctx - 8), last: prompt(n_ctx - 8)}, hidden=hidden)
    e.decode({0: prompt(4), last: prompt(4)}, hidden=hidden)  # one ubatch, slots apart
    for s in range(n_par):
        e.clear(s)
    e.decode({0: prompt(e.n_ubatch // 2), last: prompt(e.n_ubatch // 2)}, hidden=hidden)
    for s in range(n_par):
        e.clear(s)
    # the middle sequence hits the context first: the others go on with a gap between them
    lens = [n_ctx - 12 if s % 2 == 0 else n_ctx - 30 + 20 * (s // 2 + 1) for s in range(n_par)]
    lens = [min(n, n_ctx - 3) for n in lens]
    if n_par > 2:
        lens[1] = n_ctx - 4
    e.generate_batch([prompt(n) for n in lens], max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("arch,n_ctx,n_par,ub,n_max,rollback", [
    ("moe", 512, 3, 512, 0, None),
    ("dense", 600, 3, 100, 4, "snapshot"),
    ("moe", 640, 4, 64, 2, "checkpoint"),
    ("0.8b", 128, 3, 64, 3, "snapshot"),
])
def test_compute_buffers_never_grow(paths, make_engine, arch, n_ctx, n_par, ub, n_max, rollback):
    """The startup reservation covers every graph the generation loop and decode() run,
    sampler chains in the graph included (greedy, a sampled token after every graph stage,
    top-k candidates; coupled drafts in the MTP graph)."""
    with _engine(make_engine, paths[arch], n_ctx, n_par, ub, n_max, rollback,
                 backend_sampling=True) as e:
        planned = e.memory_plan.to_dict()["compute"]
        assert e.memory()["compute"] == planned
        _mixed_run(e, n_max)
        assert e.memory()["compute"] == planned
        prompts = [[300 + i for i in range(n_ctx - 20 - 4 * s)] for s in range(n_par)]
        bias = ((7, 2.0),)
        for p in (SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.02, repeat_penalty=1.2,
                                 logit_bias=bias, seed=3),
                  SamplingParams(temp=0.9, top_k=20, repeat_penalty=1.1, seed=4),
                  SamplingParams(temp=0.7, seed=5)):
            e.generate_batch(prompts, max_tokens=12, ignore_eos=True, sampling=p)
            assert e.samplers.failed is None and e.samplers.stats.device_stages, p
            assert e.memory()["compute"] == planned, p
            _check_shared_constants(e)
    assert ("CPU", e.n_vocab) not in SharedRevid.live  # freed with the engine's graphs


def _check_shared_constants(e: Engine) -> None:
    """The sampler graphs' V - id constant: one per device, shared by every cached graph
    (each kept a copy before), and inside the memory plan's "sampling" part."""
    planned = e.memory_plan.to_dict().get("sampling", {})
    got = e.memory().get("sampling", {})
    assert planned.get("CPU") == 4 * e.n_vocab
    assert got.get("CPU", 0) <= planned["CPU"]
    live = SharedRevid.live.get(("CPU", e.n_vocab))
    assert live is not None and live.users >= 2  # several graphs, one buffer


def test_prediction_and_reservation_across_devices(paths, make_engine, rpc_device):
    """Layers, the MTP block and the LM head on a second device (RPC): each device's compute
    buffer is predicted by inspect, reserved at startup and not grown by a generation."""
    path, dev = paths["dense"], rpc_device.name
    pred = _inspect(path, 512, 2, 128, 3, "snapshot", ngl=3, device=dev)
    with _engine(make_engine, path, 512, 2, 128, 3, "snapshot", n_gpu_layers=3,
                 device=dev) as e:
        got = e.memory()["compute"]
        assert set(got) == {"CPU", dev} and all(n > 0 for n in got.values())
        assert pred["compute"] == pytest.approx(got, rel=0.05)
        # per-step graphs keep schedulers of their own there: bounded, predicted by inspect
        bound = e.memory_plan.to_dict()["step_graphs"]
        assert pred["step_graphs"] == bound and set(bound) == {"CPU", dev}
        # (the draft-length calibration at startup already ran some of them)
        e.generate_batch([list(range(300, 700)), [301, 302, 303]], max_tokens=6,
                         ignore_eos=True)
        assert e.memory()["compute"] == got
        steps = e.memory()["step_graphs"]
        assert all(0 < steps[d] <= bound[d] for d in steps), (steps, bound)


def test_snapshots_that_do_not_fit_fall_back_to_checkpoints(paths, make_engine, monkeypatch):
    """auto picks snapshots; when the devices cannot hold them it says so and degrades to
    checkpoints before allocating anything; when even that does not fit, a clear error."""
    from pyggspec.errors import PyggspecError
    from pyggspec.ggml.device import Device

    path = paths["dense"]
    with make_engine(path, n_ctx=512, n_parallel=4, n_ubatch=16, n_gpu_layers=0,
                     load_tokenizer=True,
                     spec_type="draft-mtp", spec=SpecConfig(n_max=8)) as e:
        assert e.rollback == "snapshot"
        snap = e.memory_plan.total_bytes - sum(e.memory_plan.components["weights"].values())
    # snapshot rollback keeps the state after every verify row (compute buffer), checkpoint
    # rollback one spare plane: more for snapshots where those rows outweigh the buffer's
    # other peak (a prompt chunk's activations; small ubatches here)
    with make_engine(path, n_ctx=512, n_parallel=4, n_ubatch=16, n_gpu_layers=0,
                     load_tokenizer=True,
                     spec_type="draft-mtp", spec=SpecConfig(n_max=8, rollback="checkpoint")) as e:
        ck = e.memory_plan.total_bytes - sum(e.memory_plan.components["weights"].values())
    assert snap > ck
    real = Device.memory

    def limited(self, free_bytes):
        free, total = real(self)
        return (min(free, free_bytes), total) if self.is_cpu else (free, total)

    budget = (snap + ck) // 2  # enough for checkpoints, not for snapshots
    monkeypatch.setattr(Device, "memory", lambda self: limited(self, budget))
    with make_engine(path, n_ctx=512, n_parallel=4, n_ubatch=16, n_gpu_layers=0,
                     load_tokenizer=True,
                     spec_type="draft-mtp", spec=SpecConfig(n_max=8)) as e:
        assert e.rollback == "checkpoint"
        out = e.generate_batch([[300, 301]], max_tokens=8, ignore_eos=True)
        assert len(out[0].tokens) == 8
    monkeypatch.setattr(Device, "memory", lambda self: limited(self, 1024))
    with pytest.raises(PyggspecError, match="MiB are free"):
        make_engine(path, n_ctx=512, n_parallel=4, n_ubatch=16, n_gpu_layers=0,
                     load_tokenizer=True,
                    spec_type="draft-mtp", spec=SpecConfig(n_max=8))
