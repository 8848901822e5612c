"""Upload: a placement -> ggml tensors in backend buffers (:func:`load_weights` ->
:class:`~pyggspec.weights.store.Weights`). Every ggml call goes through
:mod:`pyggspec.ggml` (contexts, buffers, tensors); nothing here touches the binding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pyggspec.errors import DeviceError, ModelFileError
from pyggspec.modelfile import Model
from pyggspec.progress import Progress
from pyggspec.weights.placement import CPU, Placement, _Job
from pyggspec.weights.repack import _plan_jobs, _repack_choice, repack_buffer_types
from pyggspec.weights.store import Weights

if TYPE_CHECKING:
    import numpy as np

    from pyggspec.ggml.device import Device
    from pyggspec.ggml.repack import BufferType
    from pyggspec.ggml.tensor import Tensor

TENSOR_ALIGNMENT = 32  # ggml-backend's TENSOR_ALIGNMENT: CPU tensor data must be this aligned
PROGRESS_MIN_BYTES = 256 * 2**20
_COPY_CHUNK = 64 * 2**20  # bytes per ggml_backend_tensor_set call (progress granularity)


def _want_progress(progress: bool | None, total: int) -> bool:
    return progress if progress is not None else total > PROGRESS_MIN_BYTES


class _Progress:
    """Weight upload progress: ``pyggspec: loading weights  123.4/456.7 MiB  27%  350.2 MB/s``
    redrawn in place on a terminal; elsewhere one line at the start and one at the end."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total > 0:
            self.bar = Progress(total, _weights_frame,
                                start=f"pyggspec: loading weights ({total / 2**20:.1f} MiB)")

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish()


def _weights_frame(done: int, total: int, dt: float) -> str:
    return (f"pyggspec: loading weights {done / 2**20:9.1f}/{total / 2**20:.1f} MiB "
            f"{100.0 * done / total:3.0f}% {done / max(dt, 1e-9) / 1e6:8.1f} MB/s")


def load_weights(model: Model, placement: Placement, mtp_placement: Placement | None = None, *,
                 use_mmap: bool = True, progress: bool | None = None, repack: bool = True,
                 no_repack: frozenset[str] = frozenset()) -> Weights:
    """Create every planned tensor on its device and fill it with the file's raw bytes.

    ``placement`` is the trunk file's plan; ``mtp_placement`` the separate MTP file's (default:
    :func:`default_mtp_placement`). One context + buffer (usage WEIGHTS) per device; with
    ``use_mmap`` CPU tensors are not copied but point into the file mapping (llama.cpp's
    default), where the file's alignment allows it. Non-CPU devices are checked for free memory
    before anything is allocated. ``progress``: None = above 256 MiB of copies, True/False =
    force on/off; a bar on a terminal stderr, else a line at the start and at the end.

    ``repack`` (llama.cpp's default; ``--no-repack`` turns it off): CPU matrix weights go to
    the CPU backend's extra buffer types (re-laid out for its GEMV/GEMM kernels) wherever
    ggml says it can run them from there; AMX only where :mod:`pyggspec.ggml.amx_probe`
    saw it run. Those tensors are copies, not mapped. ``no_repack``: keys kept plain.
    """
    from pyggspec.ggml.device import cpu_device, get_device

    cpu = cpu_device()
    rtypes = repack_buffer_types(cpu) if repack else []
    jobs, aliases, plan_devices = _plan_jobs(model, placement, mtp_placement, cpu, rtypes)

    devices: dict[str, Device] = {}
    for name in sorted({j.device for j in jobs} | plan_devices):
        devices[name] = get_device(name)

    w = Weights()
    w._plan_devices = plan_devices
    w._repack_types = list(rtypes)
    try:
        _upload(w, jobs, devices, use_mmap=use_mmap, progress=progress,
                repack=[] if not rtypes else [(j.key, _repack_choice(cpu, rtypes, j.key, j.info))
                                              for j in jobs
                                              if j.key not in no_repack and j.device == CPU])
    except BaseException:
        w.close()
        raise
    w._aliases.update(aliases)
    return w


def _addr(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def _upload(w: Weights, jobs: list[_Job], devices: Mapping[str, Device], *, use_mmap: bool,
            progress: bool | None, repack: list[tuple[str, BufferType | None]] = ()) -> None:
    """Build the contexts and buffers of ``w`` and fill them (see :func:`load_weights`)."""
    from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
    from pyggspec.ggml.context import Context

    # Group: ("copy", device) -> one allocated buffer; ("map", path) -> one buffer over the
    # mmap; ("repack", buffer type) -> one CPU extra buffer (written whole, tensor by tensor).
    groups: dict[tuple[str, str], list[tuple[_Job, np.ndarray | None]]] = {}
    rtypes = {k: b for k, b in repack if b is not None}
    by_name = {b.name: b for b in rtypes.values()}
    for j in jobs:
        dev = devices[j.device]
        view = None
        if j.key in rtypes and dev.is_cpu:
            groups.setdefault(("repack", rtypes[j.key].name), []).append((j, None))
            continue
        if use_mmap and dev.is_cpu:
            view = j.file.tensor_data(j.info.name)
            if _addr(view) % TENSOR_ALIGNMENT:
                view = None  # misaligned in the file (general.alignment < 32): copy it instead
        gkey = ("map", os.fspath(j.file.path)) if view is not None else ("copy", j.device)
        groups.setdefault(gkey, []).append((j, view))

    # Free memory, checked for every device before anything is allocated.
    for (kind, dname), members in groups.items():
        dev = devices[dname] if kind == "copy" else None
        if dev is None or dev.is_cpu:
            continue  # CPU "free" is MemFree (ignores the page cache): not a useful limit
        if not dev.reachable():  # ggml aborts on a dead RPC server
            raise DeviceError(dev.name, f"RPC server {dev.description} is not reachable")
        need = sum(_pad(j.info.nbytes, 256) for j, _ in members)
        free, total = dev.memory()
        if total and need > free:
            raise DeviceError(dev.name, f"the weights placed here need {need / 2**20:.1f} MiB "
                              f"but only {free / 2**20:.1f} MiB are free (offload fewer layers "
                              "with -ngl, or move tensors with --override-tensor)")

    cpu = next((d for d in devices.values() if d.is_cpu), None)
    to_copy: list[tuple[_Job, Tensor]] = []
    for (kind, where), members in groups.items():
        ctx = Context(len(members))
        w._contexts.append(ctx)
        made: list[tuple[_Job, np.ndarray | None, Tensor]] = []
        for j, view in members:
            t = ctx.new_tensor(j.info.type.id, j.info.shape, j.key)
            if t.nbytes != j.info.nbytes:
                raise ModelFileError(j.file.path, f"tensor '{j.info.name}': ggml computes "
                                     f"{t.nbytes} bytes for {j.info.type.name} {j.info.shape}, "
                                     f"the file holds {j.info.nbytes}")
            made.append((j, view, t))
        if kind == "copy":
            dev = devices[where]
            buf = Buffer.for_context(ctx, dev, f"weights on {dev.name}", USAGE_WEIGHTS)
            w.buffers.append(buf)
            to_copy += [(j, t) for j, _, t in made]
        elif kind == "repack":
            assert cpu is not None
            dev = cpu
            buf = Buffer.in_buffer_type(ctx, by_name[where], cpu, f"weights repacked ({where})",
                                        USAGE_WEIGHTS)
            if buf is None:
                raise DeviceError(cpu.name, f"could not allocate the {where} weight buffer "
                                  "(try --no-repack)")
            w.buffers.append(buf)
            to_copy += [(j, t) for j, _, t in made]
            w._repacked.update({j.key: where for j, _, _ in made})
        else:
            assert cpu is not None
            dev = cpu
            starts = [_addr(v) for _, v, _ in made if v is not None]
            lo = min(starts) // TENSOR_ALIGNMENT * TENSOR_ALIGNMENT  # stays inside the mapping
            hi = max(s + j.info.nbytes for s, (j, _, _) in zip(starts, made, strict=True))
            biggest = max(j.info.nbytes for j, _, _ in made)
            buf = Buffer.from_host_memory(cpu, lo, hi - lo, biggest,
                                          f"weights mapped from {os.path.basename(where)}",
                                          USAGE_WEIGHTS)
            if buf is None:
                raise DeviceError(cpu.name, f"could not wrap the mapping of {where} in a buffer")
            w.buffers.append(buf)
            for (j, view, t), start in zip(made, starts, strict=True):
                buf.place(t, start)
                assert view is not None
                w._views.append(view)
                w._mapped.add(j.key)
        for j, _, t in made:
            w._tensors[j.key] = t
            w._devices[j.key] = dev
            w._sources[j.key] = (j.file, j.info)

    total = sum(j.info.nbytes for j, _ in to_copy)
    bar = _Progress(total, _want_progress(progress, total))
    try:
        for j, t in to_copy:
            data = memoryview(j.file.tensor_data(j.info.name))
            if j.key in w._repacked:  # a repacking buffer takes a tensor in one write
                t.set(data)
                bar.update(j.info.nbytes)
                continue
            for off in range(0, j.info.nbytes, _COPY_CHUNK):
                chunk = data[off:off + _COPY_CHUNK]
                t.set(chunk, off)
                bar.update(len(chunk))
    finally:
        bar.finish()


def _pad(x: int, align: int) -> int:
    return (x + align - 1) // align * align
