"""What a stream reports before its end: llama-server's ``timings_per_token`` (every chunk
carries the timings so far) and ``return_progress`` (a ``prompt_progress`` chunk when the
request gets its slot and after each prompt chunk).

Both come from the request's events: a streamed request asks the scheduler for prompt
progress events (``Request.progress``), which give the cached and evaluated prompt tokens
and the prompt's time; tokens are counted and timed as their events arrive. Why here and not
in the scheduler's result: the result exists only at the end, and a chunk's timings must be
those of the moment it is sent (llama-server fills them from the slot's live counters).
"""

from __future__ import annotations

import time
from typing import Any

from pyggspec.serving.request import RequestTimings


class LiveTimings:
    """The running timings of one streamed request: ``observe`` every event, then
    ``decorate`` the last body sent for it. ``per_token``: bodies carry ``timings``;
    ``progress``: progress events become chunks (with ``prompt_progress``), else they are
    skipped; ``tag``: False adds neither field (APIs whose shapes have no such fields)."""

    def __init__(self, per_token: bool = False, progress: bool = False,
                 tag: bool = True) -> None:
        self.per_token = per_token
        self.progress = progress
        self.tag = tag
        self.cache_n = 0
        self.prompt_n = 0
        self.prompt_ms = 0.0
        self.n_gen = 0
        self._t_first: float | None = None
        self._t_last: float | None = None

    @classmethod
    def of(cls, gen: Any) -> LiveTimings:
        """For a request's :class:`~pyggspec.serving.http.protocol.GenParams`."""
        return cls(gen.timings_per_token, gen.return_progress)

    def observe(self, ev: Any) -> None:
        p = getattr(ev, "progress", None)
        if p is not None:
            self.cache_n = p.cache
            self.prompt_n = p.processed - p.cache
            self.prompt_ms = p.time_ms
            return
        if ev.tokens:
            now = time.perf_counter()
            if self._t_first is None:
                self._t_first = now
            self._t_last = now
            self.n_gen += len(ev.tokens)

    def shown(self, ev: Any) -> bool:
        """Whether ``ev`` becomes a chunk at all (progress events only when asked for)."""
        return getattr(ev, "progress", None) is None or self.progress

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` object as of now (generation time from the first
        token, which comes with the prompt, as there)."""
        ms = ((self._t_last - self._t_first) * 1000
              if self._t_first is not None and self._t_last is not None else 0.0)
        return RequestTimings(prompt_n=self.prompt_n, prompt_ms=self.prompt_ms,
                              predicted_n=self.n_gen, predicted_ms=ms,
                              cache_n=self.cache_n).to_dict()

    def decorate(self, body: dict[str, Any], ev: Any) -> None:
        """Add ``timings`` (when per token) and ``prompt_progress`` (on a progress event)
        to ``body``, the last one sent for ``ev``, as llama-server does."""
        if not self.tag:
            return
        if self.per_token:
            body["timings"] = self.timings()
        p = getattr(ev, "progress", None)
        if p is not None and self.progress:
            body["prompt_progress"] = p.to_dict()
