"""What the served model file says about itself, in llama-server's terms.

``GET /v1/models`` (``meta``) and ``GET /props`` (``model_ftype``) report the model's size,
parameter count, file type and vocabulary kind the way llama-server computes them
(``llama_model_size``, ``llama_model_n_params``, ``llama_ftype_name``, ``llama_vocab_type``),
so UIs that read those fields (model pickers showing "4B Q4_K - Medium") show the same
thing for ``pyggspec serve``. Everything comes from the trunk GGUF's header: no tensor data
is read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

# llama.h's enum llama_ftype -> llama_ftype_name() (src/llama-model-loader.cpp)
FTYPE_NAMES: dict[int, str] = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium",
    18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw", 32: "BF16", 36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}
FTYPE_GUESSED = 1024  # LLAMA_FTYPE_GUESSED: general.file_type absent, guessed from tensors

# llama.cpp's guess when general.file_type is absent: the ggml type most tensors have
_GUESS_FROM_TYPE: dict[str, int] = {
    "F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
    "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "TQ1_0": 36, "TQ2_0": 37,
    "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31,
    "IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26, "NVFP4": 39, "Q1_0": 40, "Q2_0": 41,
}

# tokenizer.ggml.model -> llama.h's enum llama_vocab_type
VOCAB_TYPES: dict[str, int] = {"no_vocab": 0, "none": 0, "llama": 1, "gpt2": 2, "bert": 3,
                               "t5": 4, "rwkv": 5, "plamo2": 6}


def ftype_name(file_type: int | None, tensor_types: list[str]) -> str:
    """``llama_ftype_name(llama_model_ftype(model))``: the file's ``general.file_type``, or
    when absent llama.cpp's guess from the most common tensor type, marked "(guessed)"."""
    if file_type is None:
        counts = Counter(tensor_types)
        most = max(counts, key=lambda t: counts[t]) if counts else "F32"
        code = _GUESS_FROM_TYPE.get(most.upper(), 0)  # ggml names: "q4_K", "f32"
        return "(guessed) " + FTYPE_NAMES[code]
    return FTYPE_NAMES.get(int(file_type) & ~FTYPE_GUESSED, "unknown, may not work")


@dataclass(frozen=True)
class ModelInfo:
    """llama-server's model metadata (``server_context_meta``) for one model file."""

    vocab_type: int
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size: int  # bytes of all tensors
    ftype: str

    @classmethod
    def of(cls, engine: Any) -> ModelInfo:
        """From an engine's trunk model file (its header only)."""
        trunk = engine.model.trunk
        tensors = list(trunk.tensors.values())
        file_type = trunk.gguf.get("general.file_type")
        return cls(
            vocab_type=VOCAB_TYPES.get(str(trunk.tokenizer.model), 0),
            n_vocab=int(engine.n_vocab),
            n_ctx_train=int(engine.hp.n_ctx_train or 0),
            n_embd=int(engine.hp.n_embd),
            n_params=sum(int(t.n_elements) for t in tensors),
            size=int(trunk.total_bytes),
            ftype=ftype_name(None if file_type is None else int(file_type),
                             [t.type.name for t in tensors]),
        )

    def meta(self, n_ctx: int) -> dict[str, Any]:
        """``/v1/models`` ``data[].meta``, llama-server's fields in its order."""
        return {"vocab_type": self.vocab_type, "n_vocab": self.n_vocab, "n_ctx": n_ctx,
                "n_ctx_train": self.n_ctx_train, "n_embd": self.n_embd,
                "n_params": self.n_params, "size": self.size, "ftype": self.ftype}
