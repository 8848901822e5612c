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


class BindingError(PyggspecError):
    """The ggml libraries from llama-cpp-python are missing, too old, or lack a backend."""
