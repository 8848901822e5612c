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

import threading
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.engine import Engine

__all__ = ["Event", "QueueFull", "Request", "RequestError", "RequestFailed", "RequestHandle",
           "RequestTimings", "Result", "Scheduler", "SchedulerClosed"]


class Scheduler:
    """Admission, chunked prefill, continuous batching, prompt reuse and cancellation over
    one :class:`~pyggspec.engine.Engine`'s ``n_parallel`` slots.

    ``max_queue``: most requests waiting for a slot (more: :class:`QueueFull`).
    """

    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    # --- submitting ---------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Validate and queue ``request`` (thread-safe); returns its handle.

        Raises :class:`RequestError` for a request that cannot run, :class:`QueueFull`
        when ``max_queue`` requests are waiting, :class:`SchedulerClosed` after ``stop``.
        """
        raise NotImplementedError

    # --- running -------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step (admit, one prefill chunk, one decode/verify batch,
        finish). Returns False when there was nothing to do. Not for use while the
        background thread runs."""
        raise NotImplementedError

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running (synchronous mode)."""
        while self.step():
            pass

    def start(self) -> None:
        """Run the loop in a background thread (idempotent)."""
        raise NotImplementedError

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the background thread: ``drain`` finishes queued and running requests
        first, else they end as ``cancelled``. Later ``submit`` calls raise
        :class:`SchedulerClosed`."""
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """True while the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """True when no request is waiting or running."""
        raise NotImplementedError

    # --- snapshots -------------------------------------------------------------------------
    def slots(self) -> list[dict[str, Any]]:
        """Per slot: ``id``, ``state`` ("idle" | "processing"), ``request_id``, ``n_ctx``,
        ``n_cached`` (tokens in its cache), ``n_prompt``, ``n_decoded``, ``speculative``."""
        raise NotImplementedError

    def metrics(self) -> dict[str, Any]:
        """Counters since start: ``requests_total/finished/cancelled/failed``,
        ``prompt_tokens`` (evaluated), ``prompt_tokens_cached``, ``generated_tokens``,
        ``draft_n``, ``draft_n_accepted``, ``acceptance_per_position``,
        ``draft_length_histogram`` (drafts of length k -> count), ``verify_steps``,
        ``queue_depth``, ``busy_slots``, ``n_slots``, ``tokens_per_second`` (generation,
        recent), ``prompt_tokens_per_second``."""
        raise NotImplementedError

    def memory(self) -> dict[str, Any]:
        """Bytes by component and device (``Engine.memory()``, incl. prompt checkpoints)."""
        return self.engine.memory()

    # --- internal --------------------------------------------------------------------------
    def _wake(self) -> None:
        """Wake the background thread (a request was submitted or cancelled)."""
