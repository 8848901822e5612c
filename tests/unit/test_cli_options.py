"""The CLI's options are defined once (``pyggspec/cli/common.py``): ``run`` and ``serve`` take
the same engine, speculation and sampling options from the same definitions and build their
:class:`EngineConfig` the same way; ``inspect`` reports what the library's planner (the one the
engine uses) predicts for the same config."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pyggspec.cli import common, main
from pyggspec.config import EngineConfig, SpecConfig
from pyggspec.sampling.params import SamplingParams

OPTS = {name: o for name, o in vars(common).items() if isinstance(o, common.Opt)}
ALL = [*OPTS.values(), *common.SAMPLING_OPTIONS, *common.NGRAM_OPTIONS]

# where a command words a shared option its own way (or, for serve's -np, really differs);
# everything else about these options, and every other shared option, is the definition's own
WORDING = {
    "run": {"model": {"help"}},
    "serve": {"model": {"help"}, "n_parallel": {"default", "help"}, "n_ctx": {"help"},
              "n_batch": {"help"}, "n_ubatch": {"help"}, "rpc": {"help"},
              "no_repack": {"help"}, "checkpoint_min_step": {"help", "flags"}},
}


def _params(name: str) -> dict[str, click.Option]:
    return {p.name: p for p in main.commands[name].params if isinstance(p, click.Option)}


def _definition(dest: str) -> common.Opt:
    (opt,) = [o for o in ALL if o.dest == dest]
    return opt


def test_run_and_serve_share_every_engine_option():
    run, serve = _params("run"), _params("serve")
    shared = {o.dest for o in ALL} & set(run)
    assert shared == {o.dest for o in ALL} & set(serve)
    # the speculation and sampling flags, and every engine setting both commands have
    assert {o.dest for o in common.SPEC_OPTIONS + common.SAMPLING_OPTIONS} <= shared
    assert {"n_ctx", "n_parallel", "n_batch", "n_ubatch", "n_threads", "ngl", "device",
            "overrides", "cpu_moe", "type_k", "type_v", "rpc", "no_mmap", "no_repack",
            "ctx_checkpoints", "checkpoint_min_step", "backend_sampling",
            "draft_backend_sampling", "model"} <= shared
    # nothing else either command has is an engine setting (those go through common)
    for params in (run, serve):
        assert not (set(params) - shared) & common.ENGINE_DESTS


@pytest.mark.parametrize("command", ["run", "serve"])
def test_shared_options_are_the_definitions(command):
    """Flags, type and default come from the one definition (the same objects), and so
    does the help, but where WORDING says the command words it its own way."""
    own = WORDING[command]
    for dest, p in _params(command).items():
        if dest not in {o.dest for o in ALL}:
            continue
        opt, changed = _definition(dest), own.get(dest, set())
        flags = [d for d in opt.decls if d.startswith("-")]
        got = p.opts + p.secondary_opts
        if "flags" in changed:
            assert set(flags) < set(got), (command, dest)
        else:
            assert sorted(got) == sorted(" ".join(flags).replace("/", " ").split()), \
                (command, dest)
        if "type" in opt.attrs:
            assert p.type is click.types.convert_type(opt.attrs["type"]), (command, dest)
        if "default" in opt.attrs and "default" not in changed:
            assert p.default is opt.attrs["default"], (command, dest)
        if "help" in opt.attrs and "help" not in changed:
            assert p.help == opt.attrs["help"], (command, dest)
        if dest == "n_parallel" and command == "serve":
            assert p.default == 4  # slots; run's -np is the number of prompts generated


def test_run_and_serve_build_the_same_config(monkeypatch, tmp_path):
    """The same shared flags give the same EngineConfig from both commands (through
    ``config_from_options``); only serve's -np default differs, and its -c, which is
    split over the slots as llama-server's unless -kvu (given here) keeps it whole."""
    import pyggspec.cli.run as run_mod
    import pyggspec.cli.serve as serve_mod

    seen: dict[str, EngineConfig] = {}

    class Built(Exception):
        pass

    def capture(name):
        def engine_from_config(path, config):
            seen[name] = config
            raise Built
        return engine_from_config

    monkeypatch.setattr(run_mod, "engine_from_config", capture("run"))
    monkeypatch.setattr(serve_mod, "engine_from_config", capture("serve"))
    flags = ["-m", str(tmp_path / "x.gguf"), "-c", "512", "-b", "256", "-ub", "64", "-t", "1",
             "-ngl", "all", "-dev", "CUDA0", "-ot", "ffn=CPU,attn=CUDA0", "-cmoe", "-ctk",
             "q8_0", "-ctv", "q4_0", "--no-mmap", "-nr", "--spec-type", "draft-mtp",
             "-md", str(tmp_path / "mtp.gguf"), "--spec-draft-n-max", "5", "--spec-draft-n-min",
             "2", "--spec-draft-adaptive", "--spec-draft-sampling", "greedy", "--spec-rollback",
             "checkpoint", "-ctkd", "q8_0", "-ctvd", "bf16", "-ctxcp", "2",
             "--checkpoint-min-step", "64", "--temp", "0.5", "--top-k", "7", "-l", "3+1",
             "--seed", "11", "--samplers", "top_k;temp", "-bs",
             "--no-spec-draft-backend-sampling"]
    for name, extra in (("run", ["--prompt-tokens", "1,2"]), ("serve", ["-kvu"])):
        r = CliRunner().invoke(main, [name, *flags, *extra, "-np", "3"])
        assert r.exit_code == 1 and "internal error: Built" in r.output, r.output
    assert seen["run"] == seen["serve"]
    assert seen["run"] == EngineConfig(
        mtp_path=str(tmp_path / "mtp.gguf"), n_ctx=512, n_parallel=3, n_threads=1,
        n_batch=256, n_ubatch=64, n_gpu_layers="all", device="CUDA0",
        override_tensor=(("ffn", "CPU"), ("attn", "CUDA0")), cpu_moe=True, use_mmap=False,
        repack=False, type_k="q8_0", type_v="q4_0", mtp_type_k="q8_0", mtp_type_v="bf16",
        ctx_checkpoints=2, checkpoint_min_step=64, spec_type="draft-mtp",
        spec=SpecConfig(n_max=5, n_min=2, rollback="checkpoint", adaptive=True,
                        draft_sampling="greedy"),
        sampling=SamplingParams(temp=0.5, top_k=7, logit_bias=((3, 1.0),), seed=11,
                                samplers=("top_k", "temperature")),
        backend_sampling=True, draft_backend_sampling=False)
    # defaults: the same config but for the number of sequences
    for name, extra in (("run", ["--prompt-tokens", "1,2"]), ("serve", ["-kvu"])):
        CliRunner().invoke(main, [name, "-m", "x.gguf", *extra])
    assert seen["run"] == seen["serve"].replace(n_parallel=1)
    assert seen["serve"].n_parallel == 4 and seen["run"].sampling == SamplingParams()


def test_a_bad_value_is_the_configs_one_line_error(tmp_path):
    for name in ("run", "serve"):
        r = CliRunner().invoke(main, [name, "-m", str(tmp_path / "x.gguf"), "-ctk", "q9",
                                      "--prompt-tokens", "1"][: None if name == "run" else -2])
        assert r.exit_code == 1, r.output
        assert r.stderr.strip().startswith("pyggspec: -ctk: unsupported KV cache type 'q9'")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from pyggspec.testing import cached_model, tiny_dense

    return cached_model(tiny_dense(dtype="f32", agreement=0.8, tied_embeddings=False),
                        tmp_path_factory.mktemp("cli-options"))


@pytest.mark.parametrize("flags", [
    [],
    ["--spec-draft-n-max", "0", "-ub", "64"],
    ["-np", "3", "-c", "1024", "--spec-rollback", "checkpoint", "-ctk", "q8_0", "-ctvd",
     "q8_0", "--spec-draft-sampling", "greedy", "--spec-draft-n-max", "2"],
])
def test_inspect_is_the_library_planner(tiny, flags):
    """``inspect --json`` is :func:`pyggspec.inspect.inspect_model` for the config its flags
    make, and its engine plan is :func:`plan_engine_memory`'s for that config."""
    from pyggspec.compute import predict_compute
    from pyggspec.inspect import inspect_model
    from pyggspec.memory.plan import (
        coupled_drafts,
        graph_options,
        plan_engine_memory,
        planned_rollback,
    )
    from pyggspec.modelfile import open_model
    from pyggspec.weights import plan_placement, sum_bytes

    r = CliRunner().invoke(main, ["inspect", str(tiny), "--json", "-dev", "none", "-nr",
                                  *flags])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.stdout)

    n_max = int(flags[flags.index("--spec-draft-n-max") + 1]) if "--spec-draft-n-max" in \
        flags else 3
    values = {"n_ctx": 4096, "n_parallel": 1, "n_ubatch": 512, "type_k": "f16",
              "type_v": "f16", "mtp_type_k": "f16", "mtp_type_v": "f16"}
    for flag, dest in (("-np", "n_parallel"), ("-c", "n_ctx"), ("-ub", "n_ubatch")):
        if flag in flags:
            values[dest] = int(flags[flags.index(flag) + 1])
    for flag, dest in (("-ctk", "type_k"), ("-ctvd", "mtp_type_v")):
        if flag in flags:
            values[dest] = flags[flags.index(flag) + 1]
    get = (lambda f, d: flags[flags.index(f) + 1] if f in flags else d)
    cfg = EngineConfig(device="none", n_gpu_layers=None, repack=False, **values,
                       spec_type="draft-mtp" if n_max else None,
                       spec=SpecConfig(n_max=n_max or 3,
                                       rollback=get("--spec-rollback", "auto"),
                                       draft_sampling=get("--spec-draft-sampling", "coupled")))
    assert inspect_model(tiny, cfg) == cli

    with open_model(tiny) as model:
        hp = model.trunk.hparams
        p = plan_placement(model.trunk, ["CPU"], None, "none", (), False)
        rollback = planned_rollback(cfg)
        sized = predict_compute(model, graph_options(cfg, hp, rollback), p,
                                backend_sampling=cfg.backend_sampling,
                                coupled_drafts=coupled_drafts(cfg))
        plan = plan_engine_memory(cfg, hp, model.trunk.n_vocab, p, sum_bytes(p),
                                  rollback=rollback, mtp_device="CPU" if n_max else None,
                                  compute=sized).to_dict()
    assert plan["compute"] and "compute_estimated" not in plan
    assert {k: cli["memory"][k] for k in plan} == plan
    assert cli["memory"]["spec_draft_n_max"] == n_max
