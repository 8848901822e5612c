"""One exception type for everything a user can get wrong.

The CLI prints these as a single line ``pyggspec: <where>: <what>`` and exits 1; library
users catch :class:`PyggspecError`. Anything else escaping is a bug in pyggspec.
"""

from __future__ import annotations

import os


class PyggspecError(Exception):
    """A user-facing error about a file, a device or an option."""

    def __init__(self, where: str | os.PathLike | None, message: str) -> None:
        self.where = os.fspath(where) if where is not None else None
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.where:
            return f"pyggspec: {self.where}: {self.message}"
        return f"pyggspec: {self.message}"


class ModelFileError(PyggspecError):
    """A GGUF file that is missing, malformed, or not a model pyggspec can run."""


class DeviceError(PyggspecError):
    """A ggml device or backend that cannot be found, opened or used as asked."""


class OutOfMemory(DeviceError):
    """A device that could not give the memory asked for. ``hint`` (the flag to change)
    is added by whoever knows what the memory was for (see :meth:`with_hint`)."""

    def __init__(self, device: str | None, what: str, nbytes: int | None = None,
                 hint: str = "") -> None:
        self.device, self.what, self.nbytes, self.hint = device, what, nbytes, hint
        size = f" {nbytes / 2**20:.1f} MiB" if nbytes is not None else ""
        super().__init__(device, f"out of memory allocating{size} for {what}"
                         + (f"; {hint}" if hint else ""))

    def with_hint(self, hint: str) -> OutOfMemory:
        """The same error saying which flag to change (a hint already given is kept)."""
        if self.hint:
            return self
        return OutOfMemory(self.device, self.what, self.nbytes, hint)


class BindingError(PyggspecError):
    """The ggml libraries from llama-cpp-python are missing, too old, or lack a backend."""
