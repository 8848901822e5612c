"""The MTP drafter: keeps each sequence's MTP cache in step with the target and drafts.

For every committed position q the head's KV cache holds the pair (x_q, h_{q-1}), with
h the target's post-norm hidden row (zeros before the first token). After a verify step
the new pairs -- the accepted drafts and the new pending token, each with the target's
hidden row of the position before -- go through the head in **one** batch whose last row
yields the first draft; further drafts are one row per sequence per step, paired with the
head's own hidden row (DESIGN §3, §8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyggspec.models.mtp import Mtp, MtpBatch


@dataclass
class DraftRequest:
    """New pairs for one sequence: ``tokens[k]`` at ``pos0 + k`` paired with ``hidden[k]``.

    The last token is the pending (sampled, not yet verified) token; drafting starts there.
    """

    slot: int
    pos0: int
    tokens: list[int]
    hidden: np.ndarray  # float32 [len(tokens), n_embd]
    n_max: int  # drafts wanted (0: only bring the cache up to date)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


class MtpDrafter:
    """Drafts with the MTP head, greedily (argmax; in the graph where supported)."""

    def __init__(self, mtp: Mtp, n_embd: int, n_min: int = 0, p_min: float = 0.0) -> None:
        self.mtp = mtp
        self.n_embd = n_embd
        self.n_min = n_min
        self.p_min = p_min

    def draft(self, reqs: list[DraftRequest]) -> dict[int, Draft]:
        """Write the new pairs of every request into the MTP cache and draft after them."""
        out = {r.slot: Draft() for r in reqs}
        if not reqs:
            return out
        # 1. catch-up + first draft, one batch; shorter requests padded at their end
        from pyggspec.speculative.loop import padded_rows

        B = len(reqs)
        T = max(len(r.tokens) for r in reqs)
        if T < 64:  # prompt warm-up chunks are large: no need to pad those
            T = padded_rows(T, B)
        tokens = np.zeros((B, T), np.int32)
        hidden = np.zeros((B, T, self.n_embd), np.float32)
        for b, r in enumerate(reqs):
            n = len(r.tokens)
            tokens[b, :n] = r.tokens
            hidden[b, :n] = r.hidden
            if n < T:  # padding rows sit after the real ones; the mask keeps them unseen
                tokens[b, n:] = r.tokens[-1]
        if any(r.n_max > 0 for r in reqs):
            outputs = np.array([b * T + len(r.tokens) - 1 for b, r in enumerate(reqs)],
                               np.int32)
        else:  # only bringing caches up to date: a cache-only graph (no FFN, no LM head)
            outputs = np.zeros(0, np.int32)
        pos0 = np.array([r.pos0 for r in reqs], np.int64)
        slots = tuple(r.slot for r in reqs)
        res = self.mtp.run(MtpBatch(tokens, hidden, pos0, slots, outputs))
        ends = {r.slot: r.pos0 + len(r.tokens) for r in reqs}
        for r in reqs:
            self.mtp.kv.lengths[r.slot] = ends[r.slot]

        # 2. autoregressive drafting: one row per still-drafting sequence
        live = [(b, b) for b, r in enumerate(reqs) if r.n_max > 0]  # (request, result row)
        ids, probs, h = res.ids, res.probs, res.hidden
        step = 0
        while live:
            nxt = []
            for b, row in live:
                r = reqs[b]
                d = out[r.slot]
                if probs[row] < self.p_min:
                    continue
                d.tokens.append(int(ids[row]))
                d.probs.append(float(probs[row]))
                if len(d.tokens) < r.n_max:
                    nxt.append((b, row))
            if not nxt:
                break
            step += 1
            tok = np.array([[out[reqs[b].slot].tokens[-1]] for b, _ in nxt], np.int32)
            hid = h[[row for _, row in nxt]][:, None, :]
            p0 = np.array([ends[reqs[b].slot] + step - 1 for b, _ in nxt], np.int64)
            res = self.mtp.run(MtpBatch(tok, hid, p0, tuple(reqs[b].slot for b, _ in nxt),
                                        np.arange(len(nxt), dtype=np.int32)))
            ids, probs, h = res.ids, res.probs, res.hidden
            live = [(b, i) for i, (b, _) in enumerate(nxt)]
        # draft-time entries past the committed pairs are not committed
        for r in reqs:
            self.mtp.kv.lengths[r.slot] = ends[r.slot]
            d = out[r.slot]
            if len(d.tokens) < self.n_min:
                d.tokens.clear()
                d.probs.clear()
        return out
