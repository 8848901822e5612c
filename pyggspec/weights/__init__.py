"""Model weights: where each tensor goes, and putting it there.

* :mod:`~pyggspec.weights.placement`: the plan (pure Python, llama.cpp's rules): device per
  tensor, bytes per device, and the list of tensors to create under their keys.
* :mod:`~pyggspec.weights.repack`: which CPU weights go to ggml's extra buffer types, and
  the prediction of what that adds (:func:`plan_repack`).
* :mod:`~pyggspec.weights.load`: the upload (:func:`load_weights`), through
  :mod:`pyggspec.ggml` only. Its knobs (``TENSOR_ALIGNMENT``, ``PROGRESS_MIN_BYTES``) are
  read from that module: patch them there, not on this package.
* :mod:`~pyggspec.weights.store`: :class:`Weights`, the loaded tensors by GGUF name.
"""

from pyggspec.weights.load import load_weights
from pyggspec.weights.placement import (
    CPU,
    CPU_MOE_REGEX,
    MTP_PREFIX,
    NGpuLayers,
    Placement,
    default_mtp_placement,
    layer_devices,
    plan_placement,
    resolve_n_gpu_layers,
    select_offload_devices,
    sum_bytes,
)
from pyggspec.weights.repack import RepackPlan, plan_repack, repack_buffer_types
from pyggspec.weights.store import Weights

__all__ = [
    "CPU",
    "CPU_MOE_REGEX",
    "MTP_PREFIX",
    "NGpuLayers",
    "Placement",
    "RepackPlan",
    "Weights",
    "default_mtp_placement",
    "layer_devices",
    "load_weights",
    "plan_placement",
    "plan_repack",
    "repack_buffer_types",
    "resolve_n_gpu_layers",
    "select_offload_devices",
    "sum_bytes",
]
