"""The fit is exact, not hopeful (issue 53, item 2): an engine fitted to a tight RPC device
(``-fitt`` = free memory minus the budget) with ``-np 4``, MTP speculation at
``n_max 4`` and every slot's context filled keeps what it holds on the device (its
buffers, as ggml reports their sizes, step-graph schedulers included) within the fit's
plan, and the plan within the budget, after the largest shapes ran: four slots full, the
longest verify (4 x 5 rows), prompt chunks, sampling in the graph."""

from __future__ import annotations

import pytest

from pyggspec import Engine, SamplingParams, SpecConfig

MiB = 1 << 20
N_CTX = 128  # per slot: small, so filling four slots takes seconds on loopback
N_MAX = 4


@pytest.fixture(scope="module")
def moe(models):
    return models.moe(n_embd=128, n_ff_exp=1024, context_length=32768)


def _engine(moe, dev: str, **kw) -> Engine:
    return Engine(moe, device=dev, n_ctx=N_CTX, n_parallel=4, n_threads=2,
                  spec_type="draft-mtp",
                  spec=SpecConfig(n_max=N_MAX, n_min=N_MAX, adaptive=False),
                  sampling=SamplingParams(temp=0.0), load_tokenizer=False, **kw)


def test_full_context_np4_nmax4_stays_inside_the_plan(rpc_device, moe):
    dev = rpc_device.name
    with _engine(moe, dev, fit=False, n_gpu_layers="all") as whole_e:
        whole = whole_e.memory_plan.by_device()[dev]
    budget = whole - 18 * MiB  # about 1.5 blocks of experts short: the fit must move some
    fitt = (rpc_device.memory()[0] - budget) // MiB
    with _engine(moe, dev, n_gpu_layers=None, fit_target=(fitt,)) as e:
        fitted = e.fit
        assert fitted is not None and fitted.result.n_cpu_moe > 0
        plan = e.memory_plan.by_device()[dev]
        assert plan <= fitted.by_device[dev] + MiB // 2 and fitted.by_device[dev] <= budget
        prompts = [[(7 * s + 3 * i) % 200 + 10 for i in range(40)] for s in range(4)]
        out = e.generate_batch(prompts, max_tokens=4 * N_CTX, ignore_eos=True)
        # every slot filled to its context (the verify's spare cells aside)
        for p, g in zip(prompts, out, strict=True):
            assert len(p) + len(g.tokens) >= N_CTX - N_MAX - 2, g.stop_reason
        # speculation ran at full length: n_min = n_max, fixed lengths
        assert all(g.timings.draft_n >= N_MAX for g in out)
        used, planned = e.memory(), e.memory_plan.to_dict()
        measured = used["by_device"][dev]
        assert measured <= plan <= budget, (used, planned)
        # exact, not generous: what is allocated once is what the plan says, byte for byte;
        # the compute buffers did not grow at the largest shapes (they are reserved at start)
        for part in ("weights", "kv", "mtp_kv", "recurrent", "snapshots", "checkpoints",
                     "compute"):
            assert used.get(part, {}).get(dev, 0) == planned.get(part, {}).get(dev, 0), part
        # step-graph schedulers: the plan bounds as many as may be kept; fewer were made
        assert 0 < used["step_graphs"][dev] <= planned["step_graphs"][dev]
