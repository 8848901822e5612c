"""Sampling stats (what ``run --json`` reports under ``sampling``) and the fallback log:
each reason is logged once per process on logger ``pyggspec.sampling``."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pyggspec.sampling")

_logged: set[str] = set()


def log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.warning("%s", msg)


@dataclass
class SamplingStats:
    """What ``run --json`` reports under ``sampling``."""

    device: str | None = None
    device_stages: list[str] = field(default_factory=list)
    host_stages: list[str] = field(default_factory=list)
    tokens: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    buffer_bytes: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        log_once(f"sampling falls back to the host: {reason}")

    def to_dict(self) -> dict[str, Any]:
        n = max(self.tokens, 1)
        return {"device": self.device, "device_stages": list(self.device_stages),
                "host_stages": list(self.host_stages), "tokens": self.tokens,
                "bytes_d2h": self.bytes_d2h, "bytes_d2h_per_token": self.bytes_d2h / n,
                "bytes_h2d_per_token": self.bytes_h2d / n, "buffer_bytes": self.buffer_bytes,
                "fallbacks": dict(self.fallbacks)}
