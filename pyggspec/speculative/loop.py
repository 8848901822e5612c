"""The speculative step: draft with the MTP head, verify with the target, accept, roll back.

One step for a set of sequences (gpt-fast style, as plain array logic)::

    drafts   = drafter.draft(new pairs)            # MTP: catch-up + first draft in one batch
    logits   = target([t, d1..dk] per sequence)    # one verify batch, snapshots kept
    y_i      = sample(logits[i])  for i = 0..      # the target's own choice at each row
    n        = first i with y_i != d_{i+1}         # accepted drafts
    emit d1..dn, y_n;  roll the state back to "after d_n"

Lossless by construction: every emitted token is the target's own sample from the
target's logits at that position, drawn in order, so the output equals plain decoding
(the sampler is called exactly once per emitted token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pyggspec.config import SpecConfig
from pyggspec.models.qwen35 import UBatch
from pyggspec.speculative.draft_mtp import DraftRequest, MtpDrafter


@dataclass
class SpecStats:
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0  # verify steps
    n_target_evals: int = 0  # target graph evaluations (verify + re-evaluation + prompt)
    n_mtp_evals: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # verify steps by draft length k

    def record(self, k: int, n: int) -> None:
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        while len(self.draft_lengths) <= k:
            self.draft_lengths.append(0)
        self.draft_lengths[k] += 1
        for i in range(k):
            self.drafted_at[i] += 1
            if i < n:
                self.accepted_at[i] += 1
        self.n_drafted += k
        self.n_accepted += n
        self.n_steps += 1

    def merge(self, other: SpecStats) -> None:
        """Add ``other``'s counts (e.g. one request's) into these."""
        for name in ("drafted_at", "accepted_at", "draft_lengths"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.n_drafted += other.n_drafted
        self.n_accepted += other.n_accepted
        self.n_steps += other.n_steps
        self.n_target_evals += other.n_target_evals
        self.n_mtp_evals += other.n_mtp_evals

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (1 + accepted drafts), llama.cpp's 'mean len'."""
        return 1 + self.n_accepted / self.n_steps if self.n_steps else 0.0

    def to_dict(self, spec_type: str = "draft-mtp") -> dict:
        return {"type": spec_type, "n_drafted": self.n_drafted, "n_accepted": self.n_accepted,
                "acceptance": self.acceptance, "per_position": self.per_position,
                "mean_accepted_length": self.mean_accepted_length, "n_steps": self.n_steps,
                "n_target_evals": self.n_target_evals, "n_mtp_evals": self.n_mtp_evals,
                "draft_lengths": list(self.draft_lengths)}


def emit_room(n_ctx: int, n_held: int, budget: int) -> int:
    """How many more tokens a sequence may emit: the one length/context rule, used by plain
    decoding, by the speculative step and for the first token after the prompt.

    A sequence holding ``n_held`` tokens (prompt + emitted) may emit a token only if it fits
    the context, so prompt + output never exceed ``n_ctx``: the last emitted token may take
    position ``n_ctx - 1`` (it is emitted but never evaluated; nothing needs its logits),
    and at most ``budget`` (-n) tokens are emitted. This is llama-server's rule (it stops
    once the evaluated tokens + 1 reach n_ctx). A speculative step drafts at most
    ``room - 1`` tokens, so it can emit exactly the tokens plain decoding would and stops
    at the same one; -n 0 samples nothing.
    """
    return max(0, min(budget, n_ctx - n_held))


@dataclass
class SeqState:
    """One generating sequence between steps (created right after its prompt is evaluated)."""

    slot: int
    pos: int  # target positions 0..pos-1 are evaluated and committed
    pending: int  # sampled token at position ``pos``, not yet evaluated by the target
    new_tokens: list[int]  # pairs for the MTP cache: tokens at pos0.. (pending last)
    new_hidden: np.ndarray  # their paired target hidden rows
    new_pos0: int
    budget: int  # tokens still to emit
    out: list[int] = field(default_factory=list)
    done: bool = False
    stop_reason: str = "length"
    spec: bool = True  # speculates (keeps its MTP cache); False: plain rows in a verify batch
    n_max: int | None = None  # its draft cap (None: the engine's SpecConfig.n_max)
    is_stop: Callable[[int], bool] | None = None  # its end-of-generation test (None: the step's)
    stats: SpecStats | None = None  # its own speculation counts, besides the step's
    n_prompt: int = field(init=False)  # prompt tokens: ``pos`` at creation

    def __post_init__(self) -> None:
        self.n_prompt = self.pos

    def room(self, n_ctx: int) -> int:
        """Tokens this sequence may still emit (:func:`emit_room`)."""
        return emit_room(n_ctx, self.n_prompt + len(self.out), self.budget)

    def settle(self, n_ctx: int) -> bool:
        """Mark the sequence done (``length`` or ``context``) when it may emit no more."""
        if self.room(n_ctx) > 0:
            return False
        self.done = True
        self.stop_reason = "length" if self.budget <= 0 else "context"
        return True

    def emit(self, tokens: list[int], samplers) -> None:
        """Record emitted tokens (one RNG draw each); the last one becomes ``pending``."""
        for t in tokens:
            samplers.accept(self.slot, t)
        self.out.extend(tokens)
        self.budget -= len(tokens)
        if tokens:
            self.pending = tokens[-1]

    def first_token(self, choose: Callable[[], int], samplers, is_stop: Callable[[int], bool],
                    n_ctx: int) -> None:
        """Sample the token after the prompt under the same rule as every other token:
        nothing is sampled when -n is 0 or the prompt fills the context."""
        if self.settle(n_ctx):
            return
        t = choose()
        self.pending = t
        if is_stop(t):
            self.done, self.stop_reason = True, "eos"
            return
        self.emit([t], samplers)
        self.settle(n_ctx)


def padded_rows(T: int, B: int) -> int:
    """Rows per sequence for a batch of B sequences needing T rows each.

    ggml's CPU matrix kernels take activation columns in pairs: an odd count of three or
    more costs more than one more column (0.8B q8_0, 2 threads: 3 tokens 128 ms, 4 tokens
    117 ms; 5: 174 ms, 6: 155 ms). Padding rows are evaluated and ignored.
    """
    if T * B >= 3 and (T * B) % 2 == 1:
        return T + 1
    return T


def accept(drafts: list[int], choose: Callable[[int], int],
           is_stop: Callable[[int], bool]) -> tuple[list[int], int, bool]:
    """The target's choice at verify row i is ``choose(i)``; take rows in order until a
    choice differs from the draft.

    Returns (emitted tokens, accepted draft count n, stopped at a stop token). The stop
    token itself is not emitted.
    """
    emitted: list[int] = []
    for i in range(len(drafts) + 1):
        y = choose(i)
        if is_stop(y):
            return emitted, i, True
        emitted.append(y)
        if i == len(drafts) or y != drafts[i]:
            return emitted, i, False
    raise AssertionError("unreachable")


def speculative_step(engine, drafter: MtpDrafter, seqs: list[SeqState], cfg: SpecConfig,
                     stats: SpecStats, samplers, is_stop: Callable[[int], bool]) -> None:
    """Advance every live sequence by one draft/verify/accept step (in one batch each).

    ``samplers`` (:class:`~pyggspec.sampling.session.SequenceSamplers`) chooses the
    target's token at each verify row -- in the graph when its plan has a device prefix
    (only candidates or ids come back), else on the host from the logits. A sequence with
    ``spec`` off rides along without drafts (one row, padded like the others).
    """
    t_step = time.perf_counter()
    live = [s for s in seqs if not s.done]
    if not live:
        return
    n_ctx = engine.n_ctx
    policy = engine.draft_policy  # adaptive draft length (None: always the cap)
    # 1. draft: new pairs into the MTP cache, then up to n_max drafts per sequence
    caps: dict[int, int] = {}
    for s in live:
        if s.spec:
            # emitted tokens = accepted drafts + 1, so drafts stop one short of the room
            cap = cfg.n_max if s.n_max is None else s.n_max
            caps[s.slot] = max(0, min(cap, s.room(n_ctx) - 1))
            if policy is not None:
                policy.bind(s.slot, s)
    chosen = None
    if policy is not None and caps:
        chosen = policy.choose(list(caps), list(caps.values()))
        caps = {slot: min(c, chosen) for slot, c in caps.items()}
    reqs = []
    deferred: set[int] = set()
    for s in live:
        if not s.spec:
            continue
        if caps[s.slot] == 0 and policy is not None and len(s.new_tokens) <= cfg.n_max:
            deferred.add(s.slot)  # nothing to draft: its pairs wait, the MTP head rests
            continue
        reqs.append(DraftRequest(s.slot, s.new_pos0, s.new_tokens, s.new_hidden,
                                 caps[s.slot], s.is_stop or is_stop))
    before, ms0 = drafter.mtp.n_evals, drafter.mtp.compute_ms_total
    drafts = drafter.draft(reqs, samplers.chains)
    n_mtp = drafter.mtp.n_evals - before
    stats.n_mtp_evals += n_mtp
    if policy is not None and n_mtp and any(r.n_max > 0 for r in reqs):
        policy.costs.observe("mtp", len(reqs), 1, (drafter.mtp.compute_ms_total - ms0) / n_mtp)
    none: list[int] = []
    dtoks = [drafts[s.slot].tokens if s.slot in drafts else none for s in live]

    # 2. verify: [pending, d1..dk] for every sequence, padded to a common length
    k_max = max(len(d) for d in dtoks)
    B = len(live)
    T = padded_rows(k_max + 1, B)
    tokens = np.zeros((B, T), np.int32)
    for b, s in enumerate(live):
        d = dtoks[b]
        tokens[b, 0] = s.pending
        tokens[b, 1:1 + len(d)] = d
        tokens[b, 1 + len(d):] = d[-1] if d else s.pending
    rs = engine.rs
    src = np.array([rs.row(s.slot) for s in live], np.int32)
    snapshot = engine.rollback == "snapshot"  # resolved by the engine ("auto" -> one mode)
    if snapshot:
        planes = [rs.spare_planes(s.slot)[:T] for s in live]  # plane for state after token T-1-j
        dst = np.array([[rs.row(s.slot, planes[b][j]) for b, s in enumerate(live)]
                        for j in range(T)], np.int32)
    else:
        spare = [rs.spare_planes(s.slot)[0] for s in live]
        dst = np.array([[rs.row(s.slot, spare[b]) for b, s in enumerate(live)]], np.int32)
    slots = tuple(s.slot for s in live)
    plan = samplers.plan_id(B * T, T, slots)
    prefixes = [[tuple(dtoks[b][:i]) for i in range(T)] for b in range(B)] if plan else None
    rows = (samplers.rows([(s.slot, prefixes[b][i]) for b, s in enumerate(live)
                           for i in range(T)]) if plan else None)
    ub = UBatch(tokens, np.array([s.pos for s in live], np.int64), slots,
                np.arange(B * T, dtype=np.int32), hidden=True, state_src=src, state_dst=dst,
                sampling=plan, rows=rows)
    ms0 = engine.target.compute_ms_total
    res = engine.target.run(ub, copy=False)
    if policy is not None:
        policy.costs.observe("verify", B, T, engine.target.compute_ms_total - ms0)
    stats.n_target_evals += 1
    hidden = res.hidden.reshape(B, T, -1)
    ids = res.ids.reshape(B, T) if res.ids is not None else None
    logits = res.logits.reshape(B, T, -1) if res.logits is not None else None

    # 3. accept and roll back each sequence on its own
    replay: dict[int, list[int]] = {}
    for b, s in enumerate(live):
        d = dtoks[b]
        if ids is not None:
            choose = (lambda i, b=b: int(ids[b, i]))
        else:
            choose = (lambda i, b=b, slot=s.slot, d=d: samplers.choose(
                slot, logits[b, i], prefixes[b][i] if prefixes is not None else d[:i]))
        emitted, n, stopped = accept(d, choose, s.is_stop or is_stop)  # len(d) < room
        dr = drafts.get(s.slot)
        if dr is not None and dr.first is not None and emitted:
            drafter.observe(s.slot, dr, emitted[0])  # coupled draw vs argmax, row 0
        if s.spec:
            stats.record(len(d), min(n, len(d)))
            if policy is not None and d:
                policy.record(s.slot, len(d), min(n, len(d)))
        if s.stats is not None:
            s.stats.n_target_evals += 1
            s.stats.n_mtp_evals += n_mtp if s.spec else 0
            if s.spec:
                s.stats.record(len(d), min(n, len(d)))
        pending = s.pending
        s.emit(emitted, samplers)
        engine.kv.lengths[s.slot] = s.pos + n + 1  # pending + n accepted drafts are committed
        if snapshot:
            rs.set_current(s.slot, planes[b][T - 1 - n])
        elif n == T - 1:  # everything (and no padding) accepted: the new state is complete
            rs.set_current(s.slot, spare[b])
        else:  # checkpoint: state is still "before pending"; re-evaluate what was accepted
            replay[s.slot] = [pending, *d[:n]]
        if stopped:
            s.done, s.stop_reason = True, "eos"
        else:
            s.settle(n_ctx)
        # next step's MTP pairs: d1..dn and the new pending token, with target rows h_pos..
        if s.slot in deferred:  # the waiting pairs gain this step's one
            if emitted:
                s.new_tokens = [*s.new_tokens, emitted[-1]]
                s.new_hidden = np.concatenate([s.new_hidden, hidden[b, :1]])
        elif s.spec:
            s.new_tokens = [*d[:n], emitted[-1]] if emitted else []
            s.new_hidden = hidden[b, : n + 1].copy()
            s.new_pos0 = s.pos + 1
        s.pos += n + 1
    if replay:
        for slot, toks in replay.items():
            engine.kv.lengths[slot] -= len(toks)
        engine.decode(replay, logits="last")
        stats.n_target_evals += len({len(t) for t in replay.values()})
        for s in live:
            if s.slot in replay and s.stats is not None:
                s.stats.n_target_evals += 1
    if chosen is not None:  # the policy learns what whole steps of this length cost
        policy.observe_step(len(caps), chosen + 1, (time.perf_counter() - t_step) * 1000)


class PlainStepper:
    """One token for every live sequence in one ubatch (B x 1), with the host arrays of
    each batch size kept between steps (the per-step host work is writing B ids, positions
    and state rows)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._ubs: dict[int, UBatch] = {}

    def step(self, seqs: list[SeqState], samplers, is_stop: Callable[[int], bool]) -> None:
        e = self.engine
        live = [s for s in seqs if not s.done]
        if not live:
            return
        B = len(live)
        ub = self._ubs.get(B)
        if ub is None:
            rows = np.zeros(B, np.int32)
            ub = self._ubs[B] = UBatch(np.zeros((B, 1), np.int32), np.zeros(B, np.int64), (),
                                       np.arange(B, dtype=np.int32), state_src=rows,
                                       state_dst=rows[None, :])
        tok, pos0, src = ub.tokens, ub.pos0, ub.state_src
        rs = e.rs
        for b, s in enumerate(live):
            tok[b, 0] = s.pending
            pos0[b] = s.pos
            src[b] = rs.row(s.slot)
        ub.slots = tuple(s.slot for s in live)
        ub.sampling = plan = samplers.plan_id(B, 1, ub.slots)
        ub.rows = samplers.rows([(s.slot, ()) for s in live]) if plan else None
        res = e.target.run(ub, copy=False)
        n_ctx = e.n_ctx
        for b, s in enumerate(live):
            s.pos += 1
            t = (int(res.ids[b]) if res.ids is not None
                 else samplers.choose(s.slot, res.logits[b]))
            if (s.is_stop or is_stop)(t):
                s.done, s.stop_reason = True, "eos"
                continue
            s.emit([t], samplers)
            s.settle(n_ctx)
            if s.stats is not None:
                s.stats.n_target_evals += 1


@dataclass
class PromptPart:
    """A chunk of one sequence's prompt: ``tokens`` at positions ``pos0..``; ``carry`` is
    the target hidden row of position ``pos0 - 1`` (the MTP pair of its first token; None:
    zeros, or no MTP upkeep when ``warm`` is False)."""

    slot: int
    pos0: int
    tokens: list[int]
    last: bool  # the prompt ends with this chunk: its last row's logits are wanted
    warm: bool = False  # write the chunk's pairs into the MTP cache
    carry: np.ndarray | None = None


def prompt_chunk(engine, drafter: MtpDrafter | None, parts: list[PromptPart],
                 stats: SpecStats | None = None) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Evaluate one ubatch of prompt chunks (equal lengths) with the target and bring the
    MTP caches of the ``warm`` parts up to date with the pairs (x_q, h_{q-1}).

    Returns (last-row logits of the parts whose prompt ends here, each warm part's new
    carry: the hidden row of its last position). Arrays are copies.
    """
    T = len(parts[0].tokens)
    B = len(parts)
    tokens = np.array([p.tokens for p in parts], np.int32).reshape(B, T)
    outputs = np.array([b * T + T - 1 for b, p in enumerate(parts) if p.last], np.int32)
    if outputs.size == 0:
        outputs = np.array([T - 1], np.int32)  # keep the graph well-formed
    warm = any(p.warm for p in parts)
    res = engine.target.run(UBatch(tokens, np.array([p.pos0 for p in parts], np.int64),
                                   tuple(p.slot for p in parts), outputs, warm), copy=False)
    if stats is not None:
        stats.n_target_evals += 1
    rows = {int(r): i for i, r in enumerate(outputs)}
    logits = {p.slot: res.logits[rows[b * T + T - 1]].copy() for b, p in enumerate(parts)
              if p.last}
    carry: dict[int, np.ndarray] = {}
    if warm:
        h = res.hidden.reshape(B, T, -1)
        reqs = []
        for b, p in enumerate(parts):
            if not p.warm:
                continue
            first = (p.carry if p.carry is not None
                     else np.zeros(h.shape[2], np.float32))[None]
            reqs.append(DraftRequest(p.slot, p.pos0, list(p.tokens),
                                     np.concatenate([first, h[b, :-1]]), 0))
            carry[p.slot] = h[b, -1].copy()
        assert drafter is not None
        before = drafter.mtp.n_evals
        drafter.draft(reqs)
        if stats is not None:
            stats.n_mtp_evals += drafter.mtp.n_evals - before
    return logits, carry


def prefill(engine, drafter: MtpDrafter, prompts: dict[int, list[int]], stats: SpecStats,
            samplers, is_stop: Callable[[int], bool], max_tokens: int) -> list[SeqState]:
    """Evaluate whole prompts from empty slots (chunks of ``n_ubatch``, one sequence at a
    time), sample each first token and warm the MTP cache with the prompt pairs
    (x_q, h_{q-1}) -- all but the last pair, which goes with the first draft step.
    The scheduler runs the same :func:`prompt_chunk` interleaved with decoding."""
    seqs: list[SeqState] = []
    for slot, ids in prompts.items():
        engine.clear(slot)
        carry = None
        logits = None
        for start in range(0, len(ids), engine.n_ubatch):
            part = PromptPart(slot, start, list(ids[start:start + engine.n_ubatch]),
                              start + engine.n_ubatch >= len(ids), True, carry)
            lg, c = prompt_chunk(engine, drafter, [part], stats)
            carry = c[slot]
            logits = lg.get(slot, logits)
        s = SeqState(slot, pos=len(ids), pending=-1, new_tokens=[], new_hidden=carry[None],
                     new_pos0=len(ids), budget=max_tokens)
        s.first_token(lambda slot=slot, lg=logits: samplers.choose(slot, lg), samplers,
                      is_stop, engine.n_ctx)
        s.new_tokens = [s.pending]
        seqs.append(s)
    return seqs
