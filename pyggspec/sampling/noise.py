"""Counter-keyed Gumbel noise, computed the same way in a ggml graph and in numpy.

The noise of token ``id`` for the ``counter``-th sampled token of a chain with key ``key``
is a pure function ``g(key, counter, id)``. Graph and host evaluate one recipe
(:func:`_recipe`) with the same float32 operations in the same order, each of which has a
single correctly rounded result on every backend, so the values are bit-identical:

* add, sub and mul as separate ops (a ggml op never fuses across ops);
* ``scale`` by a constant (one rounding) and ``scale_bias`` only where the product is
  exact (so a fused multiply-add rounds the same as two ops);
* ``step``, ``floor``, int32 -> float32 conversion (round to nearest even) and reading a
  float's bits as an int32 (a view, no arithmetic).

No exp, log, division or sqrt runs (their last bits differ between libm, numpy and CUDA's
fast math). No value is a denormal.

Construction
    1. A uniform 23-bit integer ``n`` per token by additive tabulation over two factorings
       of the id, ``id = hi1 * a + lo1 = hi2 * b + lo2`` (``a * b >= n_vocab``):
       ``n = (A1[lo1] + B1[hi1]) mod 2^23 + (A2[lo2] + B2[hi2]) mod 2^11`` with the four
       short key vectors (2 * (a + b) values, A1/B1 multiples of 2^11) drawn per
       (key, counter) on the host by SplitMix64. In the graph this is two broadcast adds
       over ``[a, b]`` and ``[b, a]`` grids: per row only the key vectors (a few KB) are
       uploaded, never vocabulary-sized noise. Each part is uniform and 3-wise independent
       across ids; the two factorings do not share rectangles, so no structure of one grid
       survives in ``n``.
    2. ``u = (n + 1/2) / 2^23``, ``w = 1 - u`` (both exact) and the Gumbel value
       ``g = -ln(E)``, ``E = -ln(u)``: for ``w < 1/2`` (the upper tail, where precision
       matters) ``E = w * Q(w)`` with ``Q`` a degree-5 polynomial of ``-ln(1-w)/w``
       (error 1e-5); otherwise ``E = -ln2 * log2(u)``. ``log2(x)`` takes the exponent and
       mantissa from the float's bits: ``y = float(bits(x)) / 2^23``,
       ``log2 x ~ (y - 127) + C(y - floor y)`` with ``C`` a degree-5 polynomial of
       ``log2(1+t) - t`` (error 1.7e-5; the int -> float rounding adds at most 2^-17).
       The result is within ~3e-5 of the exact Gumbel transform of ``u``, and bounded:
       :data:`G_MIN` <= g <= :data:`G_MAX` (used to prune host candidates exactly).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pyggspec.ggml.context import Context
from pyggspec.ggml.tensor import Tensor

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

N_BITS = 23  # bits of the uniform n: (n + 1/2) / 2^23 is exact in float32
_LOW = 11  # bits of the second tabulation (A2 + B2); the first gives the top 12 bits
_HIGH_MOD = float(1 << N_BITS)
_LOW_MOD = float(1 << _LOW)
_F = np.float32
_LN2 = _F(np.log(2.0))
# -ln(1-w)/w on [0, 1/2], highest degree first (Chebyshev-node fit, float32)
_Q = tuple(_F(float.fromhex(h)) for h in (
    "0x1.a8a820p-1", "-0x1.293252p-2", "0x1.93e496p-2", "0x1.42c9eep-2", "0x1.00691ep-1",
    "0x1.ffff44p-1"))
# log2(1+t) - t on [0, 1], highest degree first
_C = tuple(_F(float.fromhex(h)) for h in (
    "0x1.604beep-5", "-0x1.7ffa06p-3", "0x1.a34c2ep-2", "-0x1.69b898p-1", "0x1.c41696p-2",
    "0x1.1511f8p-16"))


def splitmix64(x: int) -> int:
    """One SplitMix64 step on a Python int (a bijection on 64-bit values)."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_C1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_C2)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Grid:
    """The two factorings of the id range: ``[a, b]`` (id = hi1 * a + lo1) and ``[b, a]``."""

    a: int
    b: int

    @classmethod
    def for_vocab(cls, n_vocab: int) -> Grid:
        if n_vocab < 1:
            raise ValueError("noise: empty vocabulary")
        a = 1 << max(0, (int(np.ceil(np.sqrt(n_vocab))) - 1).bit_length())
        return cls(a, -(-n_vocab // a))

    @property
    def size(self) -> int:
        return self.a * self.b


@dataclass(frozen=True)
class RowKeys:
    """The key vectors of one (key, counter): float32 integers, A1/B1 multiples of 2^11."""

    a1: np.ndarray  # [a] in [0, 2^23)
    b1: np.ndarray  # [b]
    a2: np.ndarray  # [b] in [0, 2^11)
    b2: np.ndarray  # [a]


_KEY_CACHE: OrderedDict[tuple, RowKeys] = OrderedDict()
_KEY_CACHE_SIZE = 512


def row_keys(key: int, counter: int, grid: Grid) -> RowKeys:
    """Key vectors of the ``counter``-th sample of a chain (cached: the draft rows and the
    verify rows of a speculative step ask for the same counters)."""
    ck = (key, counter, grid)
    hit = _KEY_CACHE.get(ck)
    if hit is not None:
        _KEY_CACHE.move_to_end(ck)
        return hit
    base = np.uint64(splitmix64(key ^ splitmix64(counter)))
    a, b = grid.a, grid.b

    def stream(s: int, n: int, bits: int) -> np.ndarray:
        j = (np.arange(n, dtype=np.uint64) + np.uint64(s << 32)) * np.uint64(_GOLDEN)
        return (_mix(j + base) >> np.uint64(64 - bits)).astype(np.float32)

    keys = RowKeys(stream(1, a, 12) * _F(_LOW_MOD), stream(2, b, 12) * _F(_LOW_MOD),
                   stream(3, b, _LOW), stream(4, a, _LOW))
    _KEY_CACHE[ck] = keys
    if len(_KEY_CACHE) > _KEY_CACHE_SIZE:
        _KEY_CACHE.popitem(last=False)
    return keys


# --- the recipe, written once for both evaluators ---------------------------------------------
class _Ops:
    """What :func:`_recipe` needs; numpy and ggml implement it with the same roundings."""

    add: Callable
    sub: Callable
    mul: Callable
    scale: Callable  # (x, s): x * s, one rounding
    affine: Callable  # (x, s, c): x * s + c where x * s is exact
    step: Callable
    floor: Callable
    log2_bits: Callable  # x -> float32(int32 bits of x) * 2^-23


def _horner(ops: _Ops, coef: tuple, x):
    acc = ops.scale(x, coef[0])
    for c in coef[1:-1]:
        acc = ops.mul(ops.affine(acc, 1.0, c), x)
    return ops.affine(acc, 1.0, coef[-1])


def _log2(ops: _Ops, x):
    y = ops.log2_bits(x)
    t = ops.sub(y, ops.floor(y))
    return ops.add(ops.affine(y, 1.0, -127.0), _horner(ops, _C, t))


def _mod(ops: _Ops, s, m: float, quantum: float):
    """s mod m for s in [0, 2m), s a multiple of ``quantum``."""
    over = ops.step(ops.affine(s, 1.0, -(m - quantum / 2)))
    return ops.add(s, ops.scale(over, -m))


def _recipe(ops: _Ops, s_high, s_low):
    """Gumbel noise from the two tabulation sums (high: multiples of 2^11 below 2^24,
    low: below 2^12)."""
    n = ops.add(_mod(ops, s_high, _HIGH_MOD, _LOW_MOD), _mod(ops, s_low, _LOW_MOD, 1.0))
    u = ops.affine(n, 2.0 ** -N_BITS, 2.0 ** -(N_BITS + 1))
    w = ops.affine(n, -(2.0 ** -N_BITS), 1.0 - 2.0 ** -(N_BITS + 1))
    e_tail = ops.mul(_horner(ops, _Q, w), w)
    e_bulk = ops.scale(_log2(ops, u), -_LN2)
    tail = ops.step(ops.affine(w, -1.0, 0.5))  # w < 1/2 (w is never exactly 1/2)
    e = ops.add(ops.mul(tail, e_tail), ops.mul(ops.affine(tail, -1.0, 1.0), e_bulk))
    return ops.scale(_log2(ops, e), -_LN2)


class _NumpyOps(_Ops):
    """float32 arrays with float32 scalars: numpy rounds every op to float32 once."""

    @staticmethod
    def add(x, y):
        return x + y

    @staticmethod
    def sub(x, y):
        return x - y

    @staticmethod
    def mul(x, y):
        return x * y

    @staticmethod
    def scale(x, s):
        return x * _F(s)

    @staticmethod
    def affine(x, s, c):
        return x * _F(s) + _F(c) if s != 1.0 else x + _F(c)

    @staticmethod
    def step(x):
        return (x > 0).astype(np.float32)

    @staticmethod
    def floor(x):
        return np.floor(x)

    @staticmethod
    def log2_bits(x):
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
        return bits.astype(np.float32) * _F(2.0 ** -23)


_SPLIT_CACHE: dict[Grid, tuple[np.ndarray, ...]] = {}


def _split(ids: np.ndarray | None, grid: Grid, n_vocab: int) -> tuple[np.ndarray, ...]:
    if ids is None:
        hit = _SPLIT_CACHE.get(grid)
        if hit is None or len(hit[0]) != n_vocab:
            full = np.arange(n_vocab, dtype=np.int64)
            hit = tuple(x.astype(np.int32) for x in (*np.divmod(full, grid.a),
                                                      *np.divmod(full, grid.b)))
            _SPLIT_CACHE.clear()
            _SPLIT_CACHE[grid] = hit
        return hit
    ids = np.asarray(ids, dtype=np.int64)
    return (*np.divmod(ids, grid.a), *np.divmod(ids, grid.b))


def noise_host(key: int, counter: int, ids: np.ndarray | None, n_vocab: int) -> np.ndarray:
    """float32 noise for ``ids`` (None: all ``n_vocab``) of sample ``counter``: exactly the
    values the graph computes for those ids."""
    grid = Grid.for_vocab(n_vocab)
    k = row_keys(key, counter, grid)
    hi1, lo1, hi2, lo2 = _split(ids, grid, n_vocab)
    s_high = k.a1[lo1] + k.b1[hi1]
    s_low = k.a2[lo2] + k.b2[hi2]
    return _recipe(_NumpyOps, s_high, s_low)


def _bounds() -> tuple[float, float]:
    """The smallest and largest noise values: the extremes of n, with a margin for the
    polynomial's wiggles (it is monotone to within ~1e-5 between them)."""
    g = _recipe(_NumpyOps, np.array([0.0, _HIGH_MOD - _LOW_MOD], np.float32),
                np.array([0.0, _LOW_MOD - 1], np.float32))
    return float(g[0]) - 1e-3, float(g[1]) + 1e-3


G_MIN, G_MAX = _bounds()


# --- the graph evaluator ---------------------------------------------------------------------
class _GraphOps(_Ops):
    def __init__(self, ctx: Context, record: Callable[[Tensor], Tensor]) -> None:
        c, r = ctx, record
        self.add = lambda x, y: r(c.add(x, y))
        self.sub = lambda x, y: r(c.sub(x, y))
        self.mul = lambda x, y: r(c.mul(x, y))
        self.scale = lambda x, s: r(c.scale(x, float(s)))
        self.affine = lambda x, s, b: r(c.scale(x, float(s), float(b)))
        self.step = lambda x: r(c.step(x))
        self.floor = lambda x: r(c.floor(x))
        self.log2_bits = lambda x: r(c.scale(r(c.cast(c.view_bits(x, "i32"), "f32")),
                                             2.0 ** -23))


def build_noise(ctx: Context, n_vocab: int, n_rows: int,
                new_input: Callable[[str, str, tuple], Tensor],
                record: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """Append the noise of ``n_rows`` rows to a graph: returns ``[n_vocab, n_rows]`` f32.

    ``new_input(name, type, shape)`` creates the per-row key-vector inputs
    (``noise_a1`` [a, 1, R], ``noise_b1`` [1, b, R], ``noise_a2`` [b, 1, R],
    ``noise_b2`` [1, a, R]); write them with :func:`key_inputs`. ``record`` sees every op
    (the support probe)."""
    grid = Grid.for_vocab(n_vocab)
    a, b, R = grid.a, grid.b, n_rows
    a1 = new_input("noise_a1", "f32", (a, 1, R))
    b1 = new_input("noise_b1", "f32", (1, b, R))
    a2 = new_input("noise_a2", "f32", (b, 1, R))
    b2 = new_input("noise_b2", "f32", (1, a, R))
    s_high = record(ctx.add(record(ctx.repeat(a1, (a, b, R))), b1))
    s_low = record(ctx.add(record(ctx.repeat(a2, (b, a, R))), b2))
    g = _recipe(_GraphOps(ctx, record), ctx.reshape(s_high, (grid.size, R)),
                ctx.reshape(s_low, (grid.size, R)))
    if grid.size != n_vocab:
        g = ctx.view(g, (n_vocab, R), (g.nb[1],))
    return g


def key_inputs(keys: list[RowKeys]) -> dict[str, np.ndarray]:
    """Host arrays for :func:`build_noise`'s inputs, one :class:`RowKeys` per row, in the
    inputs' memory order ([row, ...])."""
    return {"noise_a1": np.stack([k.a1 for k in keys]),
            "noise_b1": np.stack([k.b1 for k in keys]),
            "noise_a2": np.stack([k.a2 for k in keys]),
            "noise_b2": np.stack([k.b2 for k in keys])}
