"""GGUF -> checked model description: hparams, tensor index, MTP location, tokenizer facts.

Pure Python over ``mmap``; no ggml binding needed, so ``pyggspec inspect`` and the tests run
without a backend. Modules: ``gguf`` (lazy reader), ``hparams``, ``layout`` (expected tensors
and the check), ``vocab``, ``model`` (ModelFile / Model / open_model), ``estimate`` (memory).
"""

from pyggspec.modelfile.estimate import (
    MemoryEstimate,
    estimate_memory,
    kv_bytes_per_seq,
    mtp_kv_bytes_per_seq,
    recurrent_bytes_per_seq,
)
from pyggspec.modelfile.gguf import GGML_TYPES, GGMLType, GGUFFile, TensorInfo, ggml_type
from pyggspec.modelfile.hparams import SUPPORTED_ARCHS, HParams
from pyggspec.modelfile.layout import TensorSpec, ValidationReport, expected_tensors
from pyggspec.modelfile.model import (
    PAIR_KEYS,
    Model,
    ModelFile,
    MtpInfo,
    MtpOnlyFileError,
    check_mtp_sidecar,
    detect_mtp,
    open_model,
    pair_mismatches,
    pairing_facts,
)
from pyggspec.modelfile.vocab import TokenizerInfo

__all__ = [
    "GGML_TYPES",
    "PAIR_KEYS",
    "SUPPORTED_ARCHS",
    "GGMLType",
    "GGUFFile",
    "HParams",
    "MemoryEstimate",
    "Model",
    "ModelFile",
    "MtpInfo",
    "MtpOnlyFileError",
    "TensorInfo",
    "TensorSpec",
    "TokenizerInfo",
    "ValidationReport",
    "check_mtp_sidecar",
    "detect_mtp",
    "estimate_memory",
    "expected_tensors",
    "ggml_type",
    "kv_bytes_per_seq",
    "mtp_kv_bytes_per_seq",
    "open_model",
    "pair_mismatches",
    "pairing_facts",
    "recurrent_bytes_per_seq",
]
