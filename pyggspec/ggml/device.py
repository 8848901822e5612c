"""ggml devices and backends: discovery, memory, RPC servers.

Whatever backends llama-cpp-python was built with (CPU, CUDA, Metal, Vulkan, RPC, ...)
show up through ggml's registry; nothing here names a particular GPU backend.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass

from typing_extensions import Self

from pyggspec.errors import DeviceError
from pyggspec.ggml import _lib, quirks

_TYPE_NAMES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True)
class DeviceInfo:
    """What ``pyggspec devices`` prints about one ggml device."""

    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int
    backend: str

    def to_dict(self) -> dict:
        return asdict(self)


RPC_ALIVE_S = 5.0  # an RPC server found alive is not probed again for this long
_RPC_ALIVE: dict[str, float] = {}  # endpoint -> when it was last found alive


class Device:
    """A ggml device (``ggml_backend_dev_t``); owned by ggml's registry, never freed."""

    __slots__ = ("ptr",)

    def __init__(self, ptr) -> None:
        self.ptr = ptr

    @property
    def name(self) -> str:
        return _lib.ffi.string(_lib.lib.ggml_backend_dev_name(self.ptr)).decode()

    @property
    def address(self) -> int:
        """The ``ggml_backend_dev_t`` as an integer, for other bindings of the same ggml
        (the llama_cpp oracle takes a device list)."""
        return int(_lib.ffi.cast("uintptr_t", self.ptr))

    @property
    def description(self) -> str:
        return _lib.ffi.string(_lib.lib.ggml_backend_dev_description(self.ptr)).decode()

    @property
    def type(self) -> str:
        return _TYPE_NAMES.get(int(_lib.lib.ggml_backend_dev_type(self.ptr)), "unknown")

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"

    @property
    def backend_name(self) -> str:
        reg = _lib.lib.ggml_backend_dev_backend_reg(self.ptr)
        return _lib.ffi.string(_lib.lib.ggml_backend_reg_name(reg)).decode() if reg else ""

    @property
    def is_rpc(self) -> bool:
        return self.backend_name == "RPC"

    def reachable(self) -> bool:
        """False for an RPC device whose server is gone (ggml would abort on any call).

        An rpc-server serves one client at a time with a tiny listen backlog, so a live
        server that this process is connected to may not complete new handshakes: a
        connect that times out counts as alive; only a refused or failed connect is dead.
        An answer "alive" is kept for :data:`RPC_ALIVE_S` seconds: a busy server times the
        probe out, and a probe before every buffer and sizing cost 0.5 s each.
        """
        if not self.is_rpc:
            return True
        endpoint = self.description
        if time.monotonic() - _RPC_ALIVE.get(endpoint, -RPC_ALIVE_S) < RPC_ALIVE_S:
            return True
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                pass
        except TimeoutError:
            pass
        except (OSError, ValueError):
            return False
        _RPC_ALIVE[endpoint] = time.monotonic()
        return True

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes as the device reports them; (0, 0) for a dead RPC server."""
        if not self.reachable():
            return 0, 0
        free = _lib.ffi.new("size_t *")
        total = _lib.ffi.new("size_t *")
        _lib.lib.ggml_backend_dev_memory(self.ptr, free, total)
        return int(free[0]), int(total[0])

    def info(self) -> DeviceInfo:
        free, total = self.memory()
        return DeviceInfo(self.name, self.description, self.type, free, total, self.backend_name)

    def buffer_type(self):
        """The device's default buffer type (raw cffi pointer, for Buffer/BackendScheduler)."""
        return _lib.lib.ggml_backend_dev_buffer_type(self.ptr)

    def supports_op(self, tensor) -> bool:
        return bool(_lib.lib.ggml_backend_dev_supports_op(self.ptr, tensor.ptr))

    def accepts(self, type_name: str, ne: tuple[int, ...]) -> bool:
        """Whether the device can hold a tensor of this type and shape as an operand (asked
        with metadata only: a GPU API may cap one buffer binding, e.g. lavapipe's 128 MiB
        storage-buffer range, below the size of a large LM head)."""
        if self.is_cpu:
            return True
        from pyggspec.ggml.context import Context

        ctx = Context(1)
        try:
            return self.supports_op(ctx.new_tensor(type_name, ne))
        finally:
            ctx.close()

    def open(self, n_threads: int | None = None) -> Backend:
        if not self.reachable():
            raise DeviceError(self.name, f"RPC server {self.description} is not reachable")
        quirks.report_once(self.name)
        ptr = _lib.lib.ggml_backend_dev_init(self.ptr, _lib.ffi.NULL)
        if ptr == _lib.ffi.NULL:
            raise DeviceError(self.name, "could not initialise a backend on this device")
        backend = Backend(ptr, self)
        if n_threads is not None:
            backend.set_n_threads(n_threads)
        return backend

    def __repr__(self) -> str:
        return f"Device({self.name!r}, {self.type})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and self.ptr == other.ptr

    def __hash__(self) -> int:
        return hash(self.name)


class Backend:
    """An initialised backend (stream) on a device; ``close()`` frees it."""

    def __init__(self, ptr, device: Device) -> None:
        self.ptr = ptr
        self.device = device
        self._finalizer = weakref.finalize(self, _lib.lib.ggml_backend_free, ptr)

    @property
    def name(self) -> str:
        return _lib.ffi.string(_lib.lib.ggml_backend_name(self.ptr)).decode()

    def set_n_threads(self, n_threads: int) -> bool:
        """Set worker threads where the backend has them (CPU); False if it has none."""
        if n_threads < 1:
            raise DeviceError(self.device.name, f"thread count must be >= 1, got {n_threads}")
        return bool(_lib.lib.pyggspec_backend_set_n_threads(self.ptr, int(n_threads)))

    def synchronize(self) -> None:
        _lib.lib.ggml_backend_synchronize(self.ptr)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def devices() -> list[Device]:
    """Every device in ggml's registry, in registry order (CPU is always present)."""
    lib = _lib.lib
    return [Device(lib.ggml_backend_dev_get(i)) for i in range(lib.ggml_backend_dev_count())]


def list_devices() -> list[DeviceInfo]:
    return [d.info() for d in devices()]


def get_device(name: str) -> Device:
    """A device by exact name (case-insensitive), e.g. ``CPU``, ``CUDA0``, ``RPC0``."""
    all_devs = devices()
    for d in all_devs:
        if d.name.lower() == name.lower():
            return d
    known = ", ".join(d.name for d in all_devs)
    raise DeviceError(name, f"no such device (available: {known})")


def cpu_device() -> Device:
    for d in devices():
        if d.is_cpu:
            return d
    raise DeviceError("CPU", "ggml has no CPU device")  # pragma: no cover


def backends_available() -> list[str]:
    """Names of the backend registries compiled in (e.g. ``['CPU', 'RPC']``)."""
    lib = _lib.lib
    return [
        _lib.ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))).decode()
        for i in range(lib.ggml_backend_reg_count())
    ]


def has_rpc() -> bool:
    return _lib.lib.ggml_backend_reg_by_name(b"RPC") != _lib.ffi.NULL


def add_rpc_server(endpoint: str) -> list[Device]:
    """Connect to an rpc-server at ``host:port`` and register its devices (RPC0, ...)."""
    if not has_rpc():
        raise DeviceError(
            endpoint,
            "llama-cpp-python was built without the RPC backend; reinstall it with "
            "CMAKE_ARGS=-DGGML_RPC=on (./install.sh does this)",
        )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise DeviceError(endpoint, "RPC endpoint must be host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as e:
        raise DeviceError(endpoint, f"cannot reach RPC server: {e.strerror or e}") from None
    before = {d.name for d in devices()}
    reg = _lib.lib.pyggspec_rpc_add_server(endpoint.encode())
    if reg == _lib.ffi.NULL:
        raise DeviceError(endpoint, "ggml refused the RPC server")
    added = [d for d in devices() if d.name not in before]
    if not added:  # already registered: return its devices
        n = _lib.lib.ggml_backend_reg_dev_count(reg)
        added = [Device(_lib.lib.ggml_backend_reg_dev_get(reg, i)) for i in range(n)]
    return added


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    """An RPC server serving this machine's CPU in a child process (tests, demos).

    The server blocks its process forever inside ggml, so it runs in a subprocess that
    is terminated by :meth:`close`.
    """

    def __init__(self, port: int | None = None, n_threads: int = 1,
                 host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.host = host
        self.port = port or _free_port()
        self.endpoint = f"{host}:{self.port}"
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyggspec.ggml.rpc_server", self.endpoint, str(n_threads)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                raise DeviceError(self.endpoint, f"RPC server exited: {err.splitlines()[-1:]}")
            try:
                with socket.create_connection((host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise DeviceError(self.endpoint, "RPC server did not start in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
