"""Weight placement: which device holds each tensor (the plan; pure Python, no ggml).

The plan follows llama.cpp's ``llama_model_base::load_tensors`` (src/llama-model.cpp) and the
loader's ``create_tensor`` (src/llama-model-loader.cpp):

* Layers are numbered ``0 .. n_layer_all-1`` (the MTP block included) and the output layer
  (``output``, ``output_norm``) counts as layer ``n_layer_all``. With ``-ngl N`` the last ``N`` of
  these ``n_layer_all + 1`` go to the offload devices: ``i_gpu_start = max(n_layer_all + 1 - N,
  0)``, so the output layer goes first, then the MTP block, then the trunk from the top down.
  A negative ``N`` (llama.cpp's model-param default) means all of them.
* Offloaded layers are split over several devices by cumulative weights (``--tensor-split``;
  llama.cpp defaults to free memory, we default to equal shares): layer ``il`` goes to the first
  device whose cumulative share exceeds ``(il - i_gpu_start) / n_offloaded``.
* ``token_embd`` (the input layer) always stays on the CPU. A tied LM head (no
  ``output.weight``) loads ``token_embd`` a second time as the output tensor, on the output
  layer's device; when that device differs, the bytes are counted twice.
* ``--override-tensor`` patterns are searched (regex search, not full match) in the order given;
  the first match wins. ``--cpu-moe`` appends ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` → CPU
  (``LLM_FFN_EXPS_REGEX``, common/common.h), which also matches the MTP block's experts.

The upload part (:func:`load_weights` -> :class:`Weights`) turns a plan into ggml tensors in
backend buffers; it is the only part of this module that needs the binding.
"""

from __future__ import annotations

import bisect
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from pyggspec.errors import DeviceError, ModelFileError, PyggspecError
from pyggspec.modelfile import Model, ModelFile, TensorInfo
from pyggspec.progress import Progress

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self

    from pyggspec.ggml.buffer import Buffer
    from pyggspec.ggml.context import Context
    from pyggspec.ggml.device import Device
    from pyggspec.ggml.repack import BufferType
    from pyggspec.ggml.tensor import Tensor

CPU = "CPU"
CPU_MOE_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"

NGpuLayers = int | Literal["all", "auto"] | None


@dataclass(frozen=True)
class Placement:
    """Where every loaded tensor of one file goes, and the bytes that puts on each device."""

    offload_devices: tuple[str, ...]
    n_gpu_layers: int  # effective count, clamped to n_layer_all + 1
    i_gpu_start: int
    layer_devices: tuple[str, ...]  # one per block, MTP block(s) included
    output_device: str
    tensor_devices: Mapping[str, str]  # token_embd.weight -> its input copy's device
    output_copy_device: str | None  # tied LM head: device of token_embd's second copy
    bytes_by_device: Mapping[str, int]
    overridden: Mapping[str, str] = field(default_factory=dict)  # tensor -> pattern
    skipped: tuple[str, ...] = ()  # tensors not loaded (MTP block when include_mtp=False)
    refused: Mapping[str, str] = field(default_factory=dict)  # tensor -> device that cannot hold it

    @property
    def input_device(self) -> str:
        return CPU

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_device.values())

    def device_of(self, name: str) -> str:
        return self.tensor_devices[name]

    @property
    def output_split(self) -> bool:
        """The LM head and the output norm on different devices (sampler chains then run
        on the host: the logits' device does not hold the whole output layer)."""
        return self.output_device != self.tensor_devices.get("output_norm.weight", CPU)

    def to_dict(self) -> dict:
        return {
            "offload_devices": list(self.offload_devices), "n_gpu_layers": self.n_gpu_layers,
            "i_gpu_start": self.i_gpu_start, "layer_devices": list(self.layer_devices),
            "output_device": self.output_device, "output_copy_device": self.output_copy_device,
            "bytes_by_device": dict(self.bytes_by_device),
            "n_overridden": len(self.overridden), "n_skipped": len(self.skipped),
        }


def resolve_n_gpu_layers(n_gpu_layers: NGpuLayers, n_layer_all: int) -> int:
    """llama.cpp's ``n_gpu_layers()``: negative / None / "all" / "auto" mean every layer + output.

    ("auto" in llama.cpp's CLI also fits layers to free memory; we do not fit here.)
    """
    if n_gpu_layers is None or n_gpu_layers in ("all", "auto"):
        return n_layer_all + 1
    if isinstance(n_gpu_layers, str):
        raise PyggspecError("--n-gpu-layers", f"expected a number, 'all' or 'auto', "
                            f"got '{n_gpu_layers}'")
    return n_layer_all + 1 if n_gpu_layers < 0 else int(n_gpu_layers)


def select_offload_devices(devices: Sequence[str], device: str | None) -> tuple[str, ...]:
    """The devices layers may go to: ``device`` (comma list, or "none") or every non-CPU one."""
    if CPU not in devices:
        raise DeviceError(None, f"device list {list(devices)} lacks the CPU device")
    if device is None:
        return tuple(d for d in devices if d != CPU)
    names = [d.strip() for d in device.split(",") if d.strip()]
    if not names:
        raise DeviceError("--device", "no device given")
    if names == ["none"]:
        return ()
    for n in names:
        if n not in devices or n == CPU:
            avail = ", ".join(d for d in devices if d != CPU) or "none"
            why = "the CPU is not an offload device" if n == CPU else "unknown device"
            raise DeviceError("--device", f"{why} '{n}' (offload devices: {avail})")
    return tuple(names)


def layer_devices(n_layer_all: int, n_gpu: int, offload: Sequence[str],
                  tensor_split: Sequence[float] | None = None) -> tuple[tuple[str, ...], str, int]:
    """Device of each block and of the output layer, and ``i_gpu_start`` (llama.cpp rules)."""
    i_gpu_start = max(n_layer_all + 1 - n_gpu, 0)
    act = min(n_gpu, n_layer_all + 1) if offload else 0
    weights = list(tensor_split) if tensor_split is not None else [1.0] * len(offload)
    if offload and (len(weights) != len(offload) or any(w < 0 for w in weights)
                    or sum(weights) <= 0):
        raise PyggspecError("--tensor-split", f"need {len(offload)} non-negative shares "
                            f"with a positive sum, got {weights}")
    cum: list[float] = []
    s = 0.0
    for w in weights:
        s += w
        cum.append(s)
    splits = [c / s for c in cum] if offload else []

    def dev(il: int) -> str:
        if il < i_gpu_start or il - i_gpu_start >= act:
            return CPU
        k = bisect.bisect_right(splits, (il - i_gpu_start) / act)
        return offload[min(k, len(offload) - 1)]

    return tuple(dev(il) for il in range(n_layer_all)), dev(n_layer_all), i_gpu_start


def _block_of(name: str) -> int | None:
    if name.startswith("blk."):
        return int(name.split(".", 2)[1])
    return None


def plan_placement(model: ModelFile, devices: Sequence[str],
                   n_gpu_layers: NGpuLayers = None, device: str | None = None,
                   override_tensor: Sequence[tuple[str, str]] = (), cpu_moe: bool = False,
                   tensor_split: Sequence[float] | None = None,
                   include_mtp: bool = True,
                   accepts: Callable[[str, TensorInfo], bool] | None = None) -> Placement:
    """Map every tensor ``model`` loads to a device name (see the module docstring for rules).

    ``devices`` are the available device names in order ("CPU" among them); ``device`` restricts
    offloading (``-dev``); ``override_tensor`` is ``[(regex, device), ...]``; ``include_mtp=False``
    leaves the MTP block unloaded (llama.cpp without ``--spec-type draft-mtp``).
    ``accepts(device, info)`` says whether a device can hold a tensor as an operand at all; a
    tensor it refuses stays on the CPU (listed in ``refused``), and a refused LM head moves
    the logits to the CPU: ggml would otherwise abort on the first graph that reads it.
    """
    hp = model.hparams
    offload = select_offload_devices(devices, device)
    n_gpu = min(resolve_n_gpu_layers(n_gpu_layers, hp.n_layer_all), hp.n_layer_all + 1)
    blocks, out_dev, i_gpu_start = layer_devices(hp.n_layer_all, n_gpu, offload, tensor_split)

    rules: list[tuple[re.Pattern[str], str, str]] = []
    for pattern, dev in list(override_tensor) + ([(CPU_MOE_REGEX, CPU)] if cpu_moe else []):
        if dev not in devices:
            raise DeviceError("--override-tensor", f"unknown device '{dev}' for pattern "
                              f"'{pattern}' (devices: {', '.join(devices)})")
        try:
            rules.append((re.compile(pattern), pattern, dev))
        except re.error as e:
            raise PyggspecError("--override-tensor", f"invalid regex '{pattern}': {e}") from None

    def override(name: str) -> tuple[str, str] | None:
        for rx, pattern, dev in rules:
            if rx.search(name):
                return dev, pattern
        return None

    mtp_blocks = set(hp.mtp_blocks)
    present = [s.name for s in model.report.expected if s.name in model.tensors]
    where: dict[str, str] = {}
    overridden: dict[str, str] = {}
    refused: dict[str, str] = {}
    skipped: list[str] = []
    nbytes: dict[str, int] = {d: 0 for d in (CPU, *offload)}
    for name in present:
        il = _block_of(name)
        if il is not None and il in mtp_blocks and not include_mtp:
            skipped.append(name)
            continue
        if name == "token_embd.weight":
            default = CPU
        elif il is None:
            default = out_dev  # output.weight, output_norm.weight and their scales
        else:
            default = blocks[il]
        o = override(name)
        if o is not None:
            where[name], overridden[name] = o
        else:
            where[name] = default
        if where[name] != CPU and accepts is not None and not accepts(where[name],
                                                                     model.tensors[name]):
            refused[name] = where[name]
            where[name] = CPU
        nbytes[where[name]] = nbytes.get(where[name], 0) + model.tensors[name].nbytes

    if "output.weight" in refused:
        out_dev = CPU  # the logits come from the CPU's copy of the LM head
    copy_dev = None
    if model.tied_output and "token_embd.weight" in where:
        o = override("token_embd.weight")
        out_copy = o[0] if o is not None else out_dev
        if out_copy != CPU and accepts is not None and not accepts(out_copy,
                                                                   model.tensors["token_embd.weight"]):
            refused["output.weight"] = out_copy
            out_copy = out_dev = CPU
        if out_copy != where["token_embd.weight"]:
            copy_dev = out_copy
            nbytes[copy_dev] = nbytes.get(copy_dev, 0) + model.tensors["token_embd.weight"].nbytes

    return Placement(
        offload_devices=offload, n_gpu_layers=n_gpu, i_gpu_start=i_gpu_start,
        layer_devices=blocks, output_device=out_dev, tensor_devices=where,
        output_copy_device=copy_dev, bytes_by_device=nbytes, overridden=overridden,
        skipped=tuple(skipped), refused=refused,
    )


def sum_bytes(*placements: Placement) -> dict[str, int]:
    """Per-device totals over several placements (a trunk file and its MTP sidecar)."""
    out: dict[str, int] = {}
    for p in placements:
        for d, b in p.bytes_by_device.items():
            out[d] = out.get(d, 0) + b
    return out


# ---------------------------------------------------------------------------------------------
# Upload: the plan -> ggml tensors in backend buffers
# ---------------------------------------------------------------------------------------------
#
# Names. Trunk tensors keep their GGUF names. A tied LM head is reachable as ``output.weight``
# (an alias of ``token_embd.weight``, or a second copy on the output device when the plan puts
# the output layer elsewhere: llama.cpp's TENSOR_DUPLICATED). A separate MTP file's ``blk.N.*``
# tensors keep their names; its other tensors (``token_embd``, ``output_norm``, ``output``), which
# share names with the trunk's, are kept as ``mtp:<name>`` (``mtp:output.weight`` is tied the
# same way). :meth:`Weights.get_mtp` picks the MTP file's copy when there is one.

MTP_PREFIX = "mtp:"
TENSOR_ALIGNMENT = 32  # ggml-backend's TENSOR_ALIGNMENT: CPU tensor data must be this aligned
PROGRESS_MIN_BYTES = 256 * 2**20
_COPY_CHUNK = 64 * 2**20  # bytes per ggml_backend_tensor_set call (progress granularity)


@dataclass(frozen=True)
class _Job:
    """One tensor to create: its key in :class:`Weights`, source file and bytes, device."""

    key: str
    file: ModelFile
    info: TensorInfo
    device: str


class Weights:
    """Model weights in ggml backend buffers, by GGUF name (see the naming notes above).

    CPU tensors loaded with ``use_mmap`` point into the file's read-only mapping: never write
    to a weight (``Tensor.set``, ``zero``, graph ops writing in place), it would fault. The
    mapping stays alive as long as this object (until :meth:`close`).
    """

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}
        self._devices: dict[str, Device] = {}
        self._aliases: dict[str, str] = {}
        self._mapped: set[str] = set()
        self._repacked: dict[str, str] = {}  # key -> extra buffer type name
        self._sources: dict[str, tuple[ModelFile, TensorInfo]] = {}  # key -> file, tensor
        self._repack_types: list[BufferType] = []  # what loading could repack into
        self._plan_devices: set[str] = set()
        self._views: list[np.ndarray] = []  # keep the file mappings exported (alive)
        self._contexts: list[Context] = []
        self.buffers: list[Buffer] = []
        self._closed = False

    # -- lookup ----------------------------------------------------------------------------
    def _resolve(self, name: str) -> str:
        if self._closed:
            raise PyggspecError(None, f"weights are closed (asked for '{name}')")
        return self._aliases.get(name, name)

    def get(self, name: str) -> Tensor:
        """The tensor ``name`` (GGUF name, ``output.weight`` also when tied, ``mtp:...``)."""
        key = self._resolve(name)
        t = self._tensors.get(key)
        if t is None:
            hint = ""
            if name.startswith(MTP_PREFIX):
                hint = " (no separate MTP file loaded, or it lacks this tensor)"
            elif name.startswith("blk."):
                hint = " (not in the file, or skipped by the placement)"
            raise KeyError(f"pyggspec: no weight '{name}' loaded{hint}; "
                           f"{len(self._tensors)} tensors are loaded")
        return t

    def get_mtp(self, name: str) -> Tensor:
        """The MTP head's copy of a shared tensor: ``mtp:<name>`` if loaded, else ``name``."""
        return self.get(MTP_PREFIX + name) if self.has(MTP_PREFIX + name) else self.get(name)

    def has(self, name: str) -> bool:
        return self._resolve(name) in self._tensors

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.has(name)

    def names(self) -> list[str]:
        """Keys of every uploaded tensor (aliases not included)."""
        return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._tensors)

    def device_of(self, name: str) -> Device:
        self.get(name)
        return self._devices[self._resolve(name)]

    def is_mapped(self, name: str) -> bool:
        """True if ``name`` lives in the file's (read-only) mapping rather than a copy."""
        return self._resolve(name) in self._mapped

    def bytes_by_device(self) -> dict[str, int]:
        """Bytes of weights per device name (every planned device listed, even at 0)."""
        out = {d: 0 for d in sorted(self._plan_devices)}
        for key, t in self._tensors.items():
            d = self._devices[key].name
            out[d] = out.get(d, 0) + t.nbytes
        return out

    @property
    def mapped_bytes(self) -> int:
        return sum(self._tensors[k].nbytes for k in self._mapped)

    def repacked(self) -> dict[str, str]:
        """Keys held in a CPU extra buffer type (repacked copies) -> that type's name."""
        return dict(self._repacked)

    @property
    def repacked_bytes(self) -> int:
        return sum(self._tensors[k].nbytes for k in self._repacked)

    # -- derived weights --------------------------------------------------------------------
    def add_requantized(self, key: str, src: str, type_name: str,
                        chunk_rows: int = 8192) -> Tensor:
        """A copy of weight ``src`` in another ggml type, under ``key``, on the same device
        (a CPU copy in a repack buffer type when these weights were loaded with repacking
        and ggml takes it there).

        For weights only an approximation needs (the draft LM head: a draft is a guess the
        target verifies). The rows are dequantized from the file and quantized again with
        ggml's quantizer a chunk at a time, so the host never holds them all in float32.
        """
        import numpy as np
        from gguf.quants import GGMLQuantizationType, dequantize

        from pyggspec.ggml import _lib
        from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
        from pyggspec.ggml.context import Context
        from pyggspec.ggml.quantize import quantize_rows
        from pyggspec.ggml.repack import alloc_for_context
        from pyggspec.modelfile import ggml_type

        skey = self._resolve(src)
        if skey not in self._sources:
            raise PyggspecError(None, f"weight '{src}' is not loaded from a file")
        file, info = self._sources[skey]
        dst = ggml_type(type_name)
        ne0, n_rows = info.ne[0], int(np.prod(info.ne[1: info.n_dims]))
        if ne0 % dst.block_size:
            raise PyggspecError(None, f"'{src}' rows of {ne0} values do not fit "
                                f"{dst.name} blocks of {dst.block_size}")
        raw = np.asarray(file.tensor_data(info.name)).reshape(n_rows, -1)
        rb = dst.row_bytes(ne0)
        out = bytearray(rb * n_rows)
        for r0 in range(0, n_rows, chunk_rows):
            rows = dequantize(raw[r0:r0 + chunk_rows], GGMLQuantizationType(info.type.id))
            rows = rows.reshape(-1, ne0)
            out[r0 * rb:(r0 + len(rows)) * rb] = quantize_rows(dst.id, rows)
        dev = self._devices[skey]
        ctx = Context(1)
        self._contexts.append(ctx)
        t = ctx.new_tensor(dst.id, info.shape, key)
        buft = None
        if self._repack_types and dev.is_cpu:
            buft = _repack_choice(dev, self._repack_types, key, replace(info, type=dst))
        if buft is not None:
            ptr = alloc_for_context(ctx, buft)
            if ptr is None:
                raise DeviceError(dev.name, f"could not allocate {key} in {buft.name}")
            buf = Buffer(ptr, dev, f"{key} ({buft.name})")
            _lib.lib.ggml_backend_buffer_set_usage(ptr, USAGE_WEIGHTS)
            self._repacked[key] = buft.name
        else:
            buf = Buffer.for_context(ctx, dev, key, USAGE_WEIGHTS)
        self.buffers.append(buf)
        t.set(memoryview(out))
        self._tensors[key] = t
        self._devices[key] = dev
        return t

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the buffers, then the contexts, then release the file mappings (idempotent)."""
        for b in self.buffers:
            b.close()
        for c in self._contexts:
            c.close()
        self._tensors.clear()
        self._aliases.clear()
        self._mapped.clear()
        self._repacked.clear()
        self._views.clear()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        by = ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in self.bytes_by_device().items()) \
            if not self._closed else "closed"
        return f"Weights({len(self._tensors)} tensors; {by})"


def _jobs_for(file: ModelFile, placement: Placement, prefix_shared: bool,
              dup_tied: bool = False) -> tuple[list[_Job], dict[str, str]]:
    """Tensors of one file per ``placement``, plus aliases (the tied head on the same device).

    With ``prefix_shared`` (a separate MTP file) non-block tensors get the ``mtp:`` prefix.
    ``dup_tied``: a tied head on the input's device is its own tensor anyway (as llama.cpp
    loads it), so that it can be repacked while the embedding rows stay plain.
    """
    def key(name: str) -> str:
        return MTP_PREFIX + name if prefix_shared and not name.startswith("blk.") else name

    jobs: list[_Job] = []
    for name, dev in placement.tensor_devices.items():
        info = file.tensors.get(name)
        if info is None:
            raise PyggspecError(file.path, f"the placement names tensor '{name}', which this "
                                "file lacks (was it planned for another file?)")
        jobs.append(_Job(key(name), file, info, dev))
    aliases: dict[str, str] = {}
    emb = "token_embd.weight"
    if file.tied_output and emb in placement.tensor_devices:
        if placement.output_copy_device is not None or dup_tied:
            jobs.append(_Job(key("output.weight"), file, file.tensors[emb],
                             placement.output_copy_device or placement.device_of(emb)))
        else:
            aliases[key("output.weight")] = key(emb)
    return jobs, aliases


def default_mtp_placement(model: Model, placement: Placement) -> Placement:
    """Plan the MTP file like the trunk: same offload devices and ``-ngl``, no overrides.

    Pass an explicit ``mtp_placement`` to :func:`load_weights` for overrides or a tensor split.
    """
    assert model.mtp_file is not None
    offload = placement.offload_devices
    return plan_placement(model.mtp_file, (CPU, *offload), n_gpu_layers=placement.n_gpu_layers,
                          device=",".join(offload) if offload else "none")


# weights read by something other than a matrix multiply: never re-laid out
_NOT_MATMUL = re.compile(r"(^|\.)(token_embd|embed_tokens|ssm_conv1d)\.weight$")
_log_once: set[str] = set()


def repack_buffer_types(cpu: Device) -> list[BufferType]:
    """The CPU extra buffer types weights may go to, best first: AMX only where the probe
    process saw it run (said once per process when skipped)."""
    from pyggspec.ggml.amx_probe import amx_usable
    from pyggspec.ggml.repack import extra_buffer_types

    out = []
    for b in extra_buffer_types(cpu):
        if b.name == "AMX":
            ok, why = amx_usable()
            if not ok:
                if "amx" not in _log_once:
                    _log_once.add("amx")
                    print(f"pyggspec: AMX weight buffers not used: {why}", file=sys.stderr)
                continue
        out.append(b)
    return out


def _repack_choice(cpu: Device, types: Sequence[BufferType], key: str,
                   info: TensorInfo) -> BufferType | None:
    """The first extra buffer type ggml can multiply ``info`` from, or None (stays plain)."""
    from pyggspec.ggml.repack import supports_weight

    if not types or info.n_dims not in (2, 3) or _NOT_MATMUL.search(key.split(":")[-1]):
        return None
    for b in types:
        if supports_weight(cpu, b, info.type.id, tuple(info.ne[: info.n_dims])):
            return b
    return None


def _plan_jobs(model: Model, placement: Placement, mtp_placement: Placement | None,
               cpu: Device, rtypes: Sequence[BufferType]
               ) -> tuple[list[_Job], dict[str, str], set[str]]:
    """Every tensor to load (trunk, then a separate MTP file), the aliases, and the devices
    the plans name. With repacking a tied head on the CPU becomes a tensor of its own."""
    def dup(file: ModelFile, p: Placement) -> bool:
        emb = file.tensors.get("token_embd.weight")
        return (p.output_device == CPU and emb is not None
                and _repack_choice(cpu, rtypes, "output.weight", emb) is not None)

    jobs, aliases = _jobs_for(model.trunk, placement, prefix_shared=False,
                              dup_tied=dup(model.trunk, placement))
    plan_devices = set(placement.bytes_by_device)
    if model.mtp_file is not None:
        mp = mtp_placement or default_mtp_placement(model, placement)
        mjobs, maliases = _jobs_for(model.mtp_file, mp, prefix_shared=True,
                                    dup_tied=dup(model.mtp_file, mp))
        clash = {j.key for j in jobs} & {j.key for j in mjobs}
        if clash:
            raise PyggspecError(model.mtp_file.path, f"the MTP file's {min(clash)} is also "
                                "loaded from the trunk's grafted MTP block; plan the trunk with "
                                "include_mtp=False when a separate MTP file is used")
        jobs += mjobs
        aliases.update(maliases)
        plan_devices |= set(mp.bytes_by_device)
    elif mtp_placement is not None:
        raise PyggspecError(model.trunk.path, "mtp_placement given but the model has no "
                            "separate MTP file")
    return jobs, aliases, plan_devices


@dataclass(frozen=True)
class RepackPlan:
    """What repacking will do to a placement: the bytes it adds per device (a tied LM head
    that gets its own re-laid-out copy) and the bytes held in CPU extra buffer types."""

    extra_bytes: dict[str, int]
    repacked_bytes: int
    repacked_tensors: int
    buffer_types: tuple[str, ...]


def plan_repack(model: Model, placement: Placement, mtp_placement: Placement | None = None,
                repack: bool = True) -> RepackPlan:
    """Predict :func:`load_weights`' repacking without reading a byte (``pyggspec
    inspect``): ggml is asked per tensor, as when loading."""
    from pyggspec.ggml.device import cpu_device

    cpu = cpu_device()
    rtypes = repack_buffer_types(cpu) if repack else []
    if model.mtp_file is not None and mtp_placement is None:
        mtp_placement = default_mtp_placement(model, placement)
    jobs, _, _ = _plan_jobs(model, placement, mtp_placement, cpu, rtypes)
    # what the plans count already; the rest is the tied heads' own copies
    extra = {d: -n for d, n in sum_bytes(placement, *([mtp_placement] if mtp_placement
                                                      else [])).items()}
    n_rep = n_bytes = 0
    for j in jobs:
        extra[j.device] = extra.get(j.device, 0) + j.info.nbytes
        if rtypes and j.device == CPU and _repack_choice(cpu, rtypes, j.key, j.info):
            n_rep += 1
            n_bytes += j.info.nbytes
    return RepackPlan({d: n for d, n in extra.items() if n}, n_bytes, n_rep,
                      tuple(b.name for b in rtypes))


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
    from pyggspec.ggml import _lib
    from pyggspec.ggml.buffer import USAGE_WEIGHTS, Buffer
    from pyggspec.ggml.context import Context
    from pyggspec.ggml.repack import alloc_for_context

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

    lib, ffi = _lib.lib, _lib.ffi
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
            ptr = alloc_for_context(ctx, by_name[where])
            if ptr is None:
                raise DeviceError(cpu.name, f"could not allocate the {where} weight buffer "
                                  "(try --no-repack)")
            buf = Buffer(ptr, cpu, f"weights repacked ({where})")
            w.buffers.append(buf)
            lib.ggml_backend_buffer_set_usage(ptr, USAGE_WEIGHTS)
            to_copy += [(j, t) for j, _, t in made]
            w._repacked.update({j.key: where for j, _, _ in made})
        else:
            assert cpu is not None
            dev = cpu
            starts = [_addr(v) for _, v, _ in made if v is not None]
            lo = min(starts) // TENSOR_ALIGNMENT * TENSOR_ALIGNMENT  # stays inside the mapping
            hi = max(s + j.info.nbytes for s, (j, _, _) in zip(starts, made, strict=True))
            biggest = max(j.info.nbytes for j, _, _ in made)
            ptr = lib.ggml_backend_dev_buffer_from_host_ptr(cpu.ptr, ffi.cast("void *", lo),
                                                           hi - lo, biggest)
            if ptr == ffi.NULL:
                raise DeviceError(cpu.name, f"could not wrap the mapping of {where} in a buffer")
            buf = Buffer(ptr, cpu, f"weights mapped from {os.path.basename(where)}")
            w.buffers.append(buf)
            lib.ggml_backend_buffer_set_usage(ptr, USAGE_WEIGHTS)
            for (j, view, t), start in zip(made, starts, strict=True):
                st = lib.ggml_backend_tensor_alloc(ptr, t.ptr, ffi.cast("void *", start))
                if st != lib.GGML_STATUS_SUCCESS:
                    raise DeviceError(cpu.name, f"could not place '{j.key}' in the mapping "
                                      f"(ggml status {int(st)})")
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
