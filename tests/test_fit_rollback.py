"""Memory-capped speculation state (issue 53, item 4): with ``--fit`` and
``--spec-rollback auto``, when snapshot rollback's planes (a verify's n_max + 1 states per
slot) would push weights off a tight device, the fit chooses checkpoint rollback instead
and says so (``--spec-rollback`` among what ``--fit`` set, in the table's first line)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pyggspec import Engine, SamplingParams, SpecConfig
from pyggspec.cli import main

MiB = 1 << 20
# many slots and long drafts: snapshot planes cost ~5 MiB more than checkpoints here,
# less than one block's experts (~12 MiB)
SHAPE = ("-np", "8", "--spec-draft-n-max", "16", "-c", "256")


@pytest.fixture(scope="module")
def moe(models):
    return models.moe(n_embd=128, n_ff_exp=1024, context_length=32768)


def _inspect(path, *args: str) -> dict:
    r = CliRunner().invoke(main, ["inspect", str(path), "--json", *SHAPE, *map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _need(rpc_device, path, rollback: str) -> int:
    j = _inspect(path, "--fit", "off", "-dev", rpc_device.name, "--spec-rollback", rollback)
    return j["memory"]["by_device"][rpc_device.name]


def _fitt(rpc_device, budget: int) -> int:
    return (rpc_device.memory()[0] - budget) // MiB


@pytest.fixture(scope="module")
def needs(rpc_device, moe) -> tuple[int, int]:
    snap, ck = _need(rpc_device, moe, "snapshot"), _need(rpc_device, moe, "checkpoint")
    assert snap - ck > 3 * MiB  # the case this tests: planes that matter
    return snap, ck


def test_tight_device_takes_checkpoints_not_weights_off(rpc_device, moe, needs):
    snap, ck = needs
    budget = ck + 2 * MiB  # checkpoints fit whole; snapshots would move experts
    assert snap > budget
    f = _inspect(moe, "-fitp", "-dev", rpc_device.name, "-fitt", _fitt(rpc_device, budget))
    assert f["spec_rollback"] == "checkpoint" and "--spec-rollback" in f["changed"]
    assert f["n_cpu_moe"] == 0 and set(f["layer_devices"]) == {rpc_device.name}
    assert f["by_device"][rpc_device.name] <= budget
    # snapshots asked for: honoured, experts move instead
    f = _inspect(moe, "-fitp", "-dev", rpc_device.name, "-fitt", _fitt(rpc_device, budget),
                 "--spec-rollback", "snapshot")
    assert f["spec_rollback"] == "snapshot" and f["n_cpu_moe"] >= 1
    assert "--spec-rollback" not in f["changed"]


def test_room_for_snapshots_keeps_them(rpc_device, moe, needs):
    snap, _ = needs
    f = _inspect(moe, "-fitp", "-dev", rpc_device.name, "-fitt",
                 _fitt(rpc_device, snap + 2 * MiB))
    assert f["changed"] == [] and f["spec_rollback"] == "auto"


def test_engine_runs_checkpoints_inside_the_budget(rpc_device, moe, needs):
    _, ck = needs
    budget = ck + 2 * MiB
    dev = rpc_device.name
    with Engine(moe, device=dev, n_gpu_layers=None, n_ctx=256, n_parallel=8, n_threads=2,
                spec_type="draft-mtp", spec=SpecConfig(n_max=16),
                fit_target=(_fitt(rpc_device, budget),), sampling=SamplingParams(temp=0.0),
                load_tokenizer=False) as e:
        assert e.rollback == "checkpoint" and e.fit is not None
        assert "--spec-rollback" in e.fit.result.changed and e.fit.result.n_cpu_moe == 0
        head = e.fit.table().splitlines()[0]  # the line run / serve print
        assert "--spec-rollback checkpoint" in head and "set by --fit: --spec-rollback" in head
        out = e.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True)
        assert len(out.tokens) == 12
        assert e.memory()["by_device"][dev] <= e.memory_plan.by_device()[dev] <= budget
