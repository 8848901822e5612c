"""The scheduler: requests <-> sequence slots, and the ONE generation loop.

Every generation -- ``pyggspec run``, ``Engine.generate/stream/generate_batch``,
``Engine.create_completion`` and the HTTP server -- goes through :class:`Scheduler`.
Between steps, waiting requests are admitted to free slots (the idle slot whose cached
tokens share the longest prefix with the prompt wins, and continues from that cache),
prompts are evaluated in chunks of at most ``n_ubatch`` tokens (one chunk per step, so a
long prompt delays running streams by at most one ubatch), and every generating sequence
advances by one plain or speculative (draft -> verify -> accept) step in one shared batch.
Finished, stopped, cancelled or failed requests leave and free their slot at once.

API for the server
    ``sched = engine.scheduler`` (one per engine); ``sched.start()`` runs the loop in one
    background thread (the only thread that touches ggml); ``sched.stop(drain=True)`` ends
    it. ``handle = sched.submit(Request(prompt, max_tokens=..., sampling=SamplingParams(...),
    stop=[...], ignore_eos=..., speculative=..., n_draft_max=...))`` is thread-safe and
    raises :class:`~pyggspec.serving.request.RequestError` (HTTP 400: empty or too long
    prompt, bad sampling values, token ids out of range, ...) or
    :class:`~pyggspec.serving.request.QueueFull` (HTTP 503) at once. From asyncio,
    ``async for ev in handle`` yields :class:`~pyggspec.serving.request.Event` (``tokens``,
    ``text``) without blocking the event loop, then ``handle.result()`` (or ``await
    handle.aresult()``) is the :class:`~pyggspec.serving.request.Result` (``text``,
    ``tokens``, ``stop_reason`` eos/stop/length/context/cancelled, ``timings.to_dict()`` in
    llama-server's shape incl. ``cache_n``/``draft_n``/``draft_n_accepted``, ``spec``).
    ``handle.cancel()`` (e.g. on client disconnect) frees the slot at the next step. A
    request that fails in a step raises :class:`~pyggspec.serving.request.RequestFailed`
    from its handle (HTTP 500); the others carry on. Snapshots for /slots, /metrics and
    /health: :meth:`Scheduler.slots`, :meth:`Scheduler.metrics`, :meth:`Scheduler.memory`.
    Without the thread, iterating a handle or calling ``result()`` drives the loop itself
    (how the CLI and ``Engine.generate`` run), and :meth:`Scheduler.run_until_idle` runs
    everything queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pyggspec.errors import PyggspecError
from pyggspec.sampling.params import SamplingParams
from pyggspec.serving.prefix_cache import Checkpoint, SlotMemory, common_prefix
from pyggspec.serving.request import (
    Event,
    QueueFull,
    Request,
    RequestError,
    RequestFailed,
    RequestHandle,
    RequestTimings,
    Result,
    SchedulerClosed,
)
from pyggspec.serving.stops import TextStream
from pyggspec.speculative.draft_mtp import DraftRequest
from pyggspec.speculative.loop import (
    PlainStepper,
    PromptPart,
    SeqState,
    SpecStats,
    prompt_chunk,
    speculative_step,
)

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.engine import Engine

__all__ = ["Event", "QueueFull", "Request", "RequestError", "RequestFailed", "RequestHandle",
           "RequestTimings", "Result", "Scheduler", "SchedulerClosed"]

log = logging.getLogger("pyggspec.serving")

UNLIMITED = 1 << 40  # budget of a request without max_tokens: the context ends it
_EMPTY_H = np.zeros((0, 0), np.float32)


def _never(token: int) -> bool:
    return False


class _Active:
    """A request that holds a slot: prompt progress, its sequence once decoding, its text."""

    def __init__(self, handle: RequestHandle, slot: SlotMemory, spec: bool, n_max: int | None,
                 is_stop: Callable[[int], bool], budget: int, text: TextStream) -> None:
        self.handle = handle
        self.slot = slot
        self.prompt = handle.prompt_tokens
        self.spec = spec
        self.n_max = n_max
        self.is_stop = is_stop
        self.budget = budget
        self.text = text
        self.n_cached = 0  # prompt tokens reused from the slot's cache
        self.n_done = 0  # prompt tokens in the cache (reused + evaluated)
        self.last_ckpt = 0
        self.carry: np.ndarray | None = None  # target hidden of position n_done - 1 (MTP)
        self.seq: SeqState | None = None
        self.sent = 0  # tokens of seq.out turned into events
        self.tokens: list[int] = []
        self.stop_word: str | None = None
        self.timings = RequestTimings()
        self.stats = SpecStats() if spec else None
        self.t_start: float | None = None
        self.t_first: float | None = None


class Scheduler:
    """Admission, chunked prefill, continuous batching, prompt reuse and cancellation over
    one :class:`~pyggspec.engine.Engine`'s ``n_parallel`` slots.

    ``max_queue``: most requests waiting for a slot (more: :class:`QueueFull`).
    """

    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._lock = threading.RLock()  # queue, actives, counters (not the ggml work)
        self._cv = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step at a time (ggml is single-threaded here)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stopping = False
        self._drain = True
        self._waiting: deque[RequestHandle] = deque()
        self._active: dict[int, _Active] = {}
        self._slots = [SlotMemory(i) for i in range(engine.n_parallel)]
        self.samplers = engine.make_samplers()
        self._plain = PlainStepper(engine)
        self.stats = SpecStats()  # every speculative step since start
        self.last_python_ms = 0.0  # host share of the last decode/verify step
        self._t0 = time.monotonic()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._counts = dict.fromkeys(
            ("requests_total", "requests_finished", "requests_cancelled", "requests_failed",
             "prompt_tokens", "prompt_tokens_cached", "generated_tokens", "decode_steps",
             "prompt_chunks", "decode_busy_slots"), 0)
        self._prompt_ms = 0.0

    # --- submitting ---------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Validate and queue ``request`` (thread-safe); returns its handle.

        Raises :class:`RequestError` for a request that cannot run, :class:`QueueFull`
        when ``max_queue`` requests are waiting, :class:`SchedulerClosed` after ``stop``.
        """
        if self._closed:
            raise SchedulerClosed()
        prompt = self._validate(request)
        handle = RequestHandle(request, prompt, self)
        with self._cv:
            if self._closed:
                raise SchedulerClosed()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already "
                                f"(max_queue {self.max_queue}); try again later")
            self._waiting.append(handle)
            self._counts["requests_total"] += 1
            self._cv.notify_all()
        return handle

    def _validate(self, req: Request) -> list[int]:
        e = self.engine
        p = req.prompt
        if isinstance(p, str):
            if e.tokenizer is None:
                raise RequestError("a text prompt needs the tokenizer (the engine was created "
                                   "with load_tokenizer=False)")
            toks = e.tokenizer.tokenize(p, add_special=req.add_special) if p else []
        else:
            try:
                toks = [int(t) for t in p]
            except (TypeError, ValueError):
                raise RequestError("prompt must be text or a list of token ids") from None
            bad = [t for t in toks if not 0 <= t < e.n_vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} out of range 0..{e.n_vocab - 1}")
        if not toks:
            raise RequestError("prompt is empty")
        mt = req.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, (int, np.integer))):
            raise RequestError(f"max_tokens must be an integer, got {mt!r}")
        wants = mt is None or mt != 0
        if len(toks) + wants > e.n_ctx:
            what = "does not fit" if len(toks) > e.n_ctx else "leaves no room to generate in"
            raise RequestError(f"prompt of {len(toks)} tokens {what} the context "
                               f"({e.n_ctx}); raise -c")
        sp = req.sampling
        if sp is not None:
            if not isinstance(sp, SamplingParams):
                raise RequestError("sampling must be a SamplingParams")
            try:
                sp.check_vocab(e.n_vocab)
            except PyggspecError as err:
                raise RequestError(f"{err.where}: {err.message}" if err.where
                                   else err.message) from None
        if isinstance(req.stop, str) or not all(isinstance(s, str) for s in req.stop):
            raise RequestError("stop must be a list of strings")
        if any(req.stop) and e.tokenizer is None:
            raise RequestError("stop strings need the tokenizer (the engine was created "
                               "with load_tokenizer=False)")
        if req.speculative and not e.spec_type:
            raise RequestError("speculative decoding needs an engine with an MTP head "
                               "(--spec-type draft-mtp)")
        if req.n_draft_max is not None:
            n = req.n_draft_max
            cap = e.spec.n_max if e.spec_type else 0
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= cap:
                raise RequestError(f"n_draft_max must be an integer in 0..{cap}, got {n!r}")
        if req.slot is not None and not (isinstance(req.slot, (int, np.integer))
                                         and 0 <= req.slot < e.n_parallel):
            raise RequestError(f"slot must be in 0..{e.n_parallel - 1}, got {req.slot!r}")
        return toks

    # --- running -------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step (admit, one prefill chunk, one decode/verify batch,
        finish). Returns False when there was nothing to do."""
        with self._step_lock:
            admitted = self._admit()
            cancelled = False
            for a in list(self._active.values()):
                if a.handle.cancelled:
                    self._finish(a, "cancelled")
                    cancelled = True
            pre = [a for a in self._active.values() if a.seq is None]
            if pre:
                self._prefill_step(pre)
            dec = [a for a in self._active.values() if a.seq is not None and not a.seq.done]
            if dec:
                self._decode_step(dec)
            for a in list(self._active.values()):
                if a.seq is not None:
                    self._emit(a)
            # a freed slot may admit a waiting request at the next step
            return bool(admitted or pre or dec or (cancelled and self._waiting))

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running (synchronous mode)."""
        while self.step():
            pass

    def start(self) -> None:
        """Run the loop in a background thread (idempotent)."""
        with self._cv:
            if self.running:
                return
            self._closed = self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pyggspec-scheduler",
                                            daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background thread: ``drain`` finishes queued and running requests
        first, else they end as ``cancelled``. Later ``submit`` calls raise
        :class:`SchedulerClosed` (until :meth:`start`)."""
        with self._cv:
            self._closed = True
            self._stopping = True
            self._drain = drain
            self._cv.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if not t.is_alive():
                self._thread = None
        if not drain and not self.running:
            self._cancel_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stopping and (not self._drain or not (self._waiting or self._active)):
                    break
            try:
                self.step()
            except BaseException:
                log.exception("scheduler step failed")
                for a in list(self._active.values()):
                    self._fail(a, RuntimeError("internal error in the scheduler step"))
        if not self._drain:
            self._cancel_all()

    def _cancel_all(self) -> None:
        with self._step_lock:
            for a in list(self._active.values()):
                self._finish(a, "cancelled")
            with self._cv:
                waiting = list(self._waiting)
                self._waiting.clear()
            for h in waiting:
                self._finish_waiting(h)

    @property
    def running(self) -> bool:
        """True while the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """True when no request is waiting or running."""
        return not self._waiting and not self._active

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake(self) -> None:
        """Wake the background thread (a request was submitted or cancelled)."""
        with self._cv:
            self._cv.notify_all()

    # --- admission and prompt reuse ---------------------------------------------------------
    def _admit(self) -> int:
        """Move waiting requests into free slots; returns how many."""
        chosen: list[tuple[RequestHandle, SlotMemory]] = []
        with self._cv:
            if not self._waiting:
                return 0
            free = [sm for sm in self._slots if sm.id not in self._active]
            keep: deque[RequestHandle] = deque()
            while self._waiting:
                h = self._waiting.popleft()
                if h.cancelled:
                    chosen.append((h, None))  # type: ignore[arg-type]
                    continue
                sm = self._pick_slot(h, free)
                if sm is None:
                    keep.append(h)
                    continue
                free.remove(sm)
                chosen.append((h, sm))
            self._waiting = keep
        n = 0
        for h, sm in chosen:
            if sm is None:
                self._finish_waiting(h)
                continue
            try:
                self._begin(h, sm)
                n += 1
            except Exception as exc:
                log.exception("admitting request %s failed", h.id)
                self.engine.clear(sm.id)
                sm.forget()
                self._active.pop(sm.id, None)
                self._counts["requests_failed"] += 1
                h._fail(RequestFailed(f"request {h.id}: {exc}"))
        return n

    def _pick_slot(self, h: RequestHandle, free: list[SlotMemory]) -> SlotMemory | None:
        """The idle slot sharing the longest prefix with the prompt (llama-server's slot
        choice); without one, the least recently used. A pinned request waits for its slot."""
        if h.request.slot is not None:
            return next((sm for sm in free if sm.id == h.request.slot), None)
        if not free:
            return None
        best, best_key = None, None
        for sm in free:
            c = common_prefix(sm.tokens, h.prompt_tokens) if h.request.cache_prompt else 0
            key = (c, -sm.last_used)
            if best_key is None or key > best_key:
                best, best_key = sm, key
        return best

    def _begin(self, h: RequestHandle, sm: SlotMemory) -> None:
        e = self.engine
        req = h.request
        spec = bool(e.spec_type) and req.speculative is not False and req.n_draft_max != 0
        is_stop = _never if req.ignore_eos or e.tokenizer is None else e.tokenizer.is_eog
        mt = req.max_tokens
        budget = UNLIMITED if mt is None or mt < 0 else int(mt)
        detok = e.tokenizer.detokenizer() if e.tokenizer is not None else None
        a = _Active(h, sm, spec, req.n_draft_max, is_stop, budget,
                    TextStream(detok, req.stop))
        self._active[sm.id] = a
        sm.last_used = time.monotonic()
        sm.n_decoded = 0
        self._reuse(a, req.cache_prompt)
        self.samplers.start(sm.id, a.prompt, req.sampling)
        a.timings.cache_n = a.n_cached
        with self._lock:
            self._counts["prompt_tokens_cached"] += a.n_cached

    def _reuse(self, a: _Active, allowed: bool) -> None:
        """Continue from the slot's cache where the prompt allows, else start empty."""
        e, sm, prompt = self.engine, a.slot, a.prompt
        c = min(common_prefix(sm.tokens, prompt) if allowed else 0, len(prompt) - 1)
        start, carry = 0, None
        if c > 0:
            if a.spec and sm.mtp_tail is not None and sm.mtp_tail[0] == sm.mtp_len:
                p0, toks, hid = sm.mtp_tail  # pairs still owed to the MTP cache
                if toks:
                    e.drafter.draft([DraftRequest(sm.id, p0, list(toks), hid, 0)])
                    sm.mtp_len = p0 + len(toks)
                sm.mtp_tail = None
            n = sm.n_cached
            if c == n and (not a.spec or (sm.last_hidden is not None and sm.mtp_len >= n)):
                start, carry = n, sm.last_hidden
            else:
                for ck in reversed(sm.checkpoints):
                    if ck.pos <= c and (not a.spec or (ck.hidden is not None
                                                       and sm.mtp_len >= ck.pos)):
                        e.rs.restore(ck.state, sm.id)
                        start, carry = ck.pos, ck.hidden
                        break
        if start == 0:
            e.clear(sm.id)
            sm.forget()
        else:
            e.kv.remove_tail(sm.id, start)
            if e.mtp is not None:
                e.mtp_kv.remove_tail(sm.id, start)
            sm.cut(start)
        a.n_cached = a.n_done = a.last_ckpt = start
        a.carry = None if carry is None or not a.spec else carry.copy()

    def _save_checkpoint(self, a: _Active) -> None:
        """Recurrent state after ``n_done`` prompt tokens, every ``checkpoint_min_step``
        tokens and at the prompt's end (kept: the newest ``ctx_checkpoints``)."""
        e, sm = self.engine, a.slot
        p = a.n_done
        if e.ctx_checkpoints <= 0 or p <= 0:
            return
        if p != len(a.prompt) and p - a.last_ckpt < e.checkpoint_min_step:
            return
        if any(c.pos == p for c in sm.checkpoints):
            return
        snap = e.rs.snapshot(sm.id)
        nbytes = sum(len(b) for b in snap.data.values())
        hid = a.carry.copy() if a.carry is not None else None
        sm.checkpoints.append(Checkpoint(p, snap, hid, nbytes))
        while len(sm.checkpoints) > e.ctx_checkpoints:
            sm.checkpoints.pop(0)
        a.last_ckpt = p

    # --- the two kinds of work in a step -------------------------------------------------------
    def _prefill_step(self, pre: list[_Active]) -> None:
        """One ubatch of prompt chunks: sequences sharing the smallest remaining count (at
        most ``n_ubatch`` tokens in all), never across a logical batch (-b) boundary."""
        e = self.engine
        left = {id(a): len(a.prompt) - a.n_done for a in pre}
        T = min(min(left.values()), e.n_ubatch)
        group = [a for a in pre if left[id(a)] >= T][: max(1, e.n_ubatch // T)]
        T = min(T, *(e.n_batch - (a.n_done - a.n_cached) % e.n_batch for a in group))
        parts = [PromptPart(a.slot.id, a.n_done, a.prompt[a.n_done:a.n_done + T],
                            a.n_done + T == len(a.prompt), a.spec, a.carry) for a in group]
        now = time.perf_counter()
        for a in group:
            if a.t_start is None:
                a.t_start = now
        before = e.mtp.n_evals if e.mtp is not None else 0
        try:
            logits, carry = prompt_chunk(e, e.drafter if e.mtp is not None else None, parts)
        except Exception as exc:
            log.exception("prompt chunk failed")
            for a in group:
                self._fail(a, exc)
            return
        n_mtp = (e.mtp.n_evals - before) if e.mtp is not None else 0
        with self._lock:
            self._counts["prompt_tokens"] += T * len(group)
            self._counts["prompt_chunks"] += 1
            self._counts["decode_busy_slots"] += len(group)  # llama-server's n_busy_slots
        for a, p in zip(group, parts, strict=True):
            a.n_done += T
            if a.stats is not None:
                a.stats.n_target_evals += 1
                a.stats.n_mtp_evals += n_mtp
            if p.warm:
                a.carry = carry[p.slot]
            a.slot.tokens = a.prompt[:a.n_done]
            self._save_checkpoint(a)
            if p.last:
                self._first_token(a, logits[p.slot])

    def _first_token(self, a: _Active, logits_row: np.ndarray) -> None:
        e = self.engine
        slot = a.slot.id
        P = len(a.prompt)
        s = SeqState(slot, pos=P, pending=-1, new_tokens=[],
                     new_hidden=a.carry[None] if a.carry is not None else _EMPTY_H,
                     new_pos0=P, budget=a.budget, spec=a.spec, n_max=a.n_max,
                     is_stop=a.is_stop, stats=a.stats)
        s.first_token(lambda: self.samplers.choose(slot, logits_row), self.samplers, a.is_stop,
                      e.n_ctx)
        s.new_tokens = [s.pending]
        a.seq = s
        a.t_first = time.perf_counter()
        a.timings.prompt_n = P - a.n_cached
        a.timings.prompt_ms = (a.t_first - (a.t_start or a.t_first)) * 1000
        with self._lock:
            self._prompt_ms += a.timings.prompt_ms

    def _decode_step(self, dec: list[_Active]) -> None:
        """Every generating sequence advances by one plain or speculative step, together."""
        e = self.engine
        seqs = [a.seq for a in dec]
        t0 = time.perf_counter()
        dev0 = e._device_ms()
        before = sum(len(s.out) for s in seqs)  # type: ignore[union-attr]
        try:
            if e.spec_type and any(s.spec for s in seqs):  # type: ignore[union-attr]
                speculative_step(e, e.drafter, seqs, e.spec, self.stats, self.samplers, _never)
            else:
                self._plain.step(seqs, self.samplers, _never)  # type: ignore[arg-type]
        except Exception as exc:
            log.exception("decode step failed")
            for a in dec:
                self._fail(a, exc)
            return
        py = (time.perf_counter() - t0) * 1000 - (e._device_ms() - dev0)
        self.last_python_ms = py
        n = sum(len(s.out) for s in seqs) - before  # type: ignore[union-attr]
        now = time.monotonic()
        with self._lock:
            self._counts["decode_steps"] += 1
            self._counts["decode_busy_slots"] += len(dec)  # llama-server's n_busy_slots
            self._recent.append((now, n))
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()
        for a in dec:
            a.timings.python_ms.append(py)

    # --- results ---------------------------------------------------------------------------
    def _emit(self, a: _Active) -> None:
        """One event per new token of the sequence; finish it when it is done."""
        s = a.seq
        assert s is not None
        while a.sent < len(s.out):
            t = s.out[a.sent]
            a.sent += 1
            a.tokens.append(t)
            piece, stop = a.text.add(t)
            a.handle._push(Event((t,), piece))
            if stop is not None:
                a.slot.n_decoded = len(a.tokens)
                a.stop_word = stop
                self._finish(a, "stop")
                return
        a.slot.n_decoded = len(a.tokens)
        if s.done:
            self._finish(a, s.stop_reason)

    def _release_slot(self, a: _Active) -> None:
        """Record what the slot's caches hold now (for the next request's prompt reuse)."""
        sm, s = a.slot, a.seq
        sm.last_used = time.monotonic()
        if s is not None:
            sm.tokens = a.prompt + s.out[: s.pos - len(a.prompt)]
            if a.spec and s.new_hidden.size:
                sm.last_hidden = s.new_hidden[-1].copy()
                sm.mtp_len = s.new_pos0
                tail = s.new_tokens[:-1]
                sm.mtp_tail = ((s.new_pos0, list(tail), s.new_hidden[:-1].copy())
                               if tail else None)
            else:
                sm.last_hidden = None
                sm.mtp_len = min(sm.mtp_len, a.n_cached)
                sm.mtp_tail = None
        else:  # ended during its prompt
            sm.tokens = a.prompt[:a.n_done]
            if a.spec and a.carry is not None:
                sm.last_hidden = a.carry
                sm.mtp_len = a.n_done
            else:
                sm.last_hidden = None
                sm.mtp_len = min(sm.mtp_len, a.n_cached)
            sm.mtp_tail = None

    def _finish(self, a: _Active, reason: str) -> None:
        if self._active.get(a.slot.id) is not a:
            return
        if reason != "stop" and reason != "cancelled":
            tail, stop = a.text.finish()
            if tail:
                a.handle._push(Event((), tail))
            if stop is not None:
                reason, a.stop_word = "stop", stop
        now = time.perf_counter()
        t = a.timings
        t.predicted_n = len(a.tokens)
        t.predicted_ms = (now - a.t_first) * 1000 if a.t_first is not None else 0.0
        if a.stats is not None:
            t.draft_n, t.draft_n_accepted = a.stats.n_drafted, a.stats.n_accepted
        self._release_slot(a)
        del self._active[a.slot.id]
        with self._lock:
            self._counts["requests_cancelled" if reason == "cancelled"
                         else "requests_finished"] += 1
            self._counts["generated_tokens"] += len(a.tokens)
        res = Result(a.handle.id, a.text.text, list(a.tokens), a.prompt, reason, t,
                     a.slot.id, a.stop_word, a.stats)
        a.handle._finish(res)

    def _finish_waiting(self, h: RequestHandle) -> None:
        """A request cancelled before it got a slot."""
        with self._lock:
            self._counts["requests_cancelled"] += 1
        h._finish(Result(h.id, "", [], h.prompt_tokens, "cancelled", RequestTimings()))

    def _fail(self, a: _Active, exc: BaseException) -> None:
        """The request's step failed: its slot is cleared (caches consistent again) and
        the error goes to its handle; other requests carry on."""
        sm = a.slot
        if self._active.get(sm.id) is a:
            del self._active[sm.id]
        try:
            self.engine.clear(sm.id)
        except Exception:
            log.exception("clearing slot %d failed", sm.id)
        sm.forget()
        with self._lock:
            self._counts["requests_failed"] += 1
        msg = exc.message if isinstance(exc, PyggspecError) else f"{type(exc).__name__}: {exc}"
        err = RequestFailed(f"request {a.handle.id}: {msg}")
        err.__cause__ = exc
        a.handle._fail(err)

    # --- snapshots -------------------------------------------------------------------------
    def slots(self) -> list[dict[str, Any]]:
        """Per slot: ``id``, ``state`` ("idle" | "processing"), ``request_id``, ``n_ctx``,
        ``n_cached`` (tokens in its cache), ``n_prompt``, ``n_decoded``, ``speculative``,
        ``n_checkpoints``, ``checkpoint_bytes``."""
        out = []
        for sm in self._slots:
            a = self._active.get(sm.id)
            out.append({"id": sm.id, "state": "processing" if a is not None else "idle",
                        "request_id": a.handle.id if a is not None else None,
                        "n_ctx": self.engine.n_ctx, "n_cached": sm.n_cached,
                        "n_prompt": len(a.prompt) if a is not None else 0,
                        "n_decoded": sm.n_decoded,
                        "speculative": bool(a.spec) if a is not None
                        else bool(self.engine.spec_type),
                        "n_checkpoints": len(sm.checkpoints),
                        "checkpoint_bytes": sm.checkpoint_bytes})
        return out

    def checkpoint_bytes(self) -> int:
        """Host bytes held by the slots' prompt checkpoints."""
        return sum(sm.checkpoint_bytes for sm in self._slots)

    def metrics(self) -> dict[str, Any]:
        """Counters since start: ``requests_total/finished/cancelled/failed``,
        ``prompt_tokens`` (evaluated), ``prompt_tokens_cached``, ``generated_tokens``,
        ``draft_n``, ``draft_n_accepted``, ``acceptance_per_position``,
        ``draft_length_histogram`` (drafts of length k -> count), ``verify_steps``,
        ``decode_steps`` (generation batches), ``prompt_chunks`` (prompt batches) and
        ``decode_busy_slots`` (sequences summed over both),
        ``queue_depth``, ``busy_slots``, ``n_slots``, ``tokens_per_second`` (generation,
        recent), ``prompt_tokens_per_second``."""
        with self._lock:
            m: dict[str, Any] = dict(self._counts)
            st = self.stats
            now = time.monotonic()
            recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
            m.update({
                "draft_n": st.n_drafted, "draft_n_accepted": st.n_accepted,
                "acceptance_per_position": st.per_position,
                "draft_length_histogram": {k: n for k, n in enumerate(st.draft_lengths) if n},
                "verify_steps": st.n_steps, "queue_depth": len(self._waiting),
                "busy_slots": len(self._active), "n_slots": len(self._slots),
                "tokens_per_second": (sum(n for _, n in recent) / (now - recent[0][0])
                                      if len(recent) > 1 and now > recent[0][0] else 0.0),
                "prompt_tokens_per_second": (m["prompt_tokens"] / (self._prompt_ms / 1000)
                                             if self._prompt_ms > 0 else 0.0),
                "uptime_s": now - self._t0,
            })
        return m

    def memory(self) -> dict[str, Any]:
        """Bytes by component and device (``Engine.memory()``, incl. prompt checkpoints)."""
        return self.engine.memory()
