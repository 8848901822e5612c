"""llama.cpp's command lines work with ``pyggspec serve`` and ``pyggspec run`` (issue 21,
item 1): its multi-letter short flags parse as llama.cpp means them, its sentinels (-1, -2, 0)
mean what they mean there, and every flag of llama-server / llama-cli / llama-completion is
honoured, accepted without effect, or refused in one line (never "No such option")."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.cli import run as run_mod
from pyggspec.cli import serve as serve_mod
from pyggspec.cli.llama_flags import FLAGS, HONOURED, NOOP, REFUSED, counts, status_of
from pyggspec.config import EngineConfig
from pyggspec.memory.plan import planned_n_ctx
from pyggspec.sampling.params import DEFAULT_SEED

ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's flag definitions: b11549's (the newest, built by scripts/gpu_check or by hand)
# and 0.3.36's (the sdist install.sh keeps in .cache/, so CI always has it)
ARG_CPPS = {
    "b11549": ROOT / ".gpu/build/src/llama.cpp-b11549/common/arg.cpp",
    "0.3.36": ROOT / ".cache/llama-cpp-python-0.3.36/vendor/llama.cpp/common/arg.cpp",
}
COMMANDS = ("serve", "run")
NEEDS = {"serve": [], "run": ["--prompt-tokens", "1,2"]}  # what a command needs to start


class Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch):
    """Run a command line up to the engine: returns (result, the EngineConfig or None)."""
    seen: dict[str, EngineConfig] = {}

    def engine_from_config(path, config):
        seen["config"] = config
        raise Built

    monkeypatch.setattr(run_mod, "engine_from_config", engine_from_config)
    monkeypatch.setattr(serve_mod, "engine_from_config", engine_from_config)

    def invoke(command: str, *flags: str):
        seen.clear()
        r = CliRunner().invoke(main, [command, "-m", "x.gguf", *NEEDS[command], *flags])
        return r, seen.get("config")

    return invoke


@pytest.fixture
def server_config(monkeypatch):
    """Run ``pyggspec serve`` flags up to the HTTP app: returns the ServerConfig it got."""
    import contextlib

    import pyggspec.serving.server as server_mod

    seen = {}

    def create_app(engine, config, **kw):
        seen["config"] = config
        raise Built

    monkeypatch.setattr(serve_mod, "engine_from_config",
                        lambda path, config: contextlib.nullcontext())
    monkeypatch.setattr(server_mod, "create_app", create_app)

    def config(*flags: str):
        seen.clear()
        CliRunner().invoke(main, ["serve", "-m", "x.gguf", *flags])
        return seen["config"]

    return config


def _declared(command: str) -> set[str]:
    cmd = main.commands[command]
    return {o for p in cmd.get_params(click.Context(cmd, **cmd.context_settings)) if isinstance(p, click.Option)
            for o in p.opts + p.secondary_opts}


def _value(flag, i: int = 0) -> list[str]:
    return [flag.accept[0] if flag.accept else "1"] * flag.nargs


# --------------------------------------------------------------------------- the table
@functools.cache
def _arg_cpp_flags(source: str) -> dict[str, set[str]]:
    """Every flag name of llama.cpp's arg.cpp in the server (serve) and the cli and
    completion (run) examples: an option is in an example when it names it, or names
    LLAMA_EXAMPLE_COMMON (the default) and does not exclude it."""
    src = ARG_CPPS[source].read_text()
    starts = [m.end() for m in re.finditer(r"add_opt\(common_arg\(", src)]
    out: dict[str, set[str]] = {"serve": set(), "run": set()}
    for i, s in enumerate(starts):
        block = src[s:starts[i + 1] if i + 1 < len(starts) else len(src)]
        head = re.sub(r"^\s*//[^\n]*", "", block.lstrip()).lstrip()
        m = re.match(r'\{([^}]*)\}\s*,\s*(?:\{([^}]*)\}\s*,)?', head)
        assert m, head[:80]
        names = re.findall(r'"([^"]*)"', m.group(1)) + re.findall(r'"([^"]*)"', m.group(2) or "")
        end = re.search(r"\n    \)(.*?);\n", block, re.DOTALL)
        tail = end.group(1) if end else ""
        ex = re.search(r"set_examples\(\s*(\{[^}]*\}|\w+)", tail)
        examples = set(re.findall(r"LLAMA_EXAMPLE_(\w+)", ex.group(1))) if ex else {"COMMON"}
        if ex and ex.group(1) == "mmproj_examples":
            examples = {"SERVER", "CLI"}
        exc = re.search(r"set_excludes\(\s*\{([^}]*)\}", tail)
        excludes = set(re.findall(r"LLAMA_EXAMPLE_(\w+)", exc.group(1))) if exc else set()
        common = "COMMON" in examples
        if ("SERVER" in examples or common) and "SERVER" not in excludes:
            out["serve"].update(names)
        if examples & {"CLI", "COMPLETION"} or common:
            out["run"].update(names)
    return out


@pytest.mark.parametrize("source", list(ARG_CPPS))
@pytest.mark.parametrize("command", COMMANDS)
def test_every_llama_cpp_flag_has_a_status(command, source):
    if not ARG_CPPS[source].exists():
        pytest.skip(f"llama.cpp {source}'s arg.cpp is not here ({ARG_CPPS[source]})")
    names = _arg_cpp_flags(source)[command]
    assert len(names) > 150
    missing = sorted(names - set(status_of(command)))
    assert not missing, missing


def test_the_table_is_consistent():
    seen: dict[tuple[str, str], str] = {}
    for f in FLAGS:
        assert f.names and all(n.startswith("-") for n in f.names), f
        assert f.nargs in (0, 1, 2)
        for cmd, st in f.status.items():
            assert st in (HONOURED, NOOP, REFUSED)
            assert st == HONOURED or f.why, f  # every no-op and refusal says why
            for n in f.names:
                assert (cmd, n) not in seen, (cmd, n)
                seen[cmd, n] = st
    c = counts()
    assert c["serve"][HONOURED] > 50 and c["serve"][REFUSED] > 50 and c["run"][NOOP] > 20


@pytest.mark.parametrize("command", COMMANDS)
def test_honoured_flags_are_declared(command):
    declared = _declared(command)
    honoured = {n for n, f in status_of(command).items() if f.status[command] == HONOURED}
    assert not honoured - declared, sorted(honoured - declared)


@pytest.mark.parametrize("command", COMMANDS)
def test_no_op_and_refused_flags_are_never_no_such_option(built, command):
    """Each no-op flag reaches the engine; each refused one stops with one line naming it,
    exit code 2."""
    for name, f in sorted(status_of(command).items()):
        st = f.status[command]
        if st == HONOURED:
            continue
        r, config = built(command, name, *_value(f))
        if st == NOOP:
            assert config is not None, (name, r.output)
        else:
            assert r.exit_code == 2 and config is None, (name, r.output)
            assert r.output == (f"pyggspec: {name}: not supported by pyggspec {command} "
                                f"({f.why})\n"), r.output


def test_an_unaccepted_value_of_a_no_op_flag_is_refused(built):
    r, config = built("serve", "-fa", "maybe")
    assert r.exit_code == 2 and config is None
    assert r.output.startswith("pyggspec: -fa maybe: not supported by pyggspec serve (")
    assert r.output.count("\n") == 1
    for v in ("on", "off", "auto", "ON"):
        assert built("serve", "--flash-attn", v)[1] is not None
    r, _ = built("run", "--reasoning-format", "deepseek")  # serve honours it (chat parsing)
    assert r.exit_code == 2 and "--reasoning-format deepseek: not supported" in r.output
    assert built("run", "--reasoning-format", "none")[1] is not None
    assert built("run", "-rea", "auto")[1] is not None
    assert built("run", "-rea", "on")[0].exit_code == 2


def test_the_issue_examples(built):
    r, _ = built("serve", "--embedding")
    assert r.output == ("pyggspec: --embedding: not supported by pyggspec serve (pyggspec "
                        "serve generates text only, no embeddings or reranking)\n")
    for flag in ("--reranking", "--rerank", "--embeddings"):
        assert built("serve", flag)[0].output.startswith(f"pyggspec: {flag}: not supported")
    ok = ["--metrics", "--slots", "--no-slots", "-fa", "auto", "--cont-batching",
          "--kv-unified", "--offline", "--cache-ram", "0", "--no-context-shift", "--swa-full",
          "--no-webui", "--jinja", "--reasoning", "auto", "--chat-template", "chatml",
          "--cors-origins", "*"]
    assert built("serve", *ok)[1] is not None
    r, _ = built("serve", "--context-shift")
    assert r.exit_code == 2 and r.output.startswith("pyggspec: --context-shift: not supported")


def test_slot_save_path_and_spm_infill(built, tmp_path):
    """--slot-save-path DIR turns slot actions on (a missing directory is a usage error, as
    llama.cpp's 'not a directory'); --spm-infill is honoured by /infill."""
    assert built("serve", "--slot-save-path", str(tmp_path), "--spm-infill")[1] is not None
    r, config = built("serve", "--slot-save-path", str(tmp_path / "nope"))
    assert r.exit_code == 2 and config is None and "--slot-save-path" in r.output


@pytest.mark.parametrize("command", COMMANDS)
def test_garbage_is_still_a_usage_error(built, command):
    """An unknown flag is a usage error (exit 2) in one line naming it."""
    r, _ = built(command, "--no-such-flag-at-all")
    assert r.exit_code == 2 and "No such option '--no-such-flag-at-all'" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("pyggspec: ")


@pytest.mark.parametrize("command", COMMANDS)
def test_the_other_tools_flags_are_refused(built, command):
    """Every flag of llama-server is at least refused by run, and every flag of llama-cli by
    serve: no llama.cpp spelling is 'No such option' or split into a short flag."""
    other = "run" if command == "serve" else "serve"
    for name, f in sorted(status_of(other).items()):
        if command in f.status:
            continue
        r, config = built(command, name, *_value(f))
        if name in _declared(command):
            continue
        assert r.exit_code == 2 and config is None, (name, r.output)
        assert r.output.startswith(f"pyggspec: {name}: not supported by pyggspec {command} "
                                   "(a llama-"), r.output


def test_everyday_no_ops_say_so_in_help():
    r = CliRunner().invoke(main, ["serve", "-h"])
    assert r.exit_code == 0
    for flag in ("--metrics", "-fa, --flash-attn", "-cb, --cont-batching", "--offline"):
        assert flag in r.output
    assert "without it 501" in " ".join(r.output.split())
    assert "--embedding" not in r.output  # refusals are hidden


# --------------------------------------------------------------------------- short flags
@pytest.mark.parametrize("command", COMMANDS)
def test_multi_letter_short_flags(built, command, tmp_path):
    """The issue's: -tb 2 was '-t b'; each llama.cpp short spelling is its own option."""
    r, c = built(command, "-tb", "2", "-t", "3", "-ngld", "99", "-ncmoe", "2", "-ub", "64",
                 "-np", "2", "-ctxcp", "5", "-dev", "none", "-ot", "x=CPU", "-ctk", "q8_0",
                 "-ctv", "q4_0", "-md", str(tmp_path / "m.gguf"), "-fa", "on", "-kvo",
                 "-nr", "-ngl", "3", "-bs", "-ctkd", "q8_0", "-ctvd", "q8_0", "-cmoe")
    assert c is not None, r.output
    assert (c.n_threads, c.n_ubatch, c.n_parallel, c.ctx_checkpoints) == (3, 64, 2, 5)
    assert c.override_tensor == (("x", "CPU"),
                                 (r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),
                                 (r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"))
    assert (c.type_k, c.type_v, c.mtp_type_k, c.mtp_type_v) == ("q8_0", "q4_0", "q8_0", "q8_0")
    assert c.mtp_path == str(tmp_path / "m.gguf") and c.device == "none"
    assert c.n_gpu_layers == 3 and not c.repack and c.backend_sampling and c.cpu_moe
    r, c = built(command, "-nkvo")
    assert r.output.startswith("pyggspec: -nkvo: not supported by pyggspec ")
    for flags in (["-cb"], ["-nocb"], ["-cms", "64"]):
        r, c = built(command, *flags)
        if command == "serve":
            assert r.exit_code == (2 if flags == ["-nocb"] else 1), r.output
            if flags[0] == "-cms":
                assert c.checkpoint_min_step == 64
        else:  # llama-cli has none of them: refused as llama-server's, not read as '-c b'
            assert r.exit_code == 2 and r.output.startswith(
                f"pyggspec: {flags[0]}: not supported by pyggspec run (a llama-server flag"), \
                r.output


def test_llama_cpp_long_aliases(built):
    _, c = built("serve", "--gpu-layers", "7", "--swa-checkpoints", "3", "--draft-p-min",
                 "0.5", "--spec-type", "draft-mtp", "--predict", "9")
    assert (c.n_gpu_layers, c.ctx_checkpoints, c.spec.p_min) == (7, 3, 0.5)
    _, c = built("run", "--conversation", "--n-cpu-moe", "1")
    assert len(c.override_tensor) == 1


# --------------------------------------------------------------------------- sentinels
@pytest.mark.parametrize("command", COMMANDS)
def test_seed_minus_one_is_random(built, command):
    assert built(command, "--seed", "-1")[1].sampling.seed == DEFAULT_SEED == 0xFFFFFFFF
    assert built(command, "-s", "5")[1].sampling.seed == 5
    assert built(command, "-s", "-2")[0].exit_code == 2


def test_parallel_minus_one_is_auto(built):
    assert built("serve", "-np", "-1")[1].n_parallel == 4  # llama-server: 4 slots
    assert built("run", "-np", "-1")[1].n_parallel == 1  # llama-cli's default
    for command in COMMANDS:
        r, _ = built(command, "-np", "0")
        assert r.exit_code == 2 and "0 is not a valid number" in r.output
        assert built(command, "-np", "-2")[0].exit_code == 2


def test_ctx_zero_is_the_training_context(built):
    for command in COMMANDS:
        assert built(command, "-c", "0")[1].n_ctx == 0
        assert built(command, "-c", "-1")[0].exit_code == 2
    hp = SimpleNamespace(n_ctx_train=32768)
    assert planned_n_ctx(EngineConfig(n_ctx=0), hp) == 32768
    assert planned_n_ctx(EngineConfig(n_ctx=1000), hp) == 1000
    assert planned_n_ctx(EngineConfig(n_ctx=99999), hp) == 32768
    with pytest.raises(ValueError):
        EngineConfig(n_ctx=-1)


def test_serve_n_predict_minus_two_is_until_the_context_is_full(server_config):
    for n, want in (("-2", None), ("-1", None), ("5", 5)):
        assert server_config("-n", n).n_predict == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from pyggspec.testing import cached_model, tiny_dense

    return cached_model(tiny_dense(dtype="f32", agreement=0.8, tied_embeddings=False),
                        tmp_path_factory.mktemp("llama-flags"))


@pytest.mark.parametrize("n", ["-1", "-2"])
def test_run_n_negative_fills_the_context(tiny, n):
    r = CliRunner().invoke(main, ["run", "-m", str(tiny), "--prompt-tokens", "1,2,3", "-c",
                                  "40", "-n", n, "--ignore-eos", "--temp", "0", "--json",
                                  "-dev", "none"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 40 - 3, {k: out[k] for k in out if k != "tokens"}


def test_run_ctx_zero_runs_the_training_context(tiny):
    from pyggspec.modelfile import open_model

    with open_model(tiny) as model:
        n_train = model.trunk.hparams.n_ctx_train
    r = CliRunner().invoke(main, ["inspect", str(tiny), "--json", "-dev", "none", "-c", "0"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["memory"]["n_ctx"] == n_train  # planned for that context
    from pyggspec.engine import Engine

    with Engine(tiny, n_ctx=0, device="none") as e:
        assert e.n_ctx == n_train


# --------------------------------------------------------------------------- serve extras
def test_chat_template_names_and_text():
    from pyggspec.cli.llama_flags import FlagRefused
    from pyggspec.serving.http.chat import CHATML

    assert serve_mod._chat_template("chatml", None) == CHATML
    assert serve_mod._chat_template("{{ messages }}", None) == "{{ messages }}"
    assert serve_mod._chat_template(None, None) is None
    with pytest.raises(FlagRefused, match="--chat-template llama3: not supported"):
        serve_mod._chat_template("llama3", None)
    # --no-jinja: llama.cpp's built-in templates by name (the server checks the name)
    assert serve_mod._chat_template("llama3", None, jinja=False) == "llama3"
    assert serve_mod._chat_template("chatml", None, jinja=False) == "chatml"


def test_metrics_verbose_prefill_reach_the_server(server_config):
    """--metrics (off by default: /metrics is a 501, as llama-server), -v/--verbose
    (__verbose in answers) and --no-prefill-assistant reach the ServerConfig."""
    config = server_config
    c = config()
    assert (c.endpoint_metrics, c.verbose, c.prefill_assistant) == (False, False, True)
    c = config("--metrics", "--verbose", "--no-prefill-assistant")
    assert (c.endpoint_metrics, c.verbose, c.prefill_assistant) == (True, True, False)
    assert config("-v").verbose and config("--log-verbose").verbose


def test_api_key_file(tmp_path):
    from pyggspec.cli.llama_flags import FlagRefused

    f = tmp_path / "keys"
    f.write_text("# comment\nsekret\n")
    assert serve_mod._api_key(None, f) == "sekret"
    assert serve_mod._api_key("k", None) == "k"
    f.write_text("a\nb\n")
    with pytest.raises(FlagRefused):
        serve_mod._api_key(None, f)


def test_cors_origins():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    serve_mod._add_cors(app, "http://a.example", None, None, None)
    client = TestClient(app)
    r = client.get("/health", headers={"Origin": "http://a.example"})
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    r = client.get("/health", headers={"Origin": "http://b.example"})
    assert "access-control-allow-origin" not in r.headers
    # llama-server's default (no --cors-* flag): any origin, echoed, with credentials;
    # every OPTIONS is a preflight answered before the API key is checked
    bare = FastAPI()
    bare.get("/health")(lambda: {"status": "ok"})
    serve_mod._add_cors(bare, None, None, None, None)
    client = TestClient(bare)
    r = client.get("/health", headers={"Origin": "web.mydomain.fr"})
    assert r.headers["access-control-allow-origin"] == "web.mydomain.fr"
    r = client.options("/completions", headers={"Origin": "localhost"})
    assert r.status_code == 200 and r.text == ""
    assert r.headers["access-control-allow-origin"] == "localhost"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    local = FastAPI()
    local.get("/health")(lambda: {"status": "ok"})
    serve_mod._add_cors(local, "localhost", None, None, False)
    client = TestClient(local)
    for origin, allowed in (("http://[::1]:3000", True), ("http://127.0.0.1", True),
                            ("http://localhost.evil.com", False), ("http://evil.com", False)):
        r = client.get("/health", headers={"Origin": origin})
        assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
    assert client.options("/x").headers["access-control-allow-credentials"] == "false"


def test_serve_ctx_is_split_over_slots_as_llama_server(built, tiny):
    """llama-server's -c is the context of all slots: -c 512 -np 2 gives each slot 256;
    -kvu, or -np left at auto, gives each slot all of it (b11549's llama_context)."""
    cases = [(["-c", "512", "-np", "2"], 256), (["-c", "512", "-np", "2", "-kvu"], 512),
             (["-c", "512"], 512), (["-c", "512", "-np", "-1"], 512),
             (["-c", "512", "-np", "3", "--no-kv-unified"], 170),
             (["-c", "0", "-np", "2"], 2048)]  # the tiny model's training context is 4096
    for flags, want in cases:
        seen = {}

        def engine_from_config(path, config, seen=seen):
            seen["n_ctx"] = config.n_ctx
            raise Built

        serve_mod.engine_from_config, saved = engine_from_config, serve_mod.engine_from_config
        try:
            CliRunner().invoke(main, ["serve", "-m", str(tiny), *flags])
        finally:
            serve_mod.engine_from_config = saved
        assert seen["n_ctx"] == want, (flags, seen)
    r = built("serve", "-c", "2", "-np", "4")[0]
    assert r.exit_code == 2 and "cannot be split over 4 slots" in r.output


def test_serve_aliases_tags_and_slots_flags(server_config):
    """-a A,B,C (sorted, the first names the model), --tags, --no-slots reach the server's
    config (llama-server: /v1/models lists aliases and tags, /slots answers 501)."""
    c = server_config("-a", "tinyllama-2, fim,code,", "--tags", "chat,fim,small", "--no-slots")
    assert (c.model_id, c.aliases, c.tags) == ("code", ("code", "fim", "tinyllama-2"),
                                               ("chat", "fim", "small"))
    assert c.endpoint_slots is False
    c = server_config("--slots")
    assert c.endpoint_slots and c.model_id == "x.gguf"


def test_serve_listens_on_every_host():
    """--host 127.0.0.1,::1 (llama-server's comma-separated addresses): one port, both."""
    import socket

    from pyggspec.serving.http.run import _bind

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    socks = _bind(["127.0.0.1", "[::1]"], 0)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(socks) == 2 and len(ports) == 1
        for s, host in zip(socks, ("127.0.0.1", "::1")):
            assert s.getsockname()[0] == host
    finally:
        for s in socks:
            s.close()


def test_threads_from_llama_arg_threads(built, monkeypatch):
    """llama.cpp's LLAMA_ARG_THREADS sets -t; the flag wins over it."""
    monkeypatch.setenv("LLAMA_ARG_THREADS", "3")
    for command in COMMANDS:
        assert built(command)[1].n_threads == 3
        assert built(command, "-t", "2")[1].n_threads == 2


def test_long_flags_with_underscores_are_read_as_dashes(built):
    """llama.cpp's parser replaces '_' by '-' in a long flag (its server tests start
    llama-server with --backend_sampling); values keep theirs."""
    r, config = built("serve", "--backend_sampling", "--ctx_size=512", "--alias", "a_b")
    assert r.exit_code != 2 and config is not None, r.output
    assert config.backend_sampling and config.n_ctx == 512


def test_bench_serve_gives_both_servers_the_same_total_context(tiny, monkeypatch, tmp_path):
    """scripts/bench_serve.py starts both servers with llama-server's -c (the total of all
    slots): each pyggspec slot then holds the per-slot context the benchmark asks for. It
    passed the per-slot figure to pyggspec once -c meant the total there too, and every
    request of the first GPU run's serve rows came back 400 (prompt over a 40-token slot)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_serve

    ns = SimpleNamespace(model=tiny, threads=2, parallel=8, ctx=320, no_repack=False, n_max=3)
    (tmp_path / "llama-server").touch()  # the command is only built, never run
    monkeypatch.setattr(bench_serve.benchlib, "TOOLS", tmp_path)
    ours = bench_serve.server_cmd("pyggspec", ns, True, 8080)
    theirs = bench_serve.server_cmd("llama-server", ns, True, 8080)
    flags = ours[ours.index("serve") + 1:]
    assert theirs[1:] == [f for f in flags if f not in ("--log-level", "warning")]
    seen = {}

    def engine_from_config(path, config):
        seen["n_ctx"] = config.n_ctx
        raise Built

    monkeypatch.setattr(serve_mod, "engine_from_config", engine_from_config)
    CliRunner().invoke(main, ["serve", *flags])
    assert seen["n_ctx"] == 320
