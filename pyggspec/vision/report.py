"""``pyggspec inspect MODEL --mmproj FILE``: the projector's part of the report and of the
memory plan.

Why libmtmd is opened here at all: the weights' size is in the GGUF, but the encoder's compute
buffer is sized by libmtmd's own warmup (a reservation for its largest image: 4096 merged
tokens for this projector, 46x46 for the warmup graph) and reported only in its log. So the
projector is loaded once (its weights are read; for a released f16 mmproj, under a GiB) and
that number is taken as libmtmd gives it, with its precision (MiB, two decimals).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pyggspec.vision.projector import Projector, read_projector_info


def projector_report(mmproj: str | os.PathLike[str], model: str | os.PathLike[str], *,
                     offload: bool = True, n_threads: int | None = None) -> dict[str, Any]:
    """The projector's facts and memory as a JSON-ready dict (errors: ``PyggspecError``)."""
    info = read_projector_info(mmproj)
    with Projector(mmproj, model, offload=offload, n_threads=n_threads) as p:
        compute = dict(p.compute_buffers)
    # libmtmd puts the weights where it puts the encoder: the first GPU device when offload
    # is on and one exists (its compute buffer is then not the CPU's), else the CPU
    gpu = [b for b in compute if b != "CPU"]
    weights_dev = gpu[0] if offload and gpu else "CPU"
    return {
        "file": str(Path(mmproj)),
        "projector_type": info.projector_type,
        "n_embd": info.n_embd,
        "matches_model": True,  # Projector() refuses one that does not
        "vision": {"n_embd": info.n_embd_vision, "n_layer": info.n_layer,
                   "n_head": info.n_head, "n_ff": info.n_ff, "patch_size": info.patch_size,
                   "n_merge": info.n_merge, "image_size": info.image_size,
                   "n_deepstack": info.n_deepstack},
        "image_min_tokens": info.image_min_tokens,
        "image_max_tokens": info.image_max_tokens,
        "n_tensors": info.n_tensors,
        "tensor_types": info.tensor_types,
        "file_bytes": info.file_size,
        "offload": offload,
        "weights": {weights_dev: info.weights_bytes},
        "compute": compute,
        "compute_source": "libmtmd's warmup reservation, as its log reports it",
    }


def add_projector(report: dict[str, Any], mmproj: str | os.PathLike[str],
                  model: str | os.PathLike[str], *, offload: bool = True) -> None:
    """Put ``projector_report`` into ``report`` and its bytes into the memory plan."""
    pr = projector_report(mmproj, model, offload=offload)
    report["mmproj"] = pr
    mem = report["memory"]
    mem["mmproj"] = dict(pr["weights"])
    mem["mmproj_compute"] = dict(pr["compute"])
    by_dev = mem.setdefault("by_device", {})
    for part in (pr["weights"], pr["compute"]):
        for dev, n in part.items():
            by_dev[dev] = by_dev.get(dev, 0) + n
            mem["total_bytes"] = mem.get("total_bytes", 0) + n
