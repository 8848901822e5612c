"""Sampling parameters with llama.cpp's CLI names and defaults (their click options are in
:mod:`pyggspec.cli.common`).

Defaults follow ``common_params_sampling`` (``common/common.h``); sampler names and aliases
follow ``common_sampler_types_from_names`` (``common/sampling.cpp``), so a ``--samplers``
string that works with llama.cpp works here.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyggspec.errors import PyggspecError

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.sampling.grammar import Grammar

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: draw a random seed

# canonical names, in llama.cpp's default order (common_params_sampling::samplers)
DEFAULT_SAMPLERS: tuple[str, ...] = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
)
# samplers llama.cpp knows that pyggspec does not implement; their parameters are not exposed
# here, so they are always in their disabled state and become no-ops (as llama.cpp's "empty").
UNIMPLEMENTED = frozenset({"dry", "top_n_sigma", "xtc", "infill", "adaptive_p"})
_CANONICAL = frozenset(DEFAULT_SAMPLERS) | {"infill", "adaptive_p"}
_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
          "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties",
          "a": "adaptive_p"}


def _aliases() -> dict[str, str]:
    out = {n: n for n in _CANONICAL}
    for n in _CANONICAL:
        if "_" in n:
            out[n.replace("_", "-")] = n
            out[n.replace("_", "")] = n
    out.update({"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"})
    return out


_ALIASES = _aliases()


def parse_samplers(value: str) -> tuple[str, ...]:
    """``"top_k;top-p;temp"`` (names, ``;``-separated) -> canonical names. Unknown names
    are an error here (llama.cpp only warns: a typo silently changing the chain is worse)."""
    names = []
    for raw in value.split(";"):
        raw = raw.strip().lower()
        if not raw:
            continue
        if raw not in _ALIASES:
            raise ValueError(f"unknown sampler '{raw}' (known: {', '.join(sorted(_CANONICAL))})")
        names.append(_ALIASES[raw])
    return tuple(names)


def parse_sampler_chars(value: str) -> tuple[str, ...]:
    """llama.cpp's ``--sampler-seq`` form, e.g. ``"ekypmt"``."""
    bad = [c for c in value if c not in _CHARS]
    if bad:
        raise ValueError(f"unknown sampler char(s) {''.join(bad)!r}")
    return tuple(_CHARS[c] for c in value)


def parse_logit_bias(items: tuple[str, ...] | list[str]) -> tuple[tuple[int, float], ...]:
    """``["15043+1", "2-inf"]`` -> ((15043, 1.0), (2, -inf)), as llama.cpp's ``-l`` reads
    them: the token id, one sign character, then the rest as a number (so ``5+1e-3``,
    ``5-1e+2`` and ``5+-1`` parse as there)."""
    out = []
    for item in items:
        m = _LOGIT_BIAS.match(item)
        try:
            if m is None:
                raise ValueError
            mag = float(m.group(3))
        except ValueError:
            raise ValueError(f"logit bias must be TOKEN_ID(+/-)BIAS, got '{item}'") from None
        out.append((int(m.group(1)), -mag if m.group(2) == "-" else mag))
    return tuple(out)


_LOGIT_BIAS = re.compile(r"\s*(\d+)([+-])(.+)")


class SamplingParamError(PyggspecError, ValueError):
    """A sampling value out of range: one line naming the flag (a ValueError for callers
    that validate values before they reach the CLI)."""


_FLOAT32_MAX = 3.4028234663852886e38


def _unit_interval(flag: str, x: float) -> None:
    if not 0.0 <= x <= 1.0:  # NaN fails too
        raise SamplingParamError(flag, f"must be between 0 and 1, got {x}")


def _integer(flag: str, x: int) -> None:
    try:
        operator.index(x)
    except TypeError:
        raise SamplingParamError(flag, f"must be an integer, got {x!r}") from None


def _finite(flag: str, x: float) -> None:
    if not math.isfinite(x):
        raise SamplingParamError(flag, f"must be a finite number, got {x}")


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampler settings (llama.cpp names in comments).

    Every value is checked here, so no chain ever sees a value that would filter out every
    candidate or turn the logits into NaN: temperature finite (and 1/temp finite in
    float32), top_p / min_p / typical_p in [0, 1], penalties finite, logit biases a real
    number or -inf (a ban). Token ids in ``logit_bias`` are checked against the vocabulary
    by :meth:`check_vocab` once it is known.
    """

    temp: float = 0.80  # --temp; <= 0 means greedy
    top_k: int = 40  # --top-k; <= 0 disables
    top_p: float = 0.95  # --top-p; 1.0 disables
    min_p: float = 0.05  # --min-p; 0.0 disables
    typical_p: float = 1.00  # --typical; 1.0 disables
    repeat_penalty: float = 1.00  # --repeat-penalty; 1.0 disables
    repeat_last_n: int = 64  # --repeat-last-n; 0 disables penalties
    presence_penalty: float = 0.00  # --presence-penalty
    frequency_penalty: float = 0.00  # --frequency-penalty
    seed: int = DEFAULT_SEED  # --seed; 0xFFFFFFFF draws a random seed
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS  # --samplers
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # --logit-bias
    # --grammar / --json-schema, compiled for the engine's vocabulary (sampling.grammar);
    # each chain gets its own matcher
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        for flag, v in (("--top-k", self.top_k), ("--repeat-last-n", self.repeat_last_n),
                        ("--seed", self.seed)):
            _integer(flag, v)
        _finite("--temp", self.temp)
        if self.temp > 0 and 1.0 / self.temp > _FLOAT32_MAX:
            raise SamplingParamError("--temp", f"{self.temp} is too small for float32 "
                                     "logits; use 0 for greedy")
        _unit_interval("--top-p", self.top_p)
        _unit_interval("--min-p", self.min_p)
        _unit_interval("--typical", self.typical_p)
        rp = self.repeat_penalty
        if not math.isfinite(rp) or rp <= 0 or not math.isfinite(1.0 / rp):
            raise SamplingParamError("--repeat-penalty",
                                     f"must be finite and greater than 0, got {rp}")
        if self.repeat_last_n < 0:
            raise SamplingParamError("--repeat-last-n", f"must be >= 0, got {self.repeat_last_n}")
        _finite("--presence-penalty", self.presence_penalty)
        _finite("--frequency-penalty", self.frequency_penalty)
        if not (0 <= self.seed <= 0xFFFFFFFFFFFFFFFF):
            raise SamplingParamError("--seed", "must be a non-negative 64-bit integer, "
                                     f"got {self.seed}")
        for tok, bias in self.logit_bias:
            _integer("--logit-bias", tok)
            if tok < 0:
                raise SamplingParamError("--logit-bias", f"token id {tok} is negative")
            if math.isnan(bias) or bias == math.inf:
                raise SamplingParamError("--logit-bias", f"bias of token {tok} must be a "
                                         f"number or -inf, got {bias}")
        unknown = [s for s in self.samplers if s not in _CANONICAL]
        if unknown:
            raise SamplingParamError("--samplers", f"unknown sampler(s): {', '.join(unknown)}")

    def check_vocab(self, n_vocab: int) -> None:
        """Every ``logit_bias`` token id must exist in a vocabulary of ``n_vocab`` tokens."""
        for tok, _ in self.logit_bias:
            if tok >= n_vocab:
                raise SamplingParamError("--logit-bias", f"token {tok} is outside the "
                                         f"vocabulary (0..{n_vocab - 1})")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    @property
    def penalties_active(self) -> bool:
        return self.repeat_last_n != 0 and not (
            self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"temp": self.temp, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "typical_p": self.typical_p,
                "repeat_penalty": self.repeat_penalty, "repeat_last_n": self.repeat_last_n,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "seed": self.seed,
                "samplers": ";".join(self.samplers),
                "logit_bias": [list(b) for b in self.logit_bias]}


def graph_sampling(flag: bool | None, device_name: str) -> bool:
    """Whether sampler chains run in the graph of logits on ``device_name``: as asked, else
    on any device but the CPU. On a GPU (or remote) device the graph saves the 1 MB read-back
    and the numpy pass per row; on the CPU the host is faster on peaked logits, because it
    prunes every token that cannot win the Gumbel-max while the graph computes the noise of
    the full row (docs/benchmarks.md, "In-graph counter-keyed noise")."""
    return flag if flag is not None else device_name != "CPU"
