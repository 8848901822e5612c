"""Weights over two devices (CPU + an RPC server on loopback): the generation loop's graphs
are built once and then only re-run, however they alternate (issue 9.4)."""

from __future__ import annotations

import pytest

from pyggspec.config import SpecConfig
from pyggspec.engine import Engine

PROMPTS = [[300, 301, 302], [400, 401]]


def _model(models, arch: str):
    return models.get(arch, dtype="f32", agreement=0.8, tied_embeddings=False)


def _rebuilds(e: Engine) -> int:
    return e.target.n_rebuilds + (e.mtp.n_rebuilds if e.mtp is not None else 0)


def _run(make_engine, path, prompts, n_max: int, rollback: str, **kw):
    """Tokens per prompt, rebuilds (a shape built again), verify steps."""
    with make_engine(path, n_ctx=512, n_parallel=len(prompts), spec_type="draft-mtp",
                     spec=SpecConfig(n_max=n_max, rollback=rollback), **kw) as e:
        res = e.generate_batch(prompts, max_tokens=240, ignore_eos=True)
        return [r.tokens for r in res], _rebuilds(e), res.stats.n_steps


@pytest.mark.parametrize("arch,n_seq,rollback", [("dense", 1, "snapshot"),
                                                 ("moe", 2, "snapshot"),
                                                 ("dense", 1, "checkpoint")])
def test_no_graph_builds_after_warm_up_with_rpc_offload(models, make_engine, rpc_device, arch,
                                                       n_seq, rollback):
    """Layers, the MTP head and the LM head on the RPC device: over 64+ speculative steps
    (verify, MTP catch-up of 1..n_max+1 rows and one-row drafts alternating) no graph is
    built twice -- each shape once, when first seen -- and the output equals the CPU-only
    run."""
    path = _model(models, arch)
    prompts = PROMPTS[:n_seq]
    ref, _, _ = _run(make_engine, path, prompts, 2, rollback)
    out, rebuilds, n_steps = _run(make_engine, path, prompts, 2, rollback, n_gpu_layers=3,
                                  device=rpc_device.name)
    assert out == ref
    assert n_steps >= 64
    assert rebuilds == 0
