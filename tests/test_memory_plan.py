"""inspect predicts what run allocates: every component per device, total within 5%."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.engine import Engine
from pyggspec.speculative.loop import SpecConfig
from pyggspec.testing import cached_model, tiny_dense, tiny_moe

PROMPTS = [list(range(300, 300 + 200)), [301, 302, 303]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("memplan")
    return {a: cached_model(f(dtype="f32", agreement=0.8, tied_embeddings=False), d)
            for a, f in (("dense", tiny_dense), ("moe", tiny_moe))}


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("rollback,n_max", [("snapshot", 3), ("checkpoint", 2), (None, 0)])
def test_inspect_prediction_matches_run_allocation(models, arch, rollback, n_max):
    path = models[arch]
    args = ["inspect", str(path), "--ctx", "1024", "--parallel", "2", "-ub", "128",
            "--spec-draft-n-max", str(n_max), "--json", "-ngl", "0"]
    if rollback:
        args += ["--spec-rollback", rollback]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    pred = json.loads(r.output)["memory"]
    spec = {"spec_type": "draft-mtp", "spec": SpecConfig(n_max=n_max, rollback=rollback)} \
        if n_max else {}
    with Engine(path, n_ctx=1024, n_parallel=2, n_ubatch=128, n_threads=2,
                n_gpu_layers=0, **spec) as e:
        e.generate_batch(PROMPTS, max_tokens=12, ignore_eos=True)
        got = e.memory()
        assert e.memory_plan.to_dict()["total_bytes"] == pytest.approx(got["total_bytes"],
                                                                        rel=0.05)
    assert "total_bytes" in got and "by_device" in got
    # exact components (everything but the allocator's compute buffers)
    for comp in ("kv", "mtp_kv", "recurrent", "snapshots", "checkpoints"):
        assert pred.get(comp) == got.get(comp), comp
    if not n_max:
        pred_total = pred["total_bytes"] - sum(pred.get("weights", {}).values()) \
            + sum(got["weights"].values())  # inspect counts the grafted MTP block's weights
    else:
        pred_total = pred["total_bytes"]
    assert pred_total == pytest.approx(got["total_bytes"], rel=0.05)
    assert got["compute"]["CPU"] > 0


def test_snapshots_that_do_not_fit_fall_back_to_checkpoints(models, monkeypatch):
    """auto picks snapshots; when the devices cannot hold them it says so and degrades to
    checkpoints before allocating anything; when even that does not fit, a clear error."""
    from pyggspec.errors import PyggspecError
    from pyggspec.ggml.device import Device

    path = models["dense"]
    with Engine(path, n_ctx=512, n_parallel=2, n_threads=2, n_gpu_layers=0,
                spec_type="draft-mtp", spec=SpecConfig(n_max=4)) as e:
        assert e.rollback == "snapshot"
        snap = e.memory_plan.total_bytes - sum(e.memory_plan.components["weights"].values())
        ck_plan = e.memory_plan.components.get("snapshots", {})
    real = Device.memory

    def limited(self, free_bytes):
        free, total = real(self)
        return (min(free, free_bytes), total) if self.is_cpu else (free, total)

    budget = snap - sum(ck_plan.values()) // 2  # enough for checkpoints, not for snapshots
    monkeypatch.setattr(Device, "memory", lambda self: limited(self, budget))
    with Engine(path, n_ctx=512, n_parallel=2, n_threads=2, n_gpu_layers=0,
                spec_type="draft-mtp", spec=SpecConfig(n_max=4)) as e:
        assert e.rollback == "checkpoint"
        out = e.generate_batch([[300, 301]], max_tokens=8, ignore_eos=True)
        assert len(out[0].tokens) == 8
    monkeypatch.setattr(Device, "memory", lambda self: limited(self, 1024))
    with pytest.raises(PyggspecError, match="MiB are free"):
        Engine(path, n_ctx=512, n_parallel=2, n_threads=2, n_gpu_layers=0,
               spec_type="draft-mtp", spec=SpecConfig(n_max=4))
