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

The plan's tensor list (:func:`_jobs_for`: one entry per tensor to create, under the key
:class:`~pyggspec.weights.store.Weights` knows it by) is made here too; uploading it is
:mod:`pyggspec.weights.load`'s job.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pyggspec.errors import DeviceError, PyggspecError
from pyggspec.modelfile import Model, ModelFile, TensorInfo

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

    (Unset / "auto" also lets ``--fit`` choose the count: :mod:`pyggspec.memory.autofit`.)
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


def n_cpu_moe_patterns(n: int) -> list[tuple[str, str]]:
    """``-ncmoe N``: the ``-ot`` patterns llama.cpp adds, keeping the MoE expert weights of
    blocks 0..N-1 on the CPU."""
    return [(f"blk\\.{i}\\.ffn_(up|down|gate|gate_up)_(ch|)exps", CPU) for i in range(n)]


@dataclass(frozen=True)
class LayerWeights:
    """A file's weight bytes by what a fit can move: per block the weights that move with
    the layer (``-ngl``) and its MoE expert weights (``-ncmoe``), the output layer, and the
    tensors the user's ``-ot`` patterns pin to a device (which no fit moves)."""

    dense: tuple[int, ...]
    experts: tuple[int, ...]
    output: int  # output.weight / output_norm (a tied head: the copy on the output device)
    pinned: Mapping[str, int]  # device -> bytes of overridden tensors (token_embd: CPU)


def layer_weights(model: ModelFile, placement: Placement) -> LayerWeights:
    """``placement``'s tensors (planned with the user's settings) by block and kind, for
    :mod:`pyggspec.memory.fit`: the same tensors, bytes and override rules as the plan."""
    n = model.hparams.n_layer_all
    dense, experts = [0] * n, [0] * n
    output = 0
    pinned: dict[str, int] = {}
    rx = re.compile(CPU_MOE_REGEX)
    for name, dev in placement.tensor_devices.items():
        nbytes = model.tensors[name].nbytes
        il = _block_of(name)
        if name in placement.overridden or name == "token_embd.weight":
            pinned[dev] = pinned.get(dev, 0) + nbytes
        elif il is None:
            output += nbytes
        elif rx.search(name):
            experts[il] += nbytes
        else:
            dense[il] += nbytes
    if model.tied_output and "token_embd.weight" in placement.tensor_devices:
        output += model.tensors["token_embd.weight"].nbytes
    return LayerWeights(tuple(dense), tuple(experts), output, pinned)


def sum_bytes(*placements: Placement) -> dict[str, int]:
    """Per-device totals over several placements (a trunk file and its MTP sidecar)."""
    out: dict[str, int] = {}
    for p in placements:
        for d, b in p.bytes_by_device.items():
            out[d] = out.get(d, 0) + b
    return out


# ---------------------------------------------------------------------------------------------
# The tensors to create: a plan -> (key, file, tensor, device) per tensor
# ---------------------------------------------------------------------------------------------
#
# Names. Trunk tensors keep their GGUF names. A tied LM head is reachable as ``output.weight``
# (an alias of ``token_embd.weight``, or a second copy on the output device when the plan puts
# the output layer elsewhere: llama.cpp's TENSOR_DUPLICATED). A separate MTP file's ``blk.N.*``
# tensors keep their names; its other tensors (``token_embd``, ``output_norm``, ``output``), which
# share names with the trunk's, are kept as ``mtp:<name>`` (``mtp:output.weight`` is tied the
# same way). :meth:`Weights.get_mtp` picks the MTP file's copy when there is one.

MTP_PREFIX = "mtp:"


@dataclass(frozen=True)
class _Job:
    """One tensor to create: its key in :class:`Weights`, source file and bytes, device."""

    key: str
    file: ModelFile
    info: TensorInfo
    device: str


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
