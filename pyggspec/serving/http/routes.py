"""The endpoints that generate nothing: ``/health``, ``/v1/models``, ``/props``, ``/slots``,
``/metrics`` (about the server) and ``/tokenize``, ``/detokenize``, ``/apply-template``
(the model's tokenizer and chat template). Field names and order follow llama-server,
pyggspec's own fields after its ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.http.chat_request import parse_chat_request, render_chat
from pyggspec.serving.http.metrics import prometheus_text
from pyggspec.serving.http.protocol import (
    ApiError,
    GenParams,
    get_bool,
    invalid,
    media_marker,
    parse_messages,
    parse_token_list,
    read_body,
)
from pyggspec.serving.http.state import ServerState


def install(app: FastAPI, state: ServerState) -> None:
    """Add the server and token endpoints to ``app``."""
    cfg = state.config
    sched = state.scheduler

    # --- health, models, props, slots, metrics --------------------------------------------
    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> JSONResponse:
        if not state.started or not sched.running:
            raise ApiError(503, "Loading model" if not state.started else "scheduler stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> JSONResponse:
        # llama-server's meta first, then pyggspec's
        meta = state.model_info.meta(state.n_ctx)
        meta.update({"n_parallel": state.n_parallel, "synthetic": cfg.synthetic,
                     "speculative": getattr(state.engine, "spec_type", None),
                     "spec_draft_n_max": state.n_max})
        if cfg.synthetic:
            meta["note"] = ("built-in SYNTHETIC demo model: random weights, constructed MTP "
                            "agreement; its text is meaningless")
        card = oa.model_card(cfg.model_id, state.created, meta, cfg.aliases, cfg.tags)
        entry = oa.ollama_model_entry(cfg.model_id)
        if state.vision is not None:  # llama-server: "multimodal" with a projector
            entry["capabilities"] = ["completion", "multimodal"]
        return JSONResponse({"models": [entry],
                             "object": "list", "data": [card]})

    @app.get("/props")
    async def props() -> JSONResponse:
        from pyggspec import __version__

        gen = GenParams(sampling=cfg.sampling, max_tokens=cfg.n_predict)
        caps = await asyncio.to_thread(state.template.caps)  # probed once, then cached
        # llama-server's fields in its order, then pyggspec's
        return JSONResponse({
            "default_generation_settings": {"params": state.settings(gen),
                                            "n_ctx": state.n_ctx,
                                            "speculative": state.speculative},
            "total_slots": state.n_parallel, "model_alias": cfg.model_id,
            "model_ftype": state.model_info.ftype, "model_path": cfg.model_path,
            "modalities": {"vision": state.vision is not None, "video": False,
                           "audio": False},
            "media_marker": media_marker(),
            "endpoint_slots": cfg.endpoint_slots, "endpoint_props": False,
            "endpoint_metrics": cfg.endpoint_metrics,
            "ui": False, "chat_template": state.template.source,
            "chat_template_caps": caps, "bos_token": state.template.bos_token,
            "eos_token": state.template.eos_token, "build_info": f"pyggspec {__version__}",
            "is_sleeping": False, "synthetic": cfg.synthetic,
            "chat_template_renderer": state.template.name})

    @app.get("/slots")
    async def slots(request: Request) -> JSONResponse:
        if not cfg.endpoint_slots:  # llama-server's ERROR_TYPE_NOT_SUPPORTED
            raise ApiError(501, "This server does not support slots endpoint. Start it with "
                           "`--slots`")
        info = await asyncio.to_thread(sched.slots)
        for s in info:  # llama-server's flag next to the scheduler's state name
            s.setdefault("is_processing", s.get("state") != "idle")
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(
                s.get("state") != "idle" for s in info):
            raise ApiError(503, "no slot available")
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if not cfg.endpoint_metrics:  # llama-server's ERROR_TYPE_NOT_SUPPORTED
            raise ApiError(501, "This server does not support metrics endpoint. Start it "
                           "with `--metrics`", type="not_supported_error")
        def text() -> str:
            return prometheus_text(state.metrics, sched.metrics(), sched.memory())

        resp = PlainTextResponse(await asyncio.to_thread(text),
                                 media_type="text/plain; version=0.0.4")
        # in llama-server's casing: llama.cpp's tests read a plain dict of header names
        resp.raw_headers.append((b"Process-Start-Time-Unix", str(state.created).encode()))
        return resp

    # --- tokens ------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise invalid("'content' (a string) is required", "content")
        ids = state.tokenizer.tokenize(content, add_special=get_bool(body, "add_special", False),
                                       parse_special=get_bool(body, "parse_special", True))
        if not get_bool(body, "with_pieces", False):
            return JSONResponse({"tokens": ids})
        out = []
        for t in ids:
            raw = state.tokenizer.token_to_piece(t)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request)
        ids = parse_token_list(body, "tokens", state.n_vocab)
        return JSONResponse({"content": state.tokenizer.detokenize(ids)})

    async def chat_prompt(request: Request) -> str:
        """A chat request's prompt, rendered as a chat request renders it (tools, thinking,
        a continued final message)."""
        body = await read_body(request)
        chat = parse_chat_request(body, parse_messages(body, []), state.config,
                                  state.template)
        prompt = await asyncio.to_thread(render_chat, state.template, chat,
                                         cfg.skip_chat_parsing)
        return prompt.text

    @app.post("/apply-template")
    async def apply_template(request: Request) -> JSONResponse:
        return JSONResponse({"prompt": await chat_prompt(request)})

    @app.post("/chat/completions/input_tokens")
    @app.post("/v1/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request) -> JSONResponse:
        """The prompt's token count of a chat request (llama-server's count-tokens
        endpoint): nothing is generated."""
        text = await chat_prompt(request)
        ids = await asyncio.to_thread(state.tokenize_prompt, [text])
        return JSONResponse({"input_tokens": len(ids), "object": "response.input_tokens"})
