"""The MTP (multi-token prediction) head graph of Qwen3.5 / Qwen3.6, and its runner.

Row k of a batch is the pair (token x_q, hidden h_{q-1}) at position q: ``h`` is the
target's post-``output_norm`` hidden of the previous position (or, while drafting, the
head's own post-norm hidden from the previous draft step). The head predicts x_{q+1}.

    e = enorm(embed(x)),  g = hnorm(h),  x = eh_proj([e; g])
    x = x + gated_attention(x)        (the head's own KV cache)
    x = x + ffn(x)                    (dense SwiGLU, or MoE + shared expert for qwen35moe)
    h' = shared_head_norm(x)          (fallback output_norm)  -> next draft step's h
    logits = head(h')                 (shared_head_head, fallback the LM head)

With ``n_chain`` k > 1 the graph repeats the head k - 1 times after the drafting rows: step
j takes step j - 1's argmax id and hidden row, one row per sequence at the next position,
and reads the K/V step j - 1 wrote (the written cache is its source, so the order is in the
graph, not only in the node list). k argmax drafts then cost one graph run, not k.

Only the rows that draft need logits; for those the graph also takes the argmax and the
probability of that token under a softmax over the **full** vocabulary, so only ids,
probabilities and hidden rows come back to the host. Optionally (``draft_vocab``) the head
drafts over the first N token ids only: the LM head is most of a draft step's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyggspec.ggml.context import Context
from pyggspec.ggml.sched import BackendScheduler, Graph
from pyggspec.ggml.tensor import HostBinding, Tensor
from pyggspec.memory import KVCache
from pyggspec.modelfile import HParams
from pyggspec.models import layers
from pyggspec.models.layers import Builder, CausalInputs
from pyggspec.models.qwen35 import kv_window
from pyggspec.models.runner import MTP_STEP_SCHEDS, GraphRunner

GRAPH_SIZE = 2048


@dataclass(frozen=True)
class MtpShape:
    n_seq_tokens: int
    n_seqs: int
    n_kv: int
    n_outputs: int
    device_argmax: bool  # argmax + top probability in the graph (else full logits come back)
    draft_vocab: int = 0  # draft over token ids [0, draft_vocab) only (0: full vocabulary)
    sampling: int = 0  # plan id (Mtp.register_plan): the drafts' sampler chains in the graph
    hot: bool = False  # score drafts over the hot vocabulary's rows (Mtp.hot)
    n_chain: int = 1  # argmax draft steps in the one graph (MtpGraph._chain_step)
    embd: bool = False  # some rows are image rows: their embedding in place of the token's


@dataclass
class HotHead:
    """The device copy of the hot vocabulary's LM-head rows (see
    :mod:`pyggspec.speculative.hot_vocab`): the rows, their ids, the ids' inverse."""

    rows: Tensor  # [n_embd, K], the head's type
    ids: Tensor  # int32 [1, K]
    pos: Tensor  # int32 [1, n_vocab]: row in ``rows``, K outside the set
    host_ids: np.ndarray  # int32 [K], as last written


@dataclass
class MtpBatch:
    """B sequences x T rows: token ids, the paired hidden rows, positions, output rows."""

    tokens: np.ndarray  # int32 [B, T]
    hidden: np.ndarray  # float32 [B, T, n_embd]
    pos0: np.ndarray  # int64 [B]
    slots: tuple[int, ...]
    outputs: np.ndarray  # int32 [n_out]: flat rows (b*T + t) that draft
    sampling: int = 0  # coupled drafts: plan id whose chains choose the output rows' tokens
    rows: list | None = None  # RowInput per output row (chain, drafts before it)
    logits: bool = False  # full logits come back (host argmax or host chains)
    hot: bool = False  # draft over the hot vocabulary (when the runner has one)
    chain: int = 1  # argmax drafts per output row in one graph (device argmax only)
    # image rows and positions (set by Mtp.run from its SlotRows, as UBatch's): float32
    # [B*T, n_embd] read where embd_rows; (t, y, x, z) per row; cells - positions per seq
    embd: np.ndarray | None = None
    embd_rows: np.ndarray | None = None
    rope_pos: np.ndarray | None = None
    rope_shift: np.ndarray | None = None


@dataclass
class MtpResult:
    ids: np.ndarray  # int32 [n_out]: argmax token of each output row
    probs: np.ndarray  # float32 [n_out]: its probability (softmax over the full vocabulary)
    hidden: np.ndarray  # float32 [n_out, n_embd]: the head's post-norm hidden of those rows
    logits: np.ndarray | None = None  # float32 [n_out, n_vocab], host-argmax path only
    sampled: bool = False  # ids were drawn by the rows' sampler chains (probs: the argmax's)
    argmax: np.ndarray | None = None  # int32 [n_out]: the head's argmax, beside sampled ids
    argmax_probs: np.ndarray | None = None  # its softmax probability (host draws, p_min > 0)
    chain_ids: np.ndarray | None = None  # int32 [n_chain, n_out]: chained drafts, step by step
    chain_probs: np.ndarray | None = None  # float32 [n_chain, n_out]: their probabilities


class MtpWeights:
    """Name resolution for the head's tensors, with llama.cpp's fallbacks.

    Takes trunk-style names (``blk.N.attn_q.weight``, ``output_norm.weight``). A separate
    MTP file's copies of shared tensors are stored as ``mtp:<name>`` and win when present
    (llama.cpp runs a sidecar head on the sidecar's own embedding and LM head).
    """

    PREFIX = "mtp:"
    DRAFT_HEAD = "draft:head"  # a lower-bit copy of the head, for drafting only (optional)

    def __init__(self, weights, block: int) -> None:
        self.weights = weights
        self.block = block

    def has(self, name: str) -> bool:
        return self.weights.has(self.PREFIX + name) or self.weights.has(name)

    def get(self, name: str) -> Tensor:
        if self.weights.has(self.PREFIX + name):
            return self.weights.get(self.PREFIX + name)
        return self.weights.get(name)

    def first(self, *names: str) -> Tensor:
        return self.get(self.first_name(*names))

    def first_name(self, *names: str) -> str:
        for n in names:
            if self.has(n):
                return self.PREFIX + n if self.weights.has(self.PREFIX + n) else n
        raise KeyError(f"none of {names} is loaded")

    @property
    def embed(self) -> Tensor:
        return self.first(f"blk.{self.block}.nextn.embed_tokens.weight", "token_embd.weight")

    @property
    def head_norm(self) -> Tensor:
        return self.first(f"blk.{self.block}.nextn.shared_head_norm.weight", "output_norm.weight")

    @property
    def head_name(self) -> str:
        """Key of the model's own LM head for the MTP block (the target's when shared)."""
        return self.first_name(f"blk.{self.block}.nextn.shared_head_head.weight",
                               "output.weight", "token_embd.weight")

    HOT_HEAD = "mtp.hot_head.weight"

    @property
    def head(self) -> Tensor:
        """The head drafts are made with: the lower-bit draft copy when one was made (only
        drafts use it; the target verifies with its own weights), else the model's."""
        if self.weights.has(self.DRAFT_HEAD):
            return self.weights.get(self.DRAFT_HEAD)
        return self.weights.get(self.head_name)


def argmax_probability(logits: np.ndarray) -> np.ndarray:
    """float32 [n]: each row's softmax probability of its largest logit (the p_min measure
    of an argmax draft)."""
    mx = logits.max(axis=1, keepdims=True)
    return (1.0 / np.exp(logits - mx).sum(axis=1)).astype(np.float32)


PAD_LOGIT = -1e30  # ids past --spec-draft-vocab: never drawn, finite (no NaN in a sampler op)


def _widen_hot(ctx: Context, logits: Tensor, pos: Tensor) -> Tensor:
    """[K, R] logits over the hot rows -> [n_vocab, R]: each id's logit, :data:`PAD_LOGIT`
    outside the set (a gather through ``pos`` from the rows with a pad row appended; the
    chains' noise is keyed by the full vocabulary's ids)."""
    R = logits.ne[1]
    col = ctx.scale(ctx.sum_rows(logits), 0.0, PAD_LOGIT)
    t = ctx.cont(ctx.transpose(ctx.concat(logits, col, 0)))  # [R, K + 1]
    wide = ctx.get_rows(t, ctx.reshape(pos, (pos.ne[1],)))  # [R, n_vocab]
    return ctx.cont(ctx.transpose(wide)) if R > 1 else ctx.reshape(wide, (pos.ne[1], 1))


def _pad_vocab(ctx: Context, logits: Tensor, n_vocab: int) -> Tensor:
    """[draft_vocab, R] logits -> [n_vocab, R] with :data:`PAD_LOGIT` past the draft
    vocabulary: a chain's noise is keyed by the full vocabulary's width, so coupled draws
    need every id (the sum only gives the pad a [1, R] source the graph computes)."""
    dv, R = logits.ne[0], logits.ne[1]
    col = ctx.scale(ctx.sum_rows(logits), 0.0, PAD_LOGIT)
    return ctx.concat(logits, ctx.repeat(col, (n_vocab - dv, R)), 0)


class MtpGraph:
    used = False  # allocated and computed at least once
    n_vocab = 0  # the LM head's full width (--spec-draft-vocab may draft over fewer ids)
    def __init__(self, hp: HParams, w: MtpWeights, kv: KVCache, shape: MtpShape,
                 plan=None, hot: HotHead | None = None) -> None:
        T, B = shape.n_seq_tokens, shape.n_seqs
        n, il, n_embd = T * B, w.block, hp.n_embd
        self.shape = shape
        self.w = w
        size = GRAPH_SIZE * shape.n_chain
        self.ctx = ctx = Context(size * 2, graph_size=size)
        try:
            self.graph = graph = Graph(ctx, [], size)
            self.names: dict[str, Tensor] = {}
            b = Builder(ctx, graph, hp, w.get, w.has, T, B, self.names)
            self.tokens = ctx.input("i32", (n,), "mtp_tokens")
            self.h = ctx.input("f32", (n_embd, n), "mtp_h_input")
            self.embd = layers.EmbdInputs(ctx, n_embd, n, "mtp_") if shape.embd else None
            self.causal = CausalInputs(ctx, T, B, shape.n_kv, kv.n_slots, "mtp_")
            self.chain: list[CausalInputs] = []  # the chained draft steps' inputs
            self.chain_ids: list[Tensor] = []
            self.chain_top: list[Tensor] = []
            self.out_ids = self.h_out = self.ids = self.top = self.logits = None
            self.sampling = self.hot = None
            written: list[Tensor] = []
            x, cur = self._attend(b, self.tokens, self.h, self.causal, kv.k(il), kv.v(il),
                                  written, self.embd)
            if shape.n_outputs == 0:
                # cache-only: pairs written for later drafts, nothing drafted now; the graph
                # holds only the KV writes (no FFN, no LM head)
                self._finish(shape, n, n_embd)
                return
            self.out_ids = ctx.input("i32", (shape.n_outputs,), "mtp_out_ids")
            # only the drafting rows go on: the others' K/V are written, and every op past
            # attention is per row, so they would be computed for nothing (a catch-up batch
            # of 32 pairs + one draft: 16 ms against 9.5 for one row on a 2-core CPU;
            # llama.cpp's head runs the FFN on every row and drops them before the LM head)
            cur = b.cb(ctx.get_rows(cur, self.out_ids), "mtp_attn_out_rows", il)
            x = b.cb(ctx.get_rows(x, self.out_ids), "mtp_eh_proj_rows", il)
            h_out = self._ffn(b, x, cur)
            self.n_vocab = w.head.ne[1]
            self.hot = hot if shape.hot else None
            logits = b.cb(ctx.mul_mat(self._head(ctx, shape), h_out), "result_output")
            self.h_out = h_out.set_output()
            graph.expand(h_out)
            if plan is not None:
                # coupled drafts: the rows' sampler chains (with the target's noise for each
                # token) in the graph; the logits stay an output for a host fallback
                # the argmax reads the set's own rows (PAD never wins, adds 0 to
                # a softmax; the set's ids ascend, so ties go to the same id): not the
                # widened [n_vocab] rows the chains need
                narrow = logits
                if self.hot is not None:
                    logits = _widen_hot(ctx, logits, self.hot.pos)
                elif logits.ne[0] < plan.n_vocab:
                    logits = _pad_vocab(ctx, logits, plan.n_vocab)
                self.logits = logits.set_output()
                graph.expand(logits)
                self.sampling = plan.build(ctx, graph, logits, 1)
                src = narrow if self.hot is not None else logits
                ids = b.cb(ctx.argmax(src), "mtp_argmax")
                self.ids = self._hot_ids(b, ctx, ids, shape.n_outputs).set_output()
                graph.expand(self.ids)
            elif shape.device_argmax:
                self.ids, self.top = self._pick(b, ctx, logits, shape.n_outputs)
                for j in range(1, shape.n_chain):
                    h_out = self._chain_step(b, j, h_out, written)
            else:
                self.ids = self.top = None
                self.logits = logits.set_output()
                graph.expand(logits)
        except BaseException:
            ctx.close()
            raise
        self._finish(shape, n, n_embd)

    def _attend(self, b: Builder, tokens: Tensor, h: Tensor, causal: CausalInputs,
                k: Tensor, v: Tensor, written: list[Tensor],
                embd: layers.EmbdInputs | None = None) -> tuple[Tensor, Tensor]:
        """The head up to its attention: (the eh_proj rows, the attention output).
        ``embd``: image rows taken in place of token embeddings (b11549's
        ``add_embd`` rows: enorm then normalises them as it does a token's)."""
        ctx, w, il = b.ctx, self.w, self.w.block
        e = ctx.get_rows(w.embed, tokens)
        if embd is not None:
            e = embd.select(ctx, e)
        e = b.cb(e, "mtp_tok_embd", il)
        hn = b.cb(layers.rms_norm(b, h, b.w("nextn.hnorm.weight", il)), "mtp_hnorm", il)
        en = b.cb(layers.rms_norm(b, e, b.w("nextn.enorm.weight", il)), "mtp_enorm", il)
        x = b.cb(ctx.mul_mat(b.w("nextn.eh_proj.weight", il), ctx.concat(en, hn, 0)),
                 "mtp_eh_proj", il)
        cur = b.cb(layers.rms_norm(b, x, b.w("attn_norm.weight", il)), "mtp_attn_norm", il)
        return x, layers.attention(b, cur, il, causal.attn, k, v, written)

    def _ffn(self, b: Builder, x: Tensor, cur: Tensor) -> Tensor:
        """The head past its attention, to the post-norm hidden rows."""
        ctx, il = b.ctx, self.w.block
        x = b.cb(ctx.add(cur, x), "mtp_attn_residual", il)
        cur = b.cb(layers.rms_norm(b, x, b.w("post_attention_norm.weight", il)),
                   "mtp_attn_post_norm", il)
        cur = b.cb(layers.ffn(b, cur, il), "mtp_ffn_out", il)
        x = b.cb(ctx.add(cur, x), "mtp_post_ffn", il)
        return b.cb(layers.rms_norm(b, x, self.w.head_norm), "mtp_shared_head_norm")

    def _head(self, ctx: Context, shape: MtpShape) -> Tensor:
        """The LM-head rows drafts are scored over: the hot set's, the first
        ``draft_vocab`` ids, or the whole head."""
        head = self.w.head
        if self.hot is not None:
            return self.hot.rows
        if 0 < shape.draft_vocab < head.ne[1]:
            # the first rows of the LM head: BPE ids are roughly frequency-ordered, and a
            # draft is only a guess the target verifies, so this loses no correctness
            return ctx.view(head, (head.ne[0], shape.draft_vocab), (head.nb[1],), 0)
        return head

    def _pick(self, b: Builder, ctx: Context, logits: Tensor, n_out: int,
              ) -> tuple[Tensor, Tensor]:
        """Outputs: each row's argmax token id and its softmax probability."""
        ids = b.cb(ctx.argmax(logits), "mtp_argmax")
        top = self._top_prob(b, ctx, logits, ids, n_out).set_output()
        ids = self._hot_ids(b, ctx, ids, n_out).set_output()
        b.graph.expand(ids)
        b.graph.expand(top)
        return ids, top

    def _chain_step(self, b0: Builder, j: int, h: Tensor, written: list[Tensor]) -> Tensor:
        """Draft step ``j`` in the same graph: each drafting row's argmax of step j - 1
        (already a token id) with that step's hidden row, one row per sequence at the
        next position, attending over the caches step j - 1 wrote. The host then reads
        every step's drafts at once instead of running one graph per draft."""
        ctx, n_out = b0.ctx, self.shape.n_outputs
        b = Builder(ctx, b0.graph, b0.hp, b0.weight, b0.has_weight, 1, n_out, {})
        causal = CausalInputs(ctx, 1, n_out, self.shape.n_kv, self.causal.S, f"mtp_d{j}_")
        prev = self.chain_ids[-1] if self.chain_ids else self.ids
        k, v = written[-2:]
        x, cur = self._attend(b, prev, h, causal, k, v, written)
        h = self._ffn(b, x, cur)
        logits = b.cb(ctx.mul_mat(self._head(ctx, self.shape), h), "result_output")
        ids, top = self._pick(b, ctx, logits, n_out)
        self.chain.append(causal)
        self.chain_ids.append(ids)
        self.chain_top.append(top)
        return h

    def _hot_ids(self, b, ctx: Context, ids: Tensor, n_out: int) -> Tensor:
        """Argmax rows -> token ids: through the hot set's ids when drafting over it."""
        if self.hot is None:
            return ids
        return b.cb(ctx.reshape(ctx.get_rows(self.hot.ids, ids), (n_out,)), "mtp_hot_ids")

    @staticmethod
    def _top_prob(b, ctx: Context, logits: Tensor, ids: Tensor, n_out: int) -> Tensor:
        """[n_out]: each row's softmax probability (temperature 1) of its argmax ``ids``."""
        probs = ctx.soft_max_ext(logits, None, 1.0)
        top = ctx.get_rows(ctx.reshape(probs, (1, logits.ne[0], n_out)),
                           ctx.reshape(ids, (1, n_out)))
        return b.cb(ctx.reshape(top, (n_out,)), "mtp_top_prob")

    def _finish(self, shape: MtpShape, n: int, n_embd: int) -> None:
        self._tokens = np.zeros(n, np.int32)
        self._h = np.zeros((n, n_embd), np.float32)
        self._out = np.zeros(shape.n_outputs, np.int32)
        self._ids = np.zeros(shape.n_outputs, np.int32)
        self._top = np.zeros(shape.n_outputs, np.float32)
        self._h_out = np.zeros((shape.n_outputs, n_embd), np.float32)
        self._chain_ids = np.zeros((shape.n_chain, shape.n_outputs), np.int32)
        self._chain_top = np.zeros((shape.n_chain, shape.n_outputs), np.float32)
        self._chain_pos = np.zeros(shape.n_outputs, np.int64)
        self._logits = (np.zeros((shape.n_outputs, self.logits.ne[0]), np.float32)
                        if self.logits is not None else None)
        self._bound = False

    def _bind(self) -> None:
        ins = [HostBinding(self.tokens, self._tokens), HostBinding(self.h, self._h),
               *self.causal.bindings()]
        if self.embd is not None:
            ins += self.embd.bindings()
        if self.out_ids is None:  # cache-only: inputs only the KV writes read are in the graph
            self._ins = [i for i in ins if i.tensor.is_allocated]
            self._outs = []
            self._bound = True
            return
        self._ins = [*ins, HostBinding(self.out_ids, self._out)]
        self._outs = [HostBinding(self.h_out, self._h_out)]
        if self.sampling is not None:
            self._logits_out = HostBinding(self.logits, self._logits)  # read on a failure only
            self._outs.append(HostBinding(self.ids, self._ids))
            if self.top is not None:
                self._outs.append(HostBinding(self.top, self._top))
        elif self.chain:  # every step's drafts into one array each
            self._outs = [HostBinding(t, self._chain_ids[j])
                          for j, t in enumerate([self.ids, *self.chain_ids])]
            self._outs += [HostBinding(t, self._chain_top[j])
                           for j, t in enumerate([self.top, *self.chain_top])]
            for c in self.chain:
                self._ins += c.bindings()
        elif self.ids is not None:
            self._outs += [HostBinding(self.ids, self._ids), HostBinding(self.top, self._top)]
        else:
            self._outs.append(HostBinding(self.logits, self._logits))
        self._bound = True

    def set_inputs(self, mb: MtpBatch, n_ctx: int) -> None:
        if not self._bound:
            self._bind()
        self._tokens[:] = mb.tokens.reshape(-1)
        self._h[:] = mb.hidden.reshape(self._h.shape)
        if self.embd is not None:
            self.embd.fill(mb.embd, mb.embd_rows)
        self.causal.fill(mb.pos0, tuple(mb.slots), mb.rope_pos, mb.rope_shift)
        self._out[:] = mb.outputs
        if self.chain:  # step j drafts at the output row's position + j
            T = self.shape.n_seq_tokens
            out = mb.outputs
            np.add(mb.pos0[out // T], out % T, out=self._chain_pos)
            slots = tuple(mb.slots[b] for b in out // T)
            # drafts follow the batch's rows: text past any image
            shift = mb.rope_shift[out // T] if mb.rope_shift is not None else None
            for j, c in enumerate(self.chain, 1):
                c.fill(self._chain_pos + j, slots, None, shift)
        for bnd in self._ins:
            bnd.push()
        if self.sampling is not None:
            self.sampling.set_inputs(mb.rows)

    def read(self, mb: MtpBatch) -> MtpResult:
        for bnd in self._outs:
            bnd.pull()
        if self.out_ids is None:
            return MtpResult(self._ids, self._top, self._h_out)
        if self.chain:  # no hidden rows come back: the drafts ended in the graph
            ids, top = self._chain_ids.copy(), self._chain_top.copy()
            return MtpResult(ids[0], top[0], self._h_out[:0], chain_ids=ids, chain_probs=top)
        if self.sampling is not None:
            try:
                ids = self.sampling.finish_host(mb.rows)
            except Exception:  # noqa: BLE001 - the drafter redraws these rows on the host
                self._logits_out.pull()
                return MtpResult(None, None, self._h_out.copy(), self._logits.copy())
            top = self._top.copy() if self.top is not None else None
            return MtpResult(ids, self._top.copy(), self._h_out.copy(), sampled=True,
                             argmax=self._ids.copy(), argmax_probs=top)
        if self.ids is None and self.hot is not None:  # logits over the hot rows
            lg, hot_ids = self._logits, self.hot.host_ids
            ids = hot_ids[lg.argmax(axis=1)].astype(np.int32)
            if not mb.logits:  # argmax drafts: nothing reads the logits
                return MtpResult(ids, argmax_probability(lg), self._h_out.copy())
            # the rows' chains draw over every id (their noise is keyed by it)
            wide = np.full((len(lg), self.n_vocab), PAD_LOGIT, np.float32)
            wide[:, hot_ids] = lg
            return MtpResult(ids, self._top, self._h_out.copy(), wide)
        if self.ids is None:  # host argmax + full-vocabulary softmax probability
            lg = self._logits
            ids = lg.argmax(axis=1).astype(np.int32)
            if mb.logits:  # for the rows' chains (the drafter computes any probability)
                if lg.shape[1] < self.n_vocab:  # --spec-draft-vocab: the chains need every id
                    wide = np.full((len(lg), self.n_vocab), PAD_LOGIT, np.float32)
                    wide[:, :lg.shape[1]] = lg
                    return MtpResult(ids, self._top, self._h_out.copy(), wide)
                return MtpResult(ids, self._top, self._h_out.copy(), lg.copy())
            return MtpResult(ids, argmax_probability(lg), self._h_out.copy(), lg.copy())
        return MtpResult(self._ids.copy(), self._top.copy(), self._h_out.copy())

    def close(self) -> None:
        if self.sampling is not None:
            self.sampling.close()
        self.ctx.close()


class Mtp(GraphRunner):
    """Runs MTP batches on its own scheduler (so target and draft graphs never evict each
    other's allocation), with graphs reused by shape."""

    def __init__(self, hp: HParams, weights: MtpWeights, kv: KVCache, sched: BackendScheduler,
                 device_argmax: bool = True, cache_size: int = 24, draft_vocab: int = 0,
                 hot_rows: int = 0) -> None:
        super().__init__(sched, cache_size, MTP_STEP_SCHEDS)
        self.hp = hp
        self.weights = weights
        self.kv = kv
        self.device_argmax = device_argmax
        self.draft_vocab = draft_vocab
        self.n_evals = 0
        self.media = None  # the worker's SlotRows: image rows and positions per slot
        self.hot: HotHead | None = None
        if hot_rows:
            store = weights.weights
            rows, ids, pos = store.add_row_subset(MtpWeights.HOT_HEAD, weights.head_name,
                                                  hot_rows)
            self.hot = HotHead(rows, ids, pos, np.zeros(0, np.int32))
            self.set_hot(np.arange(hot_rows, dtype=np.int32))

    def set_hot(self, ids: np.ndarray) -> None:
        """Write the hot vocabulary's rows (sorted token ids, as many as it has rows): the
        graphs read them from then on."""
        self.weights.weights.fill_row_subset(MtpWeights.HOT_HEAD, ids)
        self.hot.host_ids = np.asarray(ids, np.int32).copy()

    def run(self, mb: MtpBatch) -> MtpResult:
        B, T = mb.tokens.shape
        if self.media is not None and self.media.n_spans:  # image rows, or rows after them
            self.media.apply(mb)
        chain = mb.chain if self.chains(mb) else 1
        end = int((mb.pos0 + T).max()) + chain - 1
        shape = MtpShape(T, B, kv_window(end, self.kv.n_ctx), len(mb.outputs),
                         self.device_argmax and not mb.logits, self.draft_vocab, mb.sampling,
                         mb.hot and self.hot is not None, chain, mb.embd_rows is not None)
        res = self.execute(shape, lambda s: MtpGraph(self.hp, self.weights, self.kv, s,
                                                     self.plans.get(s.sampling), self.hot),
                           lambda g: g.set_inputs(mb, self.kv.n_ctx), lambda g: g.read(mb))
        self.n_evals += chain  # head evaluations (a chained graph makes ``chain`` of them)
        return res

    def chains(self, mb: MtpBatch) -> bool:
        """Whether ``mb``'s drafts can be chained in one graph: argmax drafts in the graph
        (no sampler chains, no logits back) of rows that draft."""
        return (mb.chain > 1 and self.device_argmax and not mb.logits and not mb.sampling
                and len(mb.outputs) > 0)
