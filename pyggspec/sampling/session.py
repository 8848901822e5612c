"""Samplers of the sequences in one generation: chains, device plans, host finishing.

The engine and the speculative loop speak only to this object: ``plan_id(n_rows)`` gives
the id of a plan whose device prefix the target graph appends (0 when the whole chain runs
on the host), ``rows()`` builds the per-row inputs, ``choose()`` finishes a row on the host
from logits, and ``accept()`` records emitted tokens (one RNG draw each).
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

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        chain = SamplerChain(self.params, self.n_vocab)
        chain.accept_prompt(prompt)
        self.chains[slot] = chain

    def plan_id(self, n_rows: int, rows_per_seq: int = 1) -> int:
        """Plan id for a graph with ``n_rows`` output rows (0: sample on the host)."""
        key = (n_rows, rows_per_seq)
        if key not in self._plans:
            plan = plan_chain(self.params, self.device, self.n_vocab, n_rows,
                              self.backend_sampling, output_split=self.output_split,
                              stats=self.stats)
            self._plans[key] = self._register((plan, self.stats)) if plan.n_device else 0
            if not self.stats.device_stages and not plan.n_device:
                self.stats.host_stages = [s.name for s in plan.host_stages]
        return self._plans[key]

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
