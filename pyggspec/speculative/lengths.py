"""The draft-length rule: each step, the draft length that yields the most tokens per cost.

A step drafting ``k`` tokens yields ``1 + S_0 + ... + S_{k-1}`` tokens per sequence (``S_i``:
the share of verified drafts whose first ``i + 1`` tokens were accepted, a running mean per
drafter kind) and costs ``r(B, k)`` plain steps of batch size ``B`` (medians of recent step
times). The rule takes the ``k`` in ``0 .. cap`` maximising their ratio (:func:`best_length`,
pure), so at a large batch, where a verify costs several plain steps, it declines. A length
not in use is tried again after a wait that keeps the time such tries lose at
:data:`EXPLORE_SHARE`, so every median stays recent; an untried length costs a plain step
and survives fully (each is tried once, early). docs/speculation.md explains it further.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

EXPLORE_SHARE = 0.01  # time lost to trying lengths other than the best (all of them)
WINDOW = 5  # recent steps of a shape whose median is its cost
SURVIVAL_MEMORY = 64  # verified drafts a kind's survival averages over (running mean)
MAX_WAIT = 256  # steps between two tries of a length, at most


def expected_tokens(survival: Sequence[float], k: int) -> float:
    """Tokens per sequence from a step that verifies ``k`` drafts."""
    return 1.0 + sum(survival[:k])


def best_length(survival: Sequence[float], ratio: Sequence[float]) -> int:
    """The ``k`` maximising ``expected_tokens / ratio[k]`` (``ratio[0]`` is 1; ties: the
    shorter)."""
    values = [expected_tokens(survival, k) / ratio[k] for k in range(len(ratio))]
    return max(range(len(values)), key=lambda k: (values[k], -k))


def try_wait(loss: float, ratio_k: float, ratio_best: float, others: int) -> float:
    """Steps until a length that yields ``loss`` (a fraction) less than the best is tried
    again, so that the tries of all ``others`` lengths cost :data:`EXPLORE_SHARE` of the
    time: a try costs ``loss * ratio_k`` plain steps, the steps between cost ``ratio_best``."""
    return min(MAX_WAIT, loss * ratio_k * others / (EXPLORE_SHARE * ratio_best))


class DraftLengths:
    """The rule's measurements and its choice per step (owned by the worker)."""

    def __init__(self, cap: int, kinds: Sequence[str]) -> None:
        self.cap = cap
        self.kinds = tuple(kinds)
        self.survival = {name: [1.0] * cap for name in self.kinds}
        self._seen = {name: [1] * cap for name in self.kinds}  # the prior counts as one
        self._ms: dict[tuple, deque[float]] = {}  # (B, kind, k) -> recent step ms; k 0: plain
        self._cost: dict[tuple, float] = {}  # their medians
        self._tried: dict[tuple, int] = {}  # (B, kind, k) -> step count at its last step
        self._step = 0
        self._last_try = -2
        self.chosen = {name: [0] * (cap + 1) for name in self.kinds}

    def ratios(self, B: int, kind: str) -> list[float]:
        """r(B, k) for k = 0..cap; a length not measured yet costs a plain step."""
        plain = self._cost.get((B, "", 0))
        return [1.0] + [self._cost[(B, kind, k)] / plain if plain and (B, kind, k) in self._cost
                        else 1.0 for k in range(1, self.cap + 1)]

    def lengths(self, B: int) -> dict[str, int]:
        """Drafts per sequence each kind may make this step at batch size ``B``."""
        self._step += 1
        out = {}
        for name in self.kinds:
            r, s = self.ratios(B, name), self.survival[name]
            best = best_length(s, r)
            v = [expected_tokens(s, k) / r[k] for k in range(self.cap + 1)]
            k = best
            for j in sorted(range(self.cap + 1), key=lambda j: -v[j]):  # a try that is due
                if j == best or self._key(B, name, best) not in self._cost:
                    continue  # (the best is measured first)
                key = self._key(B, name, j)
                if key in self._cost and self._step - self._last_try < 2:
                    continue  # (measured lengths are not tried on consecutive steps)
                if key not in self._cost or self._step - self._tried[key] >= try_wait(
                        1 - v[j] / v[best], r[j], r[best], self.cap):
                    k, self._last_try = j, self._step
                    break
            self.chosen[name][k] += 1
            out[name] = k
        return out

    @staticmethod
    def _key(B: int, kind: str, k: int) -> tuple:
        return (B, "", 0) if k == 0 else (B, kind, k)

    def observe_step(self, B: int, kind: str, k: int, ms: float) -> None:
        """A whole step of ``B`` sequences whose longest draft (by ``kind``) was ``k``."""
        key = self._key(B, kind, k)
        q = self._ms.setdefault(key, deque(maxlen=WINDOW))
        q.append(ms)
        self._cost[key] = statistics.median(q)
        self._tried[key] = self._step

    def observe_draft(self, kind: str, k: int, n: int) -> None:
        """A sequence verified ``k`` drafts of ``kind`` and accepted ``n`` of them."""
        s, seen = self.survival[kind], self._seen[kind]
        for i in range(min(k, self.cap)):
            seen[i] = min(seen[i] + 1, SURVIVAL_MEMORY)
            s[i] += ((n > i) - s[i]) / seen[i]

    def to_dict(self) -> dict:
        """Survival, step costs in plain steps, and the lengths chosen, per kind."""
        out: dict = {}
        for name in self.kinds:
            # (batch sizes whose plain step is measured: a ratio needs both sides)
            batches = sorted({B for B, kd, _ in self._cost
                              if kd == name and (B, "", 0) in self._cost})
            out[name] = {"survival": [round(x, 4) for x in self.survival[name]],
                         "ratios": {f"{B}x{k}": round(r, 3) for B in batches
                                    for k, r in enumerate(self.ratios(B, name))
                                    if (B, name, k) in self._cost},
                         "lengths": list(self.chosen[name])}
        return out
