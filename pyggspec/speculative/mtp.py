"""The MTP drafter: keeps each slot's MTP cache in step with the target, and drafts.

The head's KV cache holds, for every committed position q, the pair (x_q, h_{q-1}) (h: the
target's post-norm hidden row). After a verify step the new pairs go through the head in
one batch whose last row yields the first draft; argmax drafts (no sampler chain draws
them, p_min 0) are chained in that same graph, other drafts take one row per sequence per
step. With sampling, drafts are coupled to the sequence's own chain, or drawn from q for
p/q rejection; each slot keeps whichever of the coupled draw and the argmax matches the
target more often (:class:`DraftChoice`). Why each part is there: docs/speculation.md.

The carry-over (:class:`Carry`: the pairs a slot's cache still owes) lives here, per slot;
prompt checkpoints and slot files keep a copy, so a resumed slot drafts from the right pairs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from pyggspec.memory.slotfile import SlotFile, SlotFileError
from pyggspec.models.batch import catch_up_rows
from pyggspec.models.mtp import Mtp, MtpBatch, MtpResult, argmax_probability
from pyggspec.sampling.chain import RowInput, SamplerChain
from pyggspec.sampling.host import chain_probability, sample_host
from pyggspec.sampling.plan import plan_chain
from pyggspec.speculative.drafter import Draft, Drafter, DraftItem
from pyggspec.speculative.hot_vocab import HotVocab
from pyggspec.speculative.rejection import draw_draft, prob_of

log = logging.getLogger("pyggspec.speculative")


# Pairs a slot may owe the MTP cache while it does not draft: each write is a cache-only
# head run of mostly fixed cost (every n_max + 1 tokens ~3% of plain decoding on the 0.8B
# bench model; 256 at a time, under 1%)
OWED_PAIRS_MAX = 256


class Carry:
    """The pairs one slot's MTP cache still owes: ``tokens[j]`` (at ``pos0 + j``) with
    ``hidden[j]``, the target's row of the position before; ``hidden`` has one more row
    (it pairs with the next token), or none right after a draft wrote the pending pair.
    Immutable (checkpoints keep carries); rows are joined once, when first read (joined
    every step, 256 owed pairs copied ~0.3 ms a step)."""

    __slots__ = ("_joined", "_parts", "pos0", "tokens")

    def __init__(self, pos0: int, tokens: tuple[int, ...], hidden: np.ndarray,
                 *more: np.ndarray) -> None:
        self.pos0 = pos0
        self.tokens = tokens
        self._parts = (hidden, *more)
        self._joined: np.ndarray | None = None if more else hidden

    @property
    def hidden(self) -> np.ndarray:
        """float32 [len(tokens) + 1, n_embd], or [0, n_embd]."""
        if self._joined is None:
            self._joined = np.concatenate(self._parts)
            self._parts = (self._joined,)
        return self._joined

    @classmethod
    def start(cls, pos: int, hidden_row: np.ndarray) -> Carry:
        """Nothing owed before ``pos``; ``hidden_row`` is the row of position ``pos - 1``."""
        return cls(pos, (), np.array(hidden_row, np.float32).reshape(1, -1))

    def extend(self, tokens: list[int], hidden: np.ndarray) -> Carry:
        """Committed ``tokens`` and the hidden rows of the positions they took (the rows
        after the carry's last one; copied: the caller's buffer is reused)."""
        rows = np.array(hidden, np.float32)
        if len(self._parts) == 1 and not len(self._parts[0]):
            # the pending token's pair is written: it is not owed
            return Carry(self.pos0, tuple(tokens[1:]), rows)
        return Carry(self.pos0, self.tokens + tuple(tokens), *self._parts, rows)


@dataclass
class DraftRequest:
    """New pairs for one sequence: ``tokens[k]`` at ``pos0 + k`` with ``hidden[k]``; the
    last token is the pending one, where drafting starts."""

    slot: int
    pos0: int
    tokens: list[int]
    hidden: np.ndarray  # float32 [len(tokens), n_embd]
    n_max: int  # drafts wanted (0: only bring the cache up to date)
    is_stop: Callable[[int], bool] | None = None  # a stop-token draft ends the drafts


class DraftChoice:
    """A slot's running match rates (exponential averages) of the coupled draw and of the
    argmax at the first draft position. They describe the head against the target at one
    temperature, so a slot keeps them across requests until the temperature changes."""

    DECAY = 0.9

    def __init__(self, temp: float) -> None:
        self.temp = temp
        self.coupled = 0.5
        self.argmax = 0.5

    @property
    def use_coupled(self) -> bool:
        return self.coupled > self.argmax

    def observe(self, sampled: int, argmax: int, target: int) -> None:
        d = self.DECAY
        self.coupled = d * self.coupled + (1 - d) * (sampled == target)
        self.argmax = d * self.argmax + (1 - d) * (argmax == target)


class MtpDrafter(Drafter):
    """Drafts with the MTP head: the argmax (in the graph where supported), or, for
    sampling chains with ``coupled``, the chain's own draw (see the module docstring)."""

    name = "draft-mtp"
    needs_hidden = True

    def __init__(self, mtp: Mtp, memory, n_embd: int, n_min: int = 0, p_min: float = 0.0,
                 n_max: int = 3,
                 coupled: bool = False, device=None, backend_sampling: bool = True,
                 probabilistic: bool = False, hot: HotVocab | None = None) -> None:
        self.mtp = mtp
        self.hot = hot  # the hot vocabulary drafts are scored over (None: the whole head)
        self.memory = memory  # the slots' memory: the one writer of the MTP cache length
        self.carry: dict[int, Carry] = {}  # per slot (absent: the owed pairs are unknown)
        self._no_rows = np.zeros((0, n_embd), np.float32)  # a consumed carry's (never written)
        self.n_embd = n_embd
        self.n_min = n_min
        self.n_max = n_max  # the engine's cap: a verify step leaves at most n_max + 1 owed
        self.p_min = p_min
        self.coupled = coupled
        self.probabilistic = probabilistic  # sampling chains draw drafts from q (rejection)
        self.device = device  # the head's output device (plans are probed there)
        self.backend_sampling = backend_sampling
        self._plans: dict[tuple, int] = {}
        self.failed = False  # the graph part of coupled drafts failed once: host from now on
        self.choices: dict[int, DraftChoice] = {}  # per slot
        self.n_coupled = 0  # drafts made by coupled draws / by the argmax (stats)
        self.n_argmax = 0
        # time spent writing pairs owed by steps that did not draft: theirs, not the
        # drafting step's (the draft-length rule prices steps without it)
        self.catch_up_ms = 0.0
        self.unpriced_ms = 0.0  # the same for the hot vocabulary's refreshes

    # --- the drafter interface (speculative/drafter.py) -------------------------------------
    def begin(self, slot: int, prompt) -> None:
        """Nothing to do: the prompt's pairs come with its chunks (:meth:`prompt`)."""

    def accepted(self, slot: int, draft: Draft, n: int, emitted) -> None:
        """The target's token at the first draft position updates the slot's choice
        between coupled draws and the argmax."""
        c = self.choices.get(slot)
        if c is not None and draft.first is not None and emitted:
            c.observe(draft.first[0], draft.first[1], emitted[0])

    def state(self, slot: int) -> Carry | None:
        """The slot's owed pairs (None: unknown; checkpoints keep it)."""
        return self.carry.get(slot)

    def restore(self, slot: int, state: Carry) -> None:
        self.carry[slot] = state

    def counters(self) -> dict:
        return {"coupled_drafts": self.n_coupled, "argmax_drafts": self.n_argmax,
                "catch_up_ms": round(self.catch_up_ms, 3)}

    def _prob_chain(self, chains: Mapping[int, SamplerChain] | None,
                    slot: int) -> SamplerChain | None:
        """The slot's chain when its drafts are drawn from q for p/q rejection (sampling
        chains in probabilistic mode; greedy chains draft and match their argmax)."""
        if not self.probabilistic or chains is None:
            return None
        ch = chains.get(slot)
        return ch if ch is not None and ch.stages[-1].name == "dist" else None

    def _q_draws(self, res: MtpResult, rows: list[tuple[int, tuple[int, ...]]],
                 prob: Mapping[int, SamplerChain], qrow: dict[int, object],
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Rows of probabilistic slots: the draft drawn from q (top 10 of the head's logits
        at the target's temperature), its q probability, and q kept per row."""
        ids = res.ids.copy()
        probs = (argmax_probability(res.logits) if self.p_min > 0
                 else np.array(res.probs, np.float32, copy=True))
        for i, (slot, prefix) in enumerate(rows):
            ch = prob.get(slot)
            if ch is None:
                continue
            t, q = draw_draft(res.logits[i], ch.params.temp, ch.key,
                              ch.n_sampled + len(prefix))
            ids[i], probs[i], qrow[i] = t, prob_of(q, t), q
        return ids, probs

    def _sampled(self, chains: Mapping[int, SamplerChain] | None, slot: int) -> SamplerChain | None:
        """The chain that draws the slot's drafts (None: the head's argmax): a sampling
        chain's when drafts are coupled, and a chain with a grammar whenever its drafts are
        not drawn from q: its mask keeps the drafts inside the grammar (a greedy chain's
        draw is then the argmax among the allowed tokens), so they can be accepted."""
        if chains is None:
            return None
        ch = chains.get(slot)
        if ch is None:
            return None
        dist = ch.stages[-1].name == "dist"
        # (a lazy grammar's free text drafts as no grammar: the head's argmax; drafts past
        # its trigger are cut by the grammar before the verify)
        if ch.grammar is not None and not (self.probabilistic and dist) \
                and not ch.grammar.free():
            return ch
        return ch if self.coupled and dist else None

    def _run(self, mb: MtpBatch, rows: list[tuple[SamplerChain | None, tuple[int, ...]]]) -> MtpResult:
        """One MTP evaluation whose output rows are drawn by ``rows``' chains (None: argmax)."""
        coupled = [ch for ch, _ in rows if ch is not None]
        if coupled:
            sig = coupled[0].sig
            if (len(coupled) == len(rows) and not self.failed and self.p_min == 0
                    and self.backend_sampling and all(c.sig == sig for c in coupled)):
                key = (len(rows), sig)
                pid = self._plans.get(key)
                if pid is None:
                    plan = plan_chain(coupled[0].params, self.device, coupled[0].n_vocab,
                                      len(rows), True)
                    pid = self._plans[key] = self.mtp.register_plan(plan) if plan.n_device else 0
                    if not pid:  # once per chain structure and row count: planning time only
                        log.warning("coupled drafts of this chain are drawn on the host: %s",
                                    "; ".join(plan.reasons) or "no graph stage")
                if pid:
                    mb.sampling = pid
                    mb.rows = [RowInput(ch, pre) for ch, pre in rows]
            if not mb.sampling:
                mb.logits = True
        try:
            res = self.mtp.run(mb)
        except Exception as e:
            if not mb.sampling:
                raise
            self._give_up(e)  # redo with logits: an MTP step only rewrites its KV rows
            mb.sampling, mb.rows, mb.logits = 0, None, True
            res = self.mtp.run(mb)
        if res.ids is None:  # the graph part failed after compute: draw on the host
            self._give_up("reading the draws failed")
        if coupled and (res.ids is None or not res.sampled):
            lg = res.logits
            # the logits path read the argmax already; a failed read of the draws did not
            amax = res.ids if res.ids is not None else lg.argmax(axis=1).astype(np.int32)
            ids = amax.copy()
            probs, amax_probs = np.ones(len(rows), np.float32), None
            if self.p_min > 0:  # the head's softmax of its argmax
                amax_probs = argmax_probability(lg)
                probs = amax_probs.copy()
            for i, (ch, pre) in enumerate(rows):
                if ch is not None:
                    ids[i] = sample_host(ch, lg[i], pre)
                    if self.p_min > 0:  # p_min compares the chain's probability of a draw
                        probs[i] = chain_probability(ch, lg[i], pre, int(ids[i]))
            res = MtpResult(ids, probs, res.hidden, lg, sampled=True, argmax=amax,
                            argmax_probs=amax_probs)
        return res

    def _give_up(self, why: object) -> None:
        if not self.failed:
            log.warning("coupled drafts are drawn on the host from now on: %s", why)
        self.failed = True

    def _choice(self, slot: int, chain: SamplerChain | None) -> DraftChoice | None:
        if chain is None or chain.stages[-1].name != "dist" or not self.coupled:
            return None  # a greedy chain's (grammar) draw is always its best guess
        c = self.choices.get(slot)
        if c is None or c.temp != chain.params.temp:
            c = self.choices[slot] = DraftChoice(chain.params.temp)
        return c

    def _pick(self, res: MtpResult, choices: list[DraftChoice | None],
              ) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the coupled draw, or the argmax where that matches the target better
        (with its probability for ``p_min``: the head's softmax, as for greedy drafts)."""
        ids = res.ids.copy()
        probs = res.probs
        for i, c in enumerate(choices):
            if c is None:
                continue
            if c.use_coupled:
                self.n_coupled += 1
            else:
                ids[i] = res.argmax[i]
                if res.argmax_probs is not None:
                    probs[i] = res.argmax_probs[i]
                self.n_argmax += 1
        return ids, probs

    def run(self, reqs: list[DraftRequest],
            chains: Mapping[int, SamplerChain] | None = None) -> dict[int, Draft]:
        """Write the new pairs of every request into the MTP cache and draft after them.
        ``chains`` (slot -> sampler chain) enables coupled drafts for sampling chains."""
        out = {r.slot: Draft() for r in reqs}
        if not reqs:
            return out
        # 1. catch-up + first draft, one batch; shorter requests padded at their end
        B = len(reqs)
        T = catch_up_rows(max(len(r.tokens) for r in reqs), B)
        tokens = np.zeros((B, T), np.int32)
        hidden = np.zeros((B, T, self.n_embd), np.float32)
        for b, r in enumerate(reqs):
            n = len(r.tokens)
            tokens[b, :n] = r.tokens
            tokens[b, n:] = r.tokens[-1]  # padding rows: after the real ones, never seen
            hidden[b, :n] = r.hidden
        live = [b for b, r in enumerate(reqs) if r.n_max > 0]  # requests still drafting
        # (none: only bringing caches up to date, a cache-only graph: no FFN, no LM head)
        outputs = np.array([b * T + len(reqs[b].tokens) - 1 for b in live], np.int32)
        sampled = {r.slot: self._sampled(chains, r.slot) for r in reqs}
        choice = {r.slot: self._choice(r.slot, sampled[r.slot]) for r in reqs}
        prob = {r.slot: c for r in reqs if (c := self._prob_chain(chains, r.slot)) is not None}
        hot = self.hot is not None and self.hot.active
        mb = MtpBatch(tokens, hidden, np.array([r.pos0 for r in reqs], np.int64),
                      tuple(r.slot for r in reqs), outputs, hot=hot)
        mb.logits = bool(prob) and bool(live)  # q is computed from the head's logits
        if live and not prob and self.p_min == 0 and all(sampled[reqs[b].slot] is None
                                                         for b in live):
            # argmax drafts: all in one graph (a p_min cut would leave passes computed for
            # nothing, so those go step by step)
            mb.chain = max(reqs[b].n_max for b in live)
        res = self._run(mb, [(sampled[reqs[b].slot], ()) for b in live]) if live \
            else self.mtp.run(mb)
        ends = {r.slot: r.pos0 + len(r.tokens) for r in reqs}
        if res.chain_ids is not None:  # every draft came from the one graph
            self._chained(res, [reqs[b] for b in live], out)
            live = []
        if res.sampled:  # the first draws, which teach each slot's choice (accepted)
            for i, b in enumerate(live):
                if choice[reqs[b].slot] is not None:
                    out[reqs[b].slot].first = (int(res.ids[i]), int(res.argmax[i]))
        # 2. autoregressive drafting: one row per still-drafting sequence (row i: live[i])
        step = 0
        while live:
            ch = [choice[reqs[b].slot] for b in live]
            ids, probs = self._pick(res, ch) if res.sampled else (res.ids, res.probs)
            qrow: dict[int, object] = {}
            if prob:
                ids, probs = self._q_draws(res, [(reqs[b].slot, tuple(out[reqs[b].slot].tokens))
                                                 for b in live], prob, qrow)
            nxt = []
            for i, b in enumerate(live):
                r, d = reqs[b], out[reqs[b].slot]
                if self.p_min > 0 and probs[i] < self.p_min:
                    continue
                tok = int(ids[i])
                d.tokens.append(tok)
                d.probs.append(float(probs[i]))
                if i in qrow:
                    d.q.append(qrow[i])
                if len(d.tokens) < r.n_max and not (r.is_stop is not None and r.is_stop(tok)):
                    nxt.append((b, i))
            if not nxt:
                break
            step += 1
            live = [b for b, _ in nxt]
            mb = MtpBatch(np.array([[out[reqs[b].slot].tokens[-1]] for b in live], np.int32),
                          res.hidden[[i for _, i in nxt]][:, None, :],
                          np.array([ends[reqs[b].slot] + step - 1 for b in live], np.int64),
                          tuple(reqs[b].slot for b in live),
                          np.arange(len(live), dtype=np.int32), hot=hot)
            mb.logits = bool(prob)
            # a sequence drafting by argmax needs no draws
            res = self._run(mb, [(sampled[reqs[b].slot] if c is None or c.use_coupled else None,
                                  tuple(out[reqs[b].slot].tokens))
                                 for b, c in zip(live, (choice[reqs[b].slot] for b in live))])
        # draft-time entries past the committed pairs are not committed
        for r in reqs:
            self.memory.commit_mtp(r.slot, ends[r.slot])
            d = out[r.slot]
            if len(d.tokens) < self.n_min:
                d.tokens.clear()
                d.probs.clear()
                d.q.clear()
        return out

    def _chained(self, res: MtpResult, reqs: list[DraftRequest], out: dict[int, Draft]) -> None:
        """Each request's drafts from a chained graph's steps, cut where the step-by-step
        loop would have stopped (its ``n_max``, a stop token): the same drafts."""
        for i, r in enumerate(reqs):
            d = out[r.slot]
            for tok, p in zip(res.chain_ids[:, i].tolist(), res.chain_probs[:, i].tolist()):
                d.tokens.append(tok)
                d.probs.append(p)
                if len(d.tokens) >= r.n_max or (r.is_stop is not None and r.is_stop(tok)):
                    break

    # --- the carry-over, per slot ---------------------------------------------------------
    def draft(self, items: list[DraftItem], history=None,
              chains: Mapping[int, SamplerChain] | None = None) -> dict[int, Draft]:
        """Draft after each slot's owed pairs and its pending token, up to ``item.cap``
        drafts. Pairs owed by steps that did not draft are written first, on their own
        (:attr:`catch_up_ms`). The pairs are written, so each carry becomes empty (the
        pending token's pair included)."""
        owed = [it.slot for it in items if len(self.carry[it.slot].tokens) > self.n_max + 1]
        if owed:
            t0 = time.perf_counter()
            self.flush(*owed)
            self.catch_up_ms += (time.perf_counter() - t0) * 1000
        reqs = []
        for it in items:
            c = self.carry[it.slot]
            reqs.append(DraftRequest(it.slot, c.pos0, [*c.tokens, it.pending], c.hidden,
                                     it.cap, it.is_stop))
        out = self.run(reqs, chains)
        for r in reqs:
            self.carry[r.slot] = Carry(r.pos0 + len(r.tokens), (), self._no_rows)
        return out

    def committed(self, slot: int, committed: list[int], hidden: np.ndarray) -> None:
        """The target committed ``committed`` (the old pending token and the accepted
        drafts) with ``hidden`` their rows: they become owed pairs, written once
        :data:`OWED_PAIRS_MAX` are owed."""
        c = self.carry.get(slot)
        if c is not None:
            c = self.carry[slot] = c.extend(committed, hidden)
            if len(c.tokens) >= OWED_PAIRS_MAX:
                t0 = time.perf_counter()
                self.flush(slot)
                self.catch_up_ms += (time.perf_counter() - t0) * 1000
        if self.hot is not None and self.hot.observe(committed, emitted=True):
            self._refresh_hot()

    def _refresh_hot(self) -> None:
        """Choose the hot set again and write its rows (~20 ms on the 0.8B bench model):
        counted in :attr:`unpriced_ms`, so that whichever step it lands in is not priced
        with it by the draft-length rule."""
        t0 = time.perf_counter()
        self.mtp.set_hot(self.hot.choose())
        self.unpriced_ms += (time.perf_counter() - t0) * 1000

    def prompt(self, parts: list[tuple[int, int, list[int], np.ndarray]]) -> None:
        """Prompt chunks (slot, first position, tokens, their target hidden rows): their
        pairs go into the MTP cache in one batch, and the carry moves past them."""
        reqs = []
        for slot, pos0, tokens, h in parts:
            if self.hot is not None and self.hot.observe(tokens, emitted=False):
                self._refresh_hot()
            c = self.carry.get(slot)
            if c is None or c.pos0 + len(c.tokens) != pos0:
                c = Carry.start(pos0, np.zeros(h.shape[1], np.float32))
            reqs.append(DraftRequest(slot, c.pos0, [*c.tokens, *tokens],
                                     np.concatenate([c.hidden, h[:-1]]), 0))
            self.carry[slot] = Carry.start(pos0 + len(tokens), h[-1])
        self.run(reqs)

    def flush(self, *slots: int) -> None:
        """Write these slots' owed pairs now, in one batch (a new request continues from
        its cache; or drafting resumes after declined steps)."""
        reqs = []
        for slot in slots:
            c = self.carry.get(slot)
            if c is None or not c.tokens:
                continue
            reqs.append(DraftRequest(slot, c.pos0, list(c.tokens), c.hidden[:-1], 0))
            self.carry[slot] = Carry.start(c.pos0 + len(c.tokens), c.hidden[-1])
        if reqs:
            self.run(reqs)

    def forget(self, slot: int) -> None:
        """The slot's MTP pairs after its cache length are unknown from now on."""
        self.carry.pop(slot, None)

    # --- slot files: the carry is written with the slot's memory (SlotMemory's CarryCodec)
    def encode_carry(self, carry: Carry, sf: SlotFile, prefix: str) -> dict:
        """Add ``carry``'s arrays to slot file ``sf`` under ``prefix``; its JSON part."""
        sf.add(prefix + "tokens", np.asarray(carry.tokens, np.int32))
        sf.add(prefix + "hidden", np.asarray(carry.hidden, np.float32))
        return {"pos0": int(carry.pos0)}

    def decode_carry(self, meta: Mapping, sf: SlotFile, prefix: str) -> Carry:
        """The carry :meth:`encode_carry` wrote (shapes checked against this head)."""
        tokens, hidden = sf.get(prefix + "tokens"), sf.get(prefix + "hidden")
        if (tokens.ndim != 1 or hidden.ndim != 2 or hidden.shape[1] != self.n_embd
                or hidden.shape[0] not in (0, len(tokens) + 1)):
            raise SlotFileError(None, f"the slot file's MTP carry-over ({prefix}) has "
                                f"shapes {tokens.shape} and {hidden.shape}")
        return Carry(int(meta["pos0"]), tuple(int(t) for t in tokens),
                     np.array(hidden, np.float32))
