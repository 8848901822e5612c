"""--fit on a real device: ``inspect --fit-print`` against an RPC server on loopback, made
tight with llama.cpp's own knob (``-fitt`` = the device's free memory minus the budget),
and one engine started under a fitted budget."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pyggspec.cli import main

MiB = 1 << 20


@pytest.fixture(scope="module")
def moe(models):
    """A MoE model whose experts (~12 MiB a block) are coarser than -fitt's 1 MiB steps,
    with a training context larger than -fitc's least."""
    return models.moe(n_embd=128, n_ff_exp=1024, context_length=32768)


def inspect(path, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["inspect", str(path), *map(str, args)])
    return r.exit_code, r.stdout, r.stderr


def fit_json(path, *args: str) -> dict:
    code, out, err = inspect(path, "-fitp", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def need(rpc_device, path, *args: str) -> int:
    """The device's bytes with everything on it (--fit off), as inspect plans them."""
    code, out, err = inspect(path, "--json", "--fit", "off", "-dev", rpc_device.name, *args)
    assert code == 0, err
    return json.loads(out)["memory"]["by_device"][rpc_device.name]


def fitt_for(rpc_device, budget: int) -> int:
    """-fitt (MiB) that leaves ``budget`` bytes of the device's free memory to the fit."""
    return (rpc_device.memory()[0] - budget) // MiB


def test_fits_whole(rpc_device, moe):
    f = fit_json(moe, "-dev", rpc_device.name, "-fitt", 0)
    assert f["changed"] == [] and f["n_cpu_moe"] == 0
    assert set(f["layer_devices"]) == {rpc_device.name}
    assert f["output_device"] == rpc_device.name


def test_tight_device_moves_experts_then_layers(rpc_device, moe):
    dev = rpc_device.name
    whole = need(rpc_device, moe)
    # ~1.5 blocks of experts short: experts move, every layer stays
    budget = whole - 18 * MiB
    f = fit_json(moe, "-dev", dev, "-fitt", fitt_for(rpc_device, budget))
    assert f["changed"] == ["-ncmoe"] and f["n_cpu_moe"] >= 2
    assert set(f["layer_devices"]) == {dev}
    assert f["by_device"][dev] <= budget
    # the fit's prediction is the memory plan's (one cost model): inspect -ngl/-ot by hand
    ot = [a for i in range(f["n_cpu_moe"])
          for a in ("-ot", f"blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU")]
    assert need(rpc_device, moe, *ot) == f["by_device"][dev]
    # 3 MiB: not even the output layer and the head with every expert moved: layers go
    budget = 3 * MiB
    f = fit_json(moe, "-dev", dev, "-fitt", fitt_for(rpc_device, budget))
    assert "-ngl" in f["changed"] and f["n_gpu_layers"] < len(f["layer_devices"]) + 1
    assert f["by_device"].get(dev, 0) <= budget
    assert f["layer_devices"][0] == "CPU"


def test_ctx0_is_cut_to_what_fits(rpc_device, moe):
    dev = rpc_device.name
    full = need(rpc_device, moe, "-c", 0)
    small = need(rpc_device, moe, "-c", 4096)
    budget = (full + small) // 2
    f = fit_json(moe, "-dev", dev, "-c", 0, "-fitc", 1024, "-fitt", fitt_for(rpc_device, budget))
    assert f["changed"] == ["-c"] and f["n_cpu_moe"] == 0
    assert 4096 < f["n_ctx"] < 32768 and f["n_ctx"] % 256 == 0
    assert f["by_device"][dev] <= budget
    # an explicit context is never cut: the experts move instead
    f = fit_json(moe, "-dev", dev, "-c", 32768, "-fitt", fitt_for(rpc_device, budget))
    assert f["n_ctx"] == 32768 and "-c" not in f["changed"]


def test_user_set_values_are_untouched(rpc_device, moe):
    dev = rpc_device.name
    budget = need(rpc_device, moe) - 18 * MiB
    fitt = fitt_for(rpc_device, budget)
    # -ngl set: only experts move
    f = fit_json(moe, "-dev", dev, "-ngl", 99, "-fitt", fitt)
    assert f["n_gpu_layers"] == len(f["layer_devices"]) + 1 and f["changed"] == ["-ncmoe"]
    # -ncmoe set: its experts stay where the user put them; layers move instead
    f = fit_json(moe, "-dev", dev, "-ot", "blk\\.0\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
                 "-fitt", fitt)
    assert f["n_cpu_moe"] == 0 and "-ncmoe" not in f["changed"]
    assert f["by_device"][dev] <= budget


def test_nothing_fits_is_one_line(rpc_device, moe):
    # -ngl set, every expert moved: still over; nothing else is the fit's to change
    code, out, err = inspect(moe, "-fitp", "-dev", rpc_device.name, "-ngl", 99,
                             "-fitt", fitt_for(rpc_device, 1 * MiB))
    assert code == 1 and out == ""
    assert err.strip().startswith("pyggspec: --fit: ") and "\n" not in err.strip()
    assert "-ngl 99" in err and "--fit off" in err


def test_fit_print_table(rpc_device, moe):
    code, out, err = inspect(moe, "-fitp", "-dev", rpc_device.name, "-fitt",
                             fitt_for(rpc_device, need(rpc_device, moe) - 18 * MiB))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("fit: -ngl ") and "set by --fit: -ncmoe" in lines[0]
    assert lines[1].split()[0] == "device" and lines[2].startswith(rpc_device.name)
    assert lines[3].startswith("CPU") and "experts of 0-" in lines[3]


def test_engine_starts_inside_the_fitted_budget(rpc_device, moe):
    """The engine fits as inspect does and allocates no more than the plan on the device."""
    from pyggspec import Engine

    dev = rpc_device.name
    budget = need(rpc_device, moe) - 18 * MiB
    with Engine(moe, n_gpu_layers=None, device=dev, spec_type="draft-mtp",
                fit_target=(fitt_for(rpc_device, budget),), load_tokenizer=False) as e:
        fitted = e._parts.fit
        assert fitted is not None and fitted.result.n_cpu_moe > 0
        assert len(e.config.override_tensor) == fitted.result.n_cpu_moe
        assert e.memory()["by_device"][dev] <= fitted.by_device[dev] <= budget
        assert len(e.generate([1, 2, 3], max_tokens=4, ignore_eos=True).tokens) == 4


def test_run_fit_print_needs_no_prompt(rpc_device, moe):
    r = CliRunner().invoke(main, ["run", "-m", str(moe), "-dev", rpc_device.name, "-fitp"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("fit: -ngl ") and "fits as given" in r.stdout.splitlines()[0]


def test_run_json_reports_the_fit(rpc_device, moe):
    """``run --json`` says what --fit chose (scripts/bench_fit.py reads it), and the
    device's measured bytes stay inside the budget."""
    dev = rpc_device.name
    budget = need(rpc_device, moe) - 18 * MiB
    r = CliRunner().invoke(main, ["run", "-m", str(moe), "-dev", dev, "-fitt",
                                  str(fitt_for(rpc_device, budget)), "--prompt-tokens",
                                  "1,2,3", "-n", "2", "--ignore-eos", "--spec-type", "draft-mtp",
                                  "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["fit"]["n_cpu_moe"] > 0 and "-ncmoe" in out["fit"]["changed"]
    assert out["memory"]["by_device"][dev] <= budget
    r = CliRunner().invoke(main, ["run", "-m", str(moe), "-dev", dev, "--fit", "off",
                                  "--prompt-tokens", "1,2,3", "-n", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.splitlines()[-1])["fit"] is None
