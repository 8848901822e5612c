"""The worker: owns the target, the MTP head and its drafter, the slots' memory and the
sampler chains; ``run(batch) -> StepOutput`` evaluates one scheduled step.

It returns what the target chose and never decides that a sequence is finished (the
scheduler's update does). One speculative step (:meth:`Worker._speculative`), as small
functions with plain inputs and outputs::

    caps = self.lengths.lengths(B)                # the draft-length rule: drafts per kind
    drafts = self.drafter.draft(items, ...)        # speculative/drafter.py: first kind wins
    ub = self._verify_batch(items, drafts)        # [pending, d1..dk] per sequence, padded
    choose = self._verify(ub)                     # one target graph: choose(b, i)
    for each sequence b:
        choices, n, stop = accept(drafts[b], choose, is_stop)  # pure (speculative/verify)
        self._accepted(...)                        # chains, drafter, rule learn
        self._commit(slot, [pending, *drafts[b][:n]], planes)  # SlotMemory (or replay):
                                                  # snapshots: the state's arena row
        self.drafter.committed(slot, committed, hidden)        # e.g. the MTP carry-over
    self.lengths.observe_step(B, kind, k, ms)     # what the step cost

The worker also offers the low-level evaluation behind ``Engine.decode/eval/decode_token``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from pyggspec.errors import OutOfMemory, PyggspecError
from pyggspec.memory import slotfile
from pyggspec.memory.slots import SlotMemory
from pyggspec.models.batch import (
    EMBD_ROW,
    MediaRows,
    SlotRows,
    StepResult,
    UBatch,
    chunk_group,
    padded_rows,
)
from pyggspec.sampling.host import chain_distribution
from pyggspec.sampling.logprobs import chain_logprobs, raw_logprobs
from pyggspec.serving.prefix_cache import common_prefix
from pyggspec.serving.sequence import (
    Batch,
    DecodeItem,
    LogprobRequest,
    PromptChunk,
    SeqOutput,
    StepOutput,
    TokenLogprob,
)
from pyggspec.speculative.drafter import DraftItem
from pyggspec.speculative.rejection import accept_rejection
from pyggspec.speculative.verify import accept

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.assemble import Parts

log = logging.getLogger("pyggspec.worker")


def _first_embd_row(tokens: Seq[int]) -> int:
    """Index of the first image row (an EMBD_ROW id) in ``tokens``; len(tokens) if none."""
    if not tokens or min(tokens) >= 0:
        return len(tokens)
    return next(i for i, t in enumerate(tokens) if t < 0)


class Worker:
    """Runs batches on the engine's graphs; the only code that moves the slots' memory.

    Built by :func:`pyggspec.assemble.assemble` (placement, caches, graphs, drafter);
    see there for what each part is.
    """

    def __init__(self, parts: Parts) -> None:
        self.target = parts.target
        self.mtp = parts.mtp
        self.drafter = parts.drafter  # speculative.drafter.Drafters (None: no speculation)
        self.mtp_drafter = parts.drafter.mtp if parts.drafter is not None else None
        self.memory: SlotMemory = parts.memory
        self.samplers = parts.samplers
        # the draft-length rule (speculative.lengths.DraftLengths; None: fixed lengths,
        # always the cap)
        self.lengths = parts.lengths
        self.n_ctx = parts.n_ctx
        self.n_vocab = parts.n_vocab
        self.n_embd = parts.hp.n_embd  # an image row's width
        self.n_ubatch = parts.cfg.n_ubatch
        self.n_batch = parts.cfg.n_batch
        self.n_parallel = parts.cfg.n_parallel
        self.ctx_checkpoints = parts.cfg.ctx_checkpoints
        self.spec = parts.cfg.spec
        self.speculative = parts.cfg.speculative
        self.snapshot = parts.rollback == "snapshot"
        self._plain_ubs: dict[int, UBatch] = {}
        self._step_ubs: dict[int, UBatch] = {}
        # image rows: which cells of each slot hold them, and every row's RoPE position
        # (an image of n rows advances the position by fewer); the MTP head reads the same
        self.rows = SlotRows(self.n_parallel)
        if self.mtp is not None:
            self.mtp.media = self.rows

    # --- one scheduled step ------------------------------------------------------------
    def run(self, batch: Batch) -> StepOutput:
        """Evaluate ``batch``: its prompt chunks, then its decode/verify part. A part that
        raises fails only its own sequences (listed in ``out.failed``)."""
        out = StepOutput()
        if batch.prompt:
            self._isolated("prompt chunk", batch.prompt, out,
                           lambda chunks: self._prompt(chunks, out))
        if batch.decode:
            t0, dev0 = time.perf_counter(), self.device_ms()
            spec = self.speculative and any(d.spec for d in batch.decode)
            step = self._speculative if spec else self._plain
            # after an out-of-memory the others go on in a plain step (with speculation:
            # as a step in which nothing was drafted, see _isolated)
            self._isolated("decode step", batch.decode, out, lambda items: step(items, out),
                           lambda items: self._plain(items, out, carry=spec))
            out.device_ms = self.device_ms() - dev0
            out.decode_ms = (time.perf_counter() - t0) * 1000
        return out

    def _isolated(self, what: str, items: list, out: StepOutput, part, retry=None) -> None:
        """Run one part of a step (``part(items)``); when it raises, its sequences (only)
        have failed.

        A device out of memory (:class:`OutOfMemory`: a graph could not be allocated, so
        it computed nothing) raised before any of the part's sequences committed a token
        (no slot's length moved) fails only the newest sequence -- the last item: the
        scheduler lists them in admission order, so the request that joined last is the one
        that gets no memory -- and the others run again without it, by ``retry`` (the
        prompt part: the same chunks less one; the decode part: a plain step, which the
        drafters take as a step that drafted nothing, whatever of the failed step's drafting
        had run), until they fit or one is left. Dropping the newest rather than running
        each alone keeps the others batched in the retry and gives the client that came
        last a clear 503 (llama-server halves the batch and retries instead, so under a
        shortage every request slows down and none is told)."""
        mem = self.memory
        before = [mem.length(it.slot) for it in items]
        try:
            part(items)
        except OutOfMemory as exc:
            clean = all(mem.length(it.slot) == n for it, n in zip(items, before, strict=True))
            if len(items) < 2 or not clean:
                log.error("%s failed: %s", what, exc)
                self._failed(items, out, exc)
                return
            log.warning("%s: %s; the newest of its %d sequences (slot %d) fails, the others "
                        "go on", what, exc, len(items), items[-1].slot)
            self._failed(items[-1:], out, exc)
            for it in items[:-1]:  # nothing of the failed attempt is kept
                out.seqs.pop(it.slot, None)
            again = retry or part
            self._isolated(what, items[:-1], out, again, again)
        except Exception as exc:
            log.exception("%s failed", what)
            self._failed(items, out, exc)

    @staticmethod
    def _failed(items: list, out: StepOutput, exc: BaseException) -> None:
        for it in items:
            out.failed[it.slot] = exc
            out.seqs.pop(it.slot, None)

    def _prompt(self, chunks: list[PromptChunk], out: StepOutput) -> None:
        """One ubatch of prompt chunks (equal lengths); the warm ones' pairs go into the
        MTP cache; a chunk that ends its prompt samples the first token when asked."""
        T, B = len(chunks[0].tokens), len(chunks)
        tokens = np.array([c.tokens for c in chunks], np.int32).reshape(B, T)
        outputs = np.array([b * T + T - 1 for b, c in enumerate(chunks) if c.last], np.int32)
        if outputs.size == 0:
            outputs = np.array([T - 1], np.int32)  # keep the graph well-formed
        # the drafters hear of prompt chunks with the target's hidden rows (the MTP head's
        # pairs); the n-gram kinds read the committed tokens when they draft
        warm = (any(c.warm for c in chunks) and self.drafter is not None
                and self.drafter.needs_hidden)
        ub = UBatch(tokens, np.array([c.pos0 for c in chunks], np.int64),
                    tuple(c.slot for c in chunks), outputs, warm)
        self.rows.apply(ub)  # image rows, or rows after them
        res = self.target.run(ub, copy=False)
        for c in chunks:
            self.memory.commit(c.slot, c.tokens)
        n_mtp = 0
        if warm:
            h = res.hidden.reshape(B, T, -1)
            before = self.mtp.n_evals
            self.drafter.prompt([(c.slot, c.pos0, c.tokens, h[b])
                                 for b, c in enumerate(chunks) if c.warm])
            n_mtp = self.mtp.n_evals - before
        for c in chunks:
            if c.checkpoint:
                self.save_checkpoint(c.slot, c.warm, self.ctx_checkpoints)
        rows = {int(r): i for i, r in enumerate(outputs)}
        for b, c in enumerate(chunks):
            so = out.seqs[c.slot] = SeqOutput(target_evals=1, mtp_evals=n_mtp)
            if c.sample:
                row = res.logits[rows[b * T + T - 1]]
                t = self.samplers.choose(c.slot, row)
                if c.logprobs is not None:
                    so.logprobs = [self._logprob(c.slot, c.logprobs, row, t)]
                if self.samplers.accept(c.slot, t):
                    so.grammar_end = 0
                so.tokens.append(t)

    def _plain(self, items: list[DecodeItem], out: StepOutput, carry: bool = False) -> None:
        """One token for every sequence in one ubatch (B x 1); the host arrays of each
        batch size are kept, so a step writes B ids, positions and state rows. A sequence
        that wants log-probabilities needs the logits: the batch then samples on the host
        (the same tokens; llama-server turns backend sampling off for such a request).

        ``carry``: a speculative step in which no sequence has a draft: the committed
        tokens go to the drafters (with the target's hidden rows when one needs them: the
        MTP head's owed pairs). Nothing can be rejected, so the recurrent state is written
        in place, as in plain decoding, and none of the verify step's per-step arrays are
        made (a one-row verify step cost ~6 ms more than a plain one on the Q8_0 bench
        model: its spare state planes, per-row arrays and all-row outputs)."""
        B = len(items)
        hidden = carry and self.drafter.needs_hidden
        ub = self._plain_ubs.get((B, hidden))
        if ub is None:
            rows = np.zeros(B, np.int32)
            ub = self._plain_ubs[(B, hidden)] = UBatch(
                np.zeros((B, 1), np.int32), np.zeros(B, np.int64), (),
                np.arange(B, dtype=np.int32), hidden=hidden, state_src=rows,
                state_dst=rows[None, :])
        tok, pos0, src = ub.tokens, ub.pos0, ub.state_src
        mem, samplers = self.memory, self.samplers
        for b, it in enumerate(items):
            tok[b, 0] = it.pending
            pos0[b] = mem.length(it.slot)
            src[b] = mem.state_row(it.slot)
        ub.slots = tuple(it.slot for it in items)
        ub.rope_shift = self.rows.shift[list(ub.slots)] if self.rows.n_spans else None
        want = any(it.logprobs is not None for it in items)
        ub.sampling = plan = 0 if want else samplers.plan_id(B, 1, ub.slots)
        ub.rows = samplers.rows([(it.slot, ()) for it in items]) if plan else None
        res = self.target.run(ub, copy=False)
        after = self.drafter.committed if carry else None
        for b, it in enumerate(items):
            mem.commit(it.slot, (it.pending,))
            t = int(res.ids[b]) if res.ids is not None else samplers.choose(it.slot, res.logits[b])
            so = out.seqs[it.slot] = SeqOutput([t], spec=carry and it.spec, target_evals=1)
            if after is not None and it.spec:
                after(it.slot, [it.pending], res.hidden[b: b + 1] if hidden else None)
            if it.logprobs is not None:
                so.logprobs = [self._logprob(it.slot, it.logprobs, res.logits[b], t)]
            if not it.is_stop(t) and samplers.accept(it.slot, t):
                so.grammar_end = 0

    # --- the speculative step ------------------------------------------------------------
    def _speculative(self, items: list[DecodeItem], out: StepOutput) -> None:
        """Draft -> verify -> accept -> commit for every sequence, in one batch each."""
        t_step, cold = time.perf_counter(), self._setup_ms()
        B = len(items)
        caps = (self.lengths.lengths(B) if self.lengths is not None
                else dict.fromkeys(self.drafter.names, self.spec.n_max))
        drafts, n_mtp = self._draft(items, caps)
        dtoks = [drafts[it.slot].tokens if it.slot in drafts else [] for it in items]
        if not any(dtoks):  # no sequence has a draft: a plain step
            self._undrafted(items, out, drafts, n_mtp)
            if self.lengths is not None:
                self.lengths.observe_step(B, "", 0, self._step_ms(t_step, cold))
            return
        qs = {it.slot: drafts[it.slot].q for it in items
              if it.slot in drafts and drafts[it.slot].q}
        want = any(it.logprobs is not None for it in items)  # they need the logits
        ub, planes, prefixes = self._verify_batch(items, dtoks, host=bool(qs) or want)
        # snapshot rollback: the verify graph overwrites the state arena (each sequence's
        # state is read first, and its commit points it to its new arena row); when this
        # step raises, its sequences fail and the scheduler clears their slots
        choose_row, hidden, logits = self._verify(ub, prefixes, dtoks)
        replay: dict[int, list[int]] = {}
        for b, it in enumerate(items):
            d = dtoks[b]
            if it.slot in qs:  # p/q rejection (probabilistic drafts)
                choices, n, stopped = self._reject(it.slot, d, qs[it.slot], logits[b],
                                                   lambda i, b=b: choose_row(b, i), it.is_stop)
            else:
                choices, n, stopped = accept(d, lambda i, b=b: choose_row(b, i), it.is_stop)
            emitted = choices[:-1] if stopped else choices
            so = out.seqs[it.slot] = SeqOutput(choices, len(d), min(n, len(d)), it.spec,
                                               target_evals=1,
                                               mtp_evals=n_mtp if it.spec else 0)
            if it.logprobs is not None:  # row i is the target's own distribution of token i
                so.logprobs = [self._logprob(it.slot, it.logprobs, logits[b, i], t, d[:i])
                               for i, t in enumerate(choices)]
            so.grammar_end = self._accepted(it, drafts.get(it.slot), d, n, emitted)
            committed = [it.pending, *d[:n]]
            if not self._commit(it.slot, committed, planes[b], ub.tokens.shape, b):
                replay[it.slot] = committed  # checkpoint rollback: re-evaluate them
                so.target_evals += 1
            self.drafter.committed(it.slot, committed, hidden[b, : n + 1])
        out.target_evals += 1
        out.mtp_evals += n_mtp
        if replay:
            self.decode(replay, logits="last")
            out.target_evals += len({len(t) for t in replay.values()})
        if self.lengths is not None:  # what a step of this length cost
            k, kind = max((len(dr.tokens), dr.kind) for dr in drafts.values())
            self.lengths.observe_step(B, kind, k, self._step_ms(t_step, cold))

    def _undrafted(self, items: list[DecodeItem], out: StepOutput, drafts: dict,
                   n_mtp: int) -> None:
        """A step in which no sequence has a draft (the rule declined, or no kind had a
        proposal): decoded as a plain step, the recurrent state written in place."""
        self._plain(items, out, carry=True)
        out.target_evals += 1  # counted as the verify it replaces (the statistics)
        out.mtp_evals += n_mtp
        for it in items:
            so = out.seqs.get(it.slot)
            if so is None or not it.spec:
                continue
            so.mtp_evals = n_mtp
            draft = drafts.get(it.slot)
            if draft is not None and so.tokens and not it.is_stop(so.tokens[0]):
                self.drafter.accepted(it.slot, draft, 0, so.tokens[:1])

    def _setup_ms(self) -> float:
        """Milliseconds spent so far on work no step shape should be priced with: graphs
        of new shapes built (a shape's first step pays for its graph once; booked into its
        cost it priced the first 4 x 4 verify of a fresh engine at 263 ms against ~240),
        the MTP head's writes of pairs owed by steps that did not draft (the price of
        those steps, paid once; booked into the next drafting step they priced it at 143
        ms against 60 on the Q8_0 ~0.70 bench model), and the hot vocabulary's refreshes
        (~20 ms, in whichever step passes the refresh threshold)."""
        ms = self.target.new_graph_ms_total
        if self.mtp is not None:
            ms += (self.mtp.new_graph_ms_total + self.mtp_drafter.catch_up_ms
                   + self.mtp_drafter.unpriced_ms)
        return ms

    def _step_ms(self, t_step: float, cold: float) -> float:
        """A step's wall time since ``t_step`` less the setup work it did (``cold``: what
        :meth:`_setup_ms` said at ``t_step``)."""
        return (time.perf_counter() - t_step) * 1000 - (self._setup_ms() - cold)

    def _draft(self, items: list[DecodeItem], caps: dict[str, int]) -> tuple[dict, int]:
        """Drafts for the speculating sequences, up to each kind's length in ``caps`` and
        the sequence's own cap. Returns (drafts by slot, MTP evaluations)."""
        before = self.mtp.n_evals if self.mtp is not None else 0
        ask = [DraftItem(it.slot, it.pending, it.n_draft, it.is_stop) for it in items
               if it.spec]
        drafts = self.drafter.draft(ask, self.memory.tokens, self.samplers.chains, caps)
        for slot, dr in drafts.items():
            keep = _first_embd_row(dr.tokens)  # an n-gram kind may copy an image row
            if keep < len(dr.tokens):
                del dr.tokens[keep:]
                del dr.probs[keep:]
                del dr.q[keep:]
            # drop drafts from the first one the slot's grammar forbids: the masked target
            # cannot choose it, so it and what follows would be wasted verify rows (not
            # probabilistic drafts: p/q rejection must see every draft it drew)
            if dr.tokens and not dr.q:
                keep = self.samplers.cut_to_grammar(slot, dr.tokens)
                if keep < len(dr.tokens):
                    del dr.tokens[keep:]
                    del dr.probs[keep:]
        return drafts, (self.mtp.n_evals - before if self.mtp is not None else 0)

    def _verify(self, ub: UBatch, prefixes: list | None, dtoks: list[list[int]]):
        """Run the verify batch. Returns ``choose(b, i)`` -- the target's token at row i of
        sequence b (sampled in the graph, or finished on the host from the logits) -- the
        hidden rows [B, T, n_embd] and the logits [B, T, n_vocab] (None when the graph
        sampled), valid until the next graph."""
        B, T = ub.tokens.shape
        res = self.target.run(ub, copy=False)
        hidden = res.hidden.reshape(B, T, -1)
        if res.ids is not None:
            ids = res.ids.reshape(B, T)
            return (lambda b, i: int(ids[b, i])), hidden, None
        logits = res.logits.reshape(B, T, -1)
        slots = ub.slots
        choose = self.samplers.choose

        def on_host(b: int, i: int) -> int:
            pre = prefixes[b][i] if prefixes is not None else dtoks[b][:i]
            return choose(slots[b], logits[b, i], pre)

        return on_host, hidden, logits

    def _logprob(self, slot: int, want: LogprobRequest, row: np.ndarray, token: int,
                 prefix: Seq[int] = ()) -> TokenLogprob:
        """``token``'s log-probabilities from the target's logits ``row`` (before the chain
        accepts it: post-sampling values need the chain's state at that row). Only for
        sequences that ask; a verified draft gets its verify row's, not the draft head's."""
        if want.post_sampling:
            lp, ids, lps = chain_logprobs(self.samplers.chains[slot], row, prefix, token,
                                          want.n_top)
        else:
            lp, ids, lps = raw_logprobs(row, token, want.n_top)
        return TokenLogprob(token, lp, tuple(zip(ids, lps)))

    def _reject(self, slot: int, d: list[int], q: list, logits: np.ndarray, bonus,
                is_stop) -> tuple[list[int], int, bool]:
        """p/q rejection of one sequence's drafts against its chain's distributions."""
        chain = self.samplers.chains[slot]
        return accept_rejection(
            d, q, lambda i: chain_distribution(chain, logits[i], d[:i]), bonus, chain.key,
            chain.n_sampled, is_stop)

    def _accepted(self, it: DecodeItem, draft, d: list[int], n: int,
                  emitted: list[int]) -> int | None:
        """What the chains, the drafter and the length rule learn from one sequence's
        outcome: emitted tokens advance its chain (one random number each), the drafter
        that made the draft hears how it fared, the rule counts its survival.
        Returns the index of the emitted token that completes the sequence's grammar (the
        output ends there: what follows it is not accepted), or None."""
        if draft is not None and emitted:
            self.drafter.accepted(it.slot, draft, min(n, len(d)), emitted)
        end = None
        for i, t in enumerate(emitted):
            if self.samplers.accept(it.slot, t):
                end = i
                break
        if self.lengths is not None and it.spec and d and draft is not None:
            self.lengths.observe_draft(draft.kind, len(d), min(n, len(d)))
        return end

    def _commit(self, slot: int, committed: list[int], planes: list[int],
                shape: tuple[int, int], b: int) -> bool:
        """Commit the pending token and the accepted drafts; False when the recurrent
        state must be re-evaluated (checkpoint rollback with a rejection or padding).
        ``shape``: the verify batch's (B, T); ``b``: this sequence's index in it."""
        n = len(committed) - 1
        B, T = shape
        if self.snapshot:  # the state after the last accepted row: its arena row
            kept = self.memory.kept_row(b, T - 1 - n, B) if T > 1 else None
            self.memory.commit(slot, committed, kept=kept)
        elif n == T - 1:  # all accepted, no padding: the spare plane's state is complete
            self.memory.commit(slot, committed, planes[0])
        else:  # the state is still "before pending"
            return False
        return True

    def _verify_batch(self, items: list[DecodeItem], dtoks: list[list[int]],
                      host: bool = False) -> tuple[UBatch, list[list[int]], list | None]:
        """[pending, d1..dk] for every sequence, padded to a common length (padding
        repeats the last token; its rows are ignored), with the recurrent-state planes the
        final state goes to: none with snapshot rollback (the state after every row goes
        to the state arena, and the accepted one's row becomes the sequence's: _commit),
        the spare one with checkpoints.
        Returns (ubatch, planes per sequence, per-row draft prefixes for device sampling)."""
        mem, samplers = self.memory, self.samplers
        B = len(items)
        T = padded_rows(max(len(d) for d in dtoks) + 1, B)
        if self.snapshot and T > 1:  # the graph overwrites the arena: others move out
            mem.evacuate_except([it.slot for it in items])
        tokens = np.zeros((B, T), np.int32)
        for b, it in enumerate(items):
            d = dtoks[b]
            tokens[b, 0] = it.pending
            tokens[b, 1:1 + len(d)] = d
            tokens[b, 1 + len(d):] = d[-1] if d else it.pending
        src = np.array([mem.state_row(it.slot) for it in items], np.int32)
        if self.snapshot:  # the states after every row go to the arena (_commit)
            planes = [[] for _ in items]
            dst = src[None, :]
        else:
            planes = [mem.spare_planes(it.slot)[:1] for it in items]
            dst = np.array([[mem.state_row(it.slot, planes[b][0])
                             for b, it in enumerate(items)]], np.int32)
        slots = tuple(it.slot for it in items)
        plan = 0 if host else samplers.plan_id(B * T, T, slots)  # host: p/q needs logits
        prefixes = [[tuple(dtoks[b][:i]) for i in range(T)] for b in range(B)] if plan else None
        rows = (samplers.rows([(it.slot, prefixes[b][i]) for b, it in enumerate(items)
                               for i in range(T)]) if plan else None)
        pos0 = np.array([mem.length(it.slot) for it in items], np.int64)
        ub = UBatch(tokens, pos0, slots, np.arange(B * T, dtype=np.int32), hidden=True,
                    state_src=src, state_dst=dst, sampling=plan, rows=rows,
                    snapshots=self.snapshot)
        if self.rows.n_spans:  # rows after images: their shifted positions
            ub.rope_shift = self.rows.shift[list(slots)]
        return ub, planes, prefixes

    # --- slots -------------------------------------------------------------------------
    def begin(self, slot: int, prompt: list[int], params, reuse: bool, spec: bool,
              media: MediaRows | None = None) -> int:
        """A new request in ``slot``: continue from the slot's cache where the prompt
        allows (the committed tokens, else the newest checkpoint inside the common prefix)
        and start its sampler chain. ``media``: the prompt's image rows (its EMBD_ROW ids).
        Returns the prompt tokens reused."""
        start = self._resume(slot, prompt, reuse, spec, media)
        if media is not None:  # the prompt's rows from cell 0 (the reused ones the same)
            self.rows.clear(slot)
            self.rows.add(slot, 0, media)
        else:  # nothing past the slot's first image row was reused
            self.rows.truncate(slot, start)
        # image rows are no tokens to penalise
        self.samplers.start(slot, prompt if media is None else [t for t in prompt if t >= 0],
                            params)
        if spec and self.drafter is not None:
            self.drafter.begin(slot, prompt)
        return start

    def _resume(self, slot: int, prompt: list[int], reuse: bool, spec: bool,
                media: MediaRows | None) -> int:
        """Keep what the slot holds of ``prompt`` (image rows where they are the same
        image). With the MTP head drafting, only where its cache holds the same positions
        (the carry-over, checkpoints keep it)."""
        mem, mtp = self.memory, self.mtp_drafter if spec else None
        c = min(common_prefix(mem.tokens(slot), prompt) if reuse else 0, len(prompt) - 1)
        c = self.rows.same_images(slot, media, c)
        start, carry = 0, None
        if c > 0:
            if mtp is not None:
                mtp.flush(slot)  # pairs still owed to the MTP cache
            n = mem.length(slot)
            cur = mtp.state(slot) if mtp is not None else None
            if c == n and (mtp is None or (cur is not None and mem.mtp_length(slot) >= n)):
                start, carry = n, cur
            else:
                for ck in reversed(mem.checkpoints(slot)):
                    if ck.pos <= c and (mtp is None or (ck.carry is not None
                                                        and mem.mtp_length(slot) >= ck.pos)):
                        mem.restore(slot, ck)
                        start, carry = ck.pos, ck.carry
                        break
        if start == 0:
            self.clear(slot)
            return 0
        mem.truncate(slot, start)
        self._set_carry(slot, carry)
        return start

    def _set_carry(self, slot: int, carry) -> None:
        """The slot's drafters start from ``carry`` (the MTP head's owed pairs; None:
        unknown, so every drafter forgets the slot)."""
        if self.drafter is None:
            return
        if carry is None or self.mtp_drafter is None:
            self.drafter.forget(slot)
        else:
            self.mtp_drafter.restore(slot, carry)

    def save_checkpoint(self, slot: int, spec: bool, keep: int) -> None:
        """A host copy of the slot's recurrent state here (with the MTP carry when the
        slot speculates); the newest ``keep`` are kept."""
        m = self.mtp_drafter
        self.memory.save_checkpoint(slot, m.state(slot) if spec and m is not None else None,
                                    keep)

    def clear(self, slot: int) -> None:
        self.check_slot(slot)
        self.memory.clear(slot)
        self.rows.clear(slot)
        if self.drafter is not None:
            self.drafter.forget(slot)

    def copy(self, src: int, dst: int) -> None:
        self.check_slot(src)
        self.check_slot(dst)
        self.memory.copy(src, dst)
        self.rows.copy(src, dst)
        self._set_carry(dst, self.mtp_drafter.state(src) if self.mtp_drafter else None)

    # --- slot files (llama-server's slot save / restore) ------------------------------
    def save_slot(self, slot: int, path: str | os.PathLike, identity: Mapping) -> tuple[int, int]:
        """Write ``slot``'s whole state (memory, and the MTP head's carry-over when it
        drafts) to ``path``. Returns (tokens saved, bytes written)."""
        self.check_slot(slot)
        d = self.mtp_drafter
        sf = self.memory.export_state(slot, identity, d.state(slot) if d else None, d)
        sf.header["media"], arrays = self.rows.export(slot)
        for name, a in arrays.items():
            sf.add(name, a)
        return self.memory.length(slot), slotfile.write(path, sf)

    def load_slot(self, slot: int, path: str | os.PathLike, identity: Mapping) -> tuple[int, int]:
        """Make ``slot`` hold the state saved in ``path`` (refused with
        :class:`~pyggspec.memory.slotfile.SlotFileError`, the slot untouched, when the
        file is not from this model and cache setup). Returns (tokens, bytes read)."""
        self.check_slot(slot)
        sf, nbytes = slotfile.read(path)
        spans = self._saved_rows(sf, identity)
        try:
            carry = self.memory.import_state(slot, sf, identity, self.mtp_drafter, self.n_ctx,
                                             self.n_vocab, image_rows=bool(spans))
        except slotfile.SlotFileError:
            raise  # refused before anything was written
        except BaseException:
            self.clear(slot)  # a write failed half-way: nothing of it may be reused
            raise
        self.rows.load(slot, spans)
        self._set_carry(slot, carry)
        return self.memory.length(slot), nbytes

    def _saved_rows(self, sf: slotfile.SlotFile, identity: Mapping
                    ) -> list[tuple[int, int, MediaRows]]:
        """A slot file's image rows, checked against its tokens and the projector (the
        rows are the projector's encoding, compared by image content on reuse)."""
        head = sf.header.get("media") or []
        if not head:
            return []
        saved = (sf.header.get("identity") or {}).get("projector")
        here = identity.get("projector")
        if here is None:  # llama-server's words (its server tests read them)
            raise slotfile.SlotFileError(None, "Cannot restore media tokens without an "
                                         "mmproj: the slot file holds image rows (--mmproj)")
        if not saved or saved.get("fingerprint") != here["fingerprint"]:
            raise slotfile.SlotFileError(None, "the slot file's image rows come from another "
                                         f"projector ({(saved or {}).get('file')!r}, not "
                                         f"{here['file']!r})")
        try:
            spans = SlotRows.parse(head, sf.get)
            tokens = np.asarray(sf.get("tokens"))
            embd_at = np.zeros(tokens.shape[0], bool)
            for cell0, _, m in spans:
                if cell0 + m.n_rows > tokens.shape[0] or m.embd.shape[1:] != (self.n_embd,):
                    raise ValueError("a span outside the tokens or of another width")
                embd_at[cell0:cell0 + m.n_rows] |= m.is_embd
            if not np.array_equal(embd_at, tokens == EMBD_ROW):
                raise ValueError("image rows where the tokens have none")
        except (KeyError, TypeError, ValueError) as e:
            raise slotfile.SlotFileError(None, f"the slot file's image rows are damaged "
                                         f"({e})") from None
        return spans

    def check_slot(self, slot: int) -> None:
        """A one-line error for a sequence id that is not a slot."""
        if not 0 <= slot < self.n_parallel:
            raise PyggspecError(None, f"sequence id {slot} outside 0..{self.n_parallel - 1}")

    def device_ms(self) -> float:
        """Device time (compute + graph building) of every graph run so far."""
        total = self.target.compute_ms_total + self.target.build_ms_total
        if self.mtp is not None:
            total += self.mtp.compute_ms_total + self.mtp.build_ms_total
        return total

    # --- low-level evaluation (Engine.decode / eval / step) ---------------------------------
    def decode(self, batch: Mapping[int, Seq[int]], logits: str = "last",
               hidden: bool = False, media: Mapping[int, MediaRows] | None = None
               ) -> dict[int, StepResult]:
        """Append tokens to several sequences at once; logits ``"last"`` or ``"all"`` rows.

        Sequences are grouped into ubatches of equal length (B sequences x T tokens), at
        most ``n_ubatch`` tokens each, in slot order, never across a sequence's logical
        batch (-b) boundary. ``media[seq]``: the sequence's tokens include image rows
        (:data:`~pyggspec.models.batch.EMBD_ROW` ids; their embeddings and positions there).
        """
        if logits not in ("last", "all"):
            raise ValueError("logits must be 'last' or 'all'")
        mem = self.memory
        media = dict(media or {})
        pending: dict[int, np.ndarray] = {}
        for seq, toks in batch.items():
            self.check_slot(seq)
            arr = np.asarray(toks, dtype=np.int32).reshape(-1)
            if arr.size == 0:
                continue
            m = media.get(seq)
            if m is not None and (m.n_rows != arr.size or not np.array_equal(arr < 0, m.is_embd)):
                raise PyggspecError(None, f"sequence {seq}: the media rows do not match the "
                                    "tokens' image rows")
            text = arr[arr >= 0] if m is not None else arr
            if text.size and (text.min() < 0 or text.max() >= self.n_vocab):
                raise PyggspecError(None, f"sequence {seq}: token id out of range 0.."
                                    f"{self.n_vocab - 1}")
            if mem.length(seq) + arr.size > self.n_ctx:
                raise PyggspecError(None, f"sequence {seq}: context full ({self.n_ctx} tokens)")
            pending[seq] = arr
        out_logits: dict[int, list[np.ndarray]] = {s: [] for s in pending}
        out_hidden: dict[int, list[np.ndarray]] = {s: [] for s in pending}
        done = dict.fromkeys(pending, 0)
        for s in pending:
            if s in media:
                self.rows.add(s, mem.length(s), media[s])
        while True:
            left = {s: a.size - done[s] for s, a in pending.items() if a.size > done[s]}
            if not left:
                break
            T, seqs = chunk_group(dict(sorted(left.items())), done, self.n_ubatch, self.n_batch)
            tokens = np.stack([pending[s][done[s]: done[s] + T] for s in seqs])
            pos0 = np.array([mem.length(s) for s in seqs], dtype=np.int64)
            if logits == "all":
                outputs = np.arange(T * len(seqs), dtype=np.int32)
            else:
                outputs = np.array([i * T + T - 1 for i, s in enumerate(seqs)
                                    if done[s] + T == pending[s].size], dtype=np.int32)
                if outputs.size == 0:
                    outputs = np.array([T - 1], dtype=np.int32)  # keep the graph well-formed
            ub = UBatch(tokens, pos0, tuple(seqs), outputs, hidden)
            self.rows.apply(ub)
            res = self.target.run(ub)
            rows = {int(r): i for i, r in enumerate(outputs)}
            for i, s in enumerate(seqs):
                mem.commit(s, tokens[i])
                if logits == "all":
                    out_logits[s].append(res.logits[i * T:(i + 1) * T])
                elif (i * T + T - 1) in rows and done[s] + T == pending[s].size:
                    out_logits[s].append(res.logits[rows[i * T + T - 1]][None])
                if hidden and res.hidden is not None:
                    out_hidden[s].append(res.hidden[i * T:(i + 1) * T])
                done[s] += T
        return {s: StepResult(np.concatenate(out_logits[s]) if out_logits[s] else
                              np.zeros((0, self.n_vocab), np.float32),
                              np.concatenate(out_hidden[s]) if hidden else None)
                for s in pending}

    def step(self, slot: int, token: int) -> np.ndarray:
        """Decode one token for one sequence and return its logits row (a copy); the host
        arrays of the ubatch are kept per sequence."""
        self.check_slot(slot)
        if not 0 <= token < self.n_vocab:
            raise PyggspecError(None, f"sequence {slot}: token id {token} out of range 0.."
                                f"{self.n_vocab - 1}")
        n = self.memory.length(slot)
        if n + 1 > self.n_ctx:
            raise PyggspecError(None, f"sequence {slot}: context full ({self.n_ctx} tokens)")
        ub = self._step_ubs.get(slot)
        if ub is None:
            ub = UBatch(np.zeros((1, 1), np.int32), np.zeros(1, np.int64), (slot,),
                        np.zeros(1, np.int32), state_src=np.zeros(1, np.int32),
                        state_dst=np.zeros((1, 1), np.int32))
            self._step_ubs[slot] = ub
        ub.tokens[0, 0] = token
        ub.pos0[0] = n
        ub.rope_shift = self.rows.shift[slot:slot + 1] if self.rows.n_spans else None
        ub.state_src[0] = ub.state_dst[0, 0] = self.memory.state_row(slot)
        # a copy: on the CPU the graph's logits are read in place (valid until the next
        # graph), and a caller may keep this row past it, even past close()
        row = self.target.run(ub, copy=False).logits[0].copy()
        self.memory.commit(slot, (token,))
        return row
