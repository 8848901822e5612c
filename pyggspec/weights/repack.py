"""Weight repacking: which CPU weights go to the CPU backend's extra buffer types (re-laid
out for its GEMV/GEMM kernels), asked of ggml per tensor, and the prediction of what that
adds (:func:`plan_repack`, for ``pyggspec inspect``) without reading a byte.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyggspec.errors import PyggspecError
from pyggspec.modelfile import Model, ModelFile, TensorInfo
from pyggspec.weights.placement import (
    CPU,
    Placement,
    _Job,
    _jobs_for,
    default_mtp_placement,
    sum_bytes,
)

if TYPE_CHECKING:
    from pyggspec.ggml.device import Device
    from pyggspec.ggml.repack import BufferType

# weights read by something other than a matrix multiply: never re-laid out
_NOT_MATMUL = re.compile(r"(^|\.)(token_embd|embed_tokens|ssm_conv1d)\.weight$")
_log_once: set[str] = set()


def repack_buffer_types(cpu: Device) -> list[BufferType]:
    """The CPU extra buffer types weights may go to, best first: AMX only where the probe
    process saw it run (said once per host, when the probe finds it unusable: every later
    run reads the same verdict, and a notice on each would only be noise)."""
    from pyggspec.ggml.amx_probe import amx_usable, cached_verdict
    from pyggspec.ggml.repack import extra_buffer_types

    out = []
    for b in extra_buffer_types(cpu):
        if b.name == "AMX":
            known = cached_verdict() is not None
            ok, why = amx_usable()
            if not ok:
                if not known and "amx" not in _log_once:
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
