"""scripts/gpu_check: the time plan of a device draw (a pure function) and the large shapes'
one-file-per-shape models (issue 54): what a lent GPU's 15 minutes rest on, checked here."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "gpu_check"))
    import plan
    import shapes

    return plan, shapes


def test_the_default_plan_fits_a_15_minute_draw(gpu_check):
    plan, _ = gpu_check
    p = plan.time_plan(12.5)
    assert p.end <= p.budget_s
    assert plan.MACHINE_START_S + p.end + plan.RETURN_S <= plan.DRAW_MIN * 60
    first = [it for it in p.items if it.fits]
    # the most important rows come first and fit: both shapes at -np 1, every n_max
    assert [it.name.split(" (")[0] for it in first[:2]] == ["mtp 27b a0.95 -np 1",
                                                            "mtp 35b-a3b a0.95 -np 1"]
    # the benchmarks start when the builds and the models are done
    assert p.bench_start >= max(st.end for st in p.stages)
    text = plan.format_plan(p)
    assert "(fits)" in text and "OVER" not in text


def test_items_past_the_budget_are_skipped_in_order(gpu_check):
    plan, _ = gpu_check
    p = plan.time_plan(8.0)
    fits = [it.fits for it in p.items]
    assert not all(fits)
    assert p.end <= p.budget_s
    ends = [it.end for it in p.items if it.fits]
    assert ends == sorted(ends)
    assert "SKIPPED" in plan.format_plan(p)


def test_a_slower_engine_estimate_moves_items_out(gpu_check, monkeypatch):
    plan, _ = gpu_check
    n_fast = sum(it.fits for it in plan.time_plan(12.5).items)
    monkeypatch.setitem(plan.ENGINE["27b"], "plain_tps", 40.0)
    assert sum(it.fits for it in plan.time_plan(12.5).items) < n_fast


def test_the_large_shapes_have_the_real_hyper_parameters(gpu_check):
    _, shapes = gpu_check
    d = shapes.model_spec("27b", 0.95)
    assert (d.arch, d.n_layer, d.n_embd, d.n_ff, d.n_head, d.n_head_kv, d.head_dim) == (
        "qwen35", 64, 5120, 17408, 24, 4, 256)
    assert (d.n_group, d.dt_rank, d.d_state, d.n_rot, d.n_vocab) == (16, 48, 128, 64, 248320)
    m = shapes.model_spec("35b-a3b", 0.70)
    assert (m.arch, m.n_layer, m.n_embd, m.n_expert, m.n_expert_used, m.n_ff_exp,
            m.n_ff_shexp) == ("qwen35moe", 40, 2048, 256, 8, 512, 512)
    assert (m.n_head, m.n_head_kv, m.n_group, m.dt_rank) == (16, 2, 16, 32)
    assert d.shared_layers and m.shared_layers and not d.tied_embeddings
    # ~27B and ~35B parameters, ~0.56 bytes each at Q4_K
    assert 14 < shapes.file_bytes("27b") / 2**30 < 15.5
    assert 18 < shapes.file_bytes("35b-a3b") / 2**30 < 20


@pytest.mark.parametrize("shape", ["tiny-dense", "tiny-moe"])
def test_one_file_per_shape_rewritten_per_agreement(gpu_check, tmp_path, monkeypatch, shape):
    """The file moved to another agreement is byte for byte the file written for it."""
    _, shapes = gpu_check
    import benchlib

    from pyggspec.testing import write_model

    monkeypatch.setattr(benchlib, "CACHE", tmp_path)
    p95 = shapes.model_path(shape, 0.95, "q4_0", log=lambda m: None)
    p70 = shapes.model_path(shape, 0.70, "q4_0", log=lambda m: None)
    assert p70 == p95
    ref = write_model(tmp_path / "ref.gguf", shapes.model_spec(shape, 0.70, "q4_0"))
    assert ref.read_bytes() == p70.read_bytes()
    assert len(list(tmp_path.glob("gpu_check-*/*.gguf"))) == 1
