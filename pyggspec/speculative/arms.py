"""Which way the draft budget drafts at a batch size, chosen by what each way realized.

The budget's gate (:class:`~pyggspec.speculative.adaptive.DraftBudget`) prices every
draft from the head's confidence and measured step costs: a model, right on average and
wrong at the margins. Where a few percent decide, its errors went one way per host: on
the AVX2 bench host (AMD EPYC, 2 cores) a one-draft step costs 1.7-1.9 plain steps and
yields ~1.7 tokens, so the gate's one- and two-draft steps lost to plain decoding while
drafting to the cap gained 20% (Q8_0 ~0.70 ``-np 1``: the default 0.965 of fixed n_max 3
in one process, and in another it declined 125 of 129 steps -- 0.78 of n_max 3); on the
AVX-512 host at Q8_0 ~0.70 ``-np 4`` it drafted where plain decoding was as fast.

So the ways are kept apart and the one that realizes the most tokens per millisecond is
used: ``gate`` (the budget's per-draft gate, declining included), ``full`` (every draft up
to the cap verified: fixed n_max's way), ``short`` (every draft up to one below the cap:
at Q8_0 ~0.70 ``-np 4`` fixed n_max 2 beat 3 by 5.6% and the gate by 2.7%, row 78) and
``plain`` (no drafting; its rate is plain decoding's price, known without trying it).
Each drafting way's rate is the tokens its recent steps yielded over what those steps
cost (the budget's prices of their shapes, measured side by side with plain steps, so
the VM's drift does not favour the way used in a fast minute).

A drafting way not in use is tried in a run of :data:`TRY_STEPS` steps, and the first
step of a run (of any way after another) is not counted. Why: a step's yield depends on
where in the text it starts, and each way starts its steps at its own points -- one
drafting to the cap starts right after a rejected draft or a run of accepted ones, one
that declines steps through the text a token at a time. Tried a step at a time at the
gate's points, the cap's way yielded 2.2-2.3 tokens a step at Q8_0 ~0.70 ``-np 1`` where
fixed n_max 3 yields 2.9 (and 2.2-2.55 against 2.8 at Q4_K_M): priced ~20% under what it
realizes, it lost to the gate where fixed n_max 3 was 8% faster (row 78). After its first
step a way runs from its own points.

A way not in use is tried again after as many steps as keep what its tries lose below
its part of :data:`EXPLORE_SHARE` of the time (the ways not in use share it) -- at least
:data:`EXPLORE` steps a try step, at most :data:`EXPLORE_CLOSE` while the two are within
their noise of each other (x 4: the loss is priced at the way's rate one standard error
up, so a way within noise of the one in use costs nothing to try and is tried often),
:data:`EXPLORE_MAX` once the one in use leads clearly. Tried every 6 or 32 steps whatever
they cost, the ways cost 1.5% more than the gate alone at Q4_K_M ~0.70 ``-np 4`` on the
AVX2 host, where plain decoding was best and a step drafting to the cap cost 2.5 plain
steps for 2.2 tokens per sequence; with waits capped at 32 while within noise (the cap's
steps are noisy: 4 to 16 tokens), 3.6%.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW = 48  # recent counted steps of a way whose yield prices it
MIN_STEPS = 3  # counted steps a drafting way needs before it is compared
TRY_STEPS = 4  # steps in a row a way not in use is tried for (the first not counted)
EXPLORE = 6  # fewest steps between two tries of a drafting way not in use, a try step
EXPLORE_CLOSE = 32  # most, while the ways are within CLEAR_SE standard errors
EXPLORE_MAX = 256  # most, once the way in use leads clearly
EXPLORE_SHARE = 0.003  # of the time the tries of ways not in use may lose
CLEAR_SE = 2.0
WAYS = ("gate", "full", "short")  # the drafting ways (``short`` where the cap is above 1)


@dataclass
class _Way:
    """One drafting way's recent steps: tokens yielded and their priced cost (ms)."""

    tokens: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    cost: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __len__(self) -> int:
        return len(self.tokens)

    def step_cost(self) -> float:
        """Mean priced cost (ms) of its recent steps."""
        return sum(self.cost) / len(self.cost) if self.cost else 0.0

    def rate(self) -> float:
        """Tokens per ms over the window (a ratio of sums: a long step weighs as long)."""
        c = sum(self.cost)
        return sum(self.tokens) / c if c > 0 else 0.0

    def se(self) -> float:
        """Standard error of :meth:`rate`, from the spread of the steps' own rates."""
        n = len(self.tokens)
        if n < 2:
            return math.inf
        r = [t / c for t, c in zip(self.tokens, self.cost) if c > 0]
        m = sum(r) / len(r)
        var = sum((x - m) ** 2 for x in r) / (len(r) - 1)
        return math.sqrt(var / len(r))


def _wait(tried: tuple[float, float, float], use_rate: float, use_cost: float, clear: bool,
          share: float) -> float:
    """Steps between two tries of the drafting way whose (rate, standard error, step cost)
    are ``tried`` against the way in use (``use_rate`` tokens per ms, ``use_cost`` ms a
    step): the time a try loses (its cost, at the share of the rate it falls short by --
    optimistically: its rate one standard error up), spread over the steps between tries
    so that it is ``share`` of the time; none lost when that rate reaches the one in use:
    tried soon."""
    rate, se, step_cost = tried
    hope = rate + (se if math.isfinite(se) else 0.0)
    loss = step_cost * max(0.0, 1.0 - hope / use_rate) if use_rate else 0.0
    wait = loss / (share * use_cost) if use_cost > 0 else EXPLORE
    return min(max(wait, EXPLORE), EXPLORE_MAX if clear else EXPLORE_CLOSE * 4)


class DraftWays:
    """Per batch size: the drafting way in use and what each realized.

    ``ways``: the drafting ways to choose among (:data:`WAYS` or a part of it)."""

    def __init__(self, ways: tuple[str, ...] = WAYS) -> None:
        self.names = tuple(ways)
        self._ways: dict[int, dict[str, _Way]] = {}
        self._since: dict[tuple[int, str], int] = {}  # steps since a way not in use was tried
        self._run: dict[int, tuple[str, int]] = {}  # per batch size: a try's way, steps left
        self._last: dict[int, str | None] = {}  # per batch size: the way of the last step

    def choose(self, B: int, plain_rate: float, plain_cost: float = 0.0) -> str:
        """The way of the next step at batch size ``B``: one of the drafting ways or
        "plain" (``plain_rate``: plain decoding's tokens per ms there; ``plain_cost``: the
        ms of a plain step, which a try of a losing way is weighed against)."""
        run = self._run.get(B)
        if run is not None:  # a try goes on
            way, left = run
            if left > 1:
                self._run[B] = (way, left - 1)
            else:
                del self._run[B]
            return way
        ways = self._ways.setdefault(B, {w: _Way() for w in self.names})
        unmeasured = [w for w in self.names if len(ways[w]) < MIN_STEPS]
        if unmeasured:  # the drafting ways measured first, a try each in turn
            return self._try(B, min(unmeasured, key=lambda w: len(ways[w])))
        # each way's (rate, standard error, step cost): one pass over its window a step
        st = {w: (ways[w].rate(), ways[w].se(), ways[w].step_cost()) for w in self.names}
        rates = {w: v[0] for w, v in st.items()}
        best = max(rates, key=rates.get)
        if rates[best] > plain_rate:
            use, use_rate, use_cost = best, rates[best], st[best][2]
            # clear: ahead of the other drafting way beyond their noise
            tries = [(w, rates[best] - rates[w] > CLEAR_SE * math.hypot(st[best][1], st[w][1]))
                     for w in self.names if w != best]
        else:
            use = "plain"
            use_rate, use_cost = plain_rate, plain_cost or st[best][2]
            # each drafting way tried at its own wait: in turn at the closer one's wait,
            # the cap's way (4 rows a sequence, clearly behind) rode along with the gate
            # (its rate counts its declined steps, so within noise of plain): tried every
            # ~21 steps, ~2.5% of the time at Q4_K_M ~0.70 -np 4 (row 79)
            tries = [(w, plain_rate - rates[w] > CLEAR_SE * st[w][1]) for w in self.names]
        due, share = None, EXPLORE_SHARE / len(tries)  # the ways' tries share the budget
        for w, clear in tries:
            since = self._since.get((B, w), 0) + 1
            wait = TRY_STEPS * _wait(st[w], use_rate, use_cost, clear, share)
            if due is None and since >= wait:
                due, since = w, 0  # (another way due waits for the next step)
            self._since[(B, w)] = since
        return self._try(B, due) if due else use

    def _try(self, B: int, way: str) -> str:
        """The first of :data:`TRY_STEPS` steps of ``way`` in a row."""
        if TRY_STEPS > 1:
            self._run[B] = (way, TRY_STEPS - 1)
        return way

    def observe(self, B: int, way: str | None, tokens: int, cost: float) -> None:
        """A step of ``way`` at batch size ``B`` yielded ``tokens`` for a priced ``cost``
        (every step, so a way's first step after another's is known: "plain" or None for
        one that drafted nothing). That first step is not counted: it starts where the
        other way's steps left the text, not where its own would."""
        last, self._last[B] = self._last.get(B), way
        if way not in self.names or cost <= 0 or way != last:
            return
        w = self._ways.setdefault(B, {v: _Way() for v in self.names})[way]
        w.tokens.append(tokens)
        w.cost.append(cost)

    def to_dict(self) -> dict:
        return {str(B): {w: {"steps": len(v), "tokens_per_ms": round(v.rate(), 5),
                             "tokens_per_step": round(sum(v.tokens) / len(v), 3) if len(v) else 0.0}
                         for w, v in ways.items()} for B, ways in sorted(self._ways.items())}
