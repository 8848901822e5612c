"""The engine's settings in one place, checked once: built by the CLI, the server and the
Python API alike (``Engine(path, **kw)`` builds an :class:`EngineConfig` from ``kw``).

Everything that can be checked without opening the model is checked here, so a bad value
is one line naming its flag whoever built the config. Values the model decides (the
training context, whether an MTP head exists) are checked where the model is opened.
Adding an option is one field here (and, for the CLI, one line in ``cli/common.py``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pyggspec.errors import PyggspecError
from pyggspec.sampling.params import SamplingParams

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
ROLLBACKS = ("auto", "snapshot", "checkpoint")
DRAFT_SAMPLING = ("coupled", "greedy", "probabilistic")


class ConfigError(PyggspecError, ValueError):
    """A setting out of range: one line naming its flag (a ValueError for library callers)."""


@dataclass(frozen=True)
class SpecConfig:
    """Speculation (``--spec-*``); only read when ``spec_type`` names a drafter."""

    n_max: int = 3  # --spec-draft-n-max
    n_min: int = 0  # --spec-draft-n-min
    p_min: float = 0.0  # --spec-draft-p-min
    rollback: str = "auto"  # --spec-rollback: auto | snapshot | checkpoint
    draft_vocab: int = 0  # --spec-draft-vocab: draft over the first N token ids (0: all)
    # --spec-draft-hot-vocab: drafts scored over the ids seen most (speculative/hot_vocab.py)
    # while they hold the emitted text; None: sized by the weights' memory, 0: off
    hot_vocab: int | None = None
    draft_head: str = ""  # --spec-draft-head: ggml type of a draft-only LM head copy ("": none)
    # draft lengths chosen per step by the draft-length rule (speculative/lengths.py; n_max
    # the cap): --spec-draft-adaptive (None: the default, on) / --spec-draft-fixed (False)
    adaptive: bool | None = None
    # n-gram drafters (llama.cpp's --spec-ngram-simple-* / --spec-ngram-mod-* and defaults)
    ngram_simple_size_n: int = 12  # --spec-ngram-simple-size-n: the n-gram looked up
    ngram_simple_size_m: int = 48  # --spec-ngram-simple-size-m: the m-gram drafted after it
    ngram_simple_min_hits: int = 1  # --spec-ngram-simple-min-hits (unused, as in llama.cpp)
    ngram_mod_n_match: int = 24  # --spec-ngram-mod-n-match: the n-gram looked up
    ngram_mod_n_min: int = 48  # --spec-ngram-mod-n-min: fewer hits than this: no draft
    ngram_mod_n_max: int = 64  # --spec-ngram-mod-n-max: most tokens looked up
    # --spec-draft-sampling: "coupled" draws drafts of sampling chains through the chain with
    # the target's noise for that token; "greedy" takes the head's argmax (llama.cpp);
    # "probabilistic" draws them from the head's top 10 and verifies by p/q rejection
    draft_sampling: str = "coupled"

    def __post_init__(self) -> None:
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError("--spec-draft-sampling", "draft_sampling must be coupled, greedy "
                              f"or probabilistic, got {self.draft_sampling!r}")
        if self.rollback not in ROLLBACKS:
            raise ConfigError("--spec-rollback", f"expected auto, snapshot or checkpoint, "
                                f"got {self.rollback!r}")
        if self.n_max < 1 or self.n_min < 0 or self.n_min > self.n_max:
            raise ConfigError("--spec-draft-n-max", "need 1 <= n_min <= n_max "
                                f"(got n_min={self.n_min}, n_max={self.n_max})")
        if not 0.0 <= self.p_min <= 1.0:
            raise ConfigError("--spec-draft-p-min", f"must be in [0, 1], got {self.p_min}")
        for flag, v, lo in (("--spec-ngram-simple-size-n", self.ngram_simple_size_n, 1),
                            ("--spec-ngram-simple-size-m", self.ngram_simple_size_m, 1),
                            ("--spec-ngram-simple-min-hits", self.ngram_simple_min_hits, 1),
                            ("--spec-ngram-mod-n-match", self.ngram_mod_n_match, 1),
                            ("--spec-ngram-mod-n-min", self.ngram_mod_n_min, 0),
                            ("--spec-ngram-mod-n-max", self.ngram_mod_n_max, 0)):
            if not lo <= v <= 1024:
                raise ConfigError(flag, f"must be between {lo} and 1024, got {v}")
        if self.draft_vocab < 0:
            raise ConfigError("--spec-draft-vocab", f"must be >= 0, got {self.draft_vocab}")
        if self.hot_vocab is not None and self.hot_vocab < 0:
            raise ConfigError("--spec-draft-hot-vocab", f"must be >= 0, got {self.hot_vocab}")
        if self.hot_vocab and (self.p_min > 0 or self.draft_vocab or self.draft_head):
            raise ConfigError("--spec-draft-hot-vocab", "cannot be combined with "
                                "--spec-draft-p-min, --spec-draft-vocab or --spec-draft-head")
        if self.draft_vocab and self.p_min > 0:
            raise ConfigError("--spec-draft-vocab", "cannot be combined with "
                                "--spec-draft-p-min: p_min needs the full-vocabulary softmax")


    @property
    def calibrated(self) -> bool:
        """Draft lengths from the draft-length rule (the default) rather than fixed."""
        return self.adaptive is not False


def spec_kinds(spec_type: str | None) -> tuple[str, ...]:
    """``--spec-type`` as drafter kinds in their order of preference; one line naming the
    flag for an unknown kind."""
    from pyggspec.speculative.drafter import KINDS

    names = [n.strip() for n in (spec_type or "").split(",") if n.strip()]
    if names in ([], ["none"]):
        return ()
    bad = [n for n in names if n not in KINDS]
    if bad:
        raise ConfigError("--spec-type", f"unsupported speculative type {bad[0]!r} "
                          f"(none, {', '.join(KINDS)}, or several joined by commas)")
    return tuple(k for k in KINDS if k in names)


def check_kv_type(flag: str, t: str) -> None:
    """A KV cache type ggml cannot store is a one-line error naming its flag."""
    if str(t).lower() not in KV_TYPES:
        raise ConfigError(flag, f"unsupported KV cache type {t!r} ({', '.join(KV_TYPES)})")


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``Engine`` is built from, besides the model path (llama.cpp flag names in
    comments). Frozen: a running engine's settings never change under it."""

    mtp_path: str | None = None  # -md / --spec-draft-model: MTP-only sidecar GGUF
    mmproj: str | None = None  # -mm / --mmproj: vision projector GGUF (image inputs)
    mmproj_offload: bool = True  # --no-mmproj-offload: encode images on the CPU
    image_min_tokens: int | None = None  # --image-min-tokens (None: the projector's, 8)
    image_max_tokens: int | None = None  # --image-max-tokens (None: the projector's, 4096)
    # context and batching
    n_ctx: int = 4096  # -c (0: the model's training context, as llama.cpp's -c 0)
    n_parallel: int = 1  # -np
    n_threads: int | None = None  # -t (None: min(cores, 8))
    n_batch: int = 2048  # -b: logical batch (prompt chunk per sequence)
    n_ubatch: int = 512  # -ub: physical batch (never more than -b)
    # placement
    n_gpu_layers: int | str | None = 0  # -ngl: N | "all" | "auto"
    device: str | None = None  # -dev NAME[,NAME]
    override_tensor: tuple[tuple[str, str], ...] = ()  # -ot PATTERN=DEVICE
    cpu_moe: bool = False  # -cmoe
    use_mmap: bool = True  # --no-mmap
    repack: bool = True  # -nr / --no-repack
    # --fit: what the user left unset (-ngl None/"auto", no -ot/-cmoe/-ncmoe, -c 0) is
    # chosen to fit each offload device's free memory less fit_target MiB (-fitt: one value
    # for every device, or one per device in order), never cutting -c 0 below fit_ctx (-fitc)
    fit: bool = True
    fit_target: tuple[int, ...] = (1024,)
    fit_ctx: int = 4096
    # caches
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    mtp_type_k: str = "f16"  # -ctkd
    mtp_type_v: str = "f16"  # -ctvd
    ctx_checkpoints: int = 4  # --ctx-checkpoints: prompt-reuse state copies per slot
    checkpoint_min_step: int = 512  # tokens between two of them
    # speculation
    # --spec-type: None/"none", or drafter kinds joined by commas (speculative/drafter.py
    # KINDS: ngram-simple, ngram-mod, draft-mtp), kept in their order of preference
    spec_type: str | None = None
    spec: SpecConfig = field(default_factory=SpecConfig)
    # sampling
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temp=0.0))
    backend_sampling: bool | None = None  # -bs: None = in the graph unless logits are on CPU
    draft_backend_sampling: bool = True  # the MTP head's argmax in its graph
    # the rest
    load_tokenizer: bool = True
    progress: bool | None = None  # load progress on stderr (None: when it is a terminal)

    def __post_init__(self) -> None:
        if self.n_ctx < 0 or min(self.n_parallel, self.n_batch, self.n_ubatch) < 1:
            raise ConfigError(None, "need n_ctx >= 0 (0: the training context) and "
                              "n_parallel, n_batch, n_ubatch >= 1")
        if self.n_threads is not None and self.n_threads < 1:
            raise ConfigError("-t", f"must be >= 1, got {self.n_threads}")
        for flag, t in (("-ctk", self.type_k), ("-ctv", self.type_v),
                        ("-ctkd", self.mtp_type_k), ("-ctvd", self.mtp_type_v)):
            check_kv_type(flag, t)
        target = tuple(self.fit_target) if not isinstance(self.fit_target, int) \
            else (self.fit_target,)
        if not target or any(not isinstance(t, int) or t < 0 for t in target):
            raise ConfigError("-fitt", f"need MiB values >= 0, got {self.fit_target!r}")
        if self.fit_ctx < 1:
            raise ConfigError("-fitc", f"must be >= 1, got {self.fit_ctx}")
        if self.ctx_checkpoints < 0 or self.checkpoint_min_step < 1:
            raise ConfigError("--ctx-checkpoints", "need ctx_checkpoints >= 0 and "
                                "checkpoint_min_step >= 1")
        kinds = spec_kinds(self.spec_type)
        if not isinstance(self.spec, SpecConfig):
            raise ConfigError(None, "spec must be a SpecConfig")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(None, "sampling must be a SamplingParams")
        # normal forms: one spelling per meaning
        set_ = object.__setattr__
        set_(self, "spec_type", ",".join(kinds) or None)
        set_(self, "n_ubatch", min(self.n_ubatch, self.n_batch))
        set_(self, "override_tensor", tuple(tuple(p) for p in self.override_tensor))
        set_(self, "fit_target", target)
        if self.mtp_path is not None:
            set_(self, "mtp_path", os.fspath(self.mtp_path))
        if self.mmproj is not None:
            set_(self, "mmproj", os.fspath(self.mmproj))

    @property
    def spec_types(self) -> tuple[str, ...]:
        """The drafter kinds, in their order of preference (empty: no speculation)."""
        return tuple(self.spec_type.split(",")) if self.spec_type else ()

    @property
    def speculative(self) -> bool:
        return self.spec_type is not None

    @property
    def uses_mtp(self) -> bool:
        """The MTP head drafts (its weights, cache and graphs are needed)."""
        return "draft-mtp" in self.spec_types

    @property
    def threads(self) -> int:
        """``n_threads`` or the default: the cores, at most 8."""
        return self.n_threads or max(1, min(os.cpu_count() or 1, 8))

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> EngineConfig:
        """``Engine(path, **kw)``'s keywords; an unknown one is a TypeError as before."""
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - names)
        if bad:
            raise TypeError(f"unexpected engine argument(s): {', '.join(bad)}")
        if kw.get("spec") is None:
            kw.pop("spec", None)
        if kw.get("sampling") is None:
            kw.pop("sampling", None)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
