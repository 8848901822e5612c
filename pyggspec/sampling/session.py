"""Samplers of the sequences in the slots: chains, device plans, host finishing.

The scheduler and the speculative loop speak only to this object: ``start(slot, prompt,
params)`` gives a slot its request's chain (each slot its own params), ``plan_id(n_rows,
rows_per_seq, slots)`` the id of a plan whose device prefix the target graph appends (0
when the chains run on the host, e.g. when the slots' chains differ in structure),
``rows()`` builds the per-row inputs, ``choose()`` finishes a row on the host from logits,
and ``accept()`` records emitted tokens (one RNG draw each).

Plans are registered with the target by structure (``SamplingPlan.key``), so repeated
generations reuse one plan id and one cached graph. When the device part of a step fails,
the target redoes that step with logits as output and calls :meth:`device_failed`; from
then on ``plan_id`` answers 0 and every chain of this generation finishes on the host.
Nothing was accepted for the failed step, so no random number is drawn twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pyggspec.sampling.chain import RowInput, SamplerChain
from pyggspec.sampling.host import sample_host
from pyggspec.sampling.params import SamplingParams
from pyggspec.sampling.plan import plan_chain
from pyggspec.sampling.stats import SamplingStats


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
        self._plans: dict[tuple, int] = {}
        self.failed: str | None = None  # why device sampling was given up, if it was

    def start(self, slot: int, prompt: Sequence[int], params: SamplingParams | None = None,
              ) -> None:
        """A new chain for ``slot`` (``params`` None: the default params)."""
        chain = SamplerChain(params or self.params, self.n_vocab)
        chain.accept_prompt(prompt)
        self.chains[slot] = chain

    def plan_id(self, n_rows: int, rows_per_seq: int = 1,
                slots: Sequence[int] | None = None) -> int:
        """Plan id for a graph with ``n_rows`` output rows of the sequences in ``slots``
        (None: every started chain); 0: sample on the host. Chains of different structure
        cannot share one graph: their rows are then finished on the host (logged once)."""
        if self.failed is not None:
            return 0
        chains = self.chains
        first = chains[slots[0]] if slots else next(iter(chains.values()))
        sig = first.sig
        if slots is None:
            mixed = any(c.sig != sig for c in chains.values())
        else:
            mixed = any(chains[s].sig != sig for s in slots)
        key = (n_rows, rows_per_seq, None if mixed else sig)
        pid = self._plans.get(key)
        if pid is None:
            if mixed:
                if self.backend_sampling:
                    self.stats.fallback("sequences in one batch have sampler chains of different "
                                        "structure")
                pid = 0
            else:
                plan = plan_chain(first.params, self.device, self.n_vocab, n_rows,
                                  self.backend_sampling, output_split=self.output_split,
                                  stats=self.stats)
                pid = (self._register(plan, self.stats, self.device_failed)
                       if plan.n_device else 0)
                if not self.stats.device_stages and not plan.n_device:
                    self.stats.host_stages = [s.name for s in plan.host_stages]
            self._plans[key] = pid
        return pid

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
        chain = self.chains[slot]
        st = chain.stages
        if st[-1].name == "greedy" and logits_row.shape == (self.n_vocab,) and (
                len(st) == 1 or (len(st) == 2 and st[0].name == "grammar"
                                 and chain.grammar.free(prefix))):
            # greedy over the full row (a lazy grammar's free row adds nothing): numpy's
            # argmax takes the first maximum, the lowest id, as the greedy stage's tie rule
            # (one pass, no temporaries)
            return int(logits_row.argmax())
        return sample_host(chain, logits_row, prefix)

    def accept(self, slot: int, token: int) -> bool:
        """Record an emitted token; True when the slot's grammar allows nothing but end of
        generation after it (the output ends there)."""
        chain = self.chains[slot]
        chain.accept(token)
        return chain.grammar is not None and chain.grammar.stopped

    def cut_to_grammar(self, slot: int, drafts: list[int]) -> int:
        """How many of ``drafts`` the slot's grammar allows from its state (all of them
        without a grammar): the verify stops at the first one it forbids anyway, so the
        rest need not be verified."""
        g = self.chains[slot].grammar
        return len(drafts) if g is None else g.valid_prefix(drafts)
