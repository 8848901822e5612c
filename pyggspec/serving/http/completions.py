"""The generating endpoints: OpenAI's ``POST /v1/chat/completions`` and
``/v1/completions``, llama-server's ``POST /completion`` (and ``/completions``, its alias
there: OpenAI's shape is under ``/v1`` only).

Each handler parses and validates the body (HTTP 400 for anything wrong), renders and
tokenizes the prompt off the event loop, checks it fits, submits it to the scheduler and
then waits for the whole result or streams it as SSE (:mod:`.streaming`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.http.chat import parse_template_kwargs
from pyggspec.serving.http.protocol import (
    ApiError,
    get_bool,
    parse_gen,
    parse_messages,
    parse_prompt,
    read_body,
)
from pyggspec.serving.http.state import ServerState
from pyggspec.serving.http.streaming import NO_EVENT, run_to_end, stream
from pyggspec.serving.request import Result


def install(app: FastAPI, state: ServerState) -> None:
    """Add the generation endpoints (and their 405 answers to GET) to ``app``."""
    cfg = state.config

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        messages = parse_messages(body)
        kwargs = parse_template_kwargs(body)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        # template and tokenizer off the event loop: a long conversation must not stall
        # the other streams
        ids = await asyncio.to_thread(
            lambda: state.tokenize_prompt([state.template.render(messages, True, kwargs)]))
        state.check_context(ids, gen)
        rid, created = oa.new_id("chatcmpl"), oa.now()
        handle = await state.submit(ids, gen, rid, get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.chat_response(rid, created, model, result))

        first = [True]

        def chunk(ev: Any) -> list[Any]:
            out = []
            if first[0]:
                first[0] = False
                out.append(oa.chat_chunk(rid, created, model,
                                         {"role": "assistant", "content": None}))
            if ev.text:
                out.append(oa.chat_chunk(rid, created, model, {"content": ev.text}))
            return out

        def final(result: Result) -> list[Any]:
            out = chunk(NO_EVENT) if first[0] else []
            out.append(oa.chat_final_chunk(rid, created, model, result))
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result,
                                          "chat.completion.chunk"))
            return out

        return stream(state, handle, t_start, chunk, final, done_marker=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        parts = parse_prompt(body, state.n_vocab)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        if body.get("suffix") is not None:
            raise ApiError(400, "'suffix' (infill) is not supported by pyggspec serve",
                           param="suffix", type="not_supported_error")
        ids = await asyncio.to_thread(state.tokenize_prompt, parts)
        state.check_context(ids, gen)
        prefix = state.tokenizer.detokenize(ids) if gen.echo else ""
        rid, created = oa.new_id("cmpl"), oa.now()
        handle = await state.submit(ids, gen, rid, get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.completion_response(rid, created, model, result, prefix))

        echoed = [not prefix]

        def chunk(ev: Any) -> list[Any]:
            text = ev.text
            if not echoed[0]:
                echoed[0] = True
                text = prefix + text
            return [oa.completion_chunk(rid, created, model, text)] if text else []

        def final(result: Result) -> list[Any]:
            out = chunk(NO_EVENT) if not echoed[0] else []
            out.append(oa.completion_final_chunk(rid, created, model, result))
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result, "text_completion"))
            return out

        return stream(state, handle, t_start, chunk, final, done_marker=True)

    @app.post("/completion")
    @app.post("/completions")  # llama-server: its own shape here, OpenAI's under /v1 only
    async def completion(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        parts = parse_prompt(body, state.n_vocab)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict)
        ids = await asyncio.to_thread(state.tokenize_prompt, parts)
        state.check_context(ids, gen)
        settings = state.settings(gen)
        prompt_echo = body.get("prompt")
        handle = await state.submit(ids, gen, oa.new_id("cmpl"),
                                    get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            return JSONResponse(oa.llama_completion(model, result, settings, prompt_echo,
                                                    gen.return_tokens, state.n_ctx))

        def chunk(ev: Any) -> list[Any]:
            return [oa.llama_chunk(ev.text, list(ev.tokens), -1)]

        def final(result: Result) -> list[Any]:
            last = oa.llama_completion(model, result, settings, prompt_echo, gen.return_tokens,
                                       state.n_ctx)
            last["content"] = ""
            last["tokens"] = []
            return [last]

        return stream(state, handle, t_start, chunk, final, done_marker=False)

    @app.get("/completion")
    @app.get("/v1/chat/completions")
    @app.get("/v1/completions")
    async def wrong_method(request: Request) -> Response:
        raise ApiError(405, f"use POST for {request.url.path}")
