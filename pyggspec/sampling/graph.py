"""The device part of a sampler chain: the plan's stage prefix appended to a graph after its
logits (:class:`DeviceSampling`), its per-step inputs, and the host finish of each row from
what the graph hands back (ids, candidates or filtered logits)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from pyggspec.errors import DeviceError
from pyggspec.ggml.buffer import Buffer
from pyggspec.ggml.context import Context, GraphError
from pyggspec.ggml.sched import Graph
from pyggspec.ggml.tensor import HostBinding, Tensor
from pyggspec.sampling import noise as N
from pyggspec.sampling import stages as S
from pyggspec.sampling.host import run_host
from pyggspec.sampling.stats import SamplingStats

if TYPE_CHECKING:
    from pyggspec.sampling.chain import RowInput
    from pyggspec.sampling.plan import SamplingPlan


def build_stage(b: S.GraphBuilder, x: Tensor, st: S.Stage) -> Tensor | dict[str, Tensor]:
    return S.BUILDERS[st.name](b, x, st)


class SharedRevid:
    """V - id as f32 (:meth:`~pyggspec.sampling.stages.GraphBuilder.exact_argmax`'s weights)
    on one device: one buffer for every sampler graph there, freed with its last user. Each
    cached graph kept its own copy before (1 MiB at Qwen3.5's 248k vocabulary): device
    memory that grew with the graphs cached, outside the memory plan."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    live: ClassVar[dict[tuple[str, int], SharedRevid]] = {}

    def __init__(self, device, n_vocab: int) -> None:
        self.key = (device.name, n_vocab)
        self.ctx = Context(1)
        self.tensor = self.ctx.new_tensor("f32", (n_vocab,), "smpl_revid")
        try:
            self.buf = Buffer.for_context(self.ctx, device, "sampling constants")
        except BaseException:
            self.ctx.close()
            raise
        self.tensor.set((n_vocab - np.arange(n_vocab)).astype(np.float32))
        self.users = 0

    @classmethod
    def acquire(cls, device, n_vocab: int) -> SharedRevid:
        with cls._lock:
            r = cls.live.get((device.name, n_vocab))
            if r is None:
                r = cls.live[(device.name, n_vocab)] = cls(device, n_vocab)
            r.users += 1
            return r

    @classmethod
    def bytes_on(cls, devices: set[str]) -> dict[str, int]:
        """Bytes of the live constants per device, for ``devices``."""
        out: dict[str, int] = {}
        with cls._lock:
            for (dev, _), r in cls.live.items():
                if dev in devices:
                    out[dev] = out.get(dev, 0) + r.buf.size
        return out

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                del self.live[self.key]
                self.buf.close()
                self.ctx.close()


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
        self._revid: SharedRevid | None = None
        self._device_inputs: dict[str, Tensor] = {}
        self._grid: N.Grid | None = None  # the noise's id grid (dist in the graph)
        self._bound = False
        self._arrays: dict[str, np.ndarray] = {}
        self._sig: tuple = ()  # the plan's chain structure, that every row's chain must have
        self._in_bytes = self._out_bytes = 0  # host bytes pushed / pulled per step

    # building
    @classmethod
    def build(cls, ctx: Context, graph: Graph, logits: Tensor, plan: SamplingPlan,
              rows_per_seq: int = 1, stats: SamplingStats | None = None) -> DeviceSampling:
        """Append ``plan``'s device prefix to ``graph`` reading ``logits`` [n_vocab, n_rows]
        (rows grouped by sequence, ``rows_per_seq`` each). The logits tensor is not modified."""
        self = cls()
        self.plan = plan
        self._sig = tuple(s.signature() for s in plan.stages)
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
        try:
            self._grid = N.Grid.for_vocab(V)
            b = S.GraphBuilder(ctx, V, R, self._make_revid)
            b.device_input = self._device_input
            x = logits
            if plan.stages[0].name in ("logit_bias", "penalties") or not logits.is_contiguous:
                x = b.op(ctx.cont(logits))  # sparse writes must not touch the model's logits
            out: Tensor | dict[str, Tensor] = x
            for st in plan.device_stages:
                out = build_stage(b, x, st)
                if isinstance(out, dict):
                    break
                x = out
            outs = out if isinstance(out, dict) else {"logits": out}
            for name, t in outs.items():
                t.set_output()
                graph.expand(t)
                self.outputs[name] = t
            self.inputs = {**b.inputs, **self._device_inputs}
            if self._const_ctx is not None:
                self._alloc_const()
        except BaseException:
            self.close()  # a shared constant it took is given back
            raise
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
            assert self.plan.device is not None
            self._revid = SharedRevid.acquire(self.plan.device, self.plan.n_vocab)
        return self._revid.tensor

    def _device_input(self, name: str, type: str, shape) -> Tensor:
        """A per-step input kept in the sampling device's buffer (written by set_inputs)."""
        t = self._const().new_tensor(type, shape, f"smpl_{name}")
        self._device_inputs[name] = t
        return t

    def _alloc_const(self) -> None:
        assert self._const_ctx is not None and self.plan.device is not None
        self._const_buf = Buffer.for_context(self._const_ctx, self.plan.device,
                                             "sampling inputs")

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of per-step inputs, outputs and constants (sized by rows actually needed)."""
        return {"inputs": sum(t.nbytes for t in self.inputs.values()),
                "outputs": sum(t.nbytes for n, t in self.outputs.items() if n != "pre_top_k"),
                "constants": ((self._const_buf.size if self._const_buf else 0)
                              + (self._revid.buf.size if self._revid else 0))}

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
        self._in_bytes = sum(hb.array.nbytes for hb in self._in)
        self._out_bytes = sum(hb.array.nbytes for hb in self._out.values())
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
        sig = self._sig
        V = plan.n_vocab
        grid = self._grid
        a = self._arrays
        for r, ri in enumerate(rows):
            ch = ri.chain
            if ch.signature() != sig:
                raise ValueError("a chain's samplers differ from the plan's (build per plan)")
            rc = ch.row(ri.prefix)
            for st in ch.stages[:plan.n_device]:
                if isinstance(st, S.GrammarMask):
                    a["grammar_bias"][r * V:(r + 1) * V] = ch.grammar.bias(ri.prefix)
                elif isinstance(st, S.LogitBias):
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
        self.stats.bytes_h2d += self._in_bytes

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
        self.stats.bytes_d2h += self._out_bytes
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
        if self._revid is not None:
            self._revid.release()
            self._revid = None


def finish_host(handle: DeviceSampling, rows: Sequence[RowInput]) -> np.ndarray:
    """Module-level alias of :meth:`DeviceSampling.finish_host`."""
    return handle.finish_host(rows)
