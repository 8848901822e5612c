"""Tokenizer facts straight from GGUF metadata (no llama_cpp needed): what ``inspect`` shows
and what a trunk / MTP pair must agree on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pyggspec.errors import ModelFileError
from pyggspec.modelfile.gguf import GGUFFile, quote_name


@dataclass(frozen=True)
class TokenizerInfo:
    model: str  # tokenizer.ggml.model, e.g. "gpt2" (byte-level BPE)
    pre: str | None  # tokenizer.ggml.pre, e.g. "qwen35"
    n_tokens: int
    n_merges: int
    bos_id: int | None
    bos_token: str | None
    eos_id: int | None
    eos_token: str | None
    pad_id: int | None
    pad_token: str | None
    add_bos: bool | None
    has_chat_template: bool
    # sha256 of the stored token list: two files mean the same ids iff these are equal
    tokens_sha256: str = ""

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> TokenizerInfo:
        tokens = f.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelFileError(f.path, "missing required metadata key 'tokenizer.ggml.tokens'")
        kind = f.metadata["tokenizer.ggml.tokens"].type
        if kind != "array[string]":
            raise ModelFileError(f.path, f"tokenizer.ggml.tokens must be array[string], is {kind}")
        n = len(tokens)
        dup = f.first_duplicate_string("tokenizer.ggml.tokens")
        if dup is not None:
            i, j = dup
            raise ModelFileError(f.path, f"tokenizer.ggml.tokens: tokens {i} and {j} are the "
                                 f"same string {quote_name(tokens[j])} (llama.cpp aborts on a "
                                 "vocabulary with duplicates)")

        def special(key: str) -> tuple[int | None, str | None]:
            v = f.get(f"tokenizer.ggml.{key}")
            if not isinstance(v, int):
                return None, None
            return v, (tokens[v] if 0 <= v < n else None)

        bos, bos_s = special("bos_token_id")
        eos, eos_s = special("eos_token_id")
        pad, pad_s = special("padding_token_id")
        merges = f.get("tokenizer.ggml.merges")
        add_bos = f.get("tokenizer.ggml.add_bos_token")
        return cls(
            model=str(f.get("tokenizer.ggml.model", "?")),
            pre=None if f.get("tokenizer.ggml.pre") is None else str(f.get("tokenizer.ggml.pre")),
            n_tokens=n,
            n_merges=0 if merges is None else len(merges),
            bos_id=bos, bos_token=bos_s, eos_id=eos, eos_token=eos_s, pad_id=pad, pad_token=pad_s,
            add_bos=None if add_bos is None else bool(add_bos),
            has_chat_template=f.get("tokenizer.chat_template") is not None,
            tokens_sha256=hashlib.sha256(f.raw_value("tokenizer.ggml.tokens")).hexdigest(),
        )

    def to_dict(self) -> dict:
        return {
            "model": self.model, "pre": self.pre, "n_tokens": self.n_tokens,
            "n_merges": self.n_merges,
            "bos": {"id": self.bos_id, "token": self.bos_token},
            "eos": {"id": self.eos_id, "token": self.eos_token},
            "pad": {"id": self.pad_id, "token": self.pad_token},
            "add_bos": self.add_bos, "chat_template": self.has_chat_template,
            "tokens_sha256": self.tokens_sha256,
        }
