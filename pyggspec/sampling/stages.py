"""Each sampler as a host (numpy) function and, where exact, a graph builder.

Host stages work on :class:`Cand` (candidate ids + float32 logits). Device builders append
ggml ops to a full-width ``[n_vocab, n_rows]`` logits tensor; a filtered token has logit
``-inf``. Every device op is chosen so that the host computes the same float32 values with
the same IEEE operations (see the package docstring for the argument).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pyggspec.ggml.context import Context
from pyggspec.ggml.tensor import Tensor
from pyggspec.sampling.noise import G_MAX, G_MIN, build_noise, noise_host
from pyggspec.sampling.params import UNIMPLEMENTED, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.sampling.grammar import GrammarMatcher


# --- counter-based noise (pyggspec/sampling/noise.py) -----------------------------------------
def gumbel_noise(key: int, counter: int, ids: np.ndarray | None, n_vocab: int) -> np.ndarray:
    """Gumbel(0, 1) noise for token ``ids`` (None: all ``n_vocab``) of sampled token number
    ``counter``: a pure function of (key, counter, id), so any subset of ids gets exactly
    the values the full vocabulary would, and a token's randomness does not depend on which
    path (graph or host) or which candidates survived. float32, bit-identical to the
    graph's (:func:`pyggspec.sampling.noise.build_noise`)."""
    return noise_host(key, counter, ids, n_vocab)


# --- host representation ------------------------------------------------------------------
@dataclass
class Cand:
    """Candidates: ``ids`` int32 (None = the whole vocabulary, id == index), float32 logits."""

    ids: np.ndarray | None
    logits: np.ndarray

    def id_array(self) -> np.ndarray:
        return np.arange(len(self.logits), dtype=np.int32) if self.ids is None else self.ids

    def take(self, pos: np.ndarray) -> Cand:
        return Cand(self.id_array()[pos], self.logits[pos])

    def finite(self) -> Cand:
        """Drop -inf candidates (probability 0, never chosen): canonical for sums."""
        keep = self.logits > -np.inf
        return self if keep.all() and self.ids is not None else self.take(np.flatnonzero(keep))

    def canonical(self) -> Cand:
        """Finite candidates sorted by (logit desc, id asc): the order every host sum uses,
        so a softmax or cumulative sum never depends on where the candidates came from."""
        c = self.finite()
        order = np.lexsort((c.ids, -c.logits))
        return Cand(c.ids[order], c.logits[order])


@dataclass(frozen=True)
class RowCtx:
    """What one output row needs from its sequence: penalty window and noise counter."""

    history: tuple[int, ...]  # the last repeat_last_n tokens before this row's token
    key: int  # the chain's noise key
    counter: int  # number of tokens this chain sampled before this row's token
    n_vocab: int
    grammar: GrammarMatcher | None = None  # the chain's grammar state (None: no grammar)
    prefix: tuple[int, ...] = ()  # the drafts between the chain's state and this row


def argmax_lowest(c: Cand) -> int:
    """Greedy choice with the tie rule: lowest id among the maxima; 0 if nothing is finite."""
    if len(c.logits) == 0:
        return 0
    if c.ids is None:  # ids are positions: numpy's argmax takes the first maximum (0 if
        return int(c.logits.argmax())  # all are -inf), the lowest id, without an id array
    m = c.logits.max()
    if m == -np.inf:
        return 0
    ids = c.id_array()
    return int(ids[c.logits == m].min())


TOPK_SAMPLE = 4096  # logits sampled to bound the k-th largest before a full partition


def topk_exact(c: Cand, k: int) -> Cand:
    """The k largest logits; ties at the boundary go to the lowest ids.

    On a big row the k-th largest of a strided sample bounds the row's from below, so the
    row is cut to what lies above the bound before partitioning: numpy's partition takes
    ~26 ms on a 248k row that is mostly one value with a few others (a nearly flat head, the
    benchmark models' off-cycle logits), 1.4 ms on a random one, and the cut makes both
    ~0.2 ms. Same candidates, same order as partitioning the whole row."""
    n = len(c.logits)
    if k >= n:
        return c if c.ids is not None else c.take(np.arange(n))
    if n >= 8 * TOPK_SAMPLE and 4 * k <= TOPK_SAMPLE:
        sample = c.logits[:: n // TOPK_SAMPLE]
        bound = np.partition(sample, len(sample) - k)[len(sample) - k]  # <= the k-th largest
        above = np.flatnonzero(c.logits > bound)
        if len(above) >= k:  # the k largest are all above it: the same rule on fewer
            return topk_exact(c.take(above), k)
        # fewer than k above: the k-th largest is the bound itself, ties to the lowest ids
        eq = _lowest_ids(c, np.flatnonzero(c.logits == bound), k - len(above))
        return c.take(np.concatenate([above, eq]))
    t = np.partition(c.logits, n - k)[n - k]
    gt = np.flatnonzero(c.logits > t)
    eq = _lowest_ids(c, np.flatnonzero(c.logits == t), k - len(gt))
    return c.take(np.concatenate([gt, eq]))


def _lowest_ids(c: Cand, pos: np.ndarray, need: int) -> np.ndarray:
    """The ``need`` positions of ``pos`` with the lowest ids, by ascending id (ids are
    distinct, so selecting them first is exact and avoids sorting a big tie)."""
    if c.ids is None:
        return pos[:need]  # positions are ids, already ascending
    ids = c.ids[pos]
    if len(pos) > need > 0:
        sel = np.argpartition(ids, need - 1)[:need]
        return pos[sel[np.argsort(ids[sel])]]
    return pos[np.argsort(ids, kind="stable")][:need]


# --- stages -------------------------------------------------------------------------------
class Stage:
    """One sampler. ``device`` is False where no exact graph version exists."""

    name: str = ""
    device: bool = False
    terminal: bool = False  # chooses the token

    def host(self, c: Cand, row: RowCtx) -> Cand | int:  # pragma: no cover - abstract
        raise NotImplementedError

    def signature(self) -> tuple:
        """What fixes the graph shape (values that only feed inputs are left out)."""
        return (self.name,)


@dataclass(frozen=True)
class GrammarMask(Stage):
    """A grammar's constraint (:mod:`~pyggspec.sampling.grammar`): forbidden tokens get
    -inf. The first stage, so every later one sees only what the grammar allows. In the
    graph: + a 0 / -inf bias row per output row (exact)."""

    name = "grammar"
    device = True

    def host(self, c: Cand, row: RowCtx) -> Cand:
        # + the bias row, as the graph adds it (a select on a 248k row is ~7x slower)
        if row.grammar is None or row.grammar.free(row.prefix):  # a lazy grammar's free row
            return c
        bias = row.grammar.bias(row.prefix)
        return Cand(c.ids, c.logits + (bias if c.ids is None else bias[c.ids]))


@dataclass(frozen=True)
class LogitBias(Stage):
    entries: tuple[tuple[int, float], ...]  # unique ids, biases summed in float32
    name = "logit_bias"
    device = True

    def host(self, c: Cand, row: RowCtx) -> Cand:
        l = c.logits.copy()
        if c.ids is None:
            idx = np.array([t for t, _ in self.entries], dtype=np.int64)
            l[idx] = l[idx] + np.array([b for _, b in self.entries], dtype=np.float32)
        else:
            for tok, b in self.entries:
                m = c.ids == tok
                l[m] = l[m] + np.float32(b)
        return Cand(c.ids, l)

    def signature(self) -> tuple:
        return (self.name, len(self.entries))


def penalty_terms(history: Sequence[int], freq: float,
                  present: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, subtracted amounts) for the tokens in the window; float32 like the graph."""
    cnt = Counter(history)
    toks = np.fromiter(cnt.keys(), dtype=np.int32, count=len(cnt))
    counts = np.fromiter(cnt.values(), dtype=np.float32, count=len(cnt))
    a = counts * np.float32(freq) + np.float32(present)
    return toks, a.astype(np.float32)


@dataclass(frozen=True)
class Penalties(Stage):
    last_n: int
    repeat: float
    freq: float
    present: float
    name = "penalties"
    device = True

    @property
    def f_pos(self) -> np.float32:
        # multiply by the float32 reciprocal (llama.cpp divides): one rounding on both paths
        return np.float32(1.0 / self.repeat)

    @property
    def f_neg(self) -> np.float32:
        return np.float32(self.repeat)

    def apply(self, l: np.ndarray) -> np.ndarray:
        """l * (f_pos if l > 0 else f_neg if l < 0 else 0), exactly as the graph selects it."""
        f = np.where(l > 0, self.f_pos, np.where(l < 0, self.f_neg, np.float32(0)))
        return (l * f.astype(np.float32)).astype(np.float32)

    def host(self, c: Cand, row: RowCtx) -> Cand:
        hist = row.history[-self.last_n:] if self.last_n > 0 else ()
        if not hist:
            return c
        toks, a = penalty_terms(hist, self.freq, self.present)
        l = c.logits.copy()
        if c.ids is None:
            pos = toks.astype(np.int64)
            l[pos] = self.apply(l[pos]) - a
        else:
            where = {int(t): i for i, t in enumerate(c.ids)}
            for t, ai in zip(toks.tolist(), a):
                i = where.get(t)
                if i is not None:
                    l[i] = self.apply(l[i:i + 1])[0] - ai
        return Cand(c.ids, l)

    def signature(self) -> tuple:
        return (self.name, self.last_n)


@dataclass(frozen=True)
class Temperature(Stage):
    temp: float
    name = "temperature"
    device = True

    @property
    def inv(self) -> np.float32:
        return np.float32(1.0 / self.temp)

    def host(self, c: Cand, row: RowCtx) -> Cand:
        return Cand(c.ids, c.logits * self.inv)


@dataclass(frozen=True)
class MinP(Stage):
    """Keep logits >= max + log(p). The threshold never exceeds the maximum (log p is
    capped at 0, as llama.cpp always keeps the top candidate), so the maximum survives on
    both paths: float32 max + log_p rounds to at most max, and max - thr >= 0."""

    p: float
    name = "min_p"
    device = True

    @property
    def log_p(self) -> np.float32:
        return np.float32(min(float(np.log(self.p)), 0.0))

    def keep_mask(self, l: np.ndarray) -> np.ndarray:
        """Keep l >= max + log(p), written as the graph computes it: drop if -(l - thr) > 0."""
        if len(l) == 0:
            return np.zeros(0, dtype=bool)
        thr = np.float32(l.max()) + self.log_p
        return ~(-(l - thr) > 0)

    def host(self, c: Cand, row: RowCtx) -> Cand:
        return c.take(np.flatnonzero(self.keep_mask(c.logits)))


@dataclass(frozen=True)
class TopK(Stage):
    k: int
    name = "top_k"
    device = True

    def host(self, c: Cand, row: RowCtx) -> Cand:
        return topk_exact(c, self.k)

    def signature(self) -> tuple:
        return (self.name, self.k)


def _probs64(c: Cand) -> np.ndarray:
    """Softmax in float64 over canonically ordered, non-empty candidates."""
    x = c.logits.astype(np.float64)
    w = np.exp(x - x[0])
    return w / w.sum()


@dataclass(frozen=True)
class TopP(Stage):
    """Nucleus filter. Host only: it thresholds a cumulative sum of exponentials, and ggml's
    expf/summation order differ from numpy's in the last bits, which can move the cut by one
    token. It runs on the canonically ordered candidates in float64."""

    p: float
    name = "top_p"

    def host(self, c: Cand, row: RowCtx) -> Cand:
        f = c.canonical()
        if len(f.logits) == 0:  # nothing has probability > 0: nothing to filter, keep all
            return c
        c = f
        cum = np.cumsum(_probs64(c))
        n = min(int(np.searchsorted(cum, self.p, side="left")) + 1, len(cum))
        return Cand(c.ids[:n], c.logits[:n])


@dataclass(frozen=True)
class TypicalP(Stage):
    """Locally typical filter. Host only for the same reason as top_p (entropy + cumsum)."""

    p: float
    name = "typ_p"

    def host(self, c: Cand, row: RowCtx) -> Cand:
        f = c.canonical()
        if len(f.logits) == 0:  # nothing has probability > 0: nothing to filter, keep all
            return c
        c = f
        p = _probs64(c)
        with np.errstate(divide="ignore", invalid="ignore"):
            logp = np.log(p)
            ent = -np.sum(np.where(p > 0, p * logp, 0.0))
            shifted = np.abs(-logp - ent)
        order = np.argsort(shifted, kind="stable")
        cum = np.cumsum(p[order])
        over = np.flatnonzero(cum > self.p)
        n = int(over[0]) + 1 if len(over) else len(order)
        keep = order[:n]
        return Cand(c.ids[keep], c.logits[keep])


@dataclass(frozen=True)
class Greedy(Stage):
    name = "greedy"
    device = True
    terminal = True

    def host(self, c: Cand, row: RowCtx) -> int:
        return argmax_lowest(c)


@dataclass(frozen=True)
class Dist(Stage):
    """Sample from softmax(logits) by Gumbel-max: argmax(l + g), g from :func:`gumbel_noise`."""

    name = "dist"
    device = True
    terminal = True

    def host(self, c: Cand, row: RowCtx) -> int:
        # the noise lies in [G_MIN, G_MAX]: a logit more than G_MAX - G_MIN below the
        # largest can never win, so only the others need their noise (same token)
        if len(c.logits) == 0:
            return 0
        m = c.logits.max()
        if m == -np.inf:
            return 0
        keep = np.flatnonzero(c.logits >= m - np.float32(G_MAX - G_MIN))
        c = c.take(keep)
        g = gumbel_noise(row.key, row.counter, c.ids, row.n_vocab)
        return argmax_lowest(Cand(c.ids, c.logits + g))


def resolve_stages(params: SamplingParams, n_vocab: int) -> tuple[Stage, ...]:
    """The effective chain: the grammar's mask, logit bias (as llama.cpp), then ``params.samplers`` in
    order without disabled members, then dist. Temperature <= 0 becomes greedy: the
    filters that always keep the maximum (top_k, top_p, min_p) cannot change an argmax
    under the lowest-id tie rule and are dropped; later stages see one token and are too."""
    stages: list[Stage] = []
    params.check_vocab(n_vocab)
    if params.grammar is not None:
        stages.append(GrammarMask())
    if params.logit_bias:
        agg: dict[int, np.float32] = {}
        for tok, b in params.logit_bias:
            agg[tok] = np.float32(agg.get(tok, np.float32(0)) + np.float32(b))
        stages.append(LogitBias(tuple((t, float(b)) for t, b in sorted(agg.items()))))
    greedy = params.greedy
    for name in params.samplers:
        if name in UNIMPLEMENTED:
            continue
        if name == "penalties" and params.penalties_active:
            stages.append(Penalties(params.repeat_last_n, params.repeat_penalty,
                                    params.frequency_penalty, params.presence_penalty))
        elif name == "top_k" and 0 < params.top_k < n_vocab and not greedy:
            stages.append(TopK(params.top_k))
        elif name == "typ_p" and params.typical_p < 1.0:
            stages.append(TypicalP(params.typical_p))
        elif name == "top_p" and params.top_p < 1.0 and not greedy:
            stages.append(TopP(params.top_p))
        elif name == "min_p" and params.min_p > 0.0 and not greedy:
            stages.append(MinP(params.min_p))
        elif name == "temperature":
            if greedy:
                break
            if params.temp != 1.0:
                stages.append(Temperature(params.temp))
    stages.append(Greedy() if greedy else Dist())
    return tuple(stages)


# --- graph builders -----------------------------------------------------------------------
class GraphBuilder:
    """Appends sampling ops to a context; records every op (for the support probe) and
    every input (created here, written by :class:`~pyggspec.sampling.graph.DeviceSampling`)."""

    def __init__(self, ctx: Context, n_vocab: int, n_rows: int,
                 revid: Callable[[], Tensor]) -> None:
        self.ctx = ctx
        self.V = n_vocab
        self.R = n_rows
        self.ops: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self._revid = revid
        # where per-step tensors that no device tensor feeds live (the noise keys): graph
        # inputs would pin the ops that read them to the CPU; the owner may put them in a
        # buffer on the sampling device instead (DeviceSampling does)
        self.device_input: Callable[[str, str, Sequence[int]], Tensor] = self.input

    def op(self, t: Tensor) -> Tensor:
        self.ops.append(t)
        return t

    def input(self, name: str, type: str, shape: Sequence[int]) -> Tensor:
        t = self.ctx.input(type, shape, f"smpl_{name}")
        self.inputs[name] = t
        return t

    # helpers
    def rowwise_max(self, x: Tensor) -> Tensor:
        """[n, R] -> [1, R] maximum (the value at ggml_argmax, whatever its tie rule)."""
        c = self.ctx
        n, r = x.ne[0], x.ne[1]
        am = self.op(c.argmax(x))
        got = self.op(c.get_rows(c.reshape(x, (1, n, r)), c.reshape(am, (1, r))))
        return c.reshape(got, (1, r))

    def exact_argmax(self, x: Tensor) -> Tensor:
        """Argmax with the lowest-id tie rule on any backend: mark the maxima (x - max == 0),
        weight them by V - id (unique, exact in f32), and take the argmax of that."""
        c = self.ctx
        m = self.rowwise_max(x)
        nonmax = self.op(c.step(self.op(c.neg(self.op(c.sub(x, m))))))  # x < max
        ismax = self.op(c.scale(nonmax, -1.0, 1.0))
        score = self.op(c.mul(ismax, self._revid()))
        return self.op(c.argmax(score))

    def sparse_update(self, x: Tensor, n: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """Apply ``fn`` to n entries per row (flat indices in input ``idx``) and write them
        back; x is contiguous and owned by the sampler (never the model's logits tensor)."""
        c = self.ctx
        V, R = self.V, self.R
        idx = self.input(f"{fn.__name__}_idx", "i32", (n * R,))
        flat = c.reshape(x, (1, V * R))
        vals = self.op(c.get_rows(flat, idx))
        new = fn(vals)
        out = self.op(c.set_rows(flat, new, idx))
        return c.reshape(out, (V, R))


def build_grammar(b: GraphBuilder, x: Tensor, st: GrammarMask) -> Tensor:
    return b.op(b.ctx.add(x, b.input("grammar_bias", "f32", (b.V, b.R))))


def build_logit_bias(b: GraphBuilder, x: Tensor, st: LogitBias) -> Tensor:
    n = len(st.entries)

    def bias(v: Tensor) -> Tensor:
        return b.op(b.ctx.add(v, b.input("bias_val", "f32", (1, n * b.R))))

    return b.sparse_update(x, n, bias)


def build_penalties(b: GraphBuilder, x: Tensor, st: Penalties) -> Tensor:
    n, c = st.last_n, b.ctx

    def pen(v: Tensor) -> Tensor:
        shape = (1, n * b.R)
        fpos, fneg = b.input("pen_fpos", "f32", shape), b.input("pen_fneg", "f32", shape)
        sub = b.input("pen_sub", "f32", shape)
        s_pos = b.op(c.step(v))
        s_neg = b.op(c.step(b.op(c.neg(v))))
        f = b.op(c.add(b.op(c.mul(s_pos, fpos)), b.op(c.mul(s_neg, fneg))))  # exact select
        return b.op(c.sub(b.op(c.mul(v, f)), sub))

    return b.sparse_update(x, n, pen)


def build_temperature(b: GraphBuilder, x: Tensor, st: Temperature) -> Tensor:
    return b.op(b.ctx.mul(x, b.input("temp_inv", "f32", (1, b.R))))


def build_min_p(b: GraphBuilder, x: Tensor, st: MinP) -> Tensor:
    c = b.ctx
    thr = b.op(c.add(b.rowwise_max(x), b.input("minp_logp", "f32", (1, b.R))))
    drop = b.op(c.step(b.op(c.neg(b.op(c.sub(x, thr))))))
    keep = b.op(c.scale(drop, -1.0, 1.0))
    return b.op(c.add(x, b.op(c.log(keep))))  # + 0 or + -inf


def build_top_k(b: GraphBuilder, x: Tensor, st: TopK) -> dict[str, Tensor]:
    """k candidate ids and logits per row, plus how many logits are >= the k-th largest:
    more than k means a tie at the boundary, which the host resolves from the full row."""
    c, k, R = b.ctx, st.k, b.R
    ids = b.op(c.top_k(x, k))
    vals = c.reshape(b.op(c.get_rows(c.reshape(x, (1, b.V, R)), ids)), (k, R))
    am = b.op(c.argmax(b.op(c.neg(vals))))
    t = c.reshape(b.op(c.get_rows(c.reshape(vals, (1, k, R)), c.reshape(am, (1, R)))), (1, R))
    below = b.op(c.step(b.op(c.neg(b.op(c.sub(x, t))))))
    n_ge = b.op(c.sum_rows(b.op(c.scale(below, -1.0, 1.0))))
    return {"cand_ids": ids, "cand_logits": vals, "n_ge": n_ge, "pre_top_k": x}


def build_greedy(b: GraphBuilder, x: Tensor, st: Greedy) -> dict[str, Tensor]:
    return {"token": b.exact_argmax(x)}


def build_dist(b: GraphBuilder, x: Tensor, st: Dist) -> dict[str, Tensor]:
    noise = build_noise(b.ctx, b.V, b.R, b.device_input, b.op)  # only keys are uploaded
    z = b.op(b.ctx.add(x, noise))
    return {"token": b.exact_argmax(z)}


BUILDERS: dict[str, Callable] = {
    "grammar": build_grammar, "logit_bias": build_logit_bias, "penalties": build_penalties,
    "temperature": build_temperature, "min_p": build_min_p, "top_k": build_top_k,
    "greedy": build_greedy, "dist": build_dist,
}
