"""Tiny Qwen3.5 GGUF fixtures, laid out exactly as llama.cpp's converter writes them.

Public API (other modules and tests code against these names)::

    spec = tiny_dense(dtype="q8_0", agreement=0.9)
    path = write_model(tmp / "m.gguf", spec)           # trunk + grafted MTP (or trunk only)
    trunk, mtp = write_split(tmp, spec)                  # --no-mtp file + mtp-*.gguf sidecar
    path = cached_model(spec, cache_dir)                 # written once per spec digest

See ``writer`` for the converter rules followed, ``agreement`` for the constructed-agreement
model and ``oracle`` for llama.cpp (through llama_cpp) as the reference.
"""

from pyggspec.testing.agreement import AgreementPlan, agreement_plan
from pyggspec.testing.spec import GENERATOR_VERSION, ModelSpec, qwen35_0_8b, tiny_dense, tiny_moe
from pyggspec.testing.vocab import Vocab, build_vocab
from pyggspec.testing.writer import cached_model, plan_tensors, write_model, write_split

__all__ = [
    "GENERATOR_VERSION",
    "AgreementPlan",
    "ModelSpec",
    "Vocab",
    "agreement_plan",
    "build_vocab",
    "cached_model",
    "plan_tensors",
    "qwen35_0_8b",
    "tiny_dense",
    "tiny_moe",
    "write_model",
    "write_split",
]
