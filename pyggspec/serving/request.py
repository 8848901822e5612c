"""Requests, their events and results, and the handle a client holds (pure data + queues).

No numpy or ggml here: the scheduler produces :class:`Event` and :class:`Result` objects
and pushes them into a request's :class:`RequestHandle`, which any thread (or an asyncio
event loop) consumes.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyggspec.errors import PyggspecError
from pyggspec.sampling.grammar import Grammar, GrammarSpec
from pyggspec.sampling.params import SamplingParams
from pyggspec.serving.sequence import TokenLogprob

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.scheduler import Scheduler

STOP_REASONS = ("eos", "stop", "length", "context", "cancelled")


# --- errors --------------------------------------------------------------------------------
class RequestError(PyggspecError, ValueError):
    """A request that cannot run as given (bad prompt, sampling values, limits): raised by
    ``Scheduler.submit`` before anything is queued; HTTP 400."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class QueueFull(PyggspecError):
    """The waiting queue holds ``max_queue`` requests already; HTTP 503."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class SchedulerClosed(PyggspecError):
    """``submit`` after ``Scheduler.stop``/``close``; HTTP 503."""

    def __init__(self, message: str = "the scheduler is stopped") -> None:
        super().__init__(None, message)


class RequestFailed(PyggspecError):
    """A step failed for this request (device error, ...); other requests carry on.
    Raised from the handle's iteration / ``result()``; HTTP 500."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


# --- what a client asks for -----------------------------------------------------------------
@dataclass
class Request:
    """One generation request (llama-server's /completion fields, Python names).

    ``prompt`` is text (tokenized with ``add_special``) or token ids. ``max_tokens`` None
    (or < 0) generates until end of generation, a stop string or the context end.
    ``sampling`` None uses the engine's params. ``speculative`` None speculates whenever the
    engine has an MTP head; ``n_draft_max`` caps the drafts per step (<= the engine's
    ``spec.n_max``). ``stop`` strings end generation and are not part of the text.
    ``cache_prompt`` lets the request continue from a slot holding a prefix of its prompt.
    ``slot`` pins the request to one slot (llama-server's ``id_slot``); None picks one.
    ``logprobs`` (None: none) reports each emitted token's log-probability and the
    ``logprobs`` most likely tokens at its position (llama-server's ``n_probs``), from the
    raw softmax of the target's logits or, with ``post_sampling_probs``, from the sampler
    chain's distribution; the same values with and without speculation.
    ``grammar`` constrains the output (llama-server's ``grammar`` / ``json_schema``): a
    :class:`~pyggspec.sampling.grammar.GrammarSpec`, compiled for the engine's vocabulary
    when the request is validated (``grammar`` then holds the compiled grammar); the
    output ends where the grammar allows nothing but end of generation.
    ``progress``: also send an :class:`Event` carrying :class:`PromptProgress` when the
    request gets its slot and after each prompt chunk (llama-server's ``return_progress``).
    """

    prompt: str | Sequence[int]
    max_tokens: int | None = 128
    sampling: SamplingParams | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    speculative: bool | None = None
    n_draft_max: int | None = None
    add_special: bool = True
    cache_prompt: bool = True
    slot: int | None = None
    id: str | None = None
    logprobs: int | None = None
    post_sampling_probs: bool = False
    grammar: GrammarSpec | Grammar | None = None
    progress: bool = False
    # image rows of the prompt (models.batch.MediaRows; Engine.image_rows makes both): the
    # token ids hold EMBD_ROW (-1) at its rows
    media: Any = None


# --- what comes back ------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt is (llama-server's ``prompt_progress``): ``total`` prompt
    tokens, ``cache`` of them reused from the slot, ``processed`` in the slot so far (cached
    ones included) and ``time_ms`` since its first chunk was scheduled (0 at admission)."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_dict(self) -> dict[str, int]:
        """llama-server's object (its ``time_ms`` is whole milliseconds)."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": int(self.time_ms)}


@dataclass(frozen=True)
class Event:
    """One emitted token (``tokens`` has one id; empty for the text released when the
    request ends) and the text that became final with it.

    ``text`` is held back while it could still be the start of a stop string (or an
    incomplete UTF-8 character), so concatenating every event's text gives the result's
    text exactly. A token completing a stop string is included; the tokens a speculative
    step emitted after it are not. ``logprobs`` holds the token's
    :class:`~pyggspec.serving.sequence.TokenLogprob` when the request asked for them.
    A request that asked for ``progress`` also gets events with ``progress`` set and no
    tokens or text, before its first token.
    """

    tokens: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    progress: PromptProgress | None = None


@dataclass
class RequestTimings:
    """llama-server's ``timings`` object for one request, plus per-request speculation."""

    prompt_n: int = 0  # prompt tokens evaluated for this request (not counting cache_n)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0  # prompt tokens reused from a slot's cache
    draft_n: int = 0
    draft_n_accepted: int = 0
    python_ms: list[float] = field(default_factory=list)  # host share of each decode step

    @property
    def python_ms_per_step(self) -> float:
        """Median host (Python) share of a decode step."""
        return float(statistics.median(self.python_ms)) if self.python_ms else 0.0

    def to_dict(self, host: bool = False) -> dict[str, Any]:
        """llama-server's ``timings`` object (``host``: plus ``python_ms_per_step``)."""
        def per_s(n: int, ms: float) -> float:
            return n / (ms / 1000) if ms > 0 else 0.0

        d = {"cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
             "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
             "prompt_per_second": per_s(self.prompt_n, self.prompt_ms),
             "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
             # over the decode steps, as llama-server: predicted_ms runs from the first
             # token, which came with the prompt, so n tokens took n - 1 steps (counting n
             # made every tokens/s 1/(n-1) higher than llama-server's for the same run)
             "predicted_per_token_ms": (self.predicted_ms / (self.predicted_n - 1)
                                        if self.predicted_n > 1 else 0.0),
             "predicted_per_second": (per_s(self.predicted_n - 1, self.predicted_ms)
                                      if self.predicted_n > 1 else 0.0)}
        if self.draft_n:
            d["draft_n"] = self.draft_n
            d["draft_n_accepted"] = self.draft_n_accepted
        if host:
            d["python_ms_per_step"] = self.python_ms_per_step
        return d


@dataclass
class Result:
    """The finished request: text, tokens, why it stopped, timings and speculation stats.

    ``stop_reason``: ``eos`` (end of generation token), ``stop`` (a stop string:
    ``stop_word``), ``length`` (max_tokens), ``context`` (prompt + output reached n_ctx),
    ``cancelled``. ``spec`` is the request's own :class:`~pyggspec.speculative.loop.SpecStats`
    (None when it did not speculate). ``logprobs``: one
    :class:`~pyggspec.serving.sequence.TokenLogprob` per token of ``tokens`` when the
    request asked for them (``Request.logprobs``), else None.
    """

    id: str
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    stop_reason: str
    timings: RequestTimings
    slot: int = -1
    stop_word: str | None = None
    spec: Any = None  # SpecStats | None
    logprobs: list[TokenLogprob] | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def cache_n(self) -> int:
        """Prompt tokens reused from the slot's cache."""
        return self.timings.cache_n

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "text": self.text, "tokens": list(self.tokens),
             "n_prompt": self.n_prompt, "n_gen": len(self.tokens),
             "stop_reason": self.stop_reason, "stop_word": self.stop_word, "slot": self.slot,
             "cache_n": self.cache_n, "timings": self.timings.to_dict(host=True)}
        if self.spec is not None:
            d["spec"] = self.spec.to_dict()
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        return d


class Generation(list):
    """The :class:`Result` objects of one ``Engine.generate_batch`` call, in prompt order,
    with the call's totals: ``timings`` (prompt tokens and time of the batch, generated
    tokens over the wall time after the prompts) and ``stats`` (the speculation counts of
    its requests summed)."""

    def __init__(self, results: Sequence[Result], timings: RequestTimings, stats: Any) -> None:
        super().__init__(results)
        self.timings = timings
        self.stats = stats


_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


class RequestHandle:
    """A submitted request, seen from the client side (thread-safe).

    Iterate it (blocking) for :class:`Event` objects, or ``async for`` it from an asyncio
    event loop (never blocks the loop), then read :meth:`result`. ``cancel()`` may be
    called from any thread; the request ends with ``stop_reason == "cancelled"`` at the next
    step boundary and its slot is freed. When the scheduler runs without its thread,
    iterating or waiting on a handle drives the scheduler (``Scheduler.step``) itself.
    """

    def __init__(self, request: Request, prompt_tokens: list[int], scheduler: Scheduler,
                 request_id: str | None = None) -> None:
        self.request = request
        self.id = request_id or request.id or new_request_id()
        self.prompt_tokens = prompt_tokens
        self._sched = scheduler
        self._cond = threading.Condition()
        self._events: deque[Event] = deque()
        self._result: Result | None = None
        self._error: RequestFailed | None = None
        self._cancel = threading.Event()
        self._callbacks: list[Callable[[Event | Result | RequestFailed], None]] = []

    # --- client side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the scheduler to stop this request (idempotent, any thread)."""
        self._cancel.set()
        self._sched.wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        """True once the final result (or failure) is in."""
        return self._result is not None or self._error is not None

    def add_callback(self, fn: Callable[[Event | Result | RequestFailed], None]) -> None:
        """Call ``fn(item)`` (from the scheduler's thread) for each later event, then once
        with the :class:`Result` or :class:`RequestFailed`. Keep it cheap and non-blocking
        (e.g. ``loop.call_soon_threadsafe(queue.put_nowait, item)``)."""
        with self._cond:
            self._callbacks.append(fn)

    def __iter__(self) -> Iterator[Event]:
        """Events as they are produced (blocking); raises :class:`RequestFailed` if the
        request failed. Ends when the request is finished."""
        while True:
            item = self._next(None)
            if item is None:
                return
            yield item

    def _next(self, timeout: float | None) -> Event | None:
        """The next event, None when finished; drives the scheduler when it has no thread."""
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                if self._error is not None:
                    raise self._error
                if self._result is not None:
                    return None
                if self._sched.running:
                    if not self._cond.wait(timeout) and timeout is not None:
                        raise TimeoutError(f"request {self.id}: no event in {timeout} s")
                    continue
            # no scheduler thread: run one step ourselves (outside our lock)
            if not self._sched.step() and not self.done:
                raise RequestFailed(f"request {self.id}: the scheduler is idle but the "
                                    "request is not finished")

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the final :class:`Result` (events not yet read are dropped)."""
        while True:
            with self._cond:
                if self._error is not None:
                    raise self._error
                if self._result is not None:
                    self._events.clear()
                    return self._result
                if self._sched.running:
                    if not self._cond.wait(timeout) and timeout is not None:
                        raise TimeoutError(f"request {self.id}: not finished in {timeout} s")
                    continue
            if not self._sched.step() and not self.done:
                raise RequestFailed(f"request {self.id}: the scheduler is idle but the "
                                    "request is not finished")

    async def __aiter__(self) -> AsyncIterator[Event]:
        """``async for event in handle``: events without blocking the event loop (the
        scheduler must be running in its thread, ``Scheduler.start``)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def push(item: Event | Result | RequestFailed) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)

        with self._cond:
            backlog = list(self._events)
            self._events.clear()
            final = self._error or self._result
            if final is None:
                self._callbacks.append(push)
        for ev in backlog:
            yield ev
        while final is None:
            item = await q.get()
            if isinstance(item, Event):
                yield item
            else:
                final = item
        if isinstance(final, RequestFailed):
            raise final

    async def aresult(self) -> Result:
        """Await the final result from asyncio (scheduler thread running)."""
        async for _ in self:
            pass
        assert self._result is not None
        return self._result

    # --- scheduler side --------------------------------------------------------------------
    def _progress(self, total: int, cache: int, processed: int, t_start: float | None) -> None:
        """A prompt-progress event, when the request asked for them (``t_start``: the
        ``time.perf_counter()`` its first chunk was scheduled at, None before)."""
        if self.request.progress:
            ms = (time.perf_counter() - t_start) * 1000 if t_start is not None else 0.0
            self._push(Event((), "", progress=PromptProgress(total, cache, processed, ms)))

    def _push(self, ev: Event) -> None:
        with self._cond:
            cbs = list(self._callbacks)
            if not cbs:
                self._events.append(ev)
            self._cond.notify_all()
        for fn in cbs:
            fn(ev)

    def _finish(self, result: Result) -> None:
        with self._cond:
            self._result = result
            cbs = list(self._callbacks)
            self._cond.notify_all()
        for fn in cbs:
            fn(result)

    def _fail(self, error: RequestFailed) -> None:
        with self._cond:
            self._error = error
            cbs = list(self._callbacks)
            self._cond.notify_all()
        for fn in cbs:
            fn(error)
