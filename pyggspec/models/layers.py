"""The layers of Qwen3.5 / Qwen3.6 as plain functions that add ggml nodes.

Each function takes a :class:`Builder` (the ggml context, the graph being built, the
weights, the ubatch shape) and names its nodes as llama.cpp does (``attn_norm-3``), so
intermediate tensors can be compared by name. Shapes are ggml order (ne0 first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pyggspec.ggml.context import ROPE_TYPE_IMROPE, Context
from pyggspec.ggml.sched import Graph
from pyggspec.ggml.tensor import HostBinding, Tensor
from pyggspec.modelfile import HParams


@dataclass
class Builder:
    """What every layer function needs while one graph is being built."""

    ctx: Context
    graph: Graph
    hp: HParams
    weight: Callable[[str], Tensor]
    has_weight: Callable[[str], bool]
    n_seq_tokens: int  # T: tokens per sequence in this ubatch
    n_seqs: int  # B: sequences in this ubatch
    names: dict[str, Tensor]

    @property
    def n_tokens(self) -> int:
        return self.n_seq_tokens * self.n_seqs

    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        """Name a node like llama.cpp's callback and remember it for inspection."""
        full = f"{name}-{il}" if il >= 0 else name
        t.name = full
        self.names[full] = t
        return t

    def w(self, name: str, il: int | None = None) -> Tensor:
        return self.weight(f"blk.{il}.{name}" if il is not None else name)

    def has(self, name: str, il: int | None = None) -> bool:
        return self.has_weight(f"blk.{il}.{name}" if il is not None else name)


def rms_norm(b: Builder, x: Tensor, weight: Tensor) -> Tensor:
    return b.ctx.mul(b.ctx.rms_norm(x, b.hp.rms_eps), weight)


def l2_norm(b: Builder, x: Tensor) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over ne0, as llama.cpp's GDN builds it from rms_norm."""
    n = x.ne[0]
    return b.ctx.scale(b.ctx.rms_norm(x, b.hp.rms_eps / n), 1.0 / math.sqrt(n))


def linear(b: Builder, x: Tensor, name: str, il: int | None = None) -> Tensor:
    """Weight matmul, plus the bias when the file has one."""
    y = b.ctx.mul_mat(b.w(f"{name}.weight", il), x)
    if b.has(f"{name}.bias", il):
        y = b.ctx.add(y, b.w(f"{name}.bias", il))
    return y


# --- feed-forward -----------------------------------------------------------------------
def ffn_dense(b: Builder, x: Tensor, il: int, prefix: str = "ffn", suffix: str = "") -> Tensor:
    ctx = b.ctx
    up = b.cb(ctx.mul_mat(b.w(f"{prefix}_up{suffix}.weight", il), x), f"{prefix}_up{suffix}", il)
    gate = b.cb(ctx.mul_mat(b.w(f"{prefix}_gate{suffix}.weight", il), x),
                f"{prefix}_gate{suffix}", il)
    act = b.cb(ctx.swiglu_split(gate, up), f"{prefix}_swiglu{suffix}", il)
    return b.cb(ctx.mul_mat(b.w(f"{prefix}_down{suffix}.weight", il), act),
                f"{prefix}_down{suffix}", il)


def ffn_moe(b: Builder, x: Tensor, il: int) -> Tensor:
    """Softmax router, top-k renormalised, SiLU-gated experts, plus the gated shared expert."""
    ctx, hp = b.ctx, b.hp
    n_embd, n_tok = x.ne[0], x.ne[1]
    n_expert, n_used = hp.n_expert, hp.n_expert_used
    logits = b.cb(ctx.mul_mat(b.w("ffn_gate_inp.weight", il), x), "ffn_moe_logits", il)
    probs = b.cb(ctx.soft_max_ext(logits, None, 1.0), "ffn_moe_probs", il)
    selected = b.cb(ctx.argsort_top_k(probs, n_used), "ffn_moe_topk", il)
    weights = ctx.get_rows(ctx.reshape(probs, (1, n_expert, n_tok)), selected)
    b.cb(weights, "ffn_moe_weights", il)
    weights = ctx.reshape(weights, (n_used, n_tok))
    wsum = ctx.clamp(ctx.sum_rows(weights), 6.103515625e-5, math.inf)
    weights = ctx.reshape(ctx.div(weights, wsum), (1, n_used, n_tok))
    b.cb(weights, "ffn_moe_weights_norm", il)
    b.graph.expand(weights)
    cur = ctx.reshape(x, (n_embd, 1, n_tok))
    if b.has("ffn_gate_up_exps.weight", il):
        gate_up = ctx.mul_mat_id(b.w("ffn_gate_up_exps.weight", il), cur, selected)
        n_ff = gate_up.ne[0] // 2
        gate = ctx.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]),
                        (gate_up.nb[1], gate_up.nb[2]), 0)
        up = ctx.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]),
                      (gate_up.nb[1], gate_up.nb[2]), n_ff * gate_up.nb[0])
    else:
        up = b.cb(ctx.mul_mat_id(b.w("ffn_up_exps.weight", il), cur, selected), "ffn_moe_up", il)
        gate = b.cb(ctx.mul_mat_id(b.w("ffn_gate_exps.weight", il), cur, selected),
                    "ffn_moe_gate", il)
    act = b.cb(ctx.swiglu_split(gate, up), "ffn_moe_swiglu", il)
    experts = b.cb(ctx.mul_mat_id(b.w("ffn_down_exps.weight", il), act, selected),
                   "ffn_moe_down", il)
    experts = b.cb(ctx.mul(experts, weights), "ffn_moe_weighted", il)
    b.graph.expand(experts)
    views = [ctx.view(experts, (n_embd, n_tok), (experts.nb[2],), i * experts.nb[1])
             for i in range(n_used)]
    for v in views:
        b.graph.expand(v)
    out = views[0]
    for v in views[1:]:
        out = ctx.add(out, v)
        b.graph.expand(out)
    if n_used == 1:
        out = ctx.cont(out)
    out = b.cb(out, "ffn_moe_out", il)
    if b.has("ffn_up_shexp.weight", il):
        sh = ffn_dense(b, x, il, suffix="_shexp")
        gate = ctx.sigmoid(ctx.mul_mat(b.w("ffn_gate_inp_shexp.weight", il), x))
        sh = b.cb(ctx.mul(sh, gate), "ffn_shexp_gated", il)
        out = ctx.add(out, sh)
    return out


def ffn(b: Builder, x: Tensor, il: int) -> Tensor:
    if b.has("ffn_gate_inp.weight", il):
        return ffn_moe(b, x, il)
    return ffn_dense(b, x, il)


# --- gated full attention ---------------------------------------------------------------
GATHER_MIN_T = 8  # ubatches of at least this many tokens per sequence gather their windows


@dataclass
class AttnInputs:
    """Graph inputs shared by every attention layer of one ubatch.

    The KV cache interleaves the slots: the K/V of position p of slot s is cache row
    ``p * n_slots + s``. Which slots the sequences use is data, not shape, so one graph
    serves any combination of slots (continuous batching never rebuilds graphs):

    * ``window`` (decode / verify: few tokens): every sequence attends over the first
      ``n_kv * n_slots`` rows, a plain view of the cache, with the other slots' cells
      masked out (ggml's CPU flash attention skips masked cells, so they cost a compare);
    * gather (prompt chunks of ``GATHER_MIN_T`` or more tokens per sequence, several
      slots): each sequence's ``n_kv`` rows are gathered (``kv_rows``) into a contiguous
      window, a copy amortised over the chunk's tokens, so attention does no extra work.

    With one slot both are the plain contiguous window.
    """

    pos: Tensor  # I32 [4 * n_tokens]: (p, p, p, 0) per token, sectioned
    mask: Tensor  # F16 gather: [n_kv, T, 1, B]; window: [n_kv * n_slots, T * B, 1, 1]
    kv_idx: Tensor  # I64 [n_tokens]: pos * n_slots + slot, where each token's K/V goes
    kv_rows: Tensor | None  # I32 [n_kv * B]: p * n_slots + slot (gather only)
    n_kv: int
    n_slots: int

    @property
    def gather(self) -> bool:
        return self.kv_rows is not None


class EmbdInputs:
    """Rows given as embeddings in place of token rows (image rows): the graph inputs, the
    host arrays bound to them and the select rule, one owner for the trunk and the MTP
    head. Row i takes the token's embedding, or embedding row i (index n + i of the two
    concatenated: one get_rows, no branch in the graph)."""

    def __init__(self, ctx: Context, n_embd: int, n: int, prefix: str = "") -> None:
        self.embd = ctx.input("f32", (n_embd, n), f"{prefix}inp_embd")
        self.sel = ctx.input("i32", (n,), f"{prefix}inp_embd_sel")
        self._embd = np.zeros((n, n_embd), np.float32)
        self._sel = np.zeros(n, np.int32)
        self._rows = np.arange(n, dtype=np.int32)

    def select(self, ctx: Context, tok_embd: Tensor) -> Tensor:
        """``tok_embd`` [n_embd, n] with the embedding rows put in."""
        return ctx.get_rows(ctx.concat(tok_embd, self.embd, 1), self.sel)

    def bindings(self) -> list[HostBinding]:
        return [HostBinding(self.embd, self._embd), HostBinding(self.sel, self._sel)]

    def fill(self, embd: np.ndarray, is_embd: np.ndarray) -> None:
        """``embd`` [n, n_embd] (read where ``is_embd``), ``is_embd`` bool [n]."""
        self._embd[:] = embd
        np.add(self._rows, np.where(is_embd, self._rows.size, 0), out=self._sel,
               casting="unsafe")


class CausalInputs:
    """Positions, causal mask and KV cells of one ubatch: the graph inputs and the host
    arrays bound to them (filled in place every step, one C call per input)."""

    def __init__(self, ctx: Context, T: int, B: int, n_kv: int, n_slots: int,
                 prefix: str = "") -> None:
        n = T * B
        self.T, self.B, self.n_kv, self.S = T, B, n_kv, n_slots
        gather = n_slots > 1 and T >= GATHER_MIN_T
        width = n_kv if gather else n_kv * n_slots
        self.pos = ctx.input("i32", (4 * n,), f"{prefix}inp_pos")
        # gather: a mask per sequence; window: one row per token (the same bytes)
        self.mask = ctx.input("f16", (width, T, 1, B) if gather else (width, n, 1, 1),
                              f"{prefix}kq_mask")
        self.kv_idx = ctx.input("i64", (n,), f"{prefix}kv_idx")
        self.kv_rows = ctx.input("i32", (n_kv * B,), f"{prefix}kv_rows") if gather else None
        self.attn = AttnInputs(self.pos, self.mask, self.kv_idx, self.kv_rows, n_kv, n_slots)
        self._pos = np.zeros((4, n), np.int32)
        self._mask = np.zeros((B, 1, T, width), np.float16)
        self._kv_idx = np.zeros((B, T), np.int64)
        self._kv_rows = np.zeros((B, n_kv), np.int32)
        self._cells = np.arange(n_kv, dtype=np.int64)
        self._t = np.arange(T, dtype=np.int64)
        self._p = np.zeros((B, T), np.int64)
        self._visible = np.zeros((B, T, n_kv), bool)
        self._slot = np.zeros((B, 1), np.int64)
        self._slots: tuple | None = None
        self._z = False  # section 3 holds given positions (not all 0)

    def bindings(self) -> list[HostBinding]:
        out = [HostBinding(self.pos, self._pos), HostBinding(self.mask, self._mask),
               HostBinding(self.kv_idx, self._kv_idx)]
        if self.kv_rows is not None:
            out.append(HostBinding(self.kv_rows, self._kv_rows))
        return out

    def fill(self, pos0: np.ndarray, slots: tuple[int, ...], rope: np.ndarray | None = None,
             shift: np.ndarray | None = None) -> None:
        """Row t of sequence b sits in cell pos0[b] + t and sees its slot's cells 0..that
        cell. Its RoPE position is the cell's, less ``shift[b]`` (text after images), or
        given: ``rope`` int32 [4, B*T], sectioned (t, y, x, z) per row (image rows)."""
        S = self.S
        pos = self._p
        np.add(pos0[:, None], self._t[None, :], out=pos)  # [B, T]
        if rope is not None:
            self._pos[:] = rope
            self._z = True
        else:
            if shift is None:
                self._pos[:3] = pos.reshape(-1)  # M-RoPE: (p, p, p, 0) per token, sectioned
            else:
                self._pos[:3] = (pos - shift[:, None]).reshape(-1)
            if self._z:  # section 3 was written by a row-by-row fill
                self._pos[3] = 0
                self._z = False
        if slots != self._slots:  # only when the slots change
            self._slots = tuple(slots)
            self._slot[:, 0] = slots
            if self.kv_rows is not None:
                self._kv_rows[:] = self._cells[None, :] * S + self._slot
        np.less_equal(self._cells[None, None, :], pos[:, :, None], out=self._visible)
        m = self._mask[:, 0]
        m.fill(np.float16(-np.inf))
        if self.kv_rows is not None or S == 1:
            m[self._visible] = 0
        else:  # cell p * S + slot of the interleaved window
            m4 = m.reshape(self.B, self.T, self.n_kv, S)
            for b, slot in enumerate(self._slots):
                m4[b, :, :, slot][self._visible[b]] = 0
        np.multiply(pos, S, out=self._kv_idx)
        self._kv_idx += self._slot


def _kv_window(b: Builder, written: Tensor, cache: Tensor, hd: int, n_head_kv: int,
               inp: AttnInputs) -> Tensor:
    """The keys or values each sequence attends over, [hd, cells, H_kv, 1 or B]."""
    ctx = b.ctx
    if not inp.gather:  # the first n_kv positions of every slot, a view of the cache
        cell = written.nb[1]
        v = ctx.view(written, (hd, n_head_kv, inp.n_kv * inp.n_slots, 1),
                     (cell // n_head_kv, cell, cell * inp.n_kv * inp.n_slots), 0)
        return ctx.permute(v, 0, 2, 1, 3)
    # each sequence's own rows, gathered and cast back to the cache type, so attention
    # computes exactly what it would on a contiguous view
    rows = ctx.get_rows(written, inp.kv_rows)  # f32 [n_embd_kv, n_kv * B]
    if cache.type != rows.type:
        rows = ctx.cpy(rows, ctx.new_tensor(cache.type, rows.shape))
    rows = ctx.reshape(rows, (hd, n_head_kv, inp.n_kv, b.n_seqs))
    return ctx.permute(rows, 0, 2, 1, 3)


def attention(b: Builder, x: Tensor, il: int, inp: AttnInputs, k_cache: Tensor,
              v_cache: Tensor, written: list[Tensor] | None = None) -> Tensor:
    """Gated attention over the cache after writing this ubatch's K/V into it. ``written``
    receives the written caches: a later step of the same graph passes them as its
    caches, so its reads depend on these writes (the MTP head's chained drafts)."""
    ctx, hp = b.ctx, b.hp
    hd, n_head, n_head_kv = hp.head_dim, hp.n_head, hp.n_head_kv
    T, B, n_tok = b.n_seq_tokens, b.n_seqs, b.n_tokens
    if b.has("attn_qkv.weight", il):
        qkv = linear(b, x, "attn_qkv", il)
        q_full = ctx.view(qkv, (hd * n_head * 2, n_tok), (qkv.nb[1],), 0)
        k = ctx.view(qkv, (hd * n_head_kv, n_tok), (qkv.nb[1],), hd * n_head * 2 * 4)
        v = ctx.view(qkv, (hd * n_head_kv, n_tok), (qkv.nb[1],), hd * (n_head * 2 + n_head_kv) * 4)
        k, v = ctx.cont(k), ctx.cont(v)
    else:
        q_full = linear(b, x, "attn_q", il)
        k = linear(b, x, "attn_k", il)
        v = linear(b, x, "attn_v", il)
    b.cb(q_full, "Qcur_full", il)
    es = 4
    q = ctx.view(q_full, (hd, n_head, n_tok), (es * hd * 2, es * hd * 2 * n_head), 0)
    q = b.cb(rms_norm(b, q, b.w("attn_q_norm.weight", il)), "Qcur_normed", il)
    k = ctx.reshape(k, (hd, n_head_kv, n_tok))
    k = b.cb(rms_norm(b, k, b.w("attn_k_norm.weight", il)), "Kcur_normed", il)
    gate = ctx.view(q_full, (hd, n_head, n_tok), (es * hd * 2, es * hd * 2 * n_head), es * hd)
    gate = b.cb(ctx.cont(gate, (hd * n_head, n_tok)), "gate_reshaped", il)
    v = ctx.reshape(v, (hd, n_head_kv, n_tok))
    # freq/YaRN arguments resolved from the file as llama.cpp's context does (modelfile.rope)
    rope = {"n_dims": hp.n_rot, "sections": hp.rope_sections, "mode": ROPE_TYPE_IMROPE,
            **hp.rope.kwargs()}
    q = b.cb(ctx.rope_multi(q, inp.pos, **rope), "Qcur", il)
    k = b.cb(ctx.rope_multi(k, inp.pos, **rope), "Kcur", il)
    b.cb(v, "Vcur", il)

    # write this ubatch's K/V into the cache cells, then attend over the written cache
    k_all = ctx.reshape(k_cache, (k_cache.ne[0], k_cache.ne[1] * k_cache.ne[2]))
    v_all = ctx.reshape(v_cache, (v_cache.ne[0], v_cache.ne[1] * v_cache.ne[2]))
    k_written = ctx.set_rows(k_all, ctx.reshape(k, (hd * n_head_kv, n_tok)), inp.kv_idx)
    v_written = ctx.set_rows(v_all, ctx.reshape(v, (hd * n_head_kv, n_tok)), inp.kv_idx)
    b.graph.expand(k_written)
    b.graph.expand(v_written)
    if written is not None:
        written += [k_written, v_written]

    if inp.gather:  # [hd, T, H, B] against each sequence's own window
        q4 = ctx.permute(ctx.reshape(q, (hd, n_head, T, B)), 0, 2, 1, 3)
    else:  # every token of the batch against the shared window, its mask row its own
        q4 = ctx.permute(ctx.reshape(q, (hd, n_head, n_tok, 1)), 0, 2, 1, 3)
    kv = _kv_window(b, k_written, k_cache, hd, n_head_kv, inp)
    vv = _kv_window(b, v_written, v_cache, hd, n_head_kv, inp)
    o = ctx.flash_attn_ext(q4, kv, vv, inp.mask, 1.0 / math.sqrt(hd), f32_acc=True)
    o = ctx.reshape(o, (hd * n_head, n_tok))
    b.cb(o, "attn_pregate", il)
    o = b.cb(ctx.mul(o, ctx.sigmoid(gate)), "attn_gated", il)
    return b.cb(linear(b, o, "attn_output", il), "attn_output", il)


# --- gated delta net --------------------------------------------------------------------
@dataclass
class RecurrentInputs:
    """Which state rows a ubatch reads and where its new states go.

    ``src_rows`` [B]: each sequence's current row. ``n_write`` 1: ``dst_rows`` [B] receive
    the final states. ``n_write`` T (speculative rollback): the state after every token --
    the op's snapshots and a conv window per token -- is listed in ``kept`` (one
    :class:`KeptStates` per layer), and the graph's builder places those tensors in the
    state arena (:class:`~pyggspec.memory.recurrent.RecurrentState`), where the op writes
    them directly; once acceptance is known, a sequence's state is the arena row of its
    last accepted token. Written into snapshot rows with ``set_rows``, every snapshot
    crossed memory three times (op output, read, row) where one in T is kept: at ``-np 4``
    with three drafts that was 15% of a verify step; copied out of the compute buffer,
    the kept one still cost 10-14 ms of a ~280 ms 4 x 4 step.
    """

    src_rows: Tensor
    dst_rows: Tensor | None
    n_write: int
    kept: list[KeptStates] | None = None


@dataclass
class KeptStates:
    """One GDN layer's states after each token of a verify ubatch (graph nodes to place).

    ``ssm``: the op's output; sequence ``b``'s state after token ``T - 1 - j`` is ``D``
    floats at byte ``ssm_offset + (j * B + b) * D * 4``. ``conv[j]`` [n_embd_r, B]: the
    conv windows after token ``T - 1 - j``, sequence ``b`` in column ``b``."""

    il: int
    ssm: Tensor
    ssm_offset: int
    conv: list[Tensor]


def gated_delta_net(b: Builder, x: Tensor, il: int, inp: RecurrentInputs, conv_states: Tensor,
                    ssm_states: Tensor) -> Tensor:
    ctx, hp = b.ctx, b.hp
    T, B = b.n_seq_tokens, b.n_seqs
    S, Hk, Hv = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    head_v = hp.ssm_d_inner // Hv
    d_conv = hp.ssm_d_conv
    conv_ch = hp.ssm_d_inner + 2 * Hk * S

    qkv = b.cb(ctx.reshape(ctx.mul_mat(b.w("attn_qkv.weight", il), x), (conv_ch, T, B)),
               "linear_attn_qkv_mixed", il)
    z = b.cb(ctx.mul_mat(b.w("attn_gate.weight", il), x), "z", il)
    beta = ctx.reshape(ctx.mul_mat(b.w("ssm_beta.weight", il), x), (1, Hv, T, B))
    beta = b.cb(ctx.sigmoid(beta), "beta_sigmoid", il)
    alpha = ctx.reshape(ctx.mul_mat(b.w("ssm_alpha.weight", il), x), (Hv, T, B))
    alpha = ctx.softplus(ctx.add(alpha, b.w("ssm_dt.bias", il)))
    g = b.cb(ctx.mul(alpha, b.w("ssm_a", il)), "gate", il)
    g = ctx.reshape(g, (1, Hv, T, B))

    # conv window: previous d_conv-1 inputs per channel, then this ubatch's inputs
    conv_prev = ctx.reshape(ctx.get_rows(conv_states, inp.src_rows), (d_conv - 1, conv_ch, B))
    b.cb(conv_prev, "conv_states_reshaped", il)
    conv_in = b.cb(ctx.concat(conv_prev, ctx.transpose(qkv), 0), "conv_input", il)
    keep = inp.n_write > 1
    wins = []
    for j in range(inp.n_write):  # window after token T-1-j: columns T-j .. T-j+d_conv-2
        win = ctx.view(conv_in, (d_conv - 1, conv_ch, B), (conv_in.nb[1], conv_in.nb[2]),
                       (T - j) * conv_in.nb[0])
        win = ctx.cont(win, ((d_conv - 1) * conv_ch, B))
        if keep:
            wins.append(b.cb(win.set_output(), f"conv_kept_{j}", il))
            b.graph.expand(win)
        else:
            b.graph.expand(ctx.set_rows(conv_states, win, inp.dst_rows))

    state = ctx.reshape(ctx.get_rows(ssm_states, inp.src_rows), (head_v, head_v, Hv, B))
    b.cb(state, "state_predelta", il)
    conv_out = b.cb(ctx.silu(ctx.ssm_conv(conv_in, b.w("ssm_conv1d.weight", il))),
                    "conv_output_silu", il)
    row = conv_out.nb[1]  # [conv_ch, T, B]
    f = 4
    q = ctx.view(conv_out, (S, Hk, T, B), (S * f, row, row * T), 0)
    k = ctx.view(conv_out, (S, Hk, T, B), (S * f, row, row * T), S * Hk * f)
    v = ctx.view(conv_out, (head_v, Hv, T, B), (head_v * f, row, row * T), 2 * S * Hk * f)
    q = b.cb(l2_norm(b, q), "q_conv_predelta", il)
    k = b.cb(l2_norm(b, k), "k_conv_predelta", il)

    out = ctx.gated_delta_net(q, k, v, g, beta, state, inp.n_write)
    n_out = head_v * Hv * T * B
    o = b.cb(ctx.view(out, (head_v, Hv, T, B), (head_v * f, head_v * Hv * f, head_v * Hv * T * f),
                      0), "attn_output", il)
    D = head_v * head_v * Hv  # snapshots follow the outputs, most recent first, B per slot
    if keep:  # every snapshot goes to the state arena (the builder places ``out`` there)
        b.graph.expand(out.set_output())
        assert inp.kept is not None
        inp.kept.append(KeptStates(il, out, n_out * f, wins))
    else:
        new_states = ctx.view(out, (D, B), (D * f,), n_out * f)
        b.graph.expand(ctx.set_rows(ssm_states, new_states, inp.dst_rows))

    z4 = ctx.reshape(z, (head_v, Hv, T, B))
    o = ctx.mul(rms_norm(b, o, b.w("ssm_norm.weight", il)), ctx.silu(z4))
    o = b.cb(ctx.reshape(o, (head_v * Hv, T * B)), "final_output", il)
    return b.cb(ctx.mul_mat(b.w("ssm_out.weight", il), o), "linear_attn_out", il)
