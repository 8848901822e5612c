"""The Qwen3.5 / Qwen3.6 trunk ("target") graph, dense and MoE, and the runner that feeds it.

One :class:`TargetGraph` is built per ubatch shape and cached; a step with the same shape
only writes the small input tensors (token ids, positions, mask, cache cells, state slots)
and reads the logits (and, for MTP, the post-norm hidden rows ``h_nextn``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pyggspec.ggml.context import Context
from pyggspec.ggml.sched import BackendScheduler, Graph
from pyggspec.ggml.tensor import HostBinding, Tensor
from pyggspec.memory import KVCache, RecurrentState
from pyggspec.modelfile import HParams
from pyggspec.models import layers
from pyggspec.models.batch import StepResult, UBatch
from pyggspec.models.layers import Builder, CausalInputs, RecurrentInputs
from pyggspec.models.runner import GraphRunner

KV_PAD = 256  # attended cache window grows in steps of this many cells (graph reuse)
GRAPH_SIZE = 16384


@dataclass(frozen=True)
class UBatchShape:
    """Everything a built graph depends on. Same shape => same graph, reused."""

    n_seq_tokens: int
    n_seqs: int
    n_kv: int  # attended cache window (which slots a batch uses is data, not shape)
    n_outputs: int  # rows of logits wanted (== n_tokens means all)
    hidden: bool  # also read back h_nextn for every token
    # recurrent states per sequence: 1 (the final one, written) or T (one after every
    # token, written to the state arena: speculative rollback)
    n_write: int = 1
    sampling: int = 0  # id of the sampling plan whose device prefix runs in the graph (0: none)
    embd: bool = False  # some rows are embeddings given in place of tokens (image rows)


def kv_window(max_pos_end: int, n_ctx: int) -> int:
    return min(n_ctx, -(-max_pos_end // KV_PAD) * KV_PAD)


class TargetGraph:
    used = False  # allocated and computed at least once
    """A built trunk graph for one :class:`UBatchShape` with its named inputs/outputs."""

    def __init__(self, hp: HParams, weights, kv: KVCache, rs: RecurrentState,
                 shape: UBatchShape, plan=None) -> None:
        T, B = shape.n_seq_tokens, shape.n_seqs
        n_tok = T * B
        self.shape = shape
        self.ctx = ctx = Context(GRAPH_SIZE * 2, graph_size=GRAPH_SIZE)
        try:
            self.graph = graph = Graph(ctx, [], GRAPH_SIZE)
            self.names: dict[str, Tensor] = {}
            b = Builder(ctx, graph, hp, weights.get, weights.has, T, B, self.names)
            self.tokens = ctx.input("i32", (n_tok,), "inp_tokens")
            self.causal = CausalInputs(ctx, T, B, shape.n_kv, kv.n_slots)
            self.src_rows = ctx.input("i32", (B,), "rs_src")
            keep = shape.n_write > 1
            self.dst_rows = None if keep else ctx.input("i32", (B,), "rs_dst")
            attn_in = self.causal.attn
            self.kept: list[layers.KeptStates] = []
            rec_in = RecurrentInputs(self.src_rows, self.dst_rows, shape.n_write,
                                     self.kept if keep else None)

            x = ctx.get_rows(weights.get("token_embd.weight"), self.tokens)
            self.embd = layers.EmbdInputs(ctx, hp.n_embd, n_tok) if shape.embd else None
            if self.embd is not None:
                x = self.embd.select(ctx, x)
            x = b.cb(x, "model.input_embed")
            for il in range(hp.n_layer):
                inp_sa = x
                cur = b.cb(layers.rms_norm(b, x, b.w("attn_norm.weight", il)), "attn_norm", il)
                graph.expand(cur)
                if hp.is_recurrent(il):
                    cur = layers.gated_delta_net(b, cur, il, rec_in, rs.conv(il), rs.ssm(il))
                else:
                    cur = layers.attention(b, cur, il, attn_in, kv.k(il), kv.v(il))
                cur = b.cb(ctx.add(cur, inp_sa), "attn_residual", il)
                res = cur
                cur = b.cb(layers.rms_norm(b, cur, b.w("post_attention_norm.weight", il)),
                           "attn_post_norm", il)
                cur = b.cb(layers.ffn(b, cur, il), "ffn_out", il)
                x = b.cb(ctx.add(cur, res), "l_out", il)
            h = b.cb(layers.rms_norm(b, x, weights.get("output_norm.weight")), "h_nextn")
            self.out_ids = None
            sel = h
            if shape.n_outputs != n_tok:
                self.out_ids = ctx.input("i32", (shape.n_outputs,), "out_ids")
                sel = ctx.get_rows(h, self.out_ids)
            b.cb(sel, "result_norm")
            self.logits = b.cb(ctx.mul_mat(weights.get("output.weight"), sel), "result_output")
            # an output even under device sampling (only ids or candidates are read then):
            # kept intact, it lets a step whose sampling part failed finish on the host
            self.logits.set_output()
            graph.expand(self.logits)
            self.sampling = None
            if plan is not None:  # the chain's device prefix: candidates or ids come back
                rows_per_seq = shape.n_outputs // B if shape.n_outputs % B == 0 else 1
                self.sampling = plan.build(ctx, graph, self.logits, rows_per_seq)
            # h_nextn is an output whether or not this shape reads it: ggml's allocator
            # reuses the previous graph's layout for a graph of the same structure without
            # looking at output flags, so two graphs that differ only in reading h_nextn
            # must not differ in flags either (else h_nextn gets overwritten)
            h.set_output()
            graph.expand(h)
            self.hidden = h if shape.hidden else None
            if keep:
                self._pin_kept(rs)
        except BaseException:
            ctx.close()
            raise
        # host arrays bound to the graph's inputs/outputs: one C call each per step
        self._bound = False
        self._tokens = np.zeros(n_tok, dtype=np.int32)
        self._src = np.zeros(B, dtype=np.int32)
        self._dst = np.zeros(B, dtype=np.int32)
        self._out_ids = np.zeros(shape.n_outputs, dtype=np.int32)
        self._logits = (np.zeros((shape.n_outputs, self.logits.ne[0]), dtype=np.float32)
                        if self.sampling is None else None)  # sampling: made on a failure
        self._hidden = (np.zeros((n_tok, h.ne[0]), dtype=np.float32) if shape.hidden else None)

    def _bind(self) -> None:
        """Pair tensors with host arrays; needs the graph allocated (done on first use)."""
        ins = [HostBinding(self.tokens, self._tokens), *self.causal.bindings(),
               HostBinding(self.src_rows, self._src)]
        if self.dst_rows is not None:
            ins.append(HostBinding(self.dst_rows, self._dst))
        if self.out_ids is not None:
            ins.append(HostBinding(self.out_ids, self._out_ids))
        if self.embd is not None:
            ins += self.embd.bindings()
        self._inputs = ins
        self._logits_out = (HostBinding(self.logits, self._logits) if self.sampling is None
                            else None)
        self._hidden_out = HostBinding(self.hidden, self._hidden) if self.hidden else None
        self._bound = True

    def set_inputs(self, ub: UBatch, n_ctx: int, sampling_stats=None) -> None:
        if not self._bound:
            self._bind()
        self._tokens[:] = ub.tokens.reshape(-1)
        if self.embd is not None:
            self.embd.fill(ub.embd, ub.embd_rows)
        self.causal.fill(ub.pos0, ub.slots, ub.rope_pos, ub.rope_shift)
        self._src[:] = ub.state_src
        if self.dst_rows is not None:
            self._dst[:] = ub.state_dst[0]
        if self.out_ids is not None:
            self._out_ids[:] = ub.outputs
        for b in self._inputs:
            b.push()
        if self.sampling is not None:
            if sampling_stats is not None:
                self.sampling.attach(sampling_stats)
            self.sampling.set_inputs(ub.rows)

    def read_outputs(self, ub: UBatch) -> tuple[np.ndarray | None, np.ndarray | None,
                                                np.ndarray | None, Exception | None]:
        """(logits [n_out, n_vocab] or None, hidden rows, sampled ids or None, the error of
        a failed sampling part); the arrays are reused by the next step. When the sampling
        part fails after compute, the raw logits (a graph output) come back instead."""
        hidden = self._hidden_out.pull() if self._hidden_out is not None else None
        if self.sampling is None:  # logits are read in place where they are host memory
            return self._logits_out.peek(), hidden, None, None
        try:
            return None, hidden, self.sampling.finish_host(ub.rows), None
        except Exception as e:  # noqa: BLE001 - any failure of the sampling part
            if self._logits_out is None:
                self._logits = np.zeros((self.shape.n_outputs, self.logits.ne[0]), np.float32)
                self._logits_out = HostBinding(self.logits, self._logits)
            return self._logits_out.pull(), hidden, None, e

    def _pin_kept(self, rs) -> None:
        """The states after each token go straight to the state arena: each GDN layer's
        op output is placed so that its snapshot of sequence ``b`` after token ``T-1-j``
        is arena row ``j * B + b`` (its attention outputs take the pad rows before the
        arena), the conv windows after token ``T-1-j`` on rows ``j * B .. j * B + B - 1``."""
        B, n = self.shape.n_seqs, self.shape.n_write * self.shape.n_seqs
        if n > rs.arena_rows:
            raise RuntimeError(f"a verify batch of {n} rows does not fit the state arena "
                               f"({rs.arena_rows} rows)")
        base = rs.arena_base
        for k in self.kept:
            ssm, conv = rs.ssm(k.il), rs.conv(k.il)
            self.graph.pin(k.ssm, ssm, base * ssm.nb[1] - k.ssm_offset)
            for j, win in enumerate(k.conv):
                self.graph.pin(win, conv, (base + j * B) * conv.nb[1])

    def close(self) -> None:
        if self.sampling is not None:
            self.sampling.close()
        self.ctx.close()


class Target(GraphRunner):
    """Runs trunk ubatches on a scheduler, reusing graphs by shape."""

    def __init__(self, hp: HParams, weights, kv: KVCache, rs: RecurrentState,
                 sched: BackendScheduler, cache_size: int = 24) -> None:
        super().__init__(sched, cache_size)
        self.hp = hp
        self.weights = weights
        self.kv = kv
        self.rs = rs
        self._plan_users: dict[int, tuple[object, Callable[[Exception], None]]] = {}

    def register_plan(self, plan, stats, on_fail: Callable[[Exception], None]) -> int:
        """Make a sampling plan usable in graphs; returns its id for UBatch.sampling.

        Plans with equal ``plan.key`` (same chain structure, device and rows) get one id,
        so graphs are built once, not per generation. ``stats`` counts the traffic of the
        steps from now on; ``on_fail(exc)`` is told when the plan's device part fails
        (the step is then redone with logits, which come back instead of ids).
        """
        pid = super().register_plan(plan)
        self._plan_users[pid] = (stats, on_fail)
        return pid

    def shape_of(self, ub: UBatch) -> UBatchShape:
        B, T = ub.tokens.shape
        end = int((ub.pos0 + T).max())
        n_write = T if ub.snapshots and T > 1 else 1
        return UBatchShape(T, B, kv_window(end, self.kv.n_ctx), len(ub.outputs), ub.hidden,
                           n_write, ub.sampling, ub.embd_rows is not None)

    def run(self, ub: UBatch, copy: bool = True) -> StepResult:
        """Evaluate one ubatch. ``copy=False`` returns arrays the next step overwrites.

        Without explicit ``state_src/state_dst`` each sequence reads and overwrites its
        current recurrent row.

        With ``ub.sampling`` set, a failure of the sampling part falls back to the host:
        before compute (graph build, allocation, inputs) the step is redone with a logits
        graph; after compute the raw logits are read. Either way ``ids`` is None and
        ``logits`` come back, and the plan's ``on_fail`` is told. A failed compute is not
        redone (the recurrent state may have been advanced already): it raises.
        """
        if ub.state_src is None:
            rows = np.array([self.rs.row(s) for s in ub.slots], dtype=np.int32)
            ub.state_src = rows
            ub.state_dst = rows[None, :]
        if ub.sampling:
            stats, on_fail = self._plan_users[ub.sampling]
            computing = False

            def feed(g: TargetGraph) -> None:
                nonlocal computing
                g.set_inputs(ub, self.kv.n_ctx, stats)
                computing = True

            try:
                res, err = self._run(ub, copy, feed)
            except Exception as e:
                if computing:
                    raise
                res, err = None, e
            if err is not None:
                on_fail(err)
            if res is not None:
                return res
            ub = replace(ub, sampling=0, rows=None)
        return self._run(ub, copy, lambda g: g.set_inputs(ub, self.kv.n_ctx))[0]

    def _run(self, ub: UBatch, copy: bool,
             feed: Callable[[TargetGraph], None]) -> tuple[StepResult, Exception | None]:
        shape = self.shape_of(ub)
        logits, hidden, ids, err = self.execute(
            shape,
            lambda s: TargetGraph(self.hp, self.weights, self.kv, self.rs, s,
                                  self.plans.get(s.sampling)),
            feed, lambda g: g.read_outputs(ub))
        if copy:
            logits = logits.copy() if logits is not None else None
            hidden = hidden.copy() if hidden is not None else None
        return StepResult(logits, hidden, ids), err
