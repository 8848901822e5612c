"""Streaming text of one request: detokenization plus stop strings.

Text that could still become a stop string is held back, so a client never sees part of a
stop string and the concatenated stream equals the final text (which ends before the stop
string). A stop string may span several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Feed emitted tokens with :meth:`add`; each call returns the text that became safe
    to show and the stop string that matched (None while none has)."""

    def __init__(self, detokenizer, stops: Sequence[str] = ()) -> None:
        self.detok = detokenizer  # pyggspec.tokenizer.Detokenizer or None (no text)
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self._out: list[str] = []  # everything released so far (joined once, at the end:
        # a string grown by += on an attribute is copied whole per token)

    @property
    def text(self) -> str:
        return "".join(self._out)

    def add(self, token: int) -> tuple[str, str | None]:
        if self.detok is None:
            return "", None
        self.held += self.detok.add(token)
        return self._release(final=False)

    def finish(self) -> tuple[str, str | None]:
        """The request ended: release what is held (and the detokenizer's tail)."""
        if self.detok is not None:
            self.held += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, str | None]:
        held = self.held
        hit: tuple[int, str] | None = None
        for w in self.stops:
            i = held.find(w)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, w)
        if hit is not None:
            out, self.held = held[:hit[0]], ""
            self._out.append(out)
            return out, hit[1]
        keep = 0 if final else self._partial(held)
        out, self.held = held[:len(held) - keep], held[len(held) - keep:]
        if out:
            self._out.append(out)
        return out, None

    def _partial(self, held: str) -> int:
        """Length of the longest tail of ``held`` that starts some stop string."""
        keep = 0
        for w in self.stops:
            for k in range(min(len(w) - 1, len(held)), keep, -1):
                if held.endswith(w[:k]):
                    keep = k
                    break
        return keep
