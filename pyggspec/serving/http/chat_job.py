"""A chat request made ready to run: messages -> prompt -> tokens -> a submitted request.

One path for every API that chats: OpenAI's ``/v1/chat/completions``, and OpenAI's
Responses and Anthropic's Messages, whose bodies are first converted to a chat body
(:mod:`.responses_api`, :mod:`.anthropic_api`). So templating, tools, reasoning, a
reasoning budget or forced tool call (:mod:`.chat_run`), sampling and limits behave the same
whichever API asked; only the shape of the answer differs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyggspec.serving.http.chat_parse import THINK_CLOSE
from pyggspec.serving.http.chat_request import (
    ChatPrompt,
    ChatRequest,
    parse_chat_request,
    render_chat,
)
from pyggspec.serving.http.chat_run import ChatRun, ThinkingPlan, plan_for
from pyggspec.serving.http.media import chunk_ids, image_bytes
from pyggspec.serving.http.protocol import GenParams, get_bool, invalid, no_projector, parse_gen
from pyggspec.serving.http.state import ServerState


@dataclass
class ChatJob:
    """A chat request ready to submit: its parsed request, rendered prompt and tokens, and
    how it is generated (``plan``: the two-request answer of :mod:`.chat_run`, or None)."""

    chat: ChatRequest
    prompt: ChatPrompt
    ids: list[int]
    gen: GenParams
    cache_prompt: bool
    plan: ThinkingPlan | None
    media: Any = None  # the prompt's image rows (models.batch.MediaRows), None: text only

    async def start(self, state: ServerState, rid: str) -> Any:
        """Submit it; the handle (a scheduler request, or a :class:`ChatRun`) streams the
        answer's events."""
        if self.plan is not None:
            return await ChatRun(state, self.plan, self.ids, self.gen, rid,
                                 self.cache_prompt, self.media).start()
        return await state.submit(self.ids, self.gen, rid, self.cache_prompt,
                                  media=self.media)


async def render_ids(state: ServerState, chat: ChatRequest,
                     images: Sequence[tuple[str, str]] = ()) -> tuple[ChatPrompt, list[int], list]:
    """The prompt, its tokens (EMBD_ROW at image rows) and its image chunks (``images``:
    the (url, field) of each image part), off the event loop (a long conversation must not
    stall the other streams)."""

    def prepare() -> tuple[ChatPrompt, list[int], list]:
        prompt = render_chat(state.template, chat, state.config.skip_chat_parsing)
        if not images:
            return prompt, state.tokenize_prompt([prompt.text]), []
        if state.vision is None:
            raise no_projector(images[0][1])
        data = [image_bytes(url, state.vision.media_path, w) for url, w in images]
        chunks = state.vision.chunks(prompt.text, data)
        return prompt, chunk_ids(chunks), chunks

    return await asyncio.to_thread(prepare)


async def prepare_chat(state: ServerState, body: Mapping[str, Any],
                       messages: list[dict[str, Any]],
                       images: Sequence[tuple[str, str]] = ()) -> ChatJob:
    """Parse, render, tokenize and check a chat body (OpenAI's chat fields; HTTP 400 for
    anything wrong) whose ``messages`` are parsed already (``images``: what
    :func:`~.protocol.parse_messages` collected; encoded once the prompt fits)."""
    cfg = state.config
    chat = parse_chat_request(body, messages, cfg, state.template)
    gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict, api="chat",
                    tokenize=state.text_ids)
    prompt, ids, chunks = await render_ids(state, chat, images)
    state.check_context(ids, gen)
    media = None
    if chunks:
        media = (await asyncio.wrap_future(state.encode(chunks))).media
    if prompt.tool_grammar is not None:
        if gen.grammar is not None:  # llama-server refuses a grammar with tools too
            raise invalid("Cannot use custom grammar constraints with a required tool call "
                          "('tool_choice')", gen.grammar.field)
        if not prompt.tool_prefix:  # the prompt holds the call's start: hold the rest
            gen.grammar = prompt.tool_grammar
    elif prompt.auto_grammar is not None and gen.grammar is None:
        # tool_choice auto: free text, a call held from "<tool_call>" (a grammar of the
        # request's own replaces it; llama-server refuses a "grammar" beside tools)
        gen.grammar = prompt.auto_grammar
    if gen.grammar is not None and gen.grammar.kind == "json_schema" and prompt.thinking_open:
        # the prompt opened a thinking block: the model may think first, then the JSON
        # (llama-server's chat parser allows the reasoning before a response format)
        gen.grammar = dataclasses.replace(gen.grammar, after=THINK_CLOSE)
    return ChatJob(chat=chat, prompt=prompt, ids=ids, gen=gen,
                   cache_prompt=get_bool(body, "cache_prompt", True),
                   plan=plan_for(prompt, chat.reasoning_budget, chat.reasoning_budget_message),
                   media=media)


async def count_prompt_tokens(state: ServerState, body: Mapping[str, Any],
                              messages: list[dict[str, Any]],
                              images: Sequence[tuple[str, str]] = ()) -> int:
    """The prompt's token count of a chat body, as a request would be rendered (tools,
    thinking, a continued final message; an image counts its rows); nothing is generated."""
    chat = parse_chat_request(body, messages, state.config, state.template)
    return len((await render_ids(state, chat, images))[1])
