"""Sampler chains: per-sequence state, the planner (graph prefix | host suffix), the graph
part (:class:`DeviceSampling`) and the host finish, with stats and logged fallbacks."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyggspec.errors import DeviceError
from pyggspec.ggml.buffer import Buffer
from pyggspec.ggml.context import Context, GraphError
from pyggspec.ggml.device import Device
from pyggspec.ggml.sched import Graph
from pyggspec.ggml.tensor import HostBinding, Tensor
from pyggspec.sampling import noise as N
from pyggspec.sampling import stages as S
from pyggspec.sampling.params import DEFAULT_SEED, SamplingParams

log = logging.getLogger("pyggspec.sampling")

_VIEW_OPS = frozenset({"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"})
_forced_unsupported: set[str] = set()
_logged: set[str] = set()


@contextlib.contextmanager
def force_unsupported(*ops: str) -> Iterator[None]:
    """Test hook: make the support probe treat these ggml ops (``"TOP_K"``, ``"SET_ROWS"``,
    ...) as unsupported on every device, so planning exercises partial offload."""
    added = {o.upper() for o in ops} - _forced_unsupported
    _forced_unsupported.update(added)
    try:
        yield
    finally:
        _forced_unsupported.difference_update(added)


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.warning("%s", msg)


# --- per-sequence state ---------------------------------------------------------------------
@dataclass(frozen=True)
class ChainState:
    """A chain's mutable state, for speculative rollback."""

    n_sampled: int
    history: tuple[int, ...]


class SamplerChain:
    """One sequence's sampler: its stages, noise key and penalty window.

    Randomness is counter-based: the noise for the token sampled after ``n_sampled`` earlier
    samples is a function of (seed, n_sampled, token id), so exactly one draw is used per
    emitted token whichever path runs and however many verify rows were evaluated, and
    :meth:`snapshot` / :meth:`restore` are two integers and a short tuple.
    """

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self.stages = S.resolve_stages(params, n_vocab)
        self._sig: tuple = ()
        self._sig_of: tuple | None = None
        seed = params.seed
        if seed == DEFAULT_SEED:
            seed = int.from_bytes(os.urandom(8), "little")
        self.seed = seed
        self.key = N.splitmix64(seed)
        self.n_sampled = 0
        self.history: deque[int] = deque(maxlen=max(params.repeat_last_n, 1))

    def accept(self, token: int) -> None:
        """Record an emitted (sampled and kept) token: advances the noise counter."""
        self.history.append(int(token))
        self.n_sampled += 1

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """Prompt tokens count for penalties but were not sampled."""
        self.history.extend(int(t) for t in tokens)

    def snapshot(self) -> ChainState:
        return ChainState(self.n_sampled, tuple(self.history))

    def restore(self, state: ChainState) -> None:
        self.n_sampled = state.n_sampled
        self.history.clear()
        self.history.extend(state.history)

    def reset(self) -> None:
        self.restore(ChainState(0, ()))

    def row(self, prefix: Sequence[int] = ()) -> S.RowCtx:
        """The context of the token after ``prefix`` (e.g. drafts before a verify row)."""
        hist = tuple(self.history) + tuple(int(t) for t in prefix)
        n = self.params.repeat_last_n
        return S.RowCtx(hist[-n:] if n > 0 else (), self.key, self.n_sampled + len(prefix),
                        self.n_vocab)

    @property
    def sig(self) -> tuple:
        """The chain's structure (what a graph depends on), cached per ``stages`` tuple."""
        if self._sig_of is not self.stages:
            self._sig = tuple(s.signature() for s in self.stages)
            self._sig_of = self.stages
        return self._sig

    def signature(self) -> tuple:
        return self.sig

    def sample(self, logits: np.ndarray, prefix: Sequence[int] = ()) -> int:
        return sample_host(self, logits, prefix)


def run_host(stages: Sequence[S.Stage], cand: S.Cand, row: S.RowCtx) -> int:
    """Run stages on the host until the terminal one picks the token."""
    for st in stages:
        out = st.host(cand, row)
        if isinstance(out, int):
            return out
        cand = out
    raise AssertionError("chain without a terminal stage")  # pragma: no cover


def sample_host(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int] = ()) -> int:
    """The whole chain on the host for one row of float32 logits (does not accept)."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    if row.shape[0] != chain.n_vocab:
        raise ValueError(f"logits row has {row.shape[0]} entries, vocabulary is {chain.n_vocab}")
    return run_host(chain.stages, S.Cand(None, row), chain.row(prefix))


def chain_probability(chain: SamplerChain, logits: np.ndarray, prefix: Sequence[int],
                      token: int) -> float:
    """The probability of ``token`` under the chain's distribution for this row: softmax of
    the logits after every filter and the temperature (what ``dist`` samples from); for a
    greedy chain, 1 for its choice. Host only (used for draft ``p_min``)."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    cand = S.Cand(None, row)
    rc = chain.row(prefix)
    for st in chain.stages[:-1]:
        cand = st.host(cand, rc)
    c = cand.finite()
    if len(c.logits) == 0:
        return 0.0
    if chain.stages[-1].name == "greedy":
        return 1.0 if S.argmax_lowest(c) == token else 0.0
    ids = c.id_array()
    w = np.exp(c.logits.astype(np.float64) - float(c.logits.max()))
    hit = w[ids == token]
    return float(hit.sum() / w.sum()) if hit.size else 0.0


# --- stats ------------------------------------------------------------------------------------
@dataclass
class SamplingStats:
    """What ``run --json`` reports under ``sampling``."""

    device: str | None = None
    device_stages: list[str] = field(default_factory=list)
    host_stages: list[str] = field(default_factory=list)
    tokens: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    buffer_bytes: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        _log_once(f"sampling falls back to the host: {reason}")

    def to_dict(self) -> dict[str, Any]:
        n = max(self.tokens, 1)
        return {"device": self.device, "device_stages": list(self.device_stages),
                "host_stages": list(self.host_stages), "tokens": self.tokens,
                "bytes_d2h": self.bytes_d2h, "bytes_d2h_per_token": self.bytes_d2h / n,
                "bytes_h2d_per_token": self.bytes_h2d / n, "buffer_bytes": self.buffer_bytes,
                "fallbacks": dict(self.fallbacks)}


# --- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingPlan:
    """``stages[:n_device]`` run in the graph on ``device``; the rest on the host."""

    stages: tuple[S.Stage, ...]
    n_device: int
    device: Device | None
    n_vocab: int
    n_rows: int
    reasons: tuple[str, ...] = ()

    @property
    def device_stages(self) -> tuple[S.Stage, ...]:
        return self.stages[:self.n_device]

    @property
    def host_stages(self) -> tuple[S.Stage, ...]:
        return self.stages[self.n_device:]

    @property
    def key(self) -> tuple:
        """What a graph built for this plan depends on. Values that only feed inputs
        (temperature, seed, top_p, ...) are left out, so every chain of one structure on
        one device and shape shares one registered plan and one cached graph."""
        dev = self.device.name if self.device is not None and self.n_device else None
        return (tuple(s.signature() for s in self.stages), self.n_device, dev, self.n_vocab,
                self.n_rows)

    @property
    def output(self) -> str:
        """What the graph hands back: 'none', 'logits', 'candidates' or 'token'."""
        if self.n_device == 0:
            return "none"
        last = self.stages[self.n_device - 1]
        return "token" if last.terminal else "candidates" if last.name == "top_k" else "logits"

    def describe(self) -> dict[str, Any]:
        return {"device": self.device.name if self.device and self.n_device else None,
                "device_stages": [s.name for s in self.device_stages],
                "host_stages": [s.name for s in self.host_stages],
                "output": self.output, "reasons": list(self.reasons)}


class _ProbeRevid:
    def __init__(self, ctx: Context, n_vocab: int) -> None:
        self.ctx, self.V, self.t = ctx, n_vocab, None

    def __call__(self) -> Tensor:
        if self.t is None:
            self.t = self.ctx.new_tensor("f32", (self.V,), "smpl_revid")
        return self.t


def _build_stage(b: S.GraphBuilder, x: Tensor, st: S.Stage) -> Tensor | dict[str, Tensor]:
    return S.BUILDERS[st.name](b, x, st)


def plan_chain(params: SamplingParams, device: Device | None, n_vocab: int, n_rows: int,
               backend_sampling: bool, *, output_split: bool = False,
               stats: SamplingStats | None = None) -> SamplingPlan:
    """The longest prefix of the chain whose ops ``device`` supports at the real shapes
    ([n_vocab, n_rows] logits), probed with ``ggml_backend_dev_supports_op``. A top_k or a
    token-choosing stage ends the prefix (only candidates or ids come back)."""
    stages = S.resolve_stages(params, n_vocab)
    reasons: list[str] = []
    n_dev = 0
    if not backend_sampling:
        reasons.append("backend sampling is off")
    elif device is None:
        reasons.append("no output device")
    elif output_split:
        reasons.append("output layer is split across devices")
    else:
        ctx = Context(512)
        try:
            x = ctx.new_tensor("f32", (n_vocab, n_rows), "probe_logits")
            b = S.GraphBuilder(ctx, n_vocab, n_rows, _ProbeRevid(ctx, n_vocab))
            for st in stages:
                if not st.device:
                    reasons.append(f"{st.name} has no exact graph version")
                    break
                start = len(b.ops)
                try:
                    out = _build_stage(b, x, st)
                except GraphError as e:
                    reasons.append(f"{st.name}: {e}")
                    break
                bad = sorted({t.op for t in b.ops[start:]
                              if t.op not in _VIEW_OPS and (t.op in _forced_unsupported
                                                            or not device.supports_op(t))})
                if bad:
                    reasons.append(f"{st.name}: {device.name} does not support "
                                   f"{', '.join(bad)} at [{n_vocab}, {n_rows}]")
                    break
                n_dev += 1
                if isinstance(out, dict):
                    break
                x = out
        finally:
            ctx.close()
    plan = SamplingPlan(stages, n_dev, device, n_vocab, n_rows, tuple(reasons))
    if stats is not None:
        stats.device = device.name if device is not None and n_dev else None
        stats.device_stages = [s.name for s in plan.device_stages]
        stats.host_stages = [s.name for s in plan.host_stages]
        if backend_sampling and n_dev < len(stages):
            for r in reasons:
                stats.fallback(r)
    return plan


def plan_chains(params: Sequence[SamplingParams], device: Device | None, n_vocab: int,
                n_rows: int, backend_sampling: bool, *, output_split: bool = False,
                stats: SamplingStats | None = None) -> SamplingPlan:
    """One plan for a graph shared by several sequences. Their values (temperature, seed,
    penalties, ...) may differ; their stage structure may not (the graph has one shape), so
    differing structures send every sequence to the host (logged, counted)."""
    if not params:
        raise ValueError("no sequences")
    sigs = {tuple(st.signature() for st in S.resolve_stages(p, n_vocab)) for p in params}
    if len(sigs) > 1 and backend_sampling:
        plan = plan_chain(params[0], device, n_vocab, n_rows, False, stats=stats)
        reason = "sequences have sampler chains of different structure"
        if stats is not None:
            stats.fallback(reason)
        return SamplingPlan(plan.stages, 0, device, n_vocab, n_rows, (reason,))
    return plan_chain(params[0], device, n_vocab, n_rows, backend_sampling,
                      output_split=output_split, stats=stats)


# --- the graph part ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RowInput:
    """One output row of the graph: its sequence's chain and the tokens between the chain's
    accepted state and this row's token (the drafts before it in a verify batch)."""

    chain: SamplerChain
    prefix: tuple[int, ...] = ()


class DeviceSampling:
    """The sampler ops appended to a graph after its logits, with their inputs/outputs.

    Built once per graph shape; each step only writes inputs (:meth:`set_inputs`) and reads
    the small outputs (:meth:`finish_host`). Input and output host arrays are preallocated.
    """

    def __init__(self) -> None:
        self.plan: SamplingPlan
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.rows_per_seq = 1
        self.stats = SamplingStats()
        self.failed: str | None = None
        self._const_ctx: Context | None = None
        self._const_buf: Buffer | None = None
        self._revid: Tensor | None = None
        self._device_inputs: dict[str, Tensor] = {}
        self._grid: N.Grid | None = None  # the noise's id grid (dist in the graph)
        self._bound = False
        self._arrays: dict[str, np.ndarray] = {}

    # building
    @classmethod
    def build(cls, ctx: Context, graph: Graph, logits: Tensor, plan: SamplingPlan,
              rows_per_seq: int = 1, stats: SamplingStats | None = None) -> DeviceSampling:
        """Append ``plan``'s device prefix to ``graph`` reading ``logits`` [n_vocab, n_rows]
        (rows grouped by sequence, ``rows_per_seq`` each). The logits tensor is not modified."""
        self = cls()
        self.plan = plan
        self.rows_per_seq = rows_per_seq
        if stats is not None:
            self.stats = stats
        self.stats.device = plan.device.name if plan.device is not None and plan.n_device else None
        self.stats.device_stages = [s.name for s in plan.device_stages]
        self.stats.host_stages = [s.name for s in plan.host_stages]
        V, R = plan.n_vocab, plan.n_rows
        if logits.ne[:2] != (V, R) or logits.ne[2:] != (1, 1):
            raise GraphError(f"sampling: logits {logits.shape} but plan is for [{V}, {R}]")
        if R % rows_per_seq:
            raise GraphError(f"sampling: {R} rows is not a multiple of {rows_per_seq} per seq")
        if plan.n_device == 0:
            return self
        self._grid = N.Grid.for_vocab(V)
        b = S.GraphBuilder(ctx, V, R, self._make_revid)
        b.device_input = self._device_input
        x = logits
        if plan.stages[0].name in ("logit_bias", "penalties") or not logits.is_contiguous:
            x = b.op(ctx.cont(logits))  # sparse writes must not touch the model's logits
        out: Tensor | dict[str, Tensor] = x
        for st in plan.device_stages:
            out = _build_stage(b, x, st)
            if isinstance(out, dict):
                break
            x = out
        outs = out if isinstance(out, dict) else {"logits": out}
        for name, t in outs.items():
            t.set_output()
            graph.expand(t)
            self.outputs[name] = t
        self.inputs = {**b.inputs, **self._device_inputs}
        if self._revid is not None:
            self._alloc_const()
        return self

    def attach(self, stats: SamplingStats) -> None:
        """Count this graph's traffic in ``stats``: a cached graph outlives the generation
        whose stats it was built with."""
        if stats is self.stats:
            return
        self.stats = stats
        if self._bound:
            stats.buffer_bytes = sum(self.buffer_bytes.values())

    def _const(self) -> Context:
        if self._const_ctx is None:
            self._const_ctx = Context(16)
        return self._const_ctx

    def _make_revid(self) -> Tensor:
        if self._revid is None:
            self._revid = self._const().new_tensor("f32", (self.plan.n_vocab,), "smpl_revid")
        return self._revid

    def _device_input(self, name: str, type: str, shape) -> Tensor:
        """A per-step input kept in the sampling device's buffer (written by set_inputs)."""
        t = self._const().new_tensor(type, shape, f"smpl_{name}")
        self._device_inputs[name] = t
        return t

    def _alloc_const(self) -> None:
        assert self._const_ctx is not None and self._revid is not None
        dev = self.plan.device
        assert dev is not None
        self._const_buf = Buffer.for_context(self._const_ctx, dev, "sampling constants")
        V = self.plan.n_vocab
        self._revid.set((V - np.arange(V)).astype(np.float32))

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of per-step inputs, outputs and constants (sized by rows actually needed)."""
        return {"inputs": sum(t.nbytes for t in self.inputs.values()),
                "outputs": sum(t.nbytes for n, t in self.outputs.items() if n != "pre_top_k"),
                "constants": self._const_buf.size if self._const_buf else 0}

    def _bind(self) -> None:
        """Pair inputs/outputs with host arrays (needs the graph allocated)."""
        self._in: list[HostBinding] = []
        for name, t in self.inputs.items():
            arr = np.zeros(tuple(reversed(t.shape)), dtype=np.int32 if t.type.name == "I32"
                           else np.float32)
            # noise key vectors are written per row; the others as flat runs
            self._arrays[name] = (arr.reshape(self.plan.n_rows, -1) if name.startswith("noise_")
                                  else arr.reshape(-1))
            self._in.append(HostBinding(t, arr))
        self._out: dict[str, HostBinding] = {}
        for name, t in self.outputs.items():
            if name in ("pre_top_k", "logits") and self.plan.output == "candidates":
                continue
            shape = (t.ne[0],) if name == "token" else (t.ne[1], t.ne[0])  # [row, ...]
            arr = np.zeros(shape, dtype=np.int32 if t.type.name == "I32" else np.float32)
            self._out[name] = HostBinding(t, arr)
        self._bound = True
        self.stats.buffer_bytes = sum(self.buffer_bytes.values())

    # per step
    def set_inputs(self, rows: Sequence[RowInput]) -> None:
        """Write this step's inputs: one :class:`RowInput` per logits row, in row order."""
        plan = self.plan
        if plan.n_device == 0:
            return
        if len(rows) != plan.n_rows:
            raise ValueError(f"{len(rows)} rows for a graph with {plan.n_rows}")
        if not self._bound:
            self._bind()
        sig = tuple(s.signature() for s in plan.stages)
        V = plan.n_vocab
        grid = self._grid
        a = self._arrays
        for r, ri in enumerate(rows):
            ch = ri.chain
            if ch.signature() != sig:
                raise ValueError("a chain's samplers differ from the plan's (build per plan)")
            rc = ch.row(ri.prefix)
            for st in ch.stages[:plan.n_device]:
                if isinstance(st, S.LogitBias):
                    n = len(st.entries)
                    a["bias_idx"][r * n:(r + 1) * n] = [r * V + t for t, _ in st.entries]
                    a["bias_val"][r * n:(r + 1) * n] = [bv for _, bv in st.entries]
                elif isinstance(st, S.Penalties):
                    self._set_penalties(r, st, rc)
                elif isinstance(st, S.Temperature):
                    a["temp_inv"][r] = st.inv
                elif isinstance(st, S.MinP):
                    a["minp_logp"][r] = st.log_p
                elif isinstance(st, S.Dist):
                    k = N.row_keys(rc.key, rc.counter, grid)
                    a["noise_a1"][r] = k.a1
                    a["noise_b1"][r] = k.b1
                    a["noise_a2"][r] = k.a2
                    a["noise_b2"][r] = k.b2
        for hb in self._in:
            hb.push()
        self.stats.bytes_h2d += sum(hb.array.nbytes for hb in self._in)

    def _set_penalties(self, r: int, st: S.Penalties, rc: S.RowCtx) -> None:
        a, n, V = self._arrays, st.last_n, self.plan.n_vocab
        sl = slice(r * n, (r + 1) * n)
        if rc.history:
            toks, sub = S.penalty_terms(rc.history, st.freq, st.present)
            m = len(toks)
            idx = np.full(n, r * V + int(toks[0]), dtype=np.int32)
            idx[:m] = r * V + toks
            fpos = np.full(n, st.f_pos, dtype=np.float32)
            fneg = np.full(n, st.f_neg, dtype=np.float32)
            s = np.full(n, sub[0], dtype=np.float32)
            s[:m] = sub
        else:  # no-op entries: v * 1 - 0 (v * 0 when v == 0) is v
            idx = np.full(n, r * V, dtype=np.int32)
            fpos = fneg = np.ones(n, dtype=np.float32)
            s = np.zeros(n, dtype=np.float32)
        a["pen_idx"][sl] = idx
        a["pen_fpos"][sl] = fpos
        a["pen_fneg"][sl] = fneg
        a["pen_sub"][sl] = s

    def fail(self, exc: BaseException | str) -> None:
        """Record that the graph part failed (e.g. a device call raised); callers then
        sample these rows with :func:`sample_host` on the raw logits (the target keeps
        them as a graph output for this, see ``Target.run``)."""
        self.failed = str(exc)
        self.stats.fallback(f"device sampling failed: {exc}")

    def finish_host(self, rows: Sequence[RowInput]) -> np.ndarray:
        """Read the graph's sampling outputs and finish each row's chain on the host.
        Returns int32 token ids, one per row (nothing is accepted into the chains).

        The host suffix runs with each row's own chain (its values: top_p, typical_p, ...),
        not the plan's: one plan serves every chain of the same structure. Raises when the
        device's answer is unusable (an id outside the vocabulary) so that the caller falls
        back to the host; nothing is counted then."""
        plan = self.plan
        if plan.n_device == 0:
            raise ValueError("this plan runs entirely on the host: use sample_host")
        pulled = {n: hb.pull() for n, hb in self._out.items()}
        n_dev = plan.n_device
        out = np.empty(len(rows), dtype=np.int32)
        kind = plan.output
        if kind == "token":
            out[:] = pulled["token"][:len(rows)]
            if len(rows) and (int(out.min()) < 0 or int(out.max()) >= plan.n_vocab):
                raise DeviceError(None, f"device sampling returned token ids outside "
                                  f"0..{plan.n_vocab - 1}")
        else:
            for r, ri in enumerate(rows):
                if kind == "logits":
                    cand = S.Cand(None, pulled["logits"][r])
                else:
                    cand = self._candidates(r, pulled)
                out[r] = run_host(ri.chain.stages[n_dev:], cand, ri.chain.row(ri.prefix))
        self.stats.bytes_d2h += sum(hb.array.nbytes for hb in self._out.values())
        self.stats.tokens += len(rows)
        return out

    def _candidates(self, r: int, pulled: dict[str, np.ndarray]) -> S.Cand:
        ids, vals = pulled["cand_ids"][r], pulled["cand_logits"][r]
        k = len(ids)
        t = vals.min()
        if int(pulled["n_ge"][r, 0]) > k and t > -np.inf:
            # a tie at the k-th logit: the device picked some tied ids, the rule wants the
            # lowest, so take the full row (rare; counted)
            self.stats.fallback("top_k tie at the boundary: full row read")
            full = self.outputs["pre_top_k"].get_rows(r, 1)[0]
            self.stats.bytes_d2h += full.nbytes
            return S.topk_exact(S.Cand(None, full), k)
        return S.Cand(ids.copy(), vals.copy())

    def close(self) -> None:
        if self._const_buf is not None:
            self._const_buf.close()
        if self._const_ctx is not None:
            self._const_ctx.close()


def finish_host(handle: DeviceSampling, rows: Sequence[RowInput]) -> np.ndarray:
    """Module-level alias of :meth:`DeviceSampling.finish_host`."""
    return handle.finish_host(rows)
