"""One chat answer that may need text put into it mid-way: a reasoning budget and a forced
tool call, generated as up to two scheduler requests seen as one.

llama-server does both inside its sampler: ``--reasoning-budget N`` counts the tokens after
``<think>`` and, at N, forces ``MESSAGE\\n</think>`` token by token
(``common/reasoning-budget.cpp``); a required tool call is a grammar. pyggspec's samplers
have neither stage, so the HTTP layer does it with what the scheduler offers: the first
request generates the thinking, stopping at ``</think>`` or after the budget
(``max_tokens``); when it ends there, a second request continues from the prompt, the
tokens so far and the inserted text (the slot's cached prefix is reused), and the client
sees one stream: the first request's events, one event carrying the inserted text and its
tokens, then the second's. The result is merged (tokens, text, timings, speculation
counts), counted once. Both requests are ordinary ones, so the answer is the same with and
without speculation.

What differs from llama-server: the second request draws its own random numbers (with a
fixed ``seed``, a seed derived from it and the tokens so far, so reruns repeat); a budget is
counted only when the prompt opens the thinking block (Qwen3.5/3.6's templates always do,
or close it at once with ``enable_thinking: false``); a budget ending inside a multi-byte
character is not completed first.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pyggspec.sampling.grammar import GrammarSpec
from pyggspec.sampling.params import DEFAULT_SEED
from pyggspec.serving.http.chat_parse import CALL_OPEN, THINK_CLOSE, held_len
from pyggspec.serving.http.media import extend_media
from pyggspec.serving.http.protocol import ApiError, GenParams
from pyggspec.serving.request import Event, RequestFailed, RequestHandle, RequestTimings, Result

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.http.chat_request import ChatPrompt
    from pyggspec.serving.http.state import ServerState


@dataclasses.dataclass(frozen=True)
class ThinkingPlan:
    """What happens at the end of an open thinking block: ``budget`` tokens at most (-1:
    any number), ``message`` before the forced ``</think>``, and ``tool_prefix`` (a tool
    call's start) after it."""

    budget: int = -1
    message: str = ""
    tool_prefix: str = ""
    tool_grammar: GrammarSpec | None = None  # holds the text after an inserted tool_prefix

    @property
    def active(self) -> bool:
        return self.budget >= 0 or bool(self.tool_prefix)


def plan_for(prompt: ChatPrompt, budget: int, message: str) -> ThinkingPlan | None:
    """The plan for ``prompt``'s answer, None when it is one plain request."""
    if not prompt.thinking_open:
        return None
    plan = ThinkingPlan(budget=budget, message=message, tool_prefix=prompt.tool_prefix,
                        tool_grammar=prompt.tool_grammar if prompt.tool_prefix else None)
    return plan if plan.active else None


def _next_seed(seed: int, n: int) -> int:
    """A fixed seed for the second request: derived from the first and the tokens so far
    (never llama.cpp's 'random' value)."""
    if seed == DEFAULT_SEED:
        return seed
    s = (seed * 6364136223846793005 + 1442695040888963407 + n) % (1 << 32)
    return s if s != DEFAULT_SEED else 0


def merge_results(first: Result, bridge: Event, second: Result, prompt: list[int]) -> Result:
    """The two requests as one answer to ``prompt``: tokens and text in order, the second's
    stop, timings and speculation counts summed (prompt time includes re-reading the
    continuation)."""
    t1, t2 = first.timings, second.timings
    timings = RequestTimings(
        prompt_n=t1.prompt_n + t2.prompt_n, prompt_ms=t1.prompt_ms + t2.prompt_ms,
        predicted_n=t1.predicted_n + t2.predicted_n,
        predicted_ms=t1.predicted_ms + t2.predicted_ms, cache_n=t1.cache_n,
        draft_n=t1.draft_n + t2.draft_n, draft_n_accepted=t1.draft_n_accepted + t2.draft_n_accepted,
        python_ms=list(t1.python_ms) + list(t2.python_ms))
    spec = copy.deepcopy(first.spec)
    if spec is not None and second.spec is not None:
        spec.merge(second.spec)
    elif spec is None:
        spec = second.spec
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = list(first.logprobs or ()) + list(second.logprobs or ())
    return Result(id=first.id, text=first.text + bridge.text + second.text,
                  tokens=list(first.tokens) + list(bridge.tokens) + list(second.tokens),
                  prompt_tokens=prompt, stop_reason=second.stop_reason, timings=timings,
                  slot=second.slot, stop_word=second.stop_word, spec=spec, logprobs=logprobs)


class ChatRun:
    """A request handle (``async for`` events, ``result()``, ``cancel()``, ``aresult()``)
    over the one or two scheduler requests of a chat answer with a :class:`ThinkingPlan`."""

    def __init__(self, state: ServerState, plan: ThinkingPlan, ids: list[int], gen: GenParams,
                 rid: str, cache_prompt: bool, media: Any = None) -> None:
        self.state = state
        self.plan = plan
        self.ids = ids
        self.gen = gen
        self.rid = rid
        self.cache_prompt = cache_prompt
        self.media = media  # the prompt's image rows (None: text only)
        self.id = rid
        self._current: RequestHandle | None = None
        self._first: Result | None = None
        self._bridge: Event | None = None
        self._result: Result | None = None
        self._cancelled = False

    def first_params(self) -> GenParams:
        """The first request: stops at ``</think>`` when a tool call is to follow it or a
        lazy grammar waits for it (the second then holds all that follows the thinking), and
        after the budget (an answer that fits in the budget is one request)."""
        gen = dataclasses.replace(self.gen)
        if self.plan.tool_prefix or self._lazy_after_thinking():
            gen.stop = tuple(gen.stop) + (THINK_CLOSE,)
        if self.plan.budget >= 0:
            gen.max_tokens = (self.plan.budget if gen.max_tokens is None
                              else min(gen.max_tokens, self.plan.budget))
        return gen

    async def start(self) -> ChatRun:
        """Submit the first request (scheduler refusals are HTTP errors, as for one)."""
        if self.plan.budget == 0:  # no thinking at all: the end is forced before any token
            self._first = Result(id=self.rid, text="", tokens=[], prompt_tokens=self.ids,
                                 stop_reason="length", timings=RequestTimings())
            self._bridge = await self._insert(self._forced_end(), "")
            try:
                self._current = await self._submit_second()
            except _Finished as f:
                self._result = f.result
        else:
            self._current = await self.state.submit(self.ids, self.first_params(), self.rid,
                                                    self.cache_prompt, media=self.media)
        return self

    # --- the handle's interface -------------------------------------------------------------
    def cancel(self) -> None:
        self._cancelled = True
        if self._current is not None:
            self._current.cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self.plan.budget == 0:
            assert self._bridge is not None
            yield self._bridge  # the inserted text opens the answer
        else:
            assert self._current is not None, "start() first"
            async for ev in self._current:
                yield ev
            first = self._current.result()
            self._first = first
            bridge = None if self._cancelled else await self._bridge_after(first)
            if bridge is None:
                self._result = first
                return
            self._bridge = bridge
            yield bridge
            try:
                self._current = await self._submit_second()
            except _Finished as f:
                self._result = f.result
        if self._result is not None or self._current is None:
            return
        async for ev in self._current:
            yield ev
        assert self._first is not None and self._bridge is not None
        self._result = merge_results(self._first, self._bridge, self._current.result(),
                                     self.ids)

    def result(self) -> Result:
        if self._result is None:
            raise RuntimeError("the chat run is not finished (iterate it first)")
        return self._result

    async def aresult(self) -> Result:
        """The result once the request(s) end (after a cancel: what was generated)."""
        if self._result is not None:
            return self._result
        assert self._current is not None
        last = await self._current.aresult()
        if self._first is None or self._bridge is None or last is self._first:
            return last
        return merge_results(self._first, self._bridge, last, self.ids)

    def _lazy_after_thinking(self) -> bool:
        g = self.gen.grammar
        return g is not None and bool(g.trigger) and g.after == THINK_CLOSE

    # --- between the two requests -----------------------------------------------------------
    def _forced_end(self) -> str:
        """What a spent budget inserts: the message, ``\\n</think>`` (llama.cpp's first end
        tag for these templates) and the forced tool call's start."""
        text = self.plan.message + "\n" + THINK_CLOSE
        return text + ("\n\n" + self.plan.tool_prefix if self.plan.tool_prefix else "")

    async def _bridge_after(self, first: Result) -> Event | None:
        """The text to insert after the first request, None when the answer is complete."""
        if first.stop_reason == "stop" and first.stop_word == THINK_CLOSE \
                and THINK_CLOSE not in self.gen.stop:
            # thinking ended by itself before a forced tool call (or a lazy grammar): the
            # stop string (trimmed from the text) goes back in, then the call's start
            tail = await asyncio.to_thread(self._trimmed_tail, first)
            prefix = self.plan.tool_prefix
            return await self._insert("\n\n" + prefix if prefix else "", tail)
        budget_hit = (self.plan.budget >= 0 and first.stop_reason == "length"
                      and len(first.tokens) >= self.plan.budget
                      and (self.gen.max_tokens is None
                           or len(first.tokens) < self.gen.max_tokens))
        if not budget_hit:
            return None  # finished: end of generation, the client's stop or limit, context
        if THINK_CLOSE in first.text or CALL_OPEN in first.text:
            return await self._insert("", "")  # thinking ended in time: just go on
        partial = held_len(first.text, (THINK_CLOSE,))
        if partial:  # cut inside "</think>" (several tokens in some vocabularies): finish it
            return await self._insert(THINK_CLOSE[partial:], "")
        return await self._insert(self._forced_end(), "")

    def _trimmed_tail(self, first: Result) -> str:
        """The text of the first request's tokens past its result text: the stop string
        the scheduler trimmed (and anything after it in the same token)."""
        full = self.state.tokenizer.detokenize(first.tokens)  # as the scheduler renders
        tail = full[len(first.text):] if full.startswith(first.text) else ""
        return tail if THINK_CLOSE in tail else THINK_CLOSE

    async def _insert(self, text: str, tail: str) -> Event:
        """An event for ``tail`` (text of tokens already generated) and ``text`` (new).
        Inserted tokens count as generated ones (llama.cpp samples them): past the
        request's ``max_tokens`` they are cut, as llama.cpp's forcing stops at ``n_predict``."""
        tok = self.state.tokenizer
        ids = await asyncio.to_thread(tok.tokenize, text, add_special=False,
                                      parse_special=True) if text else []
        done = len(self._first.tokens) if self._first is not None else 0
        room = None if self.gen.max_tokens is None else max(0, self.gen.max_tokens - done)
        if room is not None and len(ids) > room:
            ids = ids[:room]
            text = await asyncio.to_thread(tok.detokenize, ids) if ids else ""
        return Event(tokens=tuple(ids), text=tail + text)

    async def _submit_second(self) -> RequestHandle:
        assert self._first is not None and self._bridge is not None
        done = list(self._first.tokens) + list(self._bridge.tokens)
        ids = self.ids + done
        gen = dataclasses.replace(
            self.gen, sampling=dataclasses.replace(
                self.gen.sampling, seed=_next_seed(self.gen.sampling.seed, len(done))))
        if gen.grammar is not None and gen.grammar.after:
            # the thinking block is closed now: the rest is the grammar's body alone (a lazy
            # one's free text and call)
            gen.grammar = dataclasses.replace(gen.grammar, after="", lead="")
        if self.plan.tool_grammar is not None and self._bridge.text.endswith(self.plan.tool_prefix):
            gen.grammar = self.plan.tool_grammar  # the forced call's start is in: hold the rest
        if gen.max_tokens is not None:
            gen.max_tokens -= len(done)
        if (gen.max_tokens is not None and gen.max_tokens <= 0) or len(ids) >= self.state.n_ctx:
            empty = Result(id=self.rid, text="", tokens=[], prompt_tokens=ids,
                           stop_reason="length" if len(ids) < self.state.n_ctx else "context",
                           timings=RequestTimings())
            raise _Finished(merge_results(self._first, self._bridge, empty, self.ids))
        try:
            # its prompt is the first's: progress was reported already
            media = None if self.media is None else extend_media(self.media, len(done))
            return await self.state.submit(ids, gen, self.rid, True, progress=False,
                                           media=media)
        except ApiError as e:
            raise RequestFailed(f"continuing the answer failed: {e.message}") from None


class _Finished(Exception):
    """The answer ends at the inserted text (no room or no tokens left to generate)."""

    def __init__(self, result: Result) -> None:
        super().__init__("finished")
        self.result = result

