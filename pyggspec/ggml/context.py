"""ggml contexts and the ops pyggspec builds graphs from.

Every op checks in Python what ggml would ``GGML_ASSERT`` (shapes, types, contiguity),
so a wrong graph raises :class:`GraphError` instead of aborting the process. Contexts
are metadata-only (``no_alloc``): data lives in backend buffers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from typing_extensions import Self

from pyggspec.ggml import _lib
from pyggspec.ggml.dtypes import GGMLType
from pyggspec.ggml.tensor import Tensor

ROPE_TYPE_NEOX = 2
ROPE_TYPE_MROPE = 8
ROPE_TYPE_IMROPE = 40


class GraphError(ValueError):
    """An op was given tensors ggml would reject (a bug in the caller, not in the input)."""


def _ne(t: Tensor) -> tuple[int, int, int, int]:
    return t.ne


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise GraphError(msg)


def _can_repeat(small: Tensor, big: Tensor) -> bool:
    s, b = _ne(small), _ne(big)
    return all(s[i] > 0 and b[i] % s[i] == 0 for i in range(4))


def _row_size(t: GGMLType, ne0: int) -> int:
    return int(_lib.lib.ggml_row_size(int(t), ne0))


def _contiguous_rows(t: Tensor) -> bool:
    return t.ne[0] == _lib.lib.ggml_blck_size(int(t.type)) or t.nb[0] == _lib.lib.ggml_type_size(
        int(t.type)
    )


def _contiguous_1(t: Tensor) -> bool:
    """ggml_is_contiguous_1: contiguous ignoring the stride between rows."""
    ne, nb = t.ne, t.nb
    ts = _lib.lib.ggml_type_size(int(t.type))
    if nb[0] != ts and ne[0] != 1:
        return False
    expect = nb[1] * ne[1]
    for i in (2, 3):
        if ne[i] != 1:
            if nb[i] != expect:
                return False
            expect *= ne[i]
        else:
            expect = nb[i] * ne[i] if nb[i] else expect
    return True


class Context:
    """Owns a ggml_context. ``close()`` frees it; tensors must not be used afterwards."""

    def __init__(self, n_tensors: int, graph_size: int = 0) -> None:
        lib, ffi = _lib.lib, _lib.ffi
        mem = n_tensors * lib.ggml_tensor_overhead()
        if graph_size:
            mem += lib.ggml_graph_overhead_custom(graph_size, False)
        params = ffi.new("struct ggml_init_params *")
        params.mem_size = mem + 4096
        params.mem_buffer = ffi.NULL
        params.no_alloc = True
        ptr = lib.ggml_init(params[0])
        if ptr == ffi.NULL:
            raise MemoryError("ggml_init failed")
        self.ptr = ptr
        self.capacity = n_tensors
        self._count = 0
        self._finalizer = weakref.finalize(self, lib.ggml_free, ptr)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wrap(self, ptr) -> Tensor:
        if ptr == _lib.ffi.NULL:
            raise MemoryError("ggml context is full")
        self._count += 1
        return Tensor(ptr, self)

    def _check_room(self) -> None:
        if self.closed:
            raise GraphError("context is closed")
        if self._count >= self.capacity:
            raise GraphError(f"ggml context full ({self.capacity} tensors)")

    def tensors(self) -> list[Tensor]:
        """All tensors created in this context, in creation order."""
        lib, ffi = _lib.lib, _lib.ffi
        out = []
        t = lib.ggml_get_first_tensor(self.ptr)
        while t != ffi.NULL:
            out.append(Tensor(t, self))
            t = lib.ggml_get_next_tensor(self.ptr, t)
        return out

    # --- creation ---------------------------------------------------------------
    def new_tensor(self, type: GGMLType | str | int, shape: Sequence[int], name: str = "") -> Tensor:
        """A new tensor with ``shape`` in ggml order (ne0 first), 1 to 4 dims."""
        t = GGMLType.parse(type)
        _need(1 <= len(shape) <= 4, f"tensor {name!r}: 1 to 4 dims, got {len(shape)}")
        _need(all(int(n) >= 0 for n in shape), f"tensor {name!r}: negative dim in {shape}")
        blck = _lib.lib.ggml_blck_size(int(t))
        _need(int(shape[0]) % blck == 0, f"tensor {name!r}: ne0={shape[0]} not a multiple of {blck}")
        self._check_room()
        lib = _lib.lib
        s = [int(n) for n in shape]
        fn = (lib.ggml_new_tensor_1d, lib.ggml_new_tensor_2d, lib.ggml_new_tensor_3d,
              lib.ggml_new_tensor_4d)[len(s) - 1]
        out = self._wrap(fn(self.ptr, int(t), *s))
        if name:
            out.name = name
        return out

    def input(self, type: GGMLType | str | int, shape: Sequence[int], name: str) -> Tensor:
        """A named graph input (written by the host before each compute)."""
        return self.new_tensor(type, shape, name).set_input()

    # --- elementwise --------------------------------------------------------------
    def _binary(self, fn, a: Tensor, b: Tensor, what: str) -> Tensor:
        _need(_can_repeat(b, a), f"{what}: {b.shape} does not broadcast to {a.shape}")
        self._check_room()
        return self._wrap(fn(self.ptr, a.ptr, b.ptr))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary(_lib.lib.ggml_add, a, b, "add")

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary(_lib.lib.ggml_sub, a, b, "sub")

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary(_lib.lib.ggml_mul, a, b, "mul")

    def div(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary(_lib.lib.ggml_div, a, b, "div")

    def _unary(self, fn, a: Tensor, *args) -> Tensor:
        self._check_room()
        return self._wrap(fn(self.ptr, a.ptr, *args))

    def sqr(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_sqr, a)

    def sqrt(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_sqrt, a)

    def log(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_log, a)

    def exp(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_exp, a)

    def neg(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_neg, a)

    def step(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_step, a)

    def floor(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_floor, a)

    def relu(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_relu, a)

    def cast(self, a: Tensor, type: GGMLType | str | int) -> Tensor:
        """Convert element type (f32 -> i32 truncates; exact for integer values)."""
        return self._unary(_lib.lib.ggml_cast, a, int(GGMLType.parse(type)))

    def view_bits(self, a: Tensor, type: GGMLType | str | int) -> Tensor:
        """``a``'s bytes read as another 4-byte type (f32 <-> i32): a bit reinterpretation,
        not a conversion."""
        self._check_room()
        ptr = _lib.lib.pyggspec_view_bits(self.ptr, a.ptr, int(GGMLType.parse(type)))
        _need(ptr != _lib.ffi.NULL, f"view_bits: {a.type} and {type} are not both 4-byte types")
        return self._wrap(ptr)

    def sigmoid(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_sigmoid, a)

    def silu(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_silu, a)

    def softplus(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_softplus, a)

    def scale(self, a: Tensor, s: float, bias: float | None = None) -> Tensor:
        if bias is None:
            return self._unary(_lib.lib.ggml_scale, a, float(s))
        return self._unary(_lib.lib.ggml_scale_bias, a, float(s), float(bias))

    def clamp(self, a: Tensor, lo: float, hi: float) -> Tensor:
        return self._unary(_lib.lib.ggml_clamp, a, float(lo), float(hi))

    def fill(self, a: Tensor, value: float) -> Tensor:
        return self._unary(_lib.lib.ggml_fill, a, float(value))

    def swiglu_split(self, gate: Tensor, up: Tensor) -> Tensor:
        """silu(gate) * up, fused."""
        _need(gate.ne == up.ne, f"swiglu: shapes differ {gate.shape} vs {up.shape}")
        _need(gate.type == up.type, "swiglu: types differ")
        _need(_contiguous_1(gate) and _contiguous_1(up), "swiglu: inputs must be contiguous")
        self._check_room()
        return self._wrap(_lib.lib.ggml_swiglu_split(self.ptr, gate.ptr, up.ptr))

    # --- reductions / selection ---------------------------------------------------
    def sum_rows(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_sum_rows, a)

    def sum(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_sum, a)

    def cumsum(self, a: Tensor) -> Tensor:
        _need(a.type == GGMLType.F32, "cumsum: needs f32")
        return self._unary(_lib.lib.ggml_cumsum, a)

    def argmax(self, a: Tensor) -> Tensor:
        _need(a.ne[2] == 1 and a.ne[3] == 1, f"argmax: needs a matrix, got {a.shape}")
        return self._unary(_lib.lib.ggml_argmax, a)

    def argsort(self, a: Tensor, descending: bool = False) -> Tensor:
        order = _lib.lib.GGML_SORT_ORDER_DESC if descending else _lib.lib.GGML_SORT_ORDER_ASC
        return self._unary(_lib.lib.ggml_argsort, a, order)

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest per row, in no particular order."""
        _need(0 < k <= a.ne[0], f"top_k: k={k} outside 1..{a.ne[0]}")
        return self._unary(_lib.lib.ggml_top_k, a, int(k))

    def argsort_top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest per row, sorted descending."""
        _need(0 < k <= a.ne[0], f"argsort_top_k: k={k} outside 1..{a.ne[0]}")
        return self._unary(_lib.lib.ggml_argsort_top_k, a, int(k))

    # --- norms / matmul -------------------------------------------------------------
    def rms_norm(self, a: Tensor, eps: float) -> Tensor:
        return self._unary(_lib.lib.ggml_rms_norm, a, float(eps))

    def l2_norm(self, a: Tensor, eps: float) -> Tensor:
        return self._unary(_lib.lib.ggml_l2_norm, a, float(eps))

    def mul_mat(self, a: Tensor, b: Tensor, f32_acc: bool = False) -> Tensor:
        """a: [k, m, ...] (weights), b: [k, n, ...] -> [m, n, ...]."""
        an, bn = a.ne, b.ne
        _need(
            an[0] == bn[0] and bn[2] % an[2] == 0 and bn[3] % an[3] == 0,
            f"mul_mat: cannot multiply {a.name or 'a'}{a.shape} by {b.name or 'b'}{b.shape}",
        )
        _need(a.nb[0] <= a.nb[1], "mul_mat: first operand is transposed")
        self._check_room()
        out = self._wrap(_lib.lib.ggml_mul_mat(self.ptr, a.ptr, b.ptr))
        if f32_acc:
            _lib.lib.ggml_prec_set_acc(out.ptr, _lib.lib.GGML_PREC_F32)
        return out

    def mul_mat_id(self, experts: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """experts: [k, m, n_expert], b: [k, n_used|1, n_tok], ids: I32 [n_used, n_tok]."""
        en, bn, iN = experts.ne, b.ne, ids.ne
        _need(ids.type == GGMLType.I32, "mul_mat_id: ids must be i32")
        _need(en[3] == 1 and bn[3] == 1, "mul_mat_id: experts and b must be 3-d")
        _need(iN[2] == 1 and iN[3] == 1, "mul_mat_id: ids must be 2-d")
        _need(iN[1] == bn[2], f"mul_mat_id: ids {ids.shape} vs b {b.shape} token count")
        _need(en[0] == bn[0], f"mul_mat_id: experts {experts.shape} vs b {b.shape}")
        _need(bn[1] > 0 and iN[0] % bn[1] == 0, "mul_mat_id: ids do not broadcast over b")
        self._check_room()
        return self._wrap(_lib.lib.ggml_mul_mat_id(self.ptr, experts.ptr, b.ptr, ids.ptr))

    def add_id(self, a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        _need(ids.type == GGMLType.I32, "add_id: ids must be i32")
        _need(a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1], "add_id: shapes")
        self._check_room()
        return self._wrap(_lib.lib.ggml_add_id(self.ptr, a.ptr, b.ptr, ids.ptr))

    # --- layout -------------------------------------------------------------------
    def cpy(self, a: Tensor, dst: Tensor) -> Tensor:
        _need(a.nelements == dst.nelements, f"cpy: {a.shape} -> {dst.shape} element count")
        self._check_room()
        return self._wrap(_lib.lib.ggml_cpy(self.ptr, a.ptr, dst.ptr))

    def cont(self, a: Tensor, shape: Sequence[int] | None = None) -> Tensor:
        self._check_room()
        if shape is None:
            return self._wrap(_lib.lib.ggml_cont(self.ptr, a.ptr))
        s = [int(n) for n in shape] + [1] * (4 - len(shape))
        _need(s[0] * s[1] * s[2] * s[3] == a.nelements, f"cont: {a.shape} -> {tuple(shape)}")
        return self._wrap(_lib.lib.ggml_cont_4d(self.ptr, a.ptr, *s))

    def reshape(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        s = [int(n) for n in shape]
        _need(1 <= len(s) <= 4, "reshape: 1 to 4 dims")
        n = 1
        for d in s:
            n *= d
        _need(n == a.nelements, f"reshape: {a.shape} ({a.nelements}) -> {tuple(s)}")
        _need(a.is_contiguous, f"reshape: {a.name or 'tensor'} is not contiguous")
        self._check_room()
        lib = _lib.lib
        fn = (lib.ggml_reshape_1d, lib.ggml_reshape_2d, lib.ggml_reshape_3d,
              lib.ggml_reshape_4d)[len(s) - 1]
        return self._wrap(fn(self.ptr, a.ptr, *s))

    def view(
        self,
        a: Tensor,
        shape: Sequence[int],
        strides: Sequence[int] = (),
        offset: int = 0,
    ) -> Tensor:
        """View of ``a``: ``shape`` in ggml order, ``strides`` = nb1.. in bytes (len(shape)-1)."""
        s = [int(n) for n in shape]
        nb = [int(n) for n in strides]
        _need(1 <= len(s) <= 4, "view: 1 to 4 dims")
        _need(len(nb) == len(s) - 1, f"view: need {len(s) - 1} strides, got {len(nb)}")
        size = _row_size(a.type, s[0])
        for d in s[1:]:
            size *= d
        _need(offset >= 0 and offset + size <= a.nbytes,
              f"view: {size} bytes at offset {offset} exceed {a.name or 'tensor'} ({a.nbytes})")
        self._check_room()
        lib = _lib.lib
        if len(s) == 1:
            p = lib.ggml_view_1d(self.ptr, a.ptr, s[0], offset)
        elif len(s) == 2:
            p = lib.ggml_view_2d(self.ptr, a.ptr, s[0], s[1], nb[0], offset)
        elif len(s) == 3:
            p = lib.ggml_view_3d(self.ptr, a.ptr, s[0], s[1], s[2], nb[0], nb[1], offset)
        else:
            p = lib.ggml_view_4d(self.ptr, a.ptr, *s, nb[0], nb[1], nb[2], offset)
        return self._wrap(p)

    def permute(self, a: Tensor, *axes: int) -> Tensor:
        _need(sorted(axes) == [0, 1, 2, 3], f"permute: axes {axes} are not a permutation of 0..3")
        self._check_room()
        return self._wrap(_lib.lib.ggml_permute(self.ptr, a.ptr, *axes))

    def transpose(self, a: Tensor) -> Tensor:
        return self._unary(_lib.lib.ggml_transpose, a)

    def concat(self, a: Tensor, b: Tensor, dim: int) -> Tensor:
        _need(0 <= dim < 4, f"concat: dim {dim}")
        _need(a.type == b.type, "concat: types differ")
        for d in range(4):
            _need(d == dim or a.ne[d] == b.ne[d], f"concat: {a.shape} and {b.shape} on dim {dim}")
        self._check_room()
        return self._wrap(_lib.lib.ggml_concat(self.ptr, a.ptr, b.ptr, int(dim)))

    def repeat(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        s = [int(n) for n in shape] + [1] * (4 - len(shape))
        _need(all(s[i] % a.ne[i] == 0 for i in range(4)), f"repeat: {a.shape} -> {tuple(shape)}")
        self._check_room()
        return self._wrap(_lib.lib.ggml_repeat_4d(self.ptr, a.ptr, *s))

    def get_rows(self, a: Tensor, ids: Tensor) -> Tensor:
        """Rows of a (ne1 index) picked by ids (I32)."""
        _need(ids.type == GGMLType.I32, "get_rows: ids must be i32")
        _need(a.ne[2] == ids.ne[1] and a.ne[3] == ids.ne[2] and ids.ne[3] == 1,
              f"get_rows: {a.shape} by ids {ids.shape}")
        self._check_room()
        return self._wrap(_lib.lib.ggml_get_rows(self.ptr, a.ptr, ids.ptr))

    def set_rows(self, dst: Tensor, src: Tensor, ids: Tensor) -> Tensor:
        """Write rows of src into dst at ids (I32/I64); returns the dst view to expand."""
        dn, sn, iN = dst.ne, src.ne, ids.ne
        _need(dn[0] == sn[0] and dn[2] == sn[2] and dn[3] == sn[3],
              f"set_rows: src {src.shape} into dst {dst.shape}")
        _need(sn[1] == iN[0] and sn[2] % iN[1] == 0 and sn[3] % iN[2] == 0 and iN[3] == 1,
              f"set_rows: ids {ids.shape} for src {src.shape}")
        _need(src.type in (GGMLType.F32, GGMLType.F16), "set_rows: src must be f32/f16")
        _need(ids.type in (GGMLType.I32, GGMLType.I64), "set_rows: ids must be i32/i64")
        _need(_contiguous_rows(dst) and _contiguous_rows(src), "set_rows: rows not contiguous")
        self._check_room()
        return self._wrap(_lib.lib.ggml_set_rows(self.ptr, dst.ptr, src.ptr, ids.ptr))

    # --- attention / rope / recurrent ---------------------------------------------
    def soft_max_ext(self, a: Tensor, mask: Tensor | None, scale: float,
                     max_bias: float = 0.0) -> Tensor:
        _need(a.is_contiguous, "soft_max_ext: input must be contiguous")
        if mask is not None:
            _need(mask.type in (GGMLType.F16, GGMLType.F32), "soft_max_ext: mask f16/f32")
            _need(mask.is_contiguous, "soft_max_ext: mask must be contiguous")
            _need(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1]
                  and a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0,
                  f"soft_max_ext: mask {mask.shape} for {a.shape}")
        self._check_room()
        m = mask.ptr if mask is not None else _lib.ffi.NULL
        return self._wrap(_lib.lib.ggml_soft_max_ext(self.ptr, a.ptr, m, float(scale),
                                                     float(max_bias)))

    def rope_multi(self, a: Tensor, pos: Tensor, n_dims: int, sections: Sequence[int],
                   mode: int, n_ctx_orig: int, freq_base: float, freq_scale: float = 1.0,
                   ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> Tensor:
        """M-RoPE over a [hd, n_head, T]; pos is I32 [4*T] (4 position ids per token)."""
        _need(pos.type == GGMLType.I32, "rope_multi: positions must be i32")
        _need(pos.ne[1] == 1 and pos.ne[2] == 1 and pos.ne[3] == 1, "rope_multi: pos is a vector")
        _need(pos.ne[0] == 4 * a.ne[2], f"rope_multi: pos {pos.shape} for {a.shape} (4 per token)")
        _need(len(sections) == 4, "rope_multi: 4 sections")
        _need(n_dims <= a.ne[0] and n_dims % 2 == 0, f"rope_multi: n_dims {n_dims} vs {a.shape}")
        self._check_room()
        sec = _lib.ffi.new("int[4]", [int(s) for s in sections])
        return self._wrap(_lib.lib.ggml_rope_multi(
            self.ptr, a.ptr, pos.ptr, _lib.ffi.NULL, int(n_dims), sec, int(mode), int(n_ctx_orig),
            float(freq_base), float(freq_scale), float(ext_factor), float(attn_factor),
            float(beta_fast), float(beta_slow)))

    def flash_attn_ext(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                       scale: float, max_bias: float = 0.0, softcap: float = 0.0,
                       f32_acc: bool = False) -> Tensor:
        """q [hd, T, H, B], k/v [hd, n_kv, H_kv, B]; output [hd_v, H, T, B]."""
        qn, kn, vn = q.ne, k.ne, v.ne
        _need(kn[0] == qn[0] and qn[2] % kn[2] == 0 and qn[3] % kn[3] == 0,
              f"flash_attn_ext: q {q.shape} vs k {k.shape}")
        _need(qn[3] == kn[3] == vn[3], "flash_attn_ext: batch dims differ")
        if mask is not None:
            _need(mask.type == GGMLType.F16, "flash_attn_ext: mask must be f16")
            _need(mask.is_contiguous, "flash_attn_ext: mask must be contiguous")
            _need(qn[2] % mask.ne[2] == 0 and qn[3] % mask.ne[3] == 0, "flash_attn_ext: mask dims")
        self._check_room()
        m = mask.ptr if mask is not None else _lib.ffi.NULL
        out = self._wrap(_lib.lib.ggml_flash_attn_ext(self.ptr, q.ptr, k.ptr, v.ptr, m,
                                                      float(scale), float(max_bias),
                                                      float(softcap)))
        if f32_acc:
            _lib.lib.ggml_prec_set_acc(out.ptr, _lib.lib.GGML_PREC_F32)
        return out

    def ssm_conv(self, sx: Tensor, kernel: Tensor) -> Tensor:
        """Depthwise causal conv: sx [d_conv-1+T, C, B], kernel [d_conv, C] -> [C, T, B]."""
        _need(sx.ne[3] == 1 and kernel.ne[2] == 1 and kernel.ne[3] == 1, "ssm_conv: dims")
        d_conv, c = kernel.ne[0], kernel.ne[1]
        _need(sx.ne[1] == c and sx.ne[0] >= d_conv - 1,
              f"ssm_conv: input {sx.shape} vs kernel {kernel.shape}")
        self._check_room()
        return self._wrap(_lib.lib.ggml_ssm_conv(self.ptr, sx.ptr, kernel.ptr))

    def gated_delta_net(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                        state: Tensor, n_snapshots: int = 1) -> Tensor:
        """Fused gated delta rule. Output [S*H, T*B + K*S*B]: outputs, then K states
        (most recent first). v [S, H, T, B]; q/k [S, H_k, T, B]; g, beta [1, H, T, B];
        state [S, S, H, B]."""
        S, H, T, B = v.ne
        for t, nm in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
            _need(t.type == GGMLType.F32, f"gated_delta_net: {nm} must be f32")
        for t, nm in ((q, "q"), (k, "k"), (v, "v")):
            _need(_contiguous_rows(t), f"gated_delta_net: {nm} rows must be contiguous")
        for t, nm in ((g, "g"), (beta, "beta"), (state, "state")):
            _need(t.is_contiguous, f"gated_delta_net: {nm} must be contiguous")
        _need(q.ne[0] == S and k.ne[0] == S, "gated_delta_net: head dims differ")
        _need(q.ne[2:] == (T, B) and k.ne[2:] == (T, B), "gated_delta_net: q/k tokens differ")
        _need(H % q.ne[1] == 0 and q.ne[1] == k.ne[1], "gated_delta_net: head broadcast")
        _need(g.ne[0] in (1, S) and g.ne[1:] == (H, T, B), f"gated_delta_net: g {g.shape}")
        _need(beta.ne == (1, H, T, B), f"gated_delta_net: beta {beta.shape}")
        _need(state.ne == (S, S, H, B), f"gated_delta_net: state {state.shape}")
        _need(n_snapshots >= 1, "gated_delta_net: K >= 1")
        self._check_room()
        return self._wrap(_lib.lib.ggml_gated_delta_net(self.ptr, q.ptr, k.ptr, v.ptr, g.ptr,
                                                        beta.ptr, state.ptr, int(n_snapshots)))
