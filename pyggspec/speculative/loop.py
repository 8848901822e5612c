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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pyggspec.models.qwen35 import UBatch
from pyggspec.speculative.draft_mtp import DraftRequest, MtpDrafter


@dataclass
class SpecConfig:
    n_max: int = 3  # --spec-draft-n-max
    n_min: int = 0  # --spec-draft-n-min
    p_min: float = 0.0  # --spec-draft-p-min
    rollback: str = "auto"  # "auto" | "snapshot" | "checkpoint"
    draft_vocab: int = 0  # --spec-draft-vocab: draft over the first N token ids (0: all)


@dataclass
class SpecStats:
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0  # verify steps
    n_target_evals: int = 0  # target graph evaluations (verify + re-evaluation + prompt)
    n_mtp_evals: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)

    def record(self, k: int, n: int) -> None:
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(k):
            self.drafted_at[i] += 1
            if i < n:
                self.accepted_at[i] += 1
        self.n_drafted += k
        self.n_accepted += n
        self.n_steps += 1

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
                "n_target_evals": self.n_target_evals, "n_mtp_evals": self.n_mtp_evals}


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
    (only candidates or ids come back), else on the host from the logits.
    """
    live = [s for s in seqs if not s.done]
    if not live:
        return
    n_ctx = engine.n_ctx
    # 1. draft: new pairs into the MTP cache, then up to n_max drafts per sequence
    reqs = []
    for s in live:
        # emitted tokens = accepted drafts + 1, so drafts stop one short of the room
        k = max(0, min(cfg.n_max, s.room(n_ctx) - 1))
        reqs.append(DraftRequest(s.slot, s.new_pos0, s.new_tokens, s.new_hidden, k))
    before = drafter.mtp.n_evals
    drafts = drafter.draft(reqs)
    stats.n_mtp_evals += drafter.mtp.n_evals - before

    # 2. verify: [pending, d1..dk] for every sequence, padded to a common length
    k_max = max(len(drafts[s.slot].tokens) for s in live)
    B = len(live)
    T = padded_rows(k_max + 1, B)
    tokens = np.zeros((B, T), np.int32)
    for b, s in enumerate(live):
        d = drafts[s.slot].tokens
        row = [s.pending, *d]
        tokens[b, : len(row)] = row
        tokens[b, len(row):] = row[-1]
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
    prefixes = [[tuple(tokens[b, 1:1 + i]) for i in range(T)] for b in range(B)]
    plan = samplers.plan_id(B * T, T)
    rows = (samplers.rows([(s.slot, prefixes[b][i]) for b, s in enumerate(live)
                           for i in range(T)]) if plan else None)
    ub = UBatch(tokens, np.array([s.pos for s in live], np.int64), tuple(s.slot for s in live),
                np.arange(B * T, dtype=np.int32), hidden=True, state_src=src, state_dst=dst,
                sampling=plan, rows=rows)
    res = engine.target.run(ub, copy=False)
    stats.n_target_evals += 1
    hidden = res.hidden.reshape(B, T, -1)
    ids = res.ids.reshape(B, T) if res.ids is not None else None
    logits = res.logits.reshape(B, T, -1) if res.logits is not None else None

    # 3. accept and roll back each sequence on its own
    replay: dict[int, list[int]] = {}
    for b, s in enumerate(live):
        d = drafts[s.slot].tokens
        if ids is not None:
            choose = (lambda i, b=b: int(ids[b, i]))
        else:
            choose = (lambda i, b=b, slot=s.slot: samplers.choose(slot, logits[b, i],
                                                                  prefixes[b][i]))
        emitted, n, stopped = accept(d, choose, is_stop)  # len(d) < room: all fit
        stats.record(len(d), min(n, len(d)))
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
        s.new_tokens = [*d[:n], emitted[-1]] if emitted else []
        s.new_hidden = hidden[b, : n + 1].copy()
        s.new_pos0 = s.pos + 1
        s.pos += n + 1
    if replay:
        for slot, toks in replay.items():
            engine.kv.lengths[slot] -= len(toks)
        engine.decode(replay, logits="last")
        stats.n_target_evals += len({len(t) for t in replay.values()})


def prefill(engine, drafter: MtpDrafter, prompts: dict[int, list[int]], stats: SpecStats,
            samplers, is_stop: Callable[[int], bool], max_tokens: int) -> list[SeqState]:
    """Evaluate the prompts with the target (hidden rows kept), sample each first token and
    warm the MTP cache with the prompt pairs (x_q, h_{q-1}) -- all but the last pair,
    which goes with the first draft step."""
    for slot in prompts:
        engine.clear(slot)
    res = engine.decode(prompts, logits="last", hidden=True)
    stats.n_target_evals += 1
    seqs: list[SeqState] = []
    warm: list[DraftRequest] = []
    for slot, ids in prompts.items():
        P = len(ids)
        h = res[slot].hidden  # [P, n_embd]: h_0 .. h_{P-1}
        paired = np.concatenate([np.zeros((1, h.shape[1]), np.float32), h[:-1]])  # h_{q-1}
        s = SeqState(slot, pos=P, pending=-1, new_tokens=[], new_hidden=h[-1:].copy(),
                     new_pos0=P, budget=max_tokens)
        s.first_token(lambda slot=slot: samplers.choose(slot, res[slot].logits[-1]), samplers,
                      is_stop, engine.n_ctx)
        s.new_tokens = [s.pending]
        seqs.append(s)
        if not s.done:
            warm.append(DraftRequest(slot, 0, list(ids), paired, 0))
    # warm the MTP cache in chunks of at most n_ubatch rows per sequence
    chunk = engine.n_ubatch
    longest = max((len(r.tokens) for r in warm), default=0)
    before = drafter.mtp.n_evals
    for start in range(0, longest, chunk):
        part = [DraftRequest(r.slot, start, r.tokens[start:start + chunk],
                             r.hidden[start:start + chunk], 0)
                for r in warm if start < len(r.tokens)]
        drafter.draft(part)
    stats.n_mtp_evals += drafter.mtp.n_evals - before
    return seqs
