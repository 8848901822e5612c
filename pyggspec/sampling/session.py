"""Samplers of the sequences in one generation: chains, device plans, host finishing.

The engine and the speculative loop speak only to this object: ``plan_id(n_rows)`` gives
the id of a plan whose device prefix the target graph appends (0 when the whole chain runs
on the host), ``rows()`` builds the per-row inputs, ``choose()`` finishes a row on the host
from logits, and ``accept()`` records emitted tokens (one RNG draw each).

Plans are registered with the target by structure (``SamplingPlan.key``), so repeated
generations reuse one plan id and one cached graph. When the device part of a step fails,
the target redoes that step with logits as output and calls :meth:`device_failed`; from
then on ``plan_id`` answers 0 and every chain of this generation finishes on the host.
Nothing was accepted for the failed step, so no random number is drawn twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pyggspec.sampling.chain import (
    RowInput,
    SamplerChain,
    SamplingStats,
    plan_chain,
    sample_host,
)
from pyggspec.sampling.params import SamplingParams


class SequenceSamplers:
    def __init__(self, params: SamplingParams, n_vocab: int, device, backend_sampling: bool,
                 register_plan, output_split: bool = False) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.device = device
        self.backend_sampling = backend_sampling
        self.output_split = output_split
        self._register = register_plan
        self.chains: dict[int, SamplerChain] = {}
        self.stats = SamplingStats()
        self._plans: dict[tuple[int, int], int] = {}
        self.greedy = params.temp <= 0
        self.failed: str | None = None  # why device sampling was given up, if it was

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        chain = SamplerChain(self.params, self.n_vocab)
        chain.accept_prompt(prompt)
        self.chains[slot] = chain

    def plan_id(self, n_rows: int, rows_per_seq: int = 1) -> int:
        """Plan id for a graph with ``n_rows`` output rows (0: sample on the host)."""
        if self.failed is not None:
            return 0
        key = (n_rows, rows_per_seq)
        if key not in self._plans:
            plan = plan_chain(self.params, self.device, self.n_vocab, n_rows,
                              self.backend_sampling, output_split=self.output_split,
                              stats=self.stats)
            self._plans[key] = (self._register(plan, self.stats, self.device_failed)
                                if plan.n_device else 0)
            if not self.stats.device_stages and not plan.n_device:
                self.stats.host_stages = [s.name for s in plan.host_stages]
        return self._plans[key]

    def device_failed(self, exc: BaseException) -> None:
        """The device part of a step failed (the target redid it with logits): finish every
        chain on the host from now on; logged once, counted in stats."""
        if self.failed is not None:
            return
        self.failed = f"{type(exc).__name__}: {exc}"
        self.stats.fallback(f"device sampling failed ({self.failed}); the chains finish on "
                            "the host from now on")
        chain = next(iter(self.chains.values()), None)
        if chain is not None:
            self.stats.device = None
            self.stats.device_stages = []
            self.stats.host_stages = [s.name for s in chain.stages]

    def rows(self, items: Sequence[tuple[int, Sequence[int]]]) -> list[RowInput]:
        """RowInput per (slot, prefix) output row."""
        return [RowInput(self.chains[slot], tuple(prefix)) for slot, prefix in items]

    def choose(self, slot: int, logits_row: np.ndarray, prefix: Sequence[int] = ()) -> int:
        """Finish the chain on the host for one logits row (does not accept)."""
        self.stats.bytes_d2h += logits_row.nbytes
        self.stats.tokens += 1
        return sample_host(self.chains[slot], logits_row, prefix)

    def accept(self, slot: int, token: int) -> None:
        self.chains[slot].accept(token)
