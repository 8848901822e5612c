"""Response bodies: OpenAI chat/completions (whole and streamed) and llama-server's
``/completion``, built from a finished ``serving.request.Result`` or one ``Event``, and
llama-server's ``generation_settings``.

Plain functions returning dicts, so the shapes can be read (and tested) in one place. Fields
follow llama-server: ``timings`` (with ``draft_n`` / ``draft_n_accepted`` when the request
speculated) next to OpenAI's ``usage`` in every final response and final stream chunk.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.http.protocol import GenParams
    from pyggspec.serving.sequence import TokenLogprob

# OpenAI's system_fingerprint names the backend build; llama-server's is "b<build>-<commit>"
# and its clients (and llama.cpp's own tests) read the "b" prefix: ours keeps that form
SYSTEM_FINGERPRINT = "b0-pyggspec"

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length",
          "cancelled": "stop"}
STOP_TYPE = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit",
             "cancelled": "none"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(result: Any) -> dict[str, Any]:
    n_prompt = len(result.prompt_tokens)
    n_gen = len(result.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
            "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": result.timings.cache_n}}


def timings(result: Any) -> dict[str, Any]:
    return result.timings.to_dict()


# ---------------------------------------------------------------------------- logprobs
LOG_ZERO = -3.4028234663852886e38  # llama-server's log(0): float32 lowest (JSON has no -inf)


def utf8_complete(b: bytes) -> bytes:
    """``b`` without a trailing incomplete UTF-8 character (llama-server's validate_utf8:
    a token may end inside a character; its ``token`` text drops the part, ``bytes`` not)."""
    for k in range(1, min(4, len(b)) + 1):
        c = b[-k]
        if c & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        need = 1 if c < 0x80 else 2 if c >> 5 == 6 else 3 if c >> 4 == 14 else 4
        return b if need <= k else b[:-k]
    return b


def logprob_entries(lps: Iterable[TokenLogprob], piece: Callable[[int], bytes],
                    post_sampling: bool) -> list[dict[str, Any]]:
    """llama-server's per-token objects (``completion_probabilities``, and OpenAI's
    ``logprobs.content``): ``id``, ``token``, ``bytes``, ``logprob`` and ``top_logprobs``
    [{id, token, bytes, logprob}]; with ``post_sampling`` ``prob`` and ``top_probs``."""
    key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def one(tok: int, lp: float) -> dict[str, Any]:
        b = piece(tok)
        value = math.exp(lp) if post_sampling else lp if lp > -math.inf else LOG_ZERO
        return {"id": tok, "token": utf8_complete(b).decode("utf-8", errors="replace"),
                "bytes": list(b), key: value}

    out = []
    for t in lps:
        d = one(t.id, t.logprob)
        d[top_key] = [one(i, v) for i, v in t.top]
        out.append(d)
    return out


# ---------------------------------------------------------------------------- chat
def chat_finish_reason(result: Any, tool_calls: bool) -> str:
    """llama-server's: ``tool_calls`` when the answer ended by itself (end of generation,
    a stop string) holding tool calls; ``length`` when it was cut off, calls or not."""
    if tool_calls and result.stop_reason in ("eos", "stop"):
        return "tool_calls"
    return FINISH[result.stop_reason]


def chat_response(rid: str, created: int, model: str, result: Any,
                  logprobs: list[dict[str, Any]] | None = None,
                  message: Any = None) -> dict[str, Any]:
    """``logprobs``: :func:`logprob_entries` of the result's tokens, when asked for.
    ``message``: the parsed answer (``chat_parse.ChatMessage``: content, reasoning_content,
    tool_calls); None: the text is the content."""
    msg = (message.to_openai() if message is not None
           else {"role": "assistant", "content": result.text})
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "finish_reason": chat_finish_reason(result, "tool_calls" in msg),
                     "logprobs": None if logprobs is None else {"content": logprobs},
                     "message": msg}],
        "usage": usage(result), "timings": timings(result),
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any],
               finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": None}]}


def chat_final_chunk(rid: str, created: int, model: str, result: Any,
                     tool_calls: bool = False) -> dict[str, Any]:
    c = chat_chunk(rid, created, model, {}, chat_finish_reason(result, tool_calls))
    c["timings"] = timings(result)
    return c


def usage_chunk(rid: str, created: int, model: str, result: Any, obj: str) -> dict[str, Any]:
    """``stream_options.include_usage``: one last chunk with no choices and the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage(result),
            "timings": timings(result)}


# ---------------------------------------------------------------------------- completions
def completion_response(rid: str, created: int, model: str, result: Any,
                        prefix: str = "", logprobs: list[dict[str, Any]] | None = None,
                        ) -> dict[str, Any]:
    """``logprobs`` in llama-server's shape (``{"content": [...]}``, not OpenAI's legacy
    ``tokens``/``token_logprobs`` lists), as its ``/v1/completions`` answers."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "text": prefix + result.text,
                     "logprobs": None if logprobs is None else {"content": logprobs},
                     "finish_reason": FINISH[result.stop_reason]}],
        "usage": usage(result), "timings": timings(result),
    }


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


def completion_final_chunk(rid: str, created: int, model: str, result: Any) -> dict[str, Any]:
    """The chunk with ``finish_reason``. It carries ``usage`` whether or not the request
    asked for ``stream_options.include_usage``: llama-server's ``/v1/completions`` stream
    ends with its whole final result, usage included (its chat stream does not)."""
    c = completion_chunk(rid, created, model, "", FINISH[result.stop_reason])
    c["usage"] = usage(result)
    c["timings"] = timings(result)
    return c


# ---------------------------------------------------------------------------- llama-server
def llama_completion(model: str, result: Any, settings: dict[str, Any], prompt: Any,
                     return_tokens: bool, n_ctx: int,
                     probs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """llama-server's ``/completion`` result (the final stream chunk has the same fields,
    with ``content`` empty); ``probs`` (:func:`logprob_entries`) become its
    ``completion_probabilities`` when there are any."""
    n_prompt = len(result.prompt_tokens)
    out = {
        "index": 0, "content": result.text,
        "tokens": list(result.tokens) if return_tokens else [],
        "id_slot": result.slot, "stop": True, "model": model,
        "tokens_predicted": len(result.tokens), "tokens_evaluated": n_prompt,
        "generation_settings": settings, "prompt": prompt,
        "has_new_line": "\n" in result.text,
        "truncated": result.stop_reason == "context" or n_prompt + len(result.tokens) > n_ctx,
        "stop_type": STOP_TYPE[result.stop_reason],
        "stopping_word": result.stop_word or "",
        "tokens_cached": result.timings.cache_n + result.timings.prompt_n + len(result.tokens),
        "timings": timings(result),
    }
    if probs:
        out["completion_probabilities"] = probs
    return out


def llama_chunk(text: str, tokens: list[int], slot: int) -> dict[str, Any]:
    return {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": slot}


def model_card(model_id: str, created: int, meta: dict[str, Any],
               aliases: tuple[str, ...] = (), tags: tuple[str, ...] = ()) -> dict[str, Any]:
    """One ``/v1/models`` ``data[]`` entry (OpenAI's card with llama-server's extras:
    ``-a`` aliases and ``--tags``, sorted as llama-server's sets are)."""
    return {"id": model_id, "aliases": sorted(aliases), "tags": sorted(tags),
            "object": "model", "created": created, "owned_by": "pyggspec", "meta": meta}


def ollama_model_entry(model_id: str) -> dict[str, Any]:
    """``/v1/models`` ``models[]``: the Ollama-style list llama-server sends beside OpenAI's
    ``data`` (some UIs read only this one); its fields, with llama-server's placeholders."""
    return {"name": model_id, "model": model_id, "modified_at": "", "size": "", "digest": "",
            "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
            "parameters": "",
            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                        "parameter_size": "", "quantization_level": ""}}


def generation_settings(gen: GenParams, *, n_ctx: int, model_id: str, speculative: bool,
                        n_max: int, backend_sampling: bool,
                        eog: Sequence[int] = ()) -> dict[str, Any]:
    """llama-server's ``generation_settings`` (the values a request runs with): its fields
    in its order, then pyggspec's. Samplers pyggspec does not implement (dynatemp,
    top-n-sigma, XTC, DRY, mirostat, adaptive-p) are reported in llama.cpp's disabled
    state, which is the state they run in here. ``speculative``: whether the server
    speculates at all; the request may turn it off. ``eog``: the end-of-generation ids,
    listed with a -inf bias (JSON null) when the request ignores EOS, as llama-server's
    ``ignore_eos`` adds them to the sampler's biases."""
    s = gen.sampling
    n_predict = -1 if gen.max_tokens is None else gen.max_tokens
    spec = speculative if gen.speculative is None else gen.speculative and speculative
    return {
        "seed": s.seed, "temperature": s.temp, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
        "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
        "typical_p": s.typical_p, "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "dry_multiplier": 0.0, "dry_base": 1.75,
        "dry_allowed_length": 2, "dry_penalty_last_n": 64,
        "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
        "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
        "adaptive_decay": 0.9, "stop": list(gen.stop), "max_tokens": n_predict,
        "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
        "ignore_eos": gen.ignore_eos, "stream": gen.stream,
        # llama-server's {"bias", "token"} objects; a ban (-inf) as false, the value a
        # request bans a token with (JSON has no -inf)
        "logit_bias": [{"bias": b if math.isfinite(b) else False, "token": t}
                       for t, b in s.logit_bias]
        + ([{"bias": None, "token": t} for t in eog] if gen.ignore_eos else []),
        "n_probs": gen.n_probs or 0, "min_keep": 0,
        "grammar": gen.grammar.text if gen.grammar and gen.grammar.kind == "gbnf" else "",
        "grammar_lazy": False,
        "grammar_triggers": [], "preserved_tokens": [], "chat_format": "Content-only",
        "reasoning_format": "none", "reasoning_in_content": False,
        "generation_prompt": "", "samplers": list(s.samplers),
        "speculative.types": "draft-mtp" if spec else "none",
        "timings_per_token": gen.timings_per_token,
        "post_sampling_probs": gen.post_sampling_probs,
        "backend_sampling": backend_sampling,
        "lora": [],
        # pyggspec's own
        "n_ctx": n_ctx, "model": model_id, "speculative": spec,
        "speculative.n_max": n_max,
    }
