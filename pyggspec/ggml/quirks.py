"""Devices on which ggml is known to be broken, and the rule that routes around each.

ggml_backend_dev_supports_op answers for single ops on their shapes, and the scheduler
places what a device lacks on the CPU (pyggspec probes and reports that: ``sched.py``).
What it cannot see is a backend that claims an op and then crashes running it. Each
:class:`Quirk` here names such a case, the evidence (a reproduction with llama.cpp's own
tools, so the fault is shown to be ggml's or the driver's, not ours) and the rule
applied, which is one of ggml's own switches, set before the device initialises.

Rules are applied when the binding loads (:func:`apply`, before any backend or buffer
exists) and reported once per device when it is opened (:func:`report_once`) and in
``pyggspec devices``. A switch the user has set already is left as it is.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pyggspec.devices")


@dataclass(frozen=True)
class Quirk:
    """A known-broken backend/driver combination and its route-around."""

    key: str
    backend: str  # ggml registry name of the backend ("Vulkan", "CUDA", ...)
    description: str  # regex searched in the device description
    env: Mapping[str, str]  # ggml switches set before the device initialises
    why: str  # one line: what breaks, and the evidence
    action: str  # one line: what pyggspec does about it
    mesa_below: tuple[int, int] | None = None  # only Mesa drivers older than this (unknown: yes)

    def matches(self, backend: str, description: str) -> bool:
        if backend != self.backend or re.search(self.description, description) is None:
            return False
        if self.mesa_below is None:
            return True
        from pyggspec.ggml.vulkan_driver import mesa_version

        version = mesa_version(description)
        return version is None or version < self.mesa_below

    def line(self, device: str) -> str:
        return f"{device}: {self.why}; {self.action}"


QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        key="lavapipe-fusion",
        backend="Vulkan",
        description=r"\bllvmpipe\b",
        env={"GGML_VK_DISABLE_FUSION": "1"},
        why=("lavapipe before Mesa 25 corrupts host memory in ggml-vulkan's fused kernels (llama.cpp's "
             "own test-backend-ops -b Vulkan0 -o RMS_NORM_MUL_ADD and -o TOPK_MOE abort on 22.3; "
             "Mesa 25.0.7 passes them)"),
        action="running unfused ops (GGML_VK_DISABLE_FUSION=1); scripts/lavapipe.sh installs Mesa 25",
        mesa_below=(25, 0),
    ),
)

_applied: dict[str, list[Quirk]] = {}  # device name -> quirks in force for it
_reported: set[str] = set()


def apply(lib: Any, ffi: Any) -> None:
    """Set the switches of every quirk whose device ggml lists (called once, at load).

    Enumerating the registry describes devices without initialising them, so a switch
    set here is read when the device is first opened.
    """
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        name = ffi.string(lib.ggml_backend_dev_name(dev)).decode()
        desc = ffi.string(lib.ggml_backend_dev_description(dev)).decode()
        reg = lib.ggml_backend_dev_backend_reg(dev)
        backend = ffi.string(lib.ggml_backend_reg_name(reg)).decode() if reg else ""
        for q in QUIRKS:
            if not q.matches(backend, desc):
                continue
            for k, v in q.env.items():
                os.environ.setdefault(k, v)
            _applied.setdefault(name, []).append(q)


def applied(device: str) -> list[Quirk]:
    """The quirks in force for ``device`` (by name)."""
    return list(_applied.get(device, ()))


def lines(device: str) -> list[str]:
    """One line per quirk in force for ``device``."""
    return [q.line(device) for q in _applied.get(device, ())]


def report_once(device: str) -> None:
    """Log the quirks of ``device`` the first time it is opened in this process."""
    if device in _reported:
        return
    _reported.add(device)
    for line in lines(device):
        log.warning("%s", line)

