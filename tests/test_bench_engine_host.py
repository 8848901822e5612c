"""scripts/benchlib.py's EngineHost: several engines in one child process, taking turns.

``bench_mtp.py --ours-process shared`` rests on it: our ratios (default / plain, default /
fixed n_max) come from engines that see the same phases of the machine, so the host must
really keep one process, give each engine its own configuration and keep what an engine
learnt from one request to the next.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BODY = """
res = e.generate_batch([[1, 2, 3, 4, 5]], max_tokens=12, ignore_eos=True)
import os
out = {"tokens": [r.tokens for r in res], "pid": os.getpid(), "spec": e.spec_type,
       "runs": (e.draft_lengths.to_dict()["draft-mtp"]["lengths"]
                if e.draft_lengths is not None else None)}
"""


def test_engines_share_one_process_and_keep_their_state(models, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchlib

    path = models.dense()
    engines = {"plain": "n_ctx=256, n_threads=1",
               "fixed": "n_ctx=256, n_threads=1, spec_type='draft-mtp', "
                        "spec=SpecConfig(n_max=2, adaptive=False)",
               "default": "n_ctx=256, n_threads=1, spec_type='draft-mtp'"}
    with benchlib.EngineHost(path, engines, BODY) as host:
        # "default" twice: its second run's result is kept, then compared with a third
        got = {name: host.run(name) for name in ["plain", "fixed", "default", "default"]}
        again = host.run("default")
    assert len({r["pid"] for r in [*got.values(), again]}) == 1  # one process
    assert got["plain"]["spec"] is None and got["fixed"]["spec"] == "draft-mtp"
    # speculation is lossless: the same greedy tokens from every engine
    assert got["fixed"]["tokens"] == got["plain"]["tokens"] == got["default"]["tokens"]
    assert got["fixed"]["accept"] >= 0 and "accept" not in got["plain"]
    # the default engine kept its budget from one request to the next (steps add up)
    assert sum(again["runs"]) > sum(got["default"]["runs"]) > 0
    assert host.proc.poll() is not None  # closed with the block


def test_a_failing_engine_is_an_error_with_the_childs_words(models, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchlib

    with pytest.raises(RuntimeError, match="(?s)engine host failed.*no_such_option"):
        benchlib.EngineHost(models.dense(), {"bad": "no_such_option=1"}, BODY)


TURNS = """
got = step_turns(group, [[1, 2, 3, 4, 5], [6, 7, 8]], 10)
outs = {name: {"tokens": [r.tokens for r in g["results"]], "decode_ms": g["decode_ms"],
               "all_ms": g["all_ms"],
               "runs": (sum(group[name].draft_lengths.to_dict()["draft-mtp"]["lengths"])
                        if group[name].draft_lengths else None)}
        for name, g in got.items()}
"""


def test_engines_take_turns_step_by_step(models, monkeypatch):
    """``--ours-turns step``: every engine of the group runs the same requests, stepping in
    turns; the outputs are each engine's own (lossless speculation: all equal), and the
    decode time leaves the prompt's steps out of the whole."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchlib

    engines = {"plain": "n_ctx=256, n_parallel=2, n_threads=1",
               "fixed": "n_ctx=256, n_parallel=2, n_threads=1, spec_type='draft-mtp', "
                        "spec=SpecConfig(n_max=2, adaptive=False)",
               "default": "n_ctx=256, n_parallel=2, n_threads=1, spec_type='draft-mtp'"}
    turns = f"import sys\nsys.path.insert(0, {str(ROOT / 'scripts')!r})\n" \
            "from benchlib import step_turns\n" + TURNS
    with benchlib.EngineHost(models.dense(), engines, BODY, turns=turns) as host:
        got = host.run_turns(["default", "plain", "fixed"])
        again = host.run_turns(["fixed", "plain", "default"])
    assert list(got) == ["default", "plain", "fixed"]
    for res in (got, again):
        assert res["fixed"]["tokens"] == res["plain"]["tokens"] == res["default"]["tokens"]
        assert all(len(t) == 10 for t in res["plain"]["tokens"])
        for out in res.values():
            assert 0 < out["decode_ms"] < out["all_ms"]
    assert again["default"]["runs"] > got["default"]["runs"] > 0  # the budget is kept
