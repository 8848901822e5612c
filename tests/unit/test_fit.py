"""The --fit planner as a pure function on constructed device sizes (memory/fit.py)."""

from __future__ import annotations

import pytest

from pyggspec.memory.fit import (
    FitDevice,
    FitError,
    FitNeeds,
    FitRequest,
    block_ranges,
    device_use,
    fit,
    format_table,
    margins,
    parse_fit_target,
)

MiB = 1 << 20
N = 8  # trunk blocks; block 8 is the MTP head


def needs(*, dense=10, experts=0, kv_per_cell=0, output=20, compute=5, mtp=True):
    """A model of N trunk blocks + one MTP block (MiB): every other block attention with
    ``kv_per_cell`` bytes per context cell."""
    def at(n_ctx: int) -> FitNeeds:
        d = [dense * MiB] * N + [dense * MiB if mtp else 0]
        e = [experts * MiB] * N + [experts * MiB if mtp else 0]
        s = [kv_per_cell * n_ctx if il % 2 else 1 * MiB for il in range(N)] + [0]
        return FitNeeds(tuple(d), tuple(e), tuple(s), output * MiB, {}, {"GPU0": compute * MiB})
    return at


def gpu(free_mib: float, margin_mib: float = 0) -> list[FitDevice]:
    return [FitDevice("GPU0", int(free_mib * MiB), int(margin_mib * MiB))]


def total_mib(n_ctx=4096, **kw) -> float:
    used, _, _ = device_use(needs(**kw)(n_ctx), ["GPU0"], N + 2, 0)
    return used["GPU0"] / MiB


def test_fits_whole() -> None:
    r = fit(needs(), gpu(1000), FitRequest(4096))
    assert (r.n_gpu_layers, r.n_cpu_moe, r.n_ctx, r.changed) == (N + 2, 0, 4096, ())
    assert r.fits and set(r.layer_devices) == {"GPU0"} and r.output_device == "GPU0"
    # 9 blocks x 10 + the output 20 + 4 recurrent blocks' 1 MiB states + compute 5
    assert r.used["GPU0"] == (90 + 20 + 4 + 5) * MiB


def test_experts_move_first_block_by_block() -> None:
    kw = {"dense": 2, "experts": 20}
    whole = total_mib(**kw)  # 9*22 + 20 + 4 + 5 = 227
    r = fit(needs(**kw), gpu(whole - 50), FitRequest(4096, n_moe_blocks=N))
    assert r.changed == ("-ncmoe",)
    assert r.n_gpu_layers == N + 2  # every layer stays; only experts move
    assert r.n_cpu_moe == 3  # 50 MiB over: three blocks' 20 MiB of experts
    assert r.used["GPU0"] == (whole - 60) * MiB


def test_mtp_block_experts_stay_on_the_device() -> None:
    kw = {"dense": 2, "experts": 20}
    # no room for any trunk expert: all N trunk blocks' experts move, the head's stay
    r = fit(needs(**kw), gpu(total_mib(**kw) - N * 20), FitRequest(4096, n_moe_blocks=N))
    assert r.n_cpu_moe == N and r.n_gpu_layers == N + 2
    assert r.layer_devices[N] == "GPU0"


def test_layers_move_when_experts_are_not_enough() -> None:
    kw = {"dense": 30, "experts": 5}
    # all trunk experts moved saves 40 MiB; 100 MiB short: whole layers must move
    whole = total_mib(**kw)
    r = fit(needs(**kw), gpu(whole - 100), FitRequest(4096, n_moe_blocks=N))
    assert "-ngl" in r.changed and r.n_gpu_layers < N + 2
    assert r.fits
    # the output layer and the MTP block stay on the device; the first blocks left
    assert r.output_device == "GPU0" and r.layer_devices[N] == "GPU0"
    assert r.layer_devices[0] == "CPU"
    # the most layers that fit: one more layer on the device would not
    used, _, _ = device_use(needs(**kw)(4096), ["GPU0"], r.n_gpu_layers + 1, N)
    assert used["GPU0"] > (whole - 100) * MiB


def test_dense_model_moves_whole_layers() -> None:
    whole = total_mib()
    r = fit(needs(), gpu(whole - 25), FitRequest(4096))
    assert r.changed == ("-ngl",) and r.n_cpu_moe == 0
    assert r.n_gpu_layers == N + 2 - 3  # 10 MiB + a recurrent 1 MiB state each
    assert r.layer_devices[:3] == ("CPU",) * 3 and r.layer_devices[3] == "GPU0"


def test_ctx0_is_cut_to_what_fits() -> None:
    kw = {"kv_per_cell": 64 * 1024}  # 4 attention blocks: 256 KiB per cell
    full = total_mib(262144, **kw)  # the training context
    budget = total_mib(20000, **kw)
    r = fit(needs(**kw), gpu(budget), FitRequest(262144, ctx_free=True, fit_ctx=4096))
    assert r.changed == ("-c",) and r.n_gpu_layers == N + 2
    assert r.n_ctx % 256 == 0 and 19968 <= r.n_ctx <= 20000 < full
    assert r.used["GPU0"] <= budget * MiB
    assert total_mib(r.n_ctx + 256, **kw) > budget  # the largest multiple of 256 that fits


def test_ctx_never_below_fitc_then_layers_move() -> None:
    kw = {"kv_per_cell": 64 * 1024}
    budget = total_mib(4096, **kw) - 30
    r = fit(needs(**kw), gpu(budget), FitRequest(262144, ctx_free=True, fit_ctx=4096))
    assert r.n_ctx == 4096 and "-c" in r.changed and "-ngl" in r.changed
    assert r.fits


def test_set_context_is_never_cut() -> None:
    kw = {"kv_per_cell": 64 * 1024}
    budget = total_mib(20000, **kw)
    r = fit(needs(**kw), gpu(budget), FitRequest(65536, ctx_free=False))
    assert r.n_ctx == 65536 and "-c" not in r.changed and r.changed == ("-ngl",)


def test_fit_target_is_respected() -> None:
    whole = total_mib()
    assert fit(needs(), gpu(whole), FitRequest(4096)).changed == ()
    r = fit(needs(), gpu(whole, margin_mib=25), FitRequest(4096))  # 25 MiB kept free
    assert r.changed == ("-ngl",) and r.used["GPU0"] <= (whole - 25) * MiB
    assert margins((512,), 2) == [512 * MiB] * 2
    assert margins((100, 200), 3) == [100 * MiB, 200 * MiB, 1024 * MiB]
    assert parse_fit_target("256/512") == (256, 512)


def test_user_set_values_are_untouched() -> None:
    kw = {"dense": 30, "experts": 5}
    whole = total_mib(**kw)
    # -ngl set: only experts may move
    r = fit(needs(**kw), gpu(whole - 30), FitRequest(4096, n_gpu_layers=N + 2,
                                                     n_moe_blocks=N))
    assert r.n_gpu_layers == N + 2 and r.changed == ("-ncmoe",) and r.n_cpu_moe == 6
    # -ot/-ncmoe set (n_cpu_moe fixed): only layers move
    r = fit(needs(**kw), gpu(whole - 30), FitRequest(4096, n_cpu_moe=0, n_moe_blocks=N))
    assert r.n_cpu_moe == 0 and r.changed == ("-ngl",)
    # a user -ngl that leaves the device empty: nothing to fit
    r = fit(needs(), gpu(0), FitRequest(4096, n_gpu_layers=0))
    assert r.changed == () and r.used["GPU0"] == 0


def test_nothing_fits_is_one_clear_error() -> None:
    with pytest.raises(FitError) as e:
        fit(needs(), gpu(50, margin_mib=10), FitRequest(8192, n_gpu_layers=N + 2))
    msg = str(e.value)
    assert msg.startswith("pyggspec: --fit: GPU0 lacks") and "\n" not in msg
    assert "-ngl 10" in msg and "-c 8192" in msg and "--fit off" in msg


def test_unlimited_shortage_ends_on_the_cpu() -> None:
    # a device that holds nothing needs nothing: -ngl 0 always fits
    r = fit(needs(), gpu(1, margin_mib=1024), FitRequest(4096))
    assert r.n_gpu_layers == 0 and set(r.layer_devices) == {"CPU"} and r.fits


def test_two_devices_split_equally() -> None:
    devs = [FitDevice("GPU0", 1000 * MiB, 0), FitDevice("GPU1", 1000 * MiB, 0)]

    def at(n_ctx: int) -> FitNeeds:
        base = needs()(n_ctx)
        return FitNeeds(base.dense, base.experts, base.states, base.output, {},
                        {"GPU0": 5 * MiB, "GPU1": 5 * MiB})
    r = fit(at, devs, FitRequest(4096))
    assert set(r.layer_devices) == {"GPU0", "GPU1"} and r.fits
    devs[1] = FitDevice("GPU1", 30 * MiB, 0)
    r = fit(at, devs, FitRequest(4096))
    assert r.fits and r.used["GPU1"] <= 30 * MiB and "-ngl" in r.changed


def test_table_and_ranges() -> None:
    blocks = ("CPU", "CPU", "GPU0", "GPU0", "GPU0")
    assert block_ranges(blocks, "GPU0", 4) == "2-3, mtp"
    assert block_ranges(blocks, "CPU", 4) == "0-1"
    t = format_table([{"device": "GPU0", "layers": "2-3, mtp", "output": "yes",
                       "predicted MiB": "12.0", "free MiB": "100.0", "target MiB": "1024.0"}],
                     "fit: -ngl 4")
    lines = t.splitlines()
    assert lines[0] == "fit: -ngl 4" and lines[1].startswith("device") and "2-3, mtp" in lines[2]


def test_flags_flow_into_the_config() -> None:
    from pyggspec.config import ConfigError, EngineConfig
    from pyggspec.errors import PyggspecError

    cfg = EngineConfig()
    assert (cfg.fit, cfg.fit_target, cfg.fit_ctx) == (True, (1024,), 4096)
    assert EngineConfig(fit_target=512).fit_target == (512,)
    for bad in ({"fit_target": (-1,)}, {"fit_target": ()}, {"fit_ctx": 0}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)
    for bad in ("", "x", "1,-2"):
        with pytest.raises(PyggspecError):
            parse_fit_target(bad)
    with pytest.raises(PyggspecError):
        margins((1, 2, 3), 2)


def test_cli_fit_options() -> None:
    import click
    from click.testing import CliRunner

    from pyggspec.cli.common import FIT_OPTIONS, config_from_options

    seen = {}

    @click.command()
    def cmd(**kw):
        seen["print"] = kw.pop("fit_print")
        seen["cfg"] = config_from_options(kw)

    for opt in reversed(FIT_OPTIONS):
        cmd = opt()(cmd)
    r = CliRunner().invoke(cmd, ["--fit", "off", "-fitt", "256,512", "-fitc", "8192", "-fitp"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (cfg.fit, cfg.fit_target, cfg.fit_ctx, seen["print"]) == (False, (256, 512), 8192,
                                                                     True)
    assert CliRunner().invoke(cmd, ["-fit", "maybe"]).exit_code == 2
    assert CliRunner().invoke(cmd, ["-fitt", "a"]).exit_code == 2


def test_no_offload_device_or_nothing_unset_costs_nothing() -> None:
    """fit_config returns at once (no sizing, no device asked) where it has nothing to do."""
    from types import SimpleNamespace

    from pyggspec.config import EngineConfig
    from pyggspec.memory.autofit import fit_config

    hp = SimpleNamespace(is_moe=True, n_layer_all=5, n_layer=4)
    model = SimpleNamespace(trunk=SimpleNamespace(hparams=hp))  # any other use would fail
    free = {"GPU0": 0}
    assert fit_config(model, EngineConfig(n_gpu_layers=None), ["CPU"], free=free) is None
    assert fit_config(model, EngineConfig(n_gpu_layers=None, fit=False), ["CPU", "GPU0"],
                      free=free) is None
    assert fit_config(model, EngineConfig(), ["CPU", "GPU0"], free=free) is None  # API: -ngl 0
    assert fit_config(model, EngineConfig(n_gpu_layers=99, cpu_moe=True), ["CPU", "GPU0"],
                      free=free) is None  # everything set, -c 4096
