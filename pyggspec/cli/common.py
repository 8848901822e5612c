"""What the commands share: every engine option defined once, and the one way their values
become an :class:`~pyggspec.config.EngineConfig`.

An option is an :class:`Opt` (flags, type, default, help); a command adds it with
``OPT()`` where it wants it in its help, changing only the wording (``help=``) or, where the
commands really differ, the default (``serve -np`` is 4) or an extra short flag. The
innermost decorator :func:`engine_config` then hands the command one ``config`` instead of
the values, built by :func:`config_from_options` (click only here, under ``cli/``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import click

from pyggspec.config import DRAFT_SAMPLING as DRAFT_SAMPLINGS
from pyggspec.config import ROLLBACKS, ConfigError, EngineConfig, SpecConfig, spec_kinds
from pyggspec.sampling.params import (
    DEFAULT_SAMPLERS,
    DEFAULT_SEED,
    SamplingParams,
    parse_logit_bias,
    parse_samplers,
)
from pyggspec.speculative.drafter import KINDS

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

F = TypeVar("F", bound=Callable[..., Any])


class Opt:
    """One click option, defined once: ``Opt(*flags_and_dest, **attrs)``. Calling it gives
    the decorator; ``Opt()(*more_flags, **changes)`` adds flags in front (``-cms``) or
    changes attributes (the wording, or a default) for one command."""

    def __init__(self, *decls: str, **attrs: Any) -> None:
        self.decls = decls
        self.attrs = attrs

    @property
    def dest(self) -> str:
        return self.decls[-1]

    def __call__(self, *more_flags: str, **changes: Any) -> Callable[[F], F]:
        return click.option(*more_flags, *self.decls, **{**self.attrs, **changes})


# ---------------------------------------------------------------------------- engine options
MODEL = Opt("-m", "--model", "model", type=click.Path(path_type=Path), default=None)
def _n_parallel_cb(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``-np -1``: llama.cpp's auto, which llama-server makes 4 slots (server.cpp) and
    llama-cli 1 sequence; 0 is refused, as llama-server does."""
    if value == 0:
        raise click.BadParameter("0 is not a valid number of sequences (-1: auto)")
    if value == -1:
        ctx.meta["pyggspec.n_parallel_auto"] = True  # serve: llama-server's unified KV
        return 4 if ctx.command.name == "serve" else 1
    return value


N_CTX = Opt("-c", "--ctx-size", "n_ctx", type=click.IntRange(min=0), default=4096,
            show_default=True, help="Context of each sequence (0: the model's training "
            "context).")
N_PARALLEL = Opt("-np", "--parallel", "n_parallel", type=click.IntRange(min=-1), default=1,
                 show_default=True, callback=_n_parallel_cb,
                 help="Sequences generated together (prompts are cycled; -1: auto, 1).")
N_BATCH = Opt("-b", "--batch-size", "n_batch", type=click.IntRange(min=1), default=2048,
              show_default=True, help="Logical batch: a prompt is evaluated in chunks of at "
              "most this many tokens per sequence.")
N_UBATCH = Opt("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512,
               show_default=True, help="Physical batch: each chunk runs in graphs of at most "
               "this many tokens (capped at -b, as in llama.cpp).")
N_THREADS = Opt("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=None,
                envvar="LLAMA_ARG_THREADS",  # llama.cpp's variable for -t (arg.cpp)
                help="CPU threads (default: $LLAMA_ARG_THREADS, else cores, at most 8).")
NGL = Opt("-ngl", "--gpu-layers", "--n-gpu-layers", "ngl", metavar="N|all|auto", default=None,
          help="Layers on the offload device (default: as many as --fit finds room for, "
               "all when they fit; 'all' with --fit off).")
DEVICE = Opt("-dev", "--device", "device", metavar="NAME", default=None,
             help="Offload device (see `pyggspec devices`).")
OVERRIDES = Opt("-ot", "--override-tensor", "overrides", multiple=True, metavar="REGEX=DEVICE")
CPU_MOE = Opt("-cmoe", "--cpu-moe", "cpu_moe", is_flag=True,
              help="Keep MoE expert weights on the CPU.")
N_CPU_MOE = Opt("-ncmoe", "--n-cpu-moe", "n_cpu_moe", type=click.IntRange(min=0), default=0,
                show_default=True, help="Keep the MoE expert weights of the first N layers on "
                "the CPU (llama.cpp's -ot 'blk\\.I\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU').")
TYPE_K = Opt("-ctk", "--cache-type-k", "type_k", default="f16", show_default=True)
TYPE_V = Opt("-ctv", "--cache-type-v", "type_v", default="f16", show_default=True)
RPC = Opt("--rpc", "rpc", default=None, metavar="HOST:PORT[,...]",
          help="Add remote ggml RPC servers as devices (llama.cpp's rpc-server).")
NO_MMAP = Opt("--no-mmap", "no_mmap", is_flag=True,
              help="Copy CPU weights instead of mapping the file.")
NO_REPACK = Opt("-nr", "--no-repack", "no_repack", is_flag=True, help="Keep CPU weights as "
                "stored (no repacking into ggml's CPU extra buffer types).")
CTX_CHECKPOINTS = Opt("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", "ctx_checkpoints",
                      type=click.IntRange(min=0), default=4, show_default=True,
                      help="Recurrent-state checkpoints kept per slot for prompt reuse "
                           "(host memory).")
CHECKPOINT_MIN_STEP = Opt("--checkpoint-min-step", "checkpoint_min_step",
                          type=click.IntRange(min=1), default=512, show_default=True,
                          help="Least prompt tokens between two checkpoints (two more are "
                               "saved 4 + -ub and 4 tokens before each prompt's end, as "
                               "llama-server does).")
_TRUTHY, _FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


def _on_off_cb(ctx: click.Context, param: click.Parameter, value: str | bool) -> bool:
    """llama.cpp's on|off values (is_truthy / is_falsey in arg.cpp)."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUTHY or v in _FALSEY:
        return v in _TRUTHY
    raise click.BadParameter(f"expected on or off, got '{value}'")


def _fit_target_cb(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    from pyggspec.errors import PyggspecError
    from pyggspec.memory.fit import parse_fit_target

    try:
        return parse_fit_target(value)
    except PyggspecError as e:
        raise click.BadParameter(e.message) from None


# llama-server's projector token budget per image (EngineConfig fields)
IMAGE_MAX_TOKENS = Opt("--image-max-tokens", "image_max_tokens", type=click.IntRange(1),
                       default=None, metavar="N", help="The most merged tokens per image "
                       "(default: the projector's, 8..4096 for Qwen3.5/3.6).")
IMAGE_MIN_TOKENS = Opt("--image-min-tokens", "image_min_tokens", type=click.IntRange(1),
                       default=None, metavar="N", help="The fewest merged tokens per image "
                       "(default: the projector's, 8..4096 for Qwen3.5/3.6).")
FIT = Opt("-fit", "--fit", "fit", metavar="on|off", default="on", show_default=True,
          callback=_on_off_cb, envvar="LLAMA_ARG_FIT",
          help="Choose what is left unset (-ngl, the MoE experts' device, -c 0) to fit the "
               "offload devices' free memory less -fitt.")
FIT_TARGET = Opt("-fitt", "--fit-target", "fit_target", metavar="MiB[,MiB...]", default="1024",
                 show_default=True, callback=_fit_target_cb, envvar="LLAMA_ARG_FIT_TARGET",
                 help="Memory --fit keeps free on each offload device (one value for all, or "
                      "one per device).")
FIT_CTX = Opt("-fitc", "--fit-ctx", "fit_ctx", type=click.IntRange(min=1), default=4096,
              show_default=True, envvar="LLAMA_ARG_FIT_CTX",
              help="Least context --fit cuts -c 0 (the training context) to.")
# a switch (llama.cpp's llama-fit-params takes -fitp on|off; llama-server and llama-cli
# have no -fitp): an optional value would swallow inspect's FILE after it
FIT_PRINT = Opt("-fitp", "--fit-print", "fit_print", is_flag=True,
                help="Print the placement and predicted memory per device (one table) and "
                     "exit.")
FIT_OPTIONS = (FIT, FIT_TARGET, FIT_CTX, FIT_PRINT)
# the engine options run and serve both add in this order, after their own -c/-np/-b/-ub
PLACEMENT_OPTIONS = (N_THREADS, NGL, DEVICE, OVERRIDES, CPU_MOE, N_CPU_MOE, TYPE_K, TYPE_V, RPC,
                     NO_MMAP, NO_REPACK, *FIT_OPTIONS)


def placement_options(**changes: Mapping[str, Any]) -> Callable[[F], F]:
    """Add :data:`PLACEMENT_OPTIONS` to a click command, in that order; ``changes`` maps an
    option's dest to its attributes for this command (``rpc={"help": ...}``)."""
    unknown = set(changes) - {o.dest for o in PLACEMENT_OPTIONS}
    if unknown:
        raise TypeError(f"not placement options: {', '.join(sorted(unknown))}")

    def deco(fn: F) -> F:
        for opt in reversed(PLACEMENT_OPTIONS):
            fn = opt(**changes.get(opt.dest, {}))(fn)
        return fn

    return deco


# ---------------------------------------------------------------------------- speculation
class _SpecType(click.ParamType):
    """``none`` or drafter kinds joined by commas (llama.cpp's ``--spec-type a,b``)."""

    name = "none|" + "|".join(KINDS) + "[,...]"

    def convert(self, value, param, ctx):
        try:
            return ",".join(spec_kinds(value)) or "none"
        except ConfigError as e:
            self.fail(str(e).split(": ", 1)[-1], param, ctx)


SPEC_TYPE = Opt("--spec-type", "spec_type", type=_SpecType(), default="none",
                show_default=True,
                help="Speculative decoding: draft-mtp (the model's MTP head), ngram-simple, "
                     "ngram-mod (n-grams of the text so far), or several joined by commas "
                     "(the n-gram kinds are asked first; the first with a draft wins).")
DRAFT_MODEL = Opt("-md", "--spec-draft-model", "--model-draft", "draft_model",
                  type=click.Path(path_type=Path), default=None,
                  help="Separate MTP-only GGUF (mtp-*.gguf) for --spec-type draft-mtp.")
N_MAX = Opt("--spec-draft-n-max", "n_max", type=click.IntRange(min=1), default=3,
            show_default=True, help="Most tokens drafted per step.")
N_MIN = Opt("--spec-draft-n-min", "n_min", type=click.IntRange(min=0), default=0,
            show_default=True, help="Drop drafts shorter than this.")
P_MIN = Opt("--spec-draft-p-min", "--draft-p-min", "p_min", type=click.FloatRange(0.0, 1.0), default=0.0,
            show_default=True,
            help="Stop drafting below this probability: the head's softmax over the full "
                 "vocabulary for argmax drafts; for coupled draws, the chain's probability of "
                 "the drawn token (after its filters and temperature; computed on the host "
                 "from the head's logits).")
DRAFT_ADAPTIVE = Opt("--spec-draft-adaptive/--spec-draft-fixed", "draft_adaptive",
                     default=True, show_default=True,
                     help="Choose each step's draft length (up to --spec-draft-n-max) by the "
                          "tokens it is expected to yield per measured cost, drafting nothing "
                          "where speculation cannot pay; or always draft up to n_max.")
NGRAM_OPTIONS = tuple(
    Opt(flag, dest, type=click.IntRange(lo, 1024), default=getattr(SpecConfig, dest),
        show_default=True, help=text)
    for flag, dest, lo, text in (
        ("--spec-ngram-simple-size-n", "ngram_simple_size_n", 1,
         "ngram-simple: length of the n-gram looked up in the text so far."),
        ("--spec-ngram-simple-size-m", "ngram_simple_size_m", 1,
         "ngram-simple: length of the m-gram drafted after a match."),
        ("--spec-ngram-simple-min-hits", "ngram_simple_min_hits", 1,
         "ngram-simple: minimum hits (accepted and unused, as in llama.cpp)."),
        ("--spec-ngram-mod-n-match", "ngram_mod_n_match", 1,
         "ngram-mod: length of the n-gram looked up."),
        ("--spec-ngram-mod-n-min", "ngram_mod_n_min", 0,
         "ngram-mod: no draft with fewer hits than this."),
        ("--spec-ngram-mod-n-max", "ngram_mod_n_max", 0,
         "ngram-mod: most tokens looked up.")))
DRAFT_SAMPLING = Opt("--spec-draft-sampling", "draft_sampling",
                     type=click.Choice(DRAFT_SAMPLINGS),
                     default="coupled", show_default=True,
                     help="With --temp > 0: draw each draft through the sequence's own sampler "
                          "chain with the noise the target will use for that token (coupled: "
                          "output bit-identical to plain seeded sampling), take the head's "
                          "argmax (greedy), or draw it from the head's top 10 and verify by "
                          "p/q rejection (probabilistic, as llama.cpp: same distribution, not "
                          "the same tokens). Greedy decoding drafts the argmax either way.")
DRAFT_HEAD = Opt("--spec-draft-head", "draft_head", metavar="TYPE", default="",
                 help="Draft with a copy of the LM head in this ggml type (e.g. q4_0); the "
                      "target still verifies with its own weights.")
DRAFT_VOCAB = Opt("--spec-draft-vocab", "draft_vocab", type=click.IntRange(min=0), default=0,
                  show_default=True,
                  help="Draft over the first N token ids only (0: all); the LM head dominates "
                       "a draft step. Not with --spec-draft-p-min.")


class _HotVocab(click.ParamType):
    """``auto`` (None), ``off`` (0) or a row count."""

    name = "auto|off|N"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        v = str(value).strip().lower()
        if v == "auto":
            return None
        if v in ("off", "0"):
            return 0
        try:
            n = int(v)
        except ValueError:
            self.fail(f"{value!r}: expected auto, off or a number of token ids", param, ctx)
        if n < 0:
            self.fail(f"{value!r}: must be >= 0", param, ctx)
        return n


HOT_VOCAB = Opt("--spec-draft-hot-vocab", "hot_vocab", type=_HotVocab(), default="auto",
                show_default=True,
                help="Score drafts over the N token ids this engine sees most (learnt from "
                     "prompts and outputs, seeded with the lowest ids) while they hold >= 97% "
                     "of the emitted text, else over the whole vocabulary: the LM head is "
                     "most of a draft step. auto: as many as cost <= 2% of the weights' "
                     "memory (at most 32768); off: the whole vocabulary always.")
ROLLBACK = Opt("--spec-rollback", "rollback",
               type=click.Choice(ROLLBACKS), default="auto",
               show_default=True, help="Recurrent-state rollback after partial acceptance.")
MTP_TYPE_K = Opt("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft", "mtp_type_k",
                 default="f16", show_default=True, help="MTP head KV cache type (K).")
MTP_TYPE_V = Opt("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft", "mtp_type_v",
                 default="f16", show_default=True, help="MTP head KV cache type (V).")
SPEC_OPTIONS = (SPEC_TYPE, DRAFT_MODEL, N_MAX, N_MIN, P_MIN, DRAFT_ADAPTIVE, DRAFT_SAMPLING,
                DRAFT_HEAD, DRAFT_VOCAB, HOT_VOCAB, ROLLBACK, MTP_TYPE_K, MTP_TYPE_V,
                *NGRAM_OPTIONS)


@dataclass(frozen=True)
class SpecOptions:
    """What :func:`spec_options` hands the command."""

    spec_type: str  # "none" | drafter kinds joined by commas
    draft_model: Path | None  # a separate MTP-only GGUF
    config: SpecConfig
    mtp_type_k: str
    mtp_type_v: str

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """The EngineConfig fields these flags set."""
        return {"mtp_path": self.draft_model, "spec_type": self.spec_type,
                "spec": self.config, "mtp_type_k": self.mtp_type_k,
                "mtp_type_v": self.mtp_type_v}


def _wrap(fn: F, opts: Sequence[Callable[[F], F]], convert: Callable[[dict], None]) -> F:
    """``fn`` with ``opts`` added; ``convert`` turns their values in the keywords into the
    argument ``fn`` receives instead (in place)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        convert(kwargs)
        return fn(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper  # type: ignore[return-value]


def _to_spec(kw: dict) -> None:
    v = {o.dest: kw.pop(o.dest) for o in SPEC_OPTIONS}
    if v["n_min"] > v["n_max"]:
        raise click.BadParameter(f"{v['n_min']} > --spec-draft-n-max {v['n_max']}",
                                 param_hint="'--spec-draft-n-min'")
    config = SpecConfig(n_max=v["n_max"], n_min=v["n_min"], p_min=v["p_min"],
                        rollback=v["rollback"], draft_vocab=v["draft_vocab"],
                        hot_vocab=v["hot_vocab"],
                        draft_head=v["draft_head"], adaptive=v["draft_adaptive"],
                        draft_sampling=v["draft_sampling"],
                        **{o.dest: v[o.dest] for o in NGRAM_OPTIONS})
    kw["spec"] = SpecOptions(v["spec_type"], v["draft_model"], config, v["mtp_type_k"],
                             v["mtp_type_v"])


def spec_options(fn: F) -> F:
    """Add llama.cpp's speculation flags to a click command; it receives ``spec`` (a
    :class:`SpecOptions`) instead of the individual values."""
    return _wrap(fn, [o() for o in SPEC_OPTIONS], _to_spec)


# ---------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingOptions:
    """What :func:`sampling_options` hands the command: params plus the offload switches."""

    params: SamplingParams
    # sampler chains in the graph (None: where the logits are not on the CPU, see
    # graph_sampling); tokens are the host path's either way
    backend_sampling: bool | None = None
    draft_backend_sampling: bool = True  # draft argmax in the MTP graph (llama.cpp: on)


def _samplers_cb(ctx: click.Context, param: click.Parameter, value: str | None):
    if value is None:
        return DEFAULT_SAMPLERS
    try:
        return parse_samplers(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _bias_cb(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]):
    try:
        return parse_logit_bias(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _seed_cb(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """``--seed -1``: random, llama.cpp's LLAMA_DEFAULT_SEED (its stoul wraps -1 to it)."""
    return DEFAULT_SEED if value == -1 else value


_D = SamplingParams()
SAMPLING_OPTIONS = (
    Opt("--temp", "--temperature", "temp", type=float, default=_D.temp, show_default=True,
        help="Temperature; <= 0 samples greedily."),
    Opt("--top-k", "top_k", type=int, default=_D.top_k, show_default=True,
        help="Top-k sampling (0 = disabled)."),
    Opt("--top-p", "top_p", type=float, default=_D.top_p, show_default=True,
        help="Top-p sampling (1.0 = disabled)."),
    Opt("--min-p", "min_p", type=float, default=_D.min_p, show_default=True,
        help="Min-p sampling (0.0 = disabled)."),
    Opt("--typical", "--typical-p", "typical_p", type=float, default=_D.typical_p,
        show_default=True, help="Locally typical sampling p (1.0 = disabled)."),
    Opt("--repeat-penalty", "repeat_penalty", type=float, default=_D.repeat_penalty,
        show_default=True, help="Penalize repeated tokens (1.0 = disabled)."),
    Opt("--repeat-last-n", "repeat_last_n", type=click.IntRange(min=0),
        default=_D.repeat_last_n, show_default=True,
        help="Last n tokens to penalize (0 = disabled)."),
    Opt("--presence-penalty", "presence_penalty", type=float, default=_D.presence_penalty,
        show_default=True, help="Presence penalty (0.0 = disabled)."),
    Opt("--frequency-penalty", "frequency_penalty", type=float, default=_D.frequency_penalty,
        show_default=True, help="Frequency penalty (0.0 = disabled)."),
    Opt("-s", "--seed", "seed", type=click.IntRange(min=-1), default=_D.seed, show_default=True,
        callback=_seed_cb, help=f"RNG seed ({DEFAULT_SEED} or -1 = random)."),
    Opt("--samplers", "samplers", default=None, callback=_samplers_cb, metavar="SAMPLERS",
        help=f"';'-separated sampler order (default: {';'.join(DEFAULT_SAMPLERS)})."),
    Opt("-l", "--logit-bias", "logit_bias", multiple=True, callback=_bias_cb,
        metavar="TOKEN_ID(+/-)BIAS", help="Bias one token, e.g. 15043+1."),
)
BACKEND_SAMPLING = Opt(
    "-bs", "--backend-sampling/--no-backend-sampling", "backend_sampling", default=None,
    help="Run sampler chains (the target's, and coupled drafts') in the graph where the "
         "device can. Default: when the logits are on a GPU or other non-CPU device; on the "
         "CPU the host is faster.")
DRAFT_BACKEND_SAMPLING = Opt(
    "--spec-draft-backend-sampling/--no-spec-draft-backend-sampling", "draft_backend_sampling",
    default=True, show_default=True,
    help="Take the draft argmax (and, with -bs, coupled draws) in the MTP graph.")


def _to_sampling(kw: dict) -> None:
    values = {o.dest: kw.pop(o.dest) for o in SAMPLING_OPTIONS}
    bs = kw.pop(BACKEND_SAMPLING.dest)
    dbs = kw.pop(DRAFT_BACKEND_SAMPLING.dest)
    # a value out of range raises SamplingParamError: one line, exit 1 under pyggspec's group
    kw["sampling"] = SamplingOptions(SamplingParams(**values), bs, dbs)


def sampling_options(fn: F) -> F:
    """Add llama.cpp's sampling flags to a click command; it receives ``sampling``
    (a :class:`SamplingOptions`) instead of the individual values."""
    opts = [o() for o in SAMPLING_OPTIONS] + [BACKEND_SAMPLING(), DRAFT_BACKEND_SAMPLING()]
    return _wrap(fn, opts, _to_sampling)


# ---------------------------------------------------------------------------- the config
def parse_overrides(values: Sequence[str]) -> list[tuple[str, str]]:
    """``-ot PATTERN=DEVICE[,PATTERN=DEVICE]`` values as (pattern, device) pairs."""
    out: list[tuple[str, str]] = []
    for v in values:
        for item in v.split(","):
            if not item:
                continue
            pattern, sep, dev = item.rpartition("=")
            if not sep or not pattern or not dev:
                raise click.BadParameter(f"expected PATTERN=DEVICE, got '{item}'",
                                         param_hint="'-ot'")
            out.append((pattern, dev))
    return out


def parse_ngl(value: str | None) -> int | str | None:
    """``-ngl``: a number, ``all`` or ``auto`` (None: the engine's default)."""
    if value is None or value in ("all", "auto"):
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"expected a number, 'all' or 'auto', got '{value}'",
                                 param_hint="'-ngl'") from None


def cpu_moe_patterns(n: int) -> list[tuple[str, str]]:
    """``-ncmoe N``: the -ot patterns llama.cpp adds, keeping the experts of layers 0..N-1 on
    the CPU."""
    from pyggspec.weights.placement import n_cpu_moe_patterns

    return n_cpu_moe_patterns(n)


# option dest -> EngineConfig field, for the values that are not the field itself
_CONVERT: Mapping[str, tuple[str, Callable[[Any], Any]]] = {
    "ngl": ("n_gpu_layers", parse_ngl),
    "overrides": ("override_tensor", parse_overrides),
    "no_mmap": ("use_mmap", lambda v: not v),
    "no_repack": ("repack", lambda v: not v),
}
_FIELDS = frozenset(f.name for f in fields(EngineConfig))
ENGINE_DESTS = frozenset(_CONVERT) | _FIELDS | {"spec", "sampling", "n_cpu_moe"}


def config_from_options(values: dict[str, Any]) -> EngineConfig:
    """Take the engine options' values out of ``values`` (a command's keywords: each option
    above under its dest, ``spec`` and ``sampling`` as their decorators made them) and build
    the :class:`EngineConfig`; options a command lacks keep the config's defaults. A bad
    value is a one-line :class:`~pyggspec.config.ConfigError` naming its flag."""
    kw: dict[str, Any] = {}
    moe: list[tuple[str, str]] = []
    for dest in sorted(ENGINE_DESTS & set(values)):
        v = values.pop(dest)
        if dest == "n_cpu_moe":
            moe = cpu_moe_patterns(v)
        elif dest == "spec":
            kw.update(v.engine_kwargs)
        elif dest == "sampling":
            kw.update(sampling=v.params, backend_sampling=v.backend_sampling,
                      draft_backend_sampling=v.draft_backend_sampling)
        elif dest in _CONVERT:
            name, convert = _CONVERT[dest]
            kw[name] = convert(v)
        else:
            kw[dest] = v
    if moe:  # after the user's -ot patterns (the first match wins)
        kw["override_tensor"] = [*kw.get("override_tensor", ()), *moe]
    return EngineConfig.from_kwargs(**kw)


def engine_config(fn: F) -> F:
    """The innermost decorator of a command with engine options: it receives ``config`` (an
    :class:`EngineConfig`) instead of their values."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["config"] = config_from_options(kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def with_projector(config: EngineConfig, mmproj: Path | None, offload: bool) -> EngineConfig:
    """``config`` with the projector options (unchanged without ``--mmproj``)."""
    if mmproj is None:
        return config
    return config.replace(mmproj=str(mmproj), mmproj_offload=offload)


def engine_from_config(path: str | Path, config: EngineConfig) -> Any:
    """The :class:`~pyggspec.engine.Engine` for ``config`` (the one place the CLI builds
    one)."""
    from pyggspec.engine import Engine

    return Engine(path, config=config)


def print_fit(model: str | Path | None, config: EngineConfig) -> None:
    """``-fitp``: the fit's table for ``config`` (as the engine would fit it), on stdout."""
    if model is None:
        raise click.UsageError("--fit-print needs a model (-m FILE)")
    from pyggspec.inspect import fit_table, inspect_model

    click.echo(fit_table(inspect_model(model, config)))


def add_rpc_servers(rpc: str | None) -> None:
    """``--rpc HOST:PORT[,...]``: register each remote ggml RPC server as a device."""
    if not rpc:
        return
    from pyggspec.ggml.device import add_rpc_server

    for ep in rpc.split(","):
        if ep:
            add_rpc_server(ep.strip())


# ---------------------------------------------------------------------------- formatting
def fmt_bytes(n: int) -> str:
    """Human byte count in binary units (llama.cpp prints MiB)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"  # pragma: no cover
