"""The scheduler: requests <-> sequence slots, ``schedule() -> Batch`` and
``update(batch, out)`` (nano-vllm's schedule -> run -> postprocess; vLLM v1's status enum).

Every generation -- ``pyggspec run``, ``Engine.generate/stream/generate_batch``,
``Engine.create_completion`` and the HTTP server -- goes through :class:`Scheduler`. One
step (:meth:`Scheduler.step`) is::

    batch = self.schedule()        # admit waiting requests, one prompt chunk, decode items
    out = self.worker.run(batch)   # the target's choices (no stop logic there)
    self.update(batch, out)        # the ONE place tokens are appended and stops decided

Admission: the idle slot whose cached tokens share the longest prefix with the prompt wins
and continues from that cache. Prompts are evaluated in chunks of at most ``n_ubatch``
tokens (one chunk per step, so a long prompt delays running streams by at most one ubatch),
and every generating sequence advances by one plain or speculative step in one shared batch.
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
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pyggspec.errors import OutOfMemory, PyggspecError
from pyggspec.models.batch import chunk_group
from pyggspec.sampling.grammar import (
    Grammar,
    GrammarSpec,
    compile_grammar,
    grammar_vocab,
    warm_grammar_vocab,
)
from pyggspec.sampling.params import SamplingParams
from pyggspec.serving.prefix_cache import common_prefix, prompt_checkpoints
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
from pyggspec.serving.sequence import (
    UNLIMITED,
    Batch,
    DecodeItem,
    LogprobRequest,
    PromptChunk,
    SeqOutput,
    SeqStatus,
    Sequence,
    StepOutput,
    TokenLogprob,
    report_progress,
)
from pyggspec.serving.stops import TextStream
from pyggspec.speculative.stats import SpecStats

__all__ = ["Event", "QueueFull", "Request", "RequestError", "RequestFailed", "RequestHandle",
           "RequestTimings", "Result", "Scheduler", "SchedulerClosed", "SchedulerLimits"]

log = logging.getLogger("pyggspec.serving")


def _never(token: int) -> bool:
    return False


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler needs to know of the engine (read once)."""

    n_ctx: int
    n_vocab: int
    n_parallel: int
    n_ubatch: int
    n_batch: int
    speculative: bool
    spec_n_max: int
    ctx_checkpoints: int
    checkpoint_min_step: int


@dataclass(eq=False)
class _Owner:
    """What the scheduler keeps with a running sequence: its client's handle, its text,
    timings and speculation counts."""

    handle: RequestHandle
    text: TextStream
    last_ckpt: int = 0
    sent: list[int] = field(default_factory=list)  # tokens turned into events
    timings: RequestTimings = field(default_factory=RequestTimings)
    stats: SpecStats | None = None
    logprobs: list[TokenLogprob] | None = None  # of ``sent``, when the request asked
    t_start: float | None = None
    t_first: float | None = None


@dataclass
class _SlotInfo:
    last_used: float = 0.0
    n_decoded: int = 0  # tokens generated by the slot's current/last request


class Scheduler:
    """Admission, chunked prefill, continuous batching, prompt reuse and cancellation over
    a worker's ``n_parallel`` slots.

    ``worker``: runs batches (:class:`~pyggspec.worker.Worker`); ``tokenizer``: None when
    the engine has none; ``memory``: the engine's memory report (for /metrics);
    ``max_queue``: most requests waiting for a slot (more: :class:`QueueFull`).
    """

    def __init__(self, worker, limits: SchedulerLimits, tokenizer=None,
                 memory: Callable[[], dict] | None = None, max_queue: int = 64) -> None:
        self.worker = worker
        self.limits = limits
        self.tokenizer = tokenizer
        self._memory = memory
        self.max_queue = max_queue
        self._lock = threading.RLock()  # queue, actives, counters (not the ggml work)
        self._cv = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step at a time (ggml is single-threaded here)
        self._thread: threading.Thread | None = None
        self._grammar_warm: threading.Thread | None = None  # building the grammar tables
        self._closed = False
        self._stopping = False
        self._drain = True
        self._waiting: deque[RequestHandle] = deque()
        self._active: dict[int, Sequence] = {}  # slot -> its sequence
        self._slot_info = [_SlotInfo() for _ in range(limits.n_parallel)]
        self.stats = SpecStats()  # every speculative step since start
        self.last_python_ms = 0.0  # host share of the last decode/verify step
        self._t0 = time.monotonic()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._counts = dict.fromkeys(
            ("requests_total", "requests_finished", "requests_cancelled", "requests_failed",
             "prompt_tokens", "prompt_tokens_cached", "generated_tokens", "decode_steps",
             "prompt_chunks", "decode_busy_slots"), 0)
        self._prompt_ms = 0.0
        self._actions: list[tuple[int | None, Callable[[], Any], Future]] = []  # see slot_action
    # --- submitting ---------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Validate and queue ``request`` (thread-safe); returns its handle.

        Raises :class:`RequestError` for a request that cannot run, :class:`QueueFull`
        when ``max_queue`` requests are waiting, :class:`SchedulerClosed` after ``stop``.
        """
        if self._closed:
            raise SchedulerClosed()
        prompt = self.validate(request)
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

    def validate(self, req: Request) -> list[int]:
        """The prompt's token ids, or :class:`RequestError` naming what cannot run."""
        e, tok = self.limits, self.tokenizer
        p = req.prompt
        if isinstance(p, str):
            if tok is None:
                raise RequestError("a text prompt needs the tokenizer (the engine was created "
                                   "with load_tokenizer=False)")
            toks = tok.tokenize(p, add_special=req.add_special) if p else []
        else:
            try:
                toks = [int(t) for t in p]
            except (TypeError, ValueError):
                raise RequestError("prompt must be text or a list of token ids") from None
            m = req.media
            if m is not None and (m.n_rows != len(toks)
                                  or not np.array_equal(np.asarray(toks) < 0, m.is_embd)):
                raise RequestError("the prompt's image rows do not match its media rows")
            bad = [t for t in toks if not 0 <= t < e.n_vocab and not (m is not None and t < 0)]
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
        if any(req.stop) and tok is None:
            raise RequestError("stop strings need the tokenizer (the engine was created "
                               "with load_tokenizer=False)")
        if req.speculative and not e.speculative:
            raise RequestError("speculative decoding needs an engine with an MTP head "
                               "(--spec-type draft-mtp)")
        if req.n_draft_max is not None:
            n = req.n_draft_max
            cap = e.spec_n_max if e.speculative else 0
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= cap:
                raise RequestError(f"n_draft_max must be an integer in 0..{cap}, got {n!r}")
        if req.slot is not None and not (isinstance(req.slot, (int, np.integer))
                                         and 0 <= req.slot < e.n_parallel):
            raise RequestError(f"slot must be in 0..{e.n_parallel - 1}, got {req.slot!r}")
        lp = req.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, (int, np.integer))
                               or not 0 <= lp <= e.n_vocab):
            raise RequestError(f"logprobs must be None or an integer in 0..{e.n_vocab} (the "
                               f"alternatives reported per token), got {lp!r}")
        if not isinstance(req.post_sampling_probs, bool):
            raise RequestError("post_sampling_probs must be a boolean")
        if req.grammar is not None:
            req.grammar = self._compile_grammar(req.grammar)
        return toks

    def _compile_grammar(self, g: GrammarSpec | Grammar) -> Grammar:
        """A request's grammar compiled for this engine's vocabulary (once per request; the
        vocabulary's grammar tables once per engine). :class:`GrammarError` (naming the
        request field) when it does not compile."""
        if isinstance(g, Grammar):
            if g.vocab.n_vocab != self.limits.n_vocab:
                raise RequestError("grammar was compiled for another vocabulary")
            return g
        if not isinstance(g, GrammarSpec):
            raise RequestError("grammar must be a GrammarSpec")
        if self.tokenizer is None:
            raise RequestError("a grammar needs the tokenizer (the engine was created with "
                               "load_tokenizer=False)")
        return compile_grammar(g, grammar_vocab(self.tokenizer, self.limits.n_vocab))


    # --- running -------------------------------------------------------------------------
    def step(self) -> bool:
        """One step: schedule -> run -> update. False when there was nothing to do."""
        with self._step_lock:
            acted = self._run_slot_actions()
            admitted, cancelled = self._admit(), self._cancel_requested()
            batch = self.schedule()
            if batch:
                self.update(batch, self.worker.run(batch))
            # a freed slot may admit a waiting request at the next step
            return bool(acted or admitted or batch or (cancelled and self._waiting))

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running (synchronous mode)."""
        while self.step():
            pass

    def start(self) -> None:
        """Run the loop in a background thread (idempotent). This is a server starting
        (the HTTP app's lifespan; the Python API steps synchronously): llguidance's tables
        for the vocabulary, which every grammar this scheduler compiles needs, are built in
        another thread now rather than in the first constrained request."""
        with self._cv:
            if self.running:
                return
            self._closed = self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="pyggspec-scheduler",
                                            daemon=True)
            self._thread.start()
        if self.tokenizer is not None and self._grammar_warm is None:
            self._grammar_warm = warm_grammar_vocab(self.tokenizer, self.limits.n_vocab)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background thread: ``drain`` finishes queued and running requests
        first, else they end as ``cancelled``. Later ``submit`` calls raise
        :class:`SchedulerClosed` (until :meth:`start` or :meth:`reopen`)."""
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
        if self._grammar_warm is not None:  # before the engine closes the tokenizer
            self._grammar_warm.join(timeout)
        if not drain and not self.running:
            self._cancel_all()

    def reopen(self) -> None:
        """Accept requests again after :meth:`stop`, driven synchronously."""
        with self._cv:
            if not self.running:
                self._closed = self._stopping = False

    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._stopping and not self._waiting and not self._active
                       and not self._actions):
                    self._cv.wait()
                if self._stopping and (not self._drain or not (self._waiting or self._active)):
                    break
            try:
                self.step()
            except BaseException:
                log.exception("scheduler step failed")
                for seq in list(self._active.values()):
                    self._fail(seq, RuntimeError("internal error in the scheduler step"))
        if not self._drain:
            self._cancel_all()
        self._drop_slot_actions()

    def _cancel_all(self) -> None:
        with self._step_lock:
            for seq in list(self._active.values()):
                self._finish(seq, SeqStatus.CANCELLED)
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

    def wake(self) -> None:
        """Wake the background thread (a request was submitted or cancelled)."""
        with self._cv:
            self._cv.notify_all()

    # --- slot actions (llama-server's POST /slots/{id}?action=save|restore|erase) -----------
    def slot_action(self, slot: int | None, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` (work on ``slot``'s memory) on the thread that owns the engine, at the
        start of a step in which ``slot`` is idle: llama-server defers a slot action until
        its slot has finished its request, and so do we. Returns a
        :class:`concurrent.futures.Future` of ``fn``'s result (thread-safe; without the
        background thread the call drives the loop until it is done)."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise SchedulerClosed()
            self._actions.append((slot, fn, fut))
            self._cv.notify_all()
        if not self.running:
            while not fut.done() and self.step():
                pass
        return fut

    def on_engine_thread(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the thread that owns the engine, at the start of the next step (a
        :meth:`slot_action` bound to no slot). For ggml work outside the engine's graphs --
        libmtmd's image encoding: ggml's CPU backend runs on OpenMP, and a second thread
        computing ggml graphs (an executor thread) left every later decode step of the
        engine's thread ~2x slower (journal row 95). Called on that thread, or with no
        background thread (the caller drives the loop), ``fn`` runs at once."""
        if self.running and threading.current_thread() is not self._thread:
            return self.slot_action(None, fn)
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except Exception as e:  # noqa: BLE001 - the caller gets it, as from slot_action
            fut.set_exception(e)
        return fut

    def _run_slot_actions(self) -> bool:
        """Run the queued slot actions whose slot is idle (in the step, before admission:
        a request queued after an action sees what it did)."""
        if not self._actions:
            return False
        with self._cv:
            due = [a for a in self._actions if a[0] not in self._active]
            self._actions = [a for a in self._actions if a[0] in self._active]
        for slot, fn, fut in due:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller gets it; the loop carries on
                fut.set_exception(e)
            if slot is not None:  # the slot holds something else now
                info = self._slot_info[slot]
                info.last_used, info.n_decoded = time.monotonic(), 0
        return bool(due)

    def _drop_slot_actions(self) -> None:
        with self._cv:
            left, self._actions = self._actions, []
        for _, _, fut in left:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(SchedulerClosed())

    # --- admission and prompt reuse ---------------------------------------------------------
    def _admit(self) -> int:
        """Move waiting requests into free slots; returns how many."""
        chosen: list[tuple[RequestHandle, int | None]] = []
        with self._cv:
            if not self._waiting:
                return 0
            free = [s for s in range(self.limits.n_parallel) if s not in self._active]
            keep: deque[RequestHandle] = deque()
            while self._waiting:
                h = self._waiting.popleft()
                if h.cancelled:
                    chosen.append((h, None))
                    continue
                slot = self._pick_slot(h, free)
                if slot is None:
                    keep.append(h)
                    continue
                free.remove(slot)
                chosen.append((h, slot))
            self._waiting = keep
        n = 0
        for h, slot in chosen:
            if slot is None:
                self._finish_waiting(h)
                continue
            try:
                self._begin(h, slot)
                n += 1
            except Exception as exc:
                if isinstance(exc, OutOfMemory):  # the device's one line says it all
                    log.warning("request %s: %s", h.id, str(exc).removeprefix("pyggspec: "))
                else:
                    log.exception("admitting request %s failed", h.id)
                self.worker.clear(slot)
                self._active.pop(slot, None)
                self._counts["requests_failed"] += 1
                h._fail(_failed(h, exc))
        return n

    def _pick_slot(self, h: RequestHandle, free: list[int]) -> int | None:
        """The idle slot sharing the longest prefix with the prompt (llama-server's slot
        choice); without one, the least recently used. A pinned request waits for its slot."""
        if h.request.slot is not None:
            return h.request.slot if h.request.slot in free else None
        best, best_key = None, None
        mem = self.worker.memory
        for slot in free:
            c = (common_prefix(mem.tokens(slot), h.prompt_tokens) if h.request.cache_prompt
                 else 0)
            key = (c, -self._slot_info[slot].last_used)
            if best_key is None or key > best_key:
                best, best_key = slot, key
        return best

    def _begin(self, h: RequestHandle, slot: int) -> None:
        lim, req = self.limits, h.request
        spec = lim.speculative and req.speculative is not False and req.n_draft_max != 0
        tok = self.tokenizer
        is_stop = _never if req.ignore_eos or tok is None else tok.is_eog
        mt = req.max_tokens
        detok = tok.detokenizer() if tok is not None else None
        owner = _Owner(h, TextStream(detok, req.stop), stats=SpecStats() if spec else None)
        lp = (None if req.logprobs is None
              else LogprobRequest(int(req.logprobs), req.post_sampling_probs))
        if lp is not None:
            owner.logprobs = []
        seq = Sequence(h.id, slot, h.prompt_tokens,
                       UNLIMITED if mt is None or mt < 0 else int(mt), is_stop, spec,
                       req.n_draft_max, lp, owner=owner)
        self._active[slot] = seq
        info = self._slot_info[slot]
        info.last_used = time.monotonic()
        info.n_decoded = 0
        params = req.sampling
        if isinstance(req.grammar, Grammar):  # the chain's first stage; its own matcher
            params = replace(params or self.worker.samplers.params, grammar=req.grammar)
        seq.n_cached = seq.n_done = owner.last_ckpt = self.worker.begin(
            slot, seq.prompt, params, req.cache_prompt, spec, media=req.media)
        report_progress(seq)
        owner.timings.cache_n = seq.n_cached
        with self._lock:
            self._counts["prompt_tokens_cached"] += seq.n_cached

    def _cancel_requested(self) -> bool:
        cancelled = False
        for seq in list(self._active.values()):
            if seq.owner.handle.cancelled:
                self._finish(seq, SeqStatus.CANCELLED)
                cancelled = True
        return cancelled

    # --- schedule: what runs in this step -------------------------------------------------
    def schedule(self) -> Batch:
        """One ubatch of prompt chunks (the sequences sharing the smallest count of tokens
        left before their next chunk end -- a near-end checkpoint or the prompt's end --,
        at most ``n_ubatch`` tokens in all, never across a logical batch (-b) boundary) and
        one decode/verify item per running sequence (drafts: at most ``room - 1``)."""
        lim = self.limits
        batch = Batch()
        pre = [s for s in self._active.values() if s.status is SeqStatus.PREFILL]
        if pre:
            T, group = chunk_group({s: self._chunk_end(s) - s.n_done for s in pre},
                                   {s: s.n_done - s.n_cached for s in pre}, lim.n_ubatch,
                                   lim.n_batch)
            now = time.perf_counter()
            for s in group:
                last = s.n_done + T == len(s.prompt)
                batch.prompt.append(PromptChunk(
                    s.slot, s.n_done, s.prompt[s.n_done:s.n_done + T], last,
                    last and s.room(lim.n_ctx) > 0, s.spec, self._checkpoint_due(s, T),
                    s.logprobs))
                if s.owner.t_start is None:
                    s.owner.t_start = now
        for s in self._active.values():
            if s.status is SeqStatus.RUNNING:
                cap = lim.spec_n_max if s.n_max is None else s.n_max
                n_draft = max(0, min(cap, s.room(lim.n_ctx) - 1)) if s.spec else 0
                batch.decode.append(DecodeItem(s.slot, s.id, s.out[-1], n_draft, s.spec,
                                               s.is_stop, s.logprobs))
        return batch

    def _near_end(self, s: Sequence) -> tuple[int, ...]:
        """The positions before ``s``'s prompt end that get a checkpoint (none when
        checkpoints are off: the prompt then runs in as few chunks as it can)."""
        lim = self.limits
        if lim.ctx_checkpoints <= 0:
            return ()
        return prompt_checkpoints(len(s.prompt), s.n_cached, lim.n_ubatch, lim.n_batch)

    def _chunk_end(self, s: Sequence) -> int:
        """Where ``s``'s next prompt chunk may end at the latest: its next near-end
        checkpoint, else the prompt's end."""
        return next((p for p in self._near_end(s) if p > s.n_done), len(s.prompt))

    def _checkpoint_due(self, s: Sequence, T: int) -> bool:
        """Save the recurrent state after this chunk (llama.cpp's --ctx-checkpoints): at
        the near-end positions (:func:`prompt_checkpoints`), and every
        ``checkpoint_min_step`` tokens before them. Not at the prompt's end: the same
        prompt again reuses all but its last token, so only the copy before it serves;
        a longer shared prefix resumes from there too, 4 tokens short."""
        lim = self.limits
        p = s.n_done + T
        if lim.ctx_checkpoints <= 0 or p <= 0 or p == len(s.prompt):
            return False
        if p not in self._near_end(s) and p - s.owner.last_ckpt < lim.checkpoint_min_step:
            return False
        s.owner.last_ckpt = p
        return True

    # --- update: the one place tokens are appended and sequences finish ---------------------
    def update(self, batch: Batch, out: StepOutput) -> None:
        """Fold a step's output back: prompt progress, appended tokens, events, every stop
        (end of generation, stop string, length, context), statistics and timings."""
        for slot, exc in out.failed.items():
            seq = self._active.get(slot)
            if seq is not None:
                self._fail(seq, exc)
        if batch.prompt:
            self._update_prompt(batch.prompt, out)
        if batch.decode and any(d.slot in out.seqs for d in batch.decode):
            self._update_decode(batch.decode, out)

    def _update_prompt(self, chunks: list[PromptChunk], out: StepOutput) -> None:
        done = [c for c in chunks if c.slot in out.seqs]
        if not done:
            return
        with self._lock:
            self._counts["prompt_tokens"] += sum(len(c.tokens) for c in done)
            self._counts["prompt_chunks"] += 1
            self._counts["decode_busy_slots"] += len(done)  # llama-server's n_busy_slots
        for c in done:
            seq, so = self._active[c.slot], out.seqs[c.slot]
            seq.n_done += len(c.tokens)
            report_progress(seq)
            st = seq.owner.stats
            if st is not None:
                st.n_target_evals += so.target_evals
                st.n_mtp_evals += so.mtp_evals
            if not c.last:
                continue
            o = seq.owner
            o.t_first = time.perf_counter()
            o.timings.prompt_n = len(seq.prompt) - seq.n_cached
            o.timings.prompt_ms = (o.t_first - (o.t_start or o.t_first)) * 1000
            with self._lock:
                self._prompt_ms += o.timings.prompt_ms
            seq.status = SeqStatus.RUNNING
            self._append(seq, so)

    def _update_decode(self, items: list[DecodeItem], out: StepOutput) -> None:
        py = out.decode_ms - out.device_ms
        self.last_python_ms = py
        n_new = 0
        st = self.stats
        st.n_target_evals += out.target_evals
        st.n_mtp_evals += out.mtp_evals
        for it in items:
            so = out.seqs.get(it.slot)
            if so is None:
                continue
            seq = self._active[it.slot]
            n_new += len(so.tokens)
            if so.spec:
                st.record(so.n_drafted, so.n_accepted)
            own = seq.owner.stats
            if own is not None:
                own.n_target_evals += so.target_evals
                own.n_mtp_evals += so.mtp_evals
                if so.spec:
                    own.record(so.n_drafted, so.n_accepted)
            seq.owner.timings.python_ms.append(py)
            self._append(seq, so)
        now = time.monotonic()
        with self._lock:
            self._counts["decode_steps"] += 1
            self._counts["decode_busy_slots"] += len(items)  # llama-server's n_busy_slots
            self._recent.append((now, n_new))
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()

    def _append(self, seq: Sequence, so: SeqOutput) -> None:
        """Append the target's choices in order, one stop check after each; an event per
        token (with its log-probabilities when the request asked); finish the sequence
        when one ends it or it has no room left."""
        o = seq.owner
        lps = so.logprobs
        for i, t in enumerate(so.tokens):
            if seq.is_stop(t):
                self._finish(seq, SeqStatus.FINISHED_EOS)
                return
            seq.out.append(t)
            o.sent.append(t)
            self._slot_info[seq.slot].n_decoded = len(o.sent)
            piece, stop = o.text.add(t)
            if lps is not None and o.logprobs is not None:
                o.logprobs.append(lps[i])
                o.handle._push(Event((t,), piece, (lps[i],)))
            else:
                o.handle._push(Event((t,), piece))
            if stop is not None:
                seq.stop_word = stop
                self._finish(seq, SeqStatus.FINISHED_STOP)
                return
            if i == so.grammar_end:  # the grammar is complete: only EOS could follow
                self._finish(seq, SeqStatus.FINISHED_EOS)
                return
        if seq.room(self.limits.n_ctx) <= 0:
            self._finish(seq, seq.length_reason())

    # --- results ---------------------------------------------------------------------------
    def _finish(self, seq: Sequence, status: SeqStatus) -> None:
        if self._active.get(seq.slot) is not seq:
            return
        o = seq.owner
        if status not in (SeqStatus.FINISHED_STOP, SeqStatus.CANCELLED):
            tail, stop = o.text.finish()
            if tail:
                o.handle._push(Event((), tail))
            if stop is not None:
                status, seq.stop_word = SeqStatus.FINISHED_STOP, stop
        seq.status = status
        now = time.perf_counter()
        t = o.timings
        t.predicted_n = len(o.sent)
        t.predicted_ms = (now - o.t_first) * 1000 if o.t_first is not None else 0.0
        if o.stats is not None:
            t.draft_n, t.draft_n_accepted = o.stats.n_drafted, o.stats.n_accepted
        self._slot_info[seq.slot].last_used = time.monotonic()
        del self._active[seq.slot]
        with self._lock:
            self._counts["requests_cancelled" if status is SeqStatus.CANCELLED
                         else "requests_finished"] += 1
            self._counts["generated_tokens"] += len(o.sent)
        o.handle._finish(Result(o.handle.id, o.text.text, list(o.sent), seq.prompt,
                                seq.finish_reason, t, seq.slot, seq.stop_word, o.stats,
                                o.logprobs))

    def _finish_waiting(self, h: RequestHandle) -> None:
        """A request cancelled before it got a slot."""
        with self._lock:
            self._counts["requests_cancelled"] += 1
        h._finish(Result(h.id, "", [], h.prompt_tokens, "cancelled", RequestTimings()))

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """The request's step failed: its slot is cleared (caches consistent again) and
        the error goes to its handle; other requests carry on."""
        if self._active.get(seq.slot) is seq:
            del self._active[seq.slot]
        seq.status = SeqStatus.FAILED
        try:
            self.worker.clear(seq.slot)
        except Exception:
            log.exception("clearing slot %d failed", seq.slot)
        with self._lock:
            self._counts["requests_failed"] += 1
        seq.owner.handle._fail(_failed(seq.owner.handle, exc))

    # --- snapshots -------------------------------------------------------------------------
    def slots(self) -> list[dict[str, Any]]:
        """Per slot: ``id``, ``state`` ("idle" | "processing"), ``request_id``, ``n_ctx``,
        ``n_cached`` (tokens in its cache), ``n_prompt``, ``n_decoded``, ``speculative``,
        ``n_checkpoints``, ``checkpoint_bytes``."""
        out = []
        mem = self.worker.memory
        for slot, info in enumerate(self._slot_info):
            seq = self._active.get(slot)
            out.append({"id": slot, "state": "processing" if seq is not None else "idle",
                        "request_id": seq.id if seq is not None else None,
                        "n_ctx": self.limits.n_ctx, "n_cached": mem.length(slot),
                        "n_prompt": len(seq.prompt) if seq is not None else 0,
                        "n_decoded": info.n_decoded,
                        "speculative": bool(seq.spec) if seq is not None
                        else self.limits.speculative,
                        "n_checkpoints": len(mem.checkpoints(slot)),
                        "checkpoint_bytes": mem.checkpoint_bytes(slot)})
        return out

    def checkpoint_bytes(self) -> int:
        """Host bytes held by the slots' prompt checkpoints."""
        return self.worker.memory.checkpoint_bytes()
    def metrics(self) -> dict[str, Any]:
        """Counters since start: ``requests_total/finished/cancelled/failed``,
        ``prompt_tokens`` (evaluated), ``prompt_tokens_cached``, ``generated_tokens``,
        ``draft_n``, ``draft_n_accepted``, ``acceptance_per_position``,
        ``draft_length_histogram`` (drafts of length k -> count), ``verify_steps``,
        ``decode_steps`` (generation batches), ``prompt_chunks`` (prompt batches) and
        ``decode_busy_slots`` (sequences summed over both),
        ``queue_depth``, ``busy_slots``, ``n_slots``, ``tokens_per_second`` (generation,
        recent), ``prompt_tokens_per_second``; ``draft_lengths`` (the draft-length rule's
        survival, step cost ratios and lengths chosen, per drafter kind) when it decides;
        ``drafters`` (each kind's own counts); ``hot_vocab`` (the draft head's hot
        vocabulary: size, in use, coverage, choices) when it has one."""
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
                "busy_slots": len(self._active), "n_slots": self.limits.n_parallel,
                "tokens_per_second": (sum(n for _, n in recent) / (now - recent[0][0])
                                      if len(recent) > 1 and now > recent[0][0] else 0.0),
                "prompt_tokens_per_second": (m["prompt_tokens"] / (self._prompt_ms / 1000)
                                             if self._prompt_ms > 0 else 0.0),
                "uptime_s": now - self._t0,
            })
        lengths = self.worker.lengths
        if lengths is not None:  # the draft-length rule
            m["draft_lengths"] = lengths.to_dict()
        drafter = self.worker.drafter
        if drafter is not None:
            m["drafters"] = drafter.counters()
            if drafter.mtp is not None and drafter.mtp.hot is not None:
                m["hot_vocab"] = drafter.mtp.hot.to_dict()
        return m

    def memory(self) -> dict[str, Any]:
        """Bytes by component and device (``Engine.memory()``, incl. prompt checkpoints)."""
        return self._memory() if self._memory is not None else {}


def _failed(h: RequestHandle, exc: BaseException) -> RequestFailed:
    """What a failed request's handle raises: one line, the cause kept (an
    :class:`~pyggspec.errors.OutOfMemory` cause is the server's 503)."""
    msg = exc.message if isinstance(exc, PyggspecError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OutOfMemory) and exc.where:
        msg = f"{exc.where}: {msg}"  # which device had no memory
    err = RequestFailed(f"request {h.id}: {msg}")
    err.__cause__ = exc
    return err
