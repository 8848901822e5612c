"""Device sampling at run time: a failed device step finishes on the host with the tokens
of a host-only run, and plans are registered once per chain structure, not per request."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner

from pyggspec.cli import main
from pyggspec.config import SpecConfig
from pyggspec.engine import Engine
from pyggspec.errors import DeviceError
from pyggspec.ggml.sched import BackendScheduler
from pyggspec.sampling import DeviceSampling, SamplingParams

PROMPTS = [[300, 301, 302], [400, 401]]
N_GEN = 12
PARAMS = {
    "greedy": SamplingParams(temp=0.0),
    # every stage in the graph: the device returns token ids (noise input, one draw/token)
    "dist": SamplingParams(temp=0.8, top_k=0, top_p=1.0, min_p=0.05, seed=7,
                           repeat_penalty=1.1),
    # top_k in the graph, top_p and dist on the host: the device returns candidates
    "top_k": SamplingParams(temp=1.0, top_k=40, top_p=0.95, min_p=0.0, seed=11),
}
_refs: dict[tuple, list[list[int]]] = {}


@pytest.fixture(scope="module")
def model(models):
    # random weights: flat logits, so sampling really differs from greedy
    return models.dense(dtype="f32")


@pytest.fixture
def engine(model, make_engine):
    """``engine(spec, params, backend, draft_sampling="greedy")``: an engine on ``model``,
    closed when the test ends. Greedy drafts unless asked: the injected failures count the
    target's device calls (coupled drafts run the same sampler code in the MTP graph)."""
    def make(spec: bool, params: SamplingParams, backend: bool,
             draft_sampling: str = "greedy") -> Engine:
        return make_engine(model, n_ctx=128, n_parallel=len(PROMPTS),
                           spec_type="draft-mtp" if spec else None,
                           spec=SpecConfig(n_max=2, draft_sampling=draft_sampling),
                           sampling=params, backend_sampling=backend)

    return make


@pytest.fixture
def host_tokens(model, engine):
    """``host_tokens(spec, name)``: the tokens of host-only sampling (computed once)."""
    def get(spec: bool, name: str) -> list[list[int]]:
        key = (str(model), spec, name)
        if key not in _refs:
            with engine(spec, PARAMS[name], False) as e:
                _refs[key] = [r.tokens for r in e.generate_batch(PROMPTS, N_GEN,
                                                                 ignore_eos=True)]
                assert e.samplers.stats.device is None
        return _refs[key]

    return get


def _inject(monkeypatch, method: str, after: int, msg: str) -> dict[str, int]:
    """Make ``DeviceSampling.<method>`` raise on every call after the first ``after``."""
    calls = {"n": 0}
    orig = getattr(DeviceSampling, method)

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] > after:
            raise DeviceError(None, msg)
        return orig(*args, **kw)

    monkeypatch.setattr(DeviceSampling, method,
                        classmethod(lambda cls, *a, **k: failing(*a, **k))
                        if method == "build" else failing)
    return calls


CASES = [(hook, 3, name) for hook in ("set_inputs", "finish_host") for name in PARAMS]
CASES.append(("build", 0, "dist"))


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
@pytest.mark.parametrize("hook,after,name", CASES)
def test_failed_device_step_finishes_on_host(engine, host_tokens, monkeypatch, caplog, spec,
                                             name, hook, after):
    """set_inputs / build fail before compute (the step is redone with logits as output);
    finish_host fails after it (the raw logits, kept as a graph output, are read). Either
    way: same tokens as host-only sampling (no random number drawn twice), no further
    device attempt, one log line, one count in the sampling stats."""
    ref = host_tokens(spec, name)
    msg = f"injected {hook} failure ({name}, spec={spec})"
    with caplog.at_level(logging.WARNING, logger="pyggspec.sampling"), \
            engine(spec, PARAMS[name], True) as e:
        calls = _inject(monkeypatch, hook, after, msg)  # started: the generation's calls
        out = [r.tokens for r in e.generate_batch(PROMPTS, N_GEN, ignore_eos=True)]
        stats = e.samplers.stats.to_dict()
        failed = e.samplers.failed
    assert out == ref
    assert calls["n"] == after + 1  # the device was used until the failure, never after
    assert failed is not None and msg in failed
    assert [n for r, n in stats["fallbacks"].items() if msg in r] == [1]
    assert stats["device"] is None and stats["device_stages"] == []
    assert sum(msg in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("hook", ["build", "set_inputs", "finish_host"])
def test_failed_coupled_draws_fall_back_to_the_host(engine, host_tokens, monkeypatch, caplog,
                                                    hook):
    """Coupled drafts whose graph part fails are drawn on the host from then on (one log
    line; the target's chains, which fail too, fall back on their own); the output is plain
    sampling either way."""
    ref = host_tokens(True, "dist")
    with caplog.at_level(logging.WARNING, logger="pyggspec.speculative"), \
            engine(True, PARAMS["dist"], True, "coupled") as e:
        _inject(monkeypatch, hook, 0, f"injected draft {hook} failure")
        out = [r.tokens for r in e.generate_batch(PROMPTS, N_GEN, ignore_eos=True)]
        assert e.drafter.mtp.failed
    assert out == ref
    assert sum("coupled drafts are drawn on the host" in r.getMessage()
               for r in caplog.records) == 1


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_sampling_graphs_that_cannot_be_built_at_startup(engine, host_tokens, monkeypatch, spec):
    """The startup sizing of sampled graphs leaves out those that fail to build: the engine
    starts, and the generation falls back to the host at its first sampled step."""
    ref = host_tokens(spec, "dist")
    calls = _inject(monkeypatch, "build", 0, "injected startup build failure")
    with engine(spec, PARAMS["dist"], True, "coupled") as e:
        assert calls["n"] > 0  # the sizing tried them
        planned = e.memory()["compute"]
        out = [r.tokens for r in e.generate_batch(PROMPTS, N_GEN, ignore_eos=True)]
        assert e.samplers.failed is not None
        assert e.memory()["compute"] == planned
    assert out == ref


@pytest.mark.parametrize("hook", ["set_inputs", "finish_host"])
def test_fallback_on_rpc_output_device(model, make_engine, host_tokens, monkeypatch, rpc_device,
                                       hook):
    """LM head and sampler prefix on a second device (RPC loopback): the redone step runs
    another graph on the multi-backend scheduler; tokens still equal host sampling."""
    ref = host_tokens(True, "dist")
    calls = _inject(monkeypatch, hook, 2, f"injected rpc {hook} failure")
    with make_engine(model, n_ctx=128, n_parallel=len(PROMPTS), n_gpu_layers=99,
                     device=rpc_device.name, spec_type="draft-mtp",
                     spec=SpecConfig(n_max=2, draft_sampling="greedy"),
                     sampling=PARAMS["dist"], backend_sampling=True) as e:
        assert e.placement.output_device == rpc_device.name
        out = [r.tokens for r in e.generate_batch(PROMPTS, N_GEN, ignore_eos=True)]
        assert e.samplers.failed is not None
    assert calls["n"] == 3
    assert out == ref


def test_sampled_reference_really_samples(host_tokens):
    assert host_tokens(False, "dist") != host_tokens(False, "greedy")
    assert host_tokens(True, "top_k") == host_tokens(False, "top_k")


def test_failed_compute_is_not_redone(engine, monkeypatch):
    """A failed graph compute may have advanced the recurrent state: it raises instead of
    being redone (the fallback covers build, allocation, inputs and outputs)."""
    compute, set_inputs = BackendScheduler.compute, DeviceSampling.set_inputs
    armed = []

    def arm(self, rows):
        set_inputs(self, rows)
        armed.append(True)

    def failing_compute(self, graph):
        if armed:  # the graph whose sampling inputs were just written
            raise DeviceError(None, "injected compute failure")
        return compute(self, graph)

    monkeypatch.setattr(DeviceSampling, "set_inputs", arm)
    monkeypatch.setattr(BackendScheduler, "compute", failing_compute)
    with engine(False, PARAMS["greedy"], True) as e, \
            pytest.raises(DeviceError, match="injected compute failure"):
        e.generate_batch(PROMPTS, 4, ignore_eos=True)


def test_cli_json_reports_the_fallback(model, monkeypatch):
    base = ["run", "-m", str(model), "--prompt-tokens", "300,301,302", "-n", "8",
            "--ignore-eos", "--temp", "0.8", "--top-k", "0", "--top-p", "1", "--min-p", "0.05",
            "--seed", "3", "--json", "-ngl", "0"]
    off = CliRunner().invoke(main, [*base, "--no-backend-sampling"])
    assert off.exit_code == 0, off.output
    _inject(monkeypatch, "set_inputs", 2, "injected cli failure")
    on = CliRunner().invoke(main, [*base, "--backend-sampling"])
    assert on.exit_code == 0, on.output
    d = json.loads(on.output)
    assert d["tokens"] == json.loads(off.output)["tokens"]
    assert [n for r, n in d["sampling"]["fallbacks"].items() if "injected cli failure" in r] == [1]


def test_plans_and_graphs_stay_bounded_over_requests(model, make_engine):
    """Same chain structure -> same plan id and cached graph, whatever the values (seed,
    temperature, top_p); only a new structure (top_k's k, greedy) adds a plan. Each
    request's own values are used (tokens equal host-only sampling)."""
    runs = [SamplingParams(temp=0.8, top_k=40, top_p=0.9, seed=1),
            SamplingParams(temp=0.8, top_k=20, top_p=0.9, seed=1),  # k fixes the graph
            SamplingParams(temp=1.3, top_k=40, top_p=0.5, seed=2),  # values only
            SamplingParams(temp=0.0)] * 3
    got, want = [], []
    for backend, out in ((True, got), (False, want)):
        with make_engine(model, n_ctx=128, backend_sampling=backend) as e:
            for i, p in enumerate(runs):
                out.append(e.generate(PROMPTS[0], 6, ignore_eos=True, sampling=p).tokens)
                if backend and i == 3:
                    n_plans, misses = len(e.target.plans), e.target.graphs.misses
            if backend:
                assert len(e.target.plans) == n_plans == 3
                assert e.target.graphs.misses == misses
                assert e.samplers.stats.buffer_bytes > 0  # a reused graph reports its buffers
    assert got == want
