"""``Engine.create_completion`` / ``create_chat_completion``: llama-cpp-python's Python API
(arguments, defaults and dict shapes of ``Llama.create_completion`` and
``Llama.create_chat_completion``) on top of the scheduler."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyggspec.errors import PyggspecError
from pyggspec.sampling.params import DEFAULT_SEED, SamplingParams
from pyggspec.serving.request import Request, RequestError, RequestHandle, Result

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.engine import Engine


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason for our stop reasons (llama-cpp-python's mapping)."""
    return "length" if stop_reason in ("length", "context") else "stop"


def _sampling(temperature: float, top_p: float, min_p: float, typical_p: float, top_k: int,
              repeat_penalty: float, presence_penalty: float, frequency_penalty: float,
              seed: int | None, logit_bias: Mapping[int | str, float] | None) -> SamplingParams:
    bias = tuple((int(t), float(b)) for t, b in (logit_bias or {}).items())
    return SamplingParams(temp=temperature, top_p=top_p, min_p=min_p, typical_p=typical_p,
                          top_k=top_k, repeat_penalty=repeat_penalty,
                          presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty,
                          seed=DEFAULT_SEED if seed is None else int(seed), logit_bias=bias)


def _submit(engine: Engine, prompt: str | Sequence[int], max_tokens: int | None,
            stop: str | Sequence[str] | None, sampling: SamplingParams,
            speculative: bool | None, n_draft_max: int | None) -> RequestHandle:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    mt = None if max_tokens is None or max_tokens <= 0 else int(max_tokens)
    try:
        return engine.submit(Request(prompt, max_tokens=mt, sampling=sampling, stop=stops,
                                     speculative=speculative, n_draft_max=n_draft_max))
    except RequestError as err:
        raise PyggspecError(None, err.message) from None


def _usage(res: Result) -> dict[str, int]:
    n_out = len(res.tokens)
    return {"prompt_tokens": res.n_prompt, "completion_tokens": n_out,
            "total_tokens": res.n_prompt + n_out}


def create_completion(engine: Engine, prompt: str | Sequence[int], *,
                      max_tokens: int | None = 16, temperature: float = 0.8,
                      top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                      top_k: int = 40, stop: str | Sequence[str] | None = None,
                      repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0, seed: int | None = None,
                      logit_bias: Mapping[int | str, float] | None = None, echo: bool = False,
                      stream: bool = False, model: str | None = None,
                      speculative: bool | None = None,
                      n_draft_max: int | None = None) -> dict | Iterator[dict]:
    """Text completion, llama-cpp-python style. ``max_tokens`` None or <= 0: until end of
    generation or the context end. ``echo`` prepends the prompt text."""
    sp = _sampling(temperature, top_p, min_p, typical_p, top_k, repeat_penalty,
                   presence_penalty, frequency_penalty, seed, logit_bias)
    h = _submit(engine, prompt, max_tokens, stop, sp, speculative, n_draft_max)
    cid = f"cmpl-{uuid.uuid4()}"
    created = int(time.time())
    name = model or engine.model_path
    prefix = ""
    if echo:
        prefix = prompt if isinstance(prompt, str) else engine.detokenize(h.prompt_tokens)

    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}

    if stream:
        def chunks() -> Iterator[dict]:
            try:
                if prefix:
                    yield {"id": cid, "object": "text_completion", "created": created,
                           "model": name, "choices": [choice(prefix, None)]}
                for ev in h:
                    if ev.text:
                        yield {"id": cid, "object": "text_completion", "created": created,
                               "model": name, "choices": [choice(ev.text, None)]}
                res = h.result()
                yield {"id": cid, "object": "text_completion", "created": created,
                       "model": name, "choices": [choice("", finish_reason(res.stop_reason))],
                       "usage": _usage(res)}
            finally:
                h.cancel()

        return chunks()
    res = h.result()
    return {"id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [choice(prefix + res.text, finish_reason(res.stop_reason))],
            "usage": _usage(res)}


def create_chat_completion(engine: Engine, messages: Sequence[Mapping[str, Any]], *,
                           max_tokens: int | None = None, temperature: float = 0.2,
                           top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                           top_k: int = 40, stop: str | Sequence[str] | None = None,
                           repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, seed: int | None = None,
                           logit_bias: Mapping[int | str, float] | None = None,
                           stream: bool = False, model: str | None = None,
                           speculative: bool | None = None,
                           n_draft_max: int | None = None) -> dict | Iterator[dict]:
    """Chat completion, llama-cpp-python style: the GGUF's chat template renders
    ``messages`` (the template's own BOS, no extra special tokens)."""
    if engine.tokenizer is None:
        raise PyggspecError(None, "chat needs the tokenizer (load_tokenizer=True)")
    text = engine.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    prompt = engine.tokenizer.tokenize(text, add_special=False)
    sp = _sampling(temperature, top_p, min_p, typical_p, top_k, repeat_penalty,
                   presence_penalty, frequency_penalty, seed, logit_bias)
    h = _submit(engine, prompt, max_tokens, stop, sp, speculative, n_draft_max)
    cid = f"chatcmpl-{uuid.uuid4()}"
    created = int(time.time())
    name = model or engine.model_path

    def chunk(delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"id": cid, "model": name, "created": created,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": reason}]}

    if stream:
        def chunks() -> Iterator[dict]:
            try:
                yield chunk({"role": "assistant"}, None)
                for ev in h:
                    if ev.text:
                        yield chunk({"content": ev.text}, None)
                res = h.result()
                yield chunk({}, finish_reason(res.stop_reason))
            finally:
                h.cancel()

        return chunks()
    res = h.result()
    return {"id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                         "logprobs": None, "finish_reason": finish_reason(res.stop_reason)}],
            "usage": _usage(res)}
