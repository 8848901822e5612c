"""``pyggspec bench`` (issue 55): a real paired measurement on the user's file, its report,
JSON and plot, and a verdict read from the numbers (never written in advance)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pyggspec
from pyggspec.benchmark import BenchReport, SettingResult, render


def _report(default_ratios: list[float]) -> BenchReport:
    plain = SettingResult("plain", None, [10.0] * len(default_ratios), [100.0] * 3)
    dflt = SettingResult("default", 3, [10.0 * r for r in default_ratios], [100.0] * 3,
                         list(default_ratios),
                         {"acceptance": 0.9, "per_position": [0.9, 0.8, 0.7],
                          "mean_accepted_length": 3.1, "draft_lengths": [2, 0, 1, 7]})
    return BenchReport("m.gguf", "CPU", 1, 32, [8], len(default_ratios), [plain, dflt],
                       {"plain": {"total": 2**20}, "default": {"total": 2**21}}, None,
                       True, 1.0)


@pytest.mark.parametrize(("ratios", "verdict"), [([1.30, 1.25, 1.41], "pays"),
                                                 ([0.80, 0.85, 0.90], "does not pay"),
                                                 ([0.99, 1.01, 1.00], "breaks even")])
def test_verdict_comes_from_the_ratios(ratios, verdict):
    rep = _report(ratios)
    assert rep.verdict == verdict
    text = "\n".join(render(rep))
    assert {"pays": "PAYS", "does not pay": "NOT pay", "breaks even": "breaks even"}[verdict] \
        in text
    assert rep.default_choice == {0: 2, 2: 1, 3: 7}
    assert rep.best.name == {"pays": "default", "does not pay": "plain"}.get(verdict, rep.best.name)
    assert rep.to_dict()["settings"][1]["vs_plain"] == pytest.approx(sorted(ratios)[1])


def test_bench_command_on_a_tiny_model(models, tmp_path):
    path = models.dense(dtype="q8_0", agreement=0.9)
    r = subprocess.run([sys.executable, "-m", "pyggspec", "bench", "-m", str(path), "--reps",
                        "2", "-n", "16", "-t", "2", "-c", "256", "--fixed", "1,3", "--json"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "takes minutes" in r.stderr and "about" in r.stderr  # said before it measures
    out = json.loads(r.stdout)
    names = [s["name"] for s in out["settings"]]
    assert names == ["plain", "default", "n=1", "n=3"]
    assert out["verdict"] in ("pays", "does not pay", "breaks even")
    assert out["identical_outputs"] is True  # speculation is lossless, whatever its speed
    assert out["best"] in names
    for s in out["settings"]:
        assert s["decode_tps"] > 0 and s["prefill_tps"] > 0 and len(s["decode_tps_range"]) == 2
        if s["name"] != "plain":  # (the default may decline every step: nothing drafted)
            least = 0 if s["name"] == "default" else 1
            assert least <= len(s["per_position"]) <= s["n_max"] and "vs_plain_range" in s
    assert out["memory"]["default"]["total"] > out["memory"]["plain"]["total"]


def test_run_bench_from_python(models):
    path = models.dense(dtype="q8_0", agreement=0.9)
    cfg = pyggspec.EngineConfig(n_threads=2, n_ctx=256, progress=False)
    seen: list[int] = []
    rep = pyggspec.run_bench(path, cfg, reps=1, n_predict=8, fixed=(2,),
                             progress=lambda done, total, label: seen.append(done))
    assert [s.name for s in rep.settings] == ["plain", "default", "n=2"]
    assert seen[0] == 0 and seen[-1] == 3
    assert any("verdict:" in ln for ln in rep.lines())


def test_plot_needs_matplotlib_or_draws(models, tmp_path):
    rep = _report([1.2, 1.1])
    rep.settings.append(SettingResult("n=1", 1, [11.0, 12.0], [100.0], [1.1, 1.2]))
    png = tmp_path / "b.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(pyggspec.PyggspecError, match="matplotlib"):
            pyggspec.benchmark.plot(rep, png)
        return
    pyggspec.benchmark.plot(rep, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_lengths_are_a_usage_error(models):
    r = subprocess.run([sys.executable, "-m", "pyggspec", "bench", "-m", "x.gguf", "--fixed",
                        "0,2"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--fixed" in r.stderr
