"""Request bodies -> validated generation parameters, and OpenAI-style error bodies.

Why by hand and not a schema library: every bad value must become one HTTP 400 whose message
names the JSON field and says what was expected (``'top_p' must be between 0 and 1, got
2``), with llama-server's field names and aliases (``n_predict`` / ``max_tokens``, token-id
prompts, ``logit_bias`` as a list or an object). Range checks are the sampler's own
(:class:`~pyggspec.sampling.SamplingParams`), so the server accepts exactly what ``run``
accepts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyggspec.sampling import SamplingParams
from pyggspec.sampling.grammar import GrammarError, GrammarSpec
from pyggspec.sampling.params import DEFAULT_SEED, SamplingParamError, parse_samplers

# HTTP status -> error type, as llama-server names them (OpenAI's shapes)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 500: "server_error",
               501: "not_supported_error", 503: "unavailable_error"}

# SamplingParams' CLI flag -> the JSON field a request sets it with
_FLAG_FIELD = {"--temp": "temperature", "--top-k": "top_k", "--top-p": "top_p",
               "--min-p": "min_p", "--typical": "typical_p", "--repeat-penalty": "repeat_penalty",
               "--repeat-last-n": "repeat_last_n", "--presence-penalty": "presence_penalty",
               "--frequency-penalty": "frequency_penalty", "--seed": "seed",
               "--samplers": "samplers", "--logit-bias": "logit_bias"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body ``{"error": {"message", "type", "code",
    "param"}}``; ``code`` is the HTTP status, as llama-server sends it."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param,
                               "code": self.status}
        err.update(self.extra)
        return {"error": err}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unsupported(message: str, param: str) -> ApiError:
    """A 400 for a field pyggspec does not take (llama-server's ``not_supported_error``)."""
    return ApiError(400, message, param=param, type="not_supported_error")


def context_error(n_prompt: int, n_ctx: int, room: bool) -> ApiError:
    """llama-server's ``exceed_context_size_error`` (400) with its message (clients and
    llama.cpp's tests match "exceeds the available context size") and two extra fields;
    ``room``: the prompt fits but leaves no room for a token (said after llama-server's
    words)."""
    what = " and leaves no room to generate" if room else ""
    return ApiError(400, f"request ({n_prompt} tokens) exceeds the available context size "
                    f"({n_ctx} tokens){what}, try increasing it (-c)", param="prompt",
                    type="exceed_context_size_error",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


# ---------------------------------------------------------------------------- JSON values
def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400 naming the problem."""
    if not raw.strip():
        raise invalid("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                      f"column {e.colno}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_kind(body)}")
    try:  # JSON may escape lone surrogates (\ud800) that no tokenizer can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid("the request holds a string with an unpaired surrogate (\\ud800-"
                      "\\udfff escape); it is not valid Unicode") from None
    return body


async def read_body(request: Any) -> dict[str, Any]:
    """:func:`parse_body` of an HTTP request (anything with an async ``body()``)."""
    return parse_body(await request.body())


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def get_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean, got {_kind(v)}", key)
    return v


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def get_int(body: Mapping[str, Any], key: str, default: int | None,
            lo: int | None = INT32_MIN, hi: int | None = INT32_MAX) -> int | None:
    """An integer field within ``lo..hi`` (llama-server reads its integer fields as int32,
    so that is the default range: a larger value would otherwise reach a sampler or a
    buffer size and fail there, as a 500, instead of here as a 400)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)  # JSON clients write 5.0 for 5
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{key}' must be an integer, got {_kind(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def get_float(body: Mapping[str, Any], key: str, default: float | None) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"'{key}' must be a number, got {_kind(v)}", key)
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        # llama-server reads these as float32: beyond its range a value is +-inf there and
        # overflows the samplers' float32 arithmetic here
        raise invalid(f"'{key}' must be a finite number (float32 range), got {v}", key)
    return float(v)


def get_str(body: Mapping[str, Any], key: str, default: str | None) -> str | None:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(f"'{key}' must be a string, got {_kind(v)}", key)
    return v


def object_array(v: Any, key: str, what: str) -> list[dict[str, Any]]:
    """An optional array of objects (``tools``): [] for None; a 400 naming ``key`` when it
    is not an array, naming ``key[i]`` for an item that is not an object."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise invalid(f"'{key}' must be an array of {what}, got {_kind(v)}", key)
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise invalid(f"'{key}[{i}]' must be an object, got {_kind(t)}", f"{key}[{i}]")
    return v


def field_str(obj: Mapping[str, Any], key: str, where: str) -> str:
    """``obj[key]``, which must be a string; the 400 names it as ``where.key`` (a field of
    an item of a list, e.g. ``input[2].call_id``)."""
    v = obj.get(key)
    if not isinstance(v, str):
        raise invalid(f"'{where}.{key}' must be a string, got {_kind(v)}", f"{where}.{key}")
    return v


# ---------------------------------------------------------------------------- sampling
def parse_sampling(body: Mapping[str, Any], defaults: SamplingParams, n_vocab: int,
                   tokenize: Callable[[str], list[int]] | None = None) -> SamplingParams:
    """The request's sampler settings over the server's defaults (``--temp`` etc.);
    ``tokenize`` (text -> ids, no special tokens) reads ``logit_bias`` keyed by text."""
    ch: dict[str, Any] = {}
    for key, name in (("temperature", "temp"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("typical_p", "typical_p"), ("repeat_penalty", "repeat_penalty"),
                      ("presence_penalty", "presence_penalty"),
                      ("frequency_penalty", "frequency_penalty")):
        v = get_float(body, key, None)
        if v is not None:
            ch[name] = v
    for key in ("top_k", "repeat_last_n"):
        v = get_int(body, key, None)
        if v is not None:
            ch[key] = v
    if ch.get("repeat_last_n", 0) == -1:
        ch["repeat_last_n"] = 64  # llama.cpp: -1 = context size; we keep its default window
    seed = get_int(body, "seed", None, lo=None, hi=None)
    if seed is not None:
        if seed == -1:
            seed = DEFAULT_SEED
        if not 0 <= seed < 2**64:
            raise invalid(f"'seed' must be -1 (random) or in 0..2^64-1, got {seed}", "seed")
        ch["seed"] = seed
    if body.get("samplers") is not None:
        ch["samplers"] = _samplers(body["samplers"])
    if body.get("logit_bias") is not None:
        ch["logit_bias"] = _logit_bias(body["logit_bias"], n_vocab, tokenize)
    try:
        params = dataclasses.replace(defaults, **ch)
        params.check_vocab(n_vocab)
    except SamplingParamError as e:
        key = _FLAG_FIELD.get(e.where or "", e.where)
        raise invalid(f"'{key}' {e.message}", key) from None
    return params


def _samplers(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        names = v
    elif isinstance(v, list) and all(isinstance(x, str) for x in v):
        names = ";".join(v)
    else:
        raise invalid("'samplers' must be an array of sampler names", "samplers")
    try:
        return parse_samplers(names)
    except ValueError as e:
        raise invalid(f"'samplers': {e}", "samplers") from None


def _bias_value(v: Any) -> float:
    if v is False:
        return -math.inf  # llama-server: false bans the token
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise invalid("'logit_bias' values must be numbers (or false to ban a token)",
                      "logit_bias")
    return float(v)


def _logit_bias(v: Any, n_vocab: int, tokenize: Callable[[str], list[int]] | None = None
                ) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token_id": bias}`` or llama-server's ``[[token_id, bias], ...]``; a
    key that is text, not an id (``[" the ", -100]``, ``{"hello": 5}``), biases each of its
    tokens (llama-server tokenizes it without special tokens), given ``tokenize``."""
    out: list[tuple[int, float]] = []
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = []
        for el in v:
            if not (isinstance(el, list) and len(el) == 2):
                raise invalid("'logit_bias' as an array holds [token_id, bias] pairs",
                              "logit_bias")
            items.append((el[0], el[1]))
    else:
        raise invalid(f"'logit_bias' must be an object or an array, got {_kind(v)}",
                      "logit_bias")
    for key, bias in items:
        toks: list[Any] = [key]
        if isinstance(key, str):
            try:
                toks = [int(key)]
            except ValueError:
                if tokenize is None:
                    raise invalid(f"'logit_bias' keys are token ids, got {key!r}",
                                  "logit_bias") from None
                toks = tokenize(key)
        for tok in toks:
            out.append((_bias_token(tok, n_vocab), _finite_bias(bias)))
    return tuple(out)


def _bias_token(tok: Any, n_vocab: int) -> int:
    if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < n_vocab:
            raise invalid(f"'logit_bias' token {tok!r} is not an id in 0..{n_vocab - 1}",
                          "logit_bias")
    return tok


def _finite_bias(bias: Any) -> float:
    b = _bias_value(bias)
    if b == math.inf:
        raise invalid("'logit_bias' values must be finite (or false to ban a token)",
                      "logit_bias")
    return b


# ---------------------------------------------------------------------------- generation
@dataclass
class GenParams:
    """One generation as the server understands it, before it is tokenized and queued."""

    sampling: SamplingParams
    max_tokens: int | None  # None: until end of generation or the context is full
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    speculative: bool | None = None  # None: the server's setting
    n_draft_max: int | None = None  # "speculative.n_max": fewer drafts per step than -n-max
    return_tokens: bool = False
    echo: bool = False
    n_probs: int | None = None  # alternatives reported per token (None: no logprobs at all)
    post_sampling_probs: bool = False  # from the sampler chain's distribution, as probs
    grammar: GrammarSpec | None = None  # grammar / json_schema / response_format
    n: int = 1  # choices (chat, not streamed): n requests over the same prompt
    slot: int | None = None  # llama-server's id_slot: run on this slot (None: any)
    timings_per_token: bool = False  # streamed chunks carry the timings so far
    return_progress: bool = False  # streams report prompt progress (prompt_progress)


MAX_STOP = 16
MAX_CHOICES = 16  # 'n': the requests of one answer share the server's slots
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (chat) and logprobs (completions)


def parse_logprobs(body: Mapping[str, Any], api: str, n_vocab: int) -> int | None:
    """How many alternatives to report per emitted token (None: no logprobs).

    ``api`` names the field's meaning: ``"chat"`` (OpenAI: ``logprobs`` a boolean,
    ``top_logprobs`` 0..20; llama-server's default of 20 when only ``logprobs`` is true;
    ``top_logprobs`` 0 reports each token's own logprob only), ``"completions"`` (OpenAI's
    legacy ``logprobs``: an integer 0..20) or ``"llama"`` (``/completion``: ``n_probs``,
    with ``logprobs`` its alias). llama-server's ``n_probs`` is read on every endpoint and
    wins; above the vocabulary it means all of it, as there. 0 is off except for chat's
    ``top_logprobs``."""
    n_probs = get_int(body, "n_probs", None)
    if n_probs is not None and n_probs < 0:
        raise invalid(f"'n_probs' must be >= 0, got {n_probs}", "n_probs")
    if api == "chat":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise invalid(f"'logprobs' must be a boolean, got {_kind(lp)} (top_logprobs sets "
                          "how many alternatives)", "logprobs")
        top = get_int(body, "top_logprobs", None)
        if top is not None and not lp:
            raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                          "top_logprobs")
        if n_probs:
            return min(n_probs, n_vocab)
        return (20 if top is None else top) if lp else None
    n = get_int(body, "logprobs", None)
    if n is not None and (n < 0 or (api == "completions" and n > MAX_TOP_LOGPROBS)):
        hi = f"between 0 and {MAX_TOP_LOGPROBS}" if api == "completions" else ">= 0"
        raise invalid(f"'logprobs' must be {hi}, got {n}", "logprobs")
    n = n_probs if n_probs is not None else n
    return min(n, n_vocab) if n else None


def parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(v) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} strings, got {len(v)}", "stop")
    return tuple(s for s in v if s)


def parse_max_tokens(body: Mapping[str, Any], default: int | None) -> int | None:
    """``n_predict`` (llama-server, wins), else ``max_completion_tokens`` / ``max_tokens``
    (OpenAI); -1 means no limit but the context."""
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):
        v = get_int(body, key, None)
        if v is None:
            continue
        if v == -1:
            return None
        if v < 0:
            raise invalid(f"'{key}' must be >= 0 (or -1 for no limit), got {v}", key)
        return v
    return default


# llama-server request fields that pyggspec accepts but does not act on (samplers it does not
# implement, context-shift and cache-reuse knobs, output extras), by the JSON type
# llama-server's schema reads them as. They are type-checked so a client mistake is a 400
# naming the field, as llama-server answers it, rather than silently dropped.
_NUMBER_FIELDS = ("dynatemp_range", "dynatemp_exponent", "top_n_sigma", "xtc_probability",
                  "xtc_threshold", "dry_multiplier", "dry_base", "mirostat_tau", "mirostat_eta",
                  "adaptive_target", "adaptive_decay", "speculative.p_min", "t_max_prompt_ms")
_INT_FIELDS = ("n_keep", "n_discard", "n_indent", "n_cache_reuse", "min_keep",
               "dry_allowed_length", "dry_penalty_last_n", "t_max_predict_ms",
               "sse_ping_interval", "speculative.n_min", "speculative.ngram_size_n",
               "speculative.ngram_size_m", "speculative.ngram_min_hits",
               "reasoning_budget_tokens", "id_slot")
_BOOL_FIELDS = ("timings_per_token", "return_progress", "post_sampling_probs", "verbose",
                "backend_sampling", "parse_tool_calls", "grammar_lazy", "reasoning_control",
                "cache_prompt", "parallel_tool_calls", "add_generation_prompt")
_STR_FIELDS = ("reasoning_format", "chat_parser", "generation_prompt", "speculative.type",
               "user")


def check_known_fields(body: Mapping[str, Any]) -> None:
    """Type checks for the llama-server / OpenAI fields listed above (HTTP 400 on a wrong
    type; the value itself is not used)."""
    for key in _NUMBER_FIELDS:
        get_float(body, key, None)
    for key in _INT_FIELDS:
        get_int(body, key, None, lo=None, hi=None)
    for key in _BOOL_FIELDS:
        get_bool(body, key, False)
    for key in _STR_FIELDS:
        get_str(body, key, None)


def parse_gen(body: Mapping[str, Any], defaults: SamplingParams, n_vocab: int,
              default_max_tokens: int | None, api: str = "llama",
              tokenize: Callable[[str], list[int]] | None = None) -> GenParams:
    """Everything but the prompt: sampling, limits, stop strings, streaming, logprobs
    (``api``: ``"chat"``, ``"completions"`` or ``"llama"``, see :func:`parse_logprobs`),
    extensions. ``tokenize``: text -> ids for ``logit_bias`` keyed by text."""
    n = get_int(body, "n", 1)
    if n < 1 or n > MAX_CHOICES:
        raise invalid(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    if n != 1 and (api != "chat" or get_bool(body, "stream", False)):
        raise invalid(f"'n' must be 1 here (several choices: /v1/chat/completions, not "
                      f"streamed), got {n}", "n")
    n_probs = parse_logprobs(body, api, n_vocab)
    for key in ("functions", "mirostat"):
        if body.get(key) not in (None, [], "", 0):
            raise ApiError(400, f"'{key}' is not supported by pyggspec serve", param=key,
                           type="not_supported_error")
    grammar = parse_grammar(body)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    include_usage = get_bool(so or {}, "include_usage", False)
    spec = body.get("speculative")
    if spec is not None and not isinstance(spec, bool):
        raise invalid(f"'speculative' must be a boolean, got {_kind(spec)}", "speculative")
    check_known_fields(body)
    n_draft = get_int(body, "speculative.n_max", None)
    if n_draft is not None and n_draft < 0:
        raise invalid(f"'speculative.n_max' must be >= 0, got {n_draft}", "speculative.n_max")
    slot = get_int(body, "id_slot", None, lo=None, hi=None)
    if slot is not None and slot < -1:
        raise invalid(f"'id_slot' must be -1 (any slot) or a slot id, got {slot}", "id_slot")
    return GenParams(
        slot=None if slot is None or slot == -1 else slot,
        n_draft_max=n_draft,
        sampling=parse_sampling(body, defaults, n_vocab, tokenize),
        max_tokens=parse_max_tokens(body, default_max_tokens),
        stop=parse_stop(body),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stream=get_bool(body, "stream", False),
        include_usage=include_usage,
        speculative=spec,
        return_tokens=get_bool(body, "return_tokens", False),
        echo=get_bool(body, "echo", False),
        n_probs=n_probs,
        post_sampling_probs=get_bool(body, "post_sampling_probs", False),
        grammar=grammar,
        n=n,
        timings_per_token=get_bool(body, "timings_per_token", False),
        return_progress=get_bool(body, "return_progress", False),
    )


def parse_grammar(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The output constraint: llama-server's ``grammar`` (GBNF text) or ``json_schema`` (a
    schema object), or OpenAI's ``response_format`` (``{"type": "json_object"}`` with
    llama-server's optional ``"schema"``, ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``, ``{"type": "text"}``). More than one is a 400, as llama-server
    refuses ``grammar`` with ``json_schema``. Only the shape is checked here; the scheduler
    compiles it (a grammar that does not compile is a 400 naming the field too)."""
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise invalid(f"'grammar' must be a string (GBNF), got {_kind(grammar)}", "grammar")
    found: list[GrammarSpec] = []
    if grammar:
        found.append(GrammarSpec.gbnf(grammar, "grammar"))
    schema = body.get("json_schema")
    if schema is not None:
        found.append(_schema_spec(schema, "json_schema"))
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise invalid(f"'response_format' must be an object, got {_kind(rf)}",
                          "response_format")
        kind = rf.get("type", "text")
        if kind == "json_object":
            # OpenAI's JSON mode: an object (llama-server reads any JSON value here);
            # llama-server's extension: its own "schema"
            found.append(_schema_spec(rf.get("schema", {"type": "object"}), "response_format"))
        elif kind == "json_schema":
            wrapper = rf.get("json_schema", {})
            if not isinstance(wrapper, dict):
                raise invalid("'response_format.json_schema' must be an object",
                              "response_format")
            found.append(_schema_spec(wrapper.get("schema", {}), "response_format"))
        elif kind != "text":
            raise invalid("'response_format' type must be one of \"text\", \"json_object\" "
                          f"or \"json_schema\", but got: {kind!r}", "response_format")
    if len(found) > 1:
        names = " and ".join(f"'{g.field}'" for g in found)
        raise invalid(f"{names} cannot be used together: give one output constraint",
                      found[1].field)
    return found[0] if found else None


def _schema_spec(schema: Any, key: str) -> GrammarSpec:
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"'{key}' schema must be a JSON object, got {_kind(schema)}", key)
    try:
        return GrammarSpec.json_schema(schema, key)
    except GrammarError as e:
        raise invalid(f"'{key}': {e.message}", key) from None


# ---------------------------------------------------------------------------- prompts
MAX_PROMPTS = 16  # prompts in one request (each is a request of its own to the scheduler)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ImagePrompt:
    """llama-server's ``{"prompt_string": TEXT, "multimodal_data": [BASE64, ...]}``: one
    media marker in TEXT per image."""

    text: str
    data: tuple[str, ...]


def parse_prompts(body: Mapping[str, Any], n_vocab: int, key: str = "prompt",
                  media: bool = False) -> list[list[Any]]:
    """llama-server's prompt shapes (``tokenize_input_prompts``): one prompt, or an array
    without token ids at its top level holding several; each is a string, token ids, a mix
    (``[12, "text", 34]``) or ``{"prompt_string": TEXT}`` (``multimodal_data`` there is a
    400: no multimodal input). Each prompt comes back as its parts (text and ids)."""
    if key not in body or body[key] is None:
        raise invalid(f"'{key}' is required", key)
    p = body[key]
    if isinstance(p, list) and not any(_is_id(x) for x in p):
        if not p:
            raise invalid(f"'{key}' is empty", key)
        if len(p) > MAX_PROMPTS:
            raise invalid(f"'{key}' holds {len(p)} prompts; at most {MAX_PROMPTS} per "
                          "request", key)
        return [_one_prompt(x, n_vocab, key, media and len(p) == 1) for x in p]
    return [_one_prompt(p, n_vocab, key, media)]


def parse_prompt(body: Mapping[str, Any], n_vocab: int, key: str = "prompt") -> list[Any]:
    """One prompt (:func:`parse_prompts` holding several is a 400)."""
    prompts = parse_prompts(body, n_vocab, key)
    if len(prompts) > 1:
        raise invalid(f"'{key}' holds several prompts; this endpoint takes one", key)
    return prompts[0]


def _one_prompt(p: Any, n_vocab: int, key: str, media: bool = False) -> list[Any]:
    if isinstance(p, dict):
        data = p.get("multimodal_data")
        if media and data is not None:
            text = p.get("prompt_string")
            if not isinstance(text, str) or not isinstance(data, list) \
                    or not all(isinstance(d, str) for d in data):
                raise invalid(f"'{key}' with multimodal_data needs 'prompt_string' (a string) "
                              "and 'multimodal_data' (an array of base64 strings)", key)
            return [ImagePrompt(text, tuple(data))]
        if data is not None:
            raise ApiError(400, f"'{key}.multimodal_data': multimodal input is not supported "
                           "on this endpoint (images go to /completion and the chat APIs)", param=key, type="not_supported_error")
        text = p.get("prompt_string")
        if not isinstance(text, str):
            raise invalid(f"'{key}' as an object needs 'prompt_string' (a string)", key)
        p = text
    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        out: list[Any] = []
        for x in p:
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, int) and not isinstance(x, bool):
                if not 0 <= x < n_vocab:
                    raise invalid(f"'{key}' token id {x} is outside the vocabulary "
                                  f"(0..{n_vocab - 1})", key)
                out.append(x)
            else:
                raise invalid(f"'{key}' must be a string, token ids, a mix of both, or an "
                              "array of such prompts", key)
        if not out:
            raise invalid(f"'{key}' is empty", key)
        return out
    raise invalid(f"'{key}' must be a string or an array of token ids, got {_kind(p)}", key)


def parse_token_list(body: Mapping[str, Any], key: str, n_vocab: int) -> list[int]:
    v = body.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise invalid(f"'{key}' must be an array of token ids, got {_kind(v)}", key)
    out = []
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise invalid(f"'{key}' holds {t!r}, not a token id in 0..{n_vocab - 1}", key)
        out.append(t)
    return out


# ---------------------------------------------------------------------------- chat messages
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: Mapping[str, Any], images: list[tuple[str, str]] | None = None
                   ) -> list[dict[str, Any]]:
    """OpenAI chat messages: content parts are joined into one string (templates expect
    strings). ``images``: each ``image_url`` part's (url, field) is appended there and the
    part becomes the media marker text (llama-server's rule); None refuses image parts."""
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{where}' must be an object, got {_kind(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                          f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            content = _join_parts(content, f"{where}.content", images)
        elif content is None:
            if role != "assistant":
                raise invalid(f"'{where}.content' is required for role {role}",
                              f"{where}.content")
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"'{where}.content' must be a string or an array of text parts, "
                          f"got {_kind(content)}", f"{where}.content")
        msg: dict[str, Any] = {"role": role, "content": content}
        for k in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise invalid(f"'{where}.tool_calls' is only allowed on assistant messages",
                              f"{where}.tool_calls")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _tool_calls(v: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls``: ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` each; ``arguments`` a JSON text or an object (kept
    as given; the chat template decides which it renders, see ``ChatTemplate``)."""
    if not isinstance(v, list):
        raise invalid(f"'{where}' must be an array, got {_kind(v)}", where)
    out = []
    for j, tc in enumerate(v):
        w = f"{where}[{j}]"
        if not isinstance(tc, dict):
            raise invalid(f"'{w}' must be an object, got {_kind(tc)}", w)
        if tc.get("type", "function") != "function":
            raise invalid(f"'{w}.type' must be \"function\", got {tc.get('type')!r}", f"{w}.type")
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"'{w}.function' must be an object, got {_kind(fn)}", f"{w}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"'{w}.function.name' must be a non-empty string",
                          f"{w}.function.name")
        args = fn.get("arguments", "")
        if not isinstance(args, (str, dict)):
            raise invalid(f"'{w}.function.arguments' must be a JSON string or an object, got "
                          f"{_kind(args)}", f"{w}.function.arguments")
        call: dict[str, Any] = {"type": "function", "function": {"name": name,
                                                                 "arguments": args}}
        if isinstance(tc.get("id"), str):
            call["id"] = tc["id"]
        out.append(call)
    return out


def _join_parts(parts: Sequence[Any], where: str,
                images: list[tuple[str, str]] | None = None) -> str:
    """Text parts joined by newlines, none next to a media marker (llama.cpp's
    ``concat_content_parts``)."""
    text, after_media = "", False
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else _kind(part)
        w = f"{where}[{j}]"
        if kind == "image_url":
            if images is None:

                raise no_projector(w)
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise invalid(f"'{w}.image_url.url' must be a string", w)

            images.append((url, w))
            text += media_marker()
            after_media = True
            continue
        if kind != "text":
            raise ApiError(400, f"'{w}' is {kind!r} content; only text and image_url are "
                           "supported", param=where, type="not_supported_error")
        t = part.get("text")
        if not isinstance(t, str):
            raise invalid(f"'{w}.text' must be a string", where)
        text += ("\n" if text and not after_media else "") + t
        after_media = False
    return text


# ---------------------------------------------------------------- media and file names
_FORBIDDEN = frozenset(map(ord, ':*?"<>|/\\')) | {0x7F, 0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF}


def valid_filename(name: str, subdirs: bool = False) -> bool:
    """llama.cpp's ``fs_validate_filename``: a plain file name of at most 255 bytes, no
    path separators (``subdirs``: '/' and '\\' allowed), controls or reserved characters,
    no ``..``, no leading or trailing space, no trailing dot."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for ch in name:
        c = ord(ch)
        bad = c <= 0x1F or 0x80 <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or c in _FORBIDDEN
        if bad and not (subdirs and ch in "/\\"):
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


@functools.cache
def media_marker() -> str:
    """llama-server's ``get_media_marker``: ``$LLAMA_MEDIA_MARKER`` or a random one, fixed
    for the process."""
    return os.environ.get("LLAMA_MEDIA_MARKER") or f"<__media_{secrets.token_hex(16)}__>"


def no_projector(where: str | None) -> ApiError:
    """llama-server's words for an image sent to a server without a projector."""
    return ApiError(400, "image input is not supported - hint: this server has no vision "
                    "projector; start it with --mmproj FILE", param=where,
                    type="not_supported_error")
