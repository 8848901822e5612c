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
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.http.chat_job import prepare_chat
from pyggspec.serving.http.chat_parse import ChatStream, parse_final
from pyggspec.serving.http.live_timings import LiveTimings
from pyggspec.serving.http.protocol import (
    ApiError,
    get_bool,
    invalid,
    parse_gen,
    parse_messages,
    parse_prompts,
    read_body,
)
from pyggspec.serving.http.state import ServerState
from pyggspec.serving.http.streaming import NO_EVENT, run_to_end, stream
from pyggspec.serving.request import Result


def logprob_objects(state: ServerState, gen: Any, lps: Any) -> list[dict[str, Any]] | None:
    """The response's per-token objects for ``lps`` (None: the request asked for none)."""
    if gen.n_probs is None:
        return None
    return oa.logprob_entries(lps or (), state.tokenizer.token_to_piece,
                              gen.post_sampling_probs)


async def answer_llama(state: ServerState, request: Request, handle: Any, t_start: float,
                       gen: Any, model: str, settings: dict[str, Any], echo: Any) -> Response:
    """llama-server's ``/completion`` answer for a submitted request (``/infill``'s too):
    the whole result, or SSE chunks of one token each (with ``completion_probabilities``
    when asked) and a final chunk with the timings, no ``[DONE]``."""
    if not gen.stream:
        result = await run_to_end(state, request, handle, t_start)
        return JSONResponse(oa.llama_completion(model, result, settings, echo,
                                                gen.return_tokens, state.n_ctx,
                                                logprob_objects(state, gen, result.logprobs)))

    def chunk(ev: Any) -> list[Any]:
        c = oa.llama_chunk(ev.text, list(ev.tokens), -1)
        if ev.logprobs and gen.n_probs is not None:  # one token's, as llama-server
            c["completion_probabilities"] = logprob_objects(state, gen, ev.logprobs)
        return [c]

    def final(result: Result) -> list[Any]:
        last = oa.llama_completion(model, result, settings, echo, gen.return_tokens,
                                   state.n_ctx)
        last["content"] = ""
        last["tokens"] = []
        return [last]

    return stream(state, handle, t_start, chunk, final, done_marker=False,
                  live=LiveTimings.of(gen))


def install(app: FastAPI, state: ServerState) -> None:
    """Add the generation endpoints (and their 405 answers to GET) to ``app``."""
    cfg = state.config

    def probs(gen: Any, lps: Any) -> list[dict[str, Any]] | None:
        return logprob_objects(state, gen, lps)

    def held(gen: Any) -> Callable[[Any, dict[str, Any] | None], None]:
        """For OpenAI streams: collects each event's logprobs and puts those not yet sent
        on the next chunk that carries text (the final one gets what is left, if any), so
        every token's appear once, in order, and every text chunk has ``logprobs`` when
        they were asked for."""
        pending: list[Any] = []

        def take(ev: Any, c: dict[str, Any] | None, last: bool = False) -> None:
            pending.extend(ev.logprobs)
            if c is not None and gen.n_probs is not None and (pending or not last):
                c["choices"][0]["logprobs"] = {"content": probs(gen, pending)}
                pending.clear()

        return take

    def verbose(out: dict[str, Any], body: Any, gen: Any, model: str,
                result: Result) -> dict[str, Any]:
        """llama-server's ``__verbose`` debug object on an OpenAI answer: its own
        ``/completion`` result (the prompt as the model read it, detokenized with its special
        tokens), when the request's ``verbose`` asks (default: serve's ``--verbose``)."""
        if get_bool(body, "verbose", cfg.verbose):
            prompt = state.prompt_text(result.prompt_tokens)
            out["__verbose"] = oa.llama_completion(model, result, state.settings(gen), prompt,
                                                   gen.return_tokens, state.n_ctx)
        return out

    async def several(request: Request, body: Any, prompts: list[list[Any]], gen: Any,
                      t_start: float) -> list[Result]:
        """Several prompts in one request (llama-server answers each): one scheduler
        request each, all checked before any is queued, results in prompt order. Not
        streamed (one stream per request here)."""
        if gen.stream:
            raise invalid("several prompts in one request cannot be streamed; send one "
                          "per request", "prompt")
        all_ids = await asyncio.to_thread(lambda: [state.tokenize_prompt(p) for p in prompts])
        for ids in all_ids:
            state.check_context(ids, gen)
        rid, cache_prompt = oa.new_id("cmpl"), get_bool(body, "cache_prompt", True)
        handles: list[Any] = []
        try:
            for i, ids in enumerate(all_ids):
                handles.append(await state.submit(ids, gen, f"{rid}-{i}", cache_prompt))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return list(await asyncio.gather(*(run_to_end(state, request, h, t_start)
                                           for h in handles)))

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        images: list[tuple[str, str]] = []
        job = await prepare_chat(state, body, parse_messages(body, images), images)
        gen, prompt = job.gen, job.prompt
        rid, created = oa.new_id("chatcmpl"), oa.now()

        if gen.n > 1:  # several choices: one request each, answered together (not streamed)
            handles = [await job.start(state, f"{rid}-{i}") for i in range(gen.n)]
            results = await asyncio.gather(*(run_to_end(state, request, h, t_start)
                                             for h in handles))
            outs = [oa.chat_response(rid, created, model, r, probs(gen, r.logprobs),
                                     parse_final(r.text, prompt.syntax)) for r in results]
            out = outs[0]
            out["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(outs)]
            n_out = sum(o["usage"]["completion_tokens"] for o in outs)
            out["usage"].update(completion_tokens=n_out,
                                total_tokens=out["usage"]["prompt_tokens"] + n_out)
            return JSONResponse(verbose(out, body, gen, model, results[0]))
        handle = await job.start(state, rid)
        if not gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            message = parse_final(result.text, prompt.syntax)
            out = oa.chat_response(rid, created, model, result, probs(gen, result.logprobs),
                                   message)
            return JSONResponse(verbose(out, body, gen, model, result))

        first = [True]
        logprobs = held(gen)
        parser = ChatStream(prompt.syntax)

        def chunk(ev: Any) -> list[Any]:
            out = []
            if ev.progress is not None:  # llama-server: the opening delta carries it
                return [oa.chat_chunk(rid, created, model,
                                      {"role": "assistant", "content": None})]
            if first[0]:
                first[0] = False
                out.append(oa.chat_chunk(rid, created, model,
                                         {"role": "assistant", "content": None}))
            deltas = [oa.chat_chunk(rid, created, model, d) for d in parser.feed(ev.text)]
            logprobs(ev, deltas[-1] if deltas else None)
            return out + deltas

        def final(result: Result) -> list[Any]:
            out = chunk(NO_EVENT) if first[0] else []
            out += [oa.chat_chunk(rid, created, model, d) for d in parser.finish()]
            out.append(oa.chat_final_chunk(rid, created, model, result,
                                           bool(parser.message.tool_calls)))
            logprobs(NO_EVENT, out[-1], last=True)
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result,
                                          "chat.completion.chunk"))
            return out

        return stream(state, handle, t_start, chunk, final, done_marker=True,
                      live=LiveTimings.of(gen))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        prompts = parse_prompts(body, state.n_vocab)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict, api="completions",
                        tokenize=state.text_ids)
        if body.get("suffix") is not None:
            raise ApiError(400, "'suffix' (infill) is not supported by pyggspec serve",
                           param="suffix", type="not_supported_error")
        if len(prompts) > 1:  # OpenAI: one choice per prompt
            results = await several(request, body, prompts, gen, t_start)
            rid, created = oa.new_id("cmpl"), oa.now()
            outs = [oa.completion_response(
                rid, created, model, r,
                state.prompt_text(r.prompt_tokens) if gen.echo else "",
                probs(gen, r.logprobs)) for r in results]
            out = outs[0]
            out["choices"] = [dict(o["choices"][0], index=i) for i, o in enumerate(outs)]
            for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                out["usage"][k] = sum(o["usage"][k] for o in outs)
            return JSONResponse(out)
        parts = prompts[0]
        ids = await asyncio.to_thread(state.tokenize_prompt, parts)
        state.check_context(ids, gen)
        prefix = state.prompt_text(ids) if gen.echo else ""
        rid, created = oa.new_id("cmpl"), oa.now()
        handle = await state.submit(ids, gen, rid, get_bool(body, "cache_prompt", True))
        if not gen.stream:
            result = await run_to_end(state, request, handle, t_start)
            out = oa.completion_response(rid, created, model, result, prefix,
                                         probs(gen, result.logprobs))
            return JSONResponse(verbose(out, body, gen, model, result))

        echoed = [not prefix]
        logprobs = held(gen)

        def chunk(ev: Any) -> list[Any]:
            text = ev.text
            if not echoed[0]:
                echoed[0] = True
                text = prefix + text
            c = (oa.completion_chunk(rid, created, model, text)
                 if text or ev.progress is not None else None)
            logprobs(ev, c)
            return [c] if c is not None else []

        def final(result: Result) -> list[Any]:
            out = chunk(NO_EVENT) if not echoed[0] else []
            out.append(oa.completion_final_chunk(rid, created, model, result))
            logprobs(NO_EVENT, out[-1], last=True)
            if gen.include_usage:
                out.append(oa.usage_chunk(rid, created, model, result, "text_completion"))
            return out

        return stream(state, handle, t_start, chunk, final, done_marker=True,
                      live=LiveTimings.of(gen))

    @app.post("/completion")
    @app.post("/completions")  # llama-server: its own shape here, OpenAI's under /v1 only
    async def completion(request: Request) -> Response:
        t_start = time.perf_counter()
        body = await read_body(request)
        model = state.model_name(body)
        prompts = parse_prompts(body, state.n_vocab, media=True)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict,
                        tokenize=state.text_ids)
        settings = state.settings(gen)
        if len(prompts) > 1:  # llama-server: an array of results, one per prompt
            results = await several(request, body, prompts, gen, t_start)
            return JSONResponse([
                dict(oa.llama_completion(model, r, settings, body["prompt"][i],
                                         gen.return_tokens, state.n_ctx,
                                         logprob_objects(state, gen, r.logprobs)), index=i)
                for i, r in enumerate(results)])
        ids, media = await asyncio.to_thread(state.prompt_rows, prompts[0], gen)
        # an image prompt as llama-server shows it, not its base64 sent back
        prompt_echo = body.get("prompt") if media is None else state.prompt_text(ids)
        handle = await state.submit(ids, gen, oa.new_id("cmpl"),
                                    get_bool(body, "cache_prompt", True), media=media)
        return await answer_llama(state, request, handle, t_start, gen, model, settings,
                                  prompt_echo)

    @app.get("/completion")
    @app.get("/v1/chat/completions")
    @app.get("/v1/completions")
    async def wrong_method(request: Request) -> Response:
        raise ApiError(405, f"use POST for {request.url.path}")
