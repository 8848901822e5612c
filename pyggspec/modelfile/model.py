"""``ModelFile`` (one GGUF, checked) and ``Model`` (a trunk plus where its MTP head lives)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from pyggspec.errors import ModelFileError
from pyggspec.modelfile.gguf import GGUFFile, TensorInfo, quote_name
from pyggspec.modelfile.hparams import HParams
from pyggspec.modelfile.layout import (
    ValidationReport,
    check_tensors,
    expected_tensors,
    hparams_errors,
)
from pyggspec.modelfile.vocab import TokenizerInfo

if TYPE_CHECKING:  # typing.Self is 3.11+
    from typing_extensions import Self

MtpStatus = Literal["grafted", "mtp-only", "none", "missing"]


@dataclass(frozen=True)
class MtpInfo:
    """Where a file's MTP (NextN) block is, following llama.cpp's detection.

    ``status``: "grafted" (trunk + block ``n_layer`` in one file), "mtp-only" (a sidecar:
    ``nextn_predict_layers > 0`` and no ``blk.0.attn_norm.weight``), "none"
    (``nextn_predict_layers == 0``) or "missing" (declared but none of its tensors present).
    """

    status: MtpStatus
    block: int | None
    nextn_tensors: tuple[str, ...]  # blk.N.nextn.* present
    block_tensors: tuple[str, ...]  # every blk.N.* present
    own_embedding: bool  # blk.N.nextn.embed_tokens present (else token_embd is used)
    own_head: bool  # blk.N.nextn.shared_head_head present (else output / tied token_embd)
    own_head_norm: bool  # blk.N.nextn.shared_head_norm present (else output_norm)

    @property
    def usable(self) -> bool:
        return self.status in ("grafted", "mtp-only")

    def to_dict(self) -> dict:
        return {
            "status": self.status, "block": self.block, "tensors": list(self.nextn_tensors),
            "n_block_tensors": len(self.block_tensors),
            "shared_embedding": not self.own_embedding, "shared_head": not self.own_head,
            "shared_head_norm": not self.own_head_norm,
        }


def detect_mtp(hp: HParams, tensors: Mapping[str, TensorInfo]) -> MtpInfo:
    """llama.cpp's rule: MTP-only iff nextn > 0 and ``blk.0.attn_norm.weight`` is absent."""
    if hp.n_layer_nextn == 0:
        return MtpInfo("none", None, (), (), False, False, False)
    n = hp.n_layer
    prefix = f"blk.{n}."
    block = tuple(name for name in tensors if name.startswith(prefix))
    nextn = tuple(name for name in block if name.startswith(prefix + "nextn."))
    status: MtpStatus
    if "blk.0.attn_norm.weight" not in tensors:
        status = "mtp-only"
    elif block:
        status = "grafted"
    else:
        status = "missing"
    return MtpInfo(
        status, n, nextn, block,
        own_embedding=f"{prefix}nextn.embed_tokens.weight" in tensors,
        own_head=f"{prefix}nextn.shared_head_head.weight" in tensors,
        own_head_norm=f"{prefix}nextn.shared_head_norm.weight" in tensors,
    )


class ModelFile:
    """One memory-mapped GGUF with checked hparams, tensor index, tokenizer and MTP location.

    Opening parses only the header; tensor bytes are read by whoever uploads them, through
    :meth:`tensor_data` (a zero-copy view of the mapping).
    """

    def __init__(self, gguf: GGUFFile, hparams: HParams, tokenizer: TokenizerInfo) -> None:
        self.gguf = gguf
        self.path: Path = gguf.path
        self.hparams = hparams
        self.tokenizer = tokenizer
        self.tensors: Mapping[str, TensorInfo] = gguf.tensors
        self.mtp = detect_mtp(hparams, gguf.tensors)
        self._report: ValidationReport | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, validate: bool = True) -> ModelFile:
        """Open ``path``; with ``validate`` every tensor is checked (ModelFileError on failure)."""
        f = GGUFFile(path)
        try:
            mf = cls(f, HParams.from_gguf(f), TokenizerInfo.from_gguf(f))
            if validate:
                mf.validate()
        except BaseException:
            f.close()
            raise
        return mf

    # -- facts -----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.tokenizer.n_tokens

    @property
    def name(self) -> str | None:
        v = self.gguf.get("general.name")
        return None if v is None else str(v)

    @property
    def has_trunk(self) -> bool:
        return self.mtp.status != "mtp-only"

    @property
    def tied_output(self) -> bool:
        """No ``output.weight``: the LM head is ``token_embd`` (llama.cpp TENSOR_DUPLICATED)."""
        return "output.weight" not in self.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_by_type(self) -> dict[str, int]:
        """Tensor bytes per ggml type name, largest first."""
        c: Counter[str] = Counter()
        for t in self.tensors.values():
            c[t.type.name] += t.nbytes
        return dict(c.most_common())

    def tensor_data(self, name: str) -> np.ndarray:
        """Raw bytes of tensor ``name`` as a zero-copy uint8 view of the file mapping."""
        if name not in self.tensors:
            raise ModelFileError(self.path, f"no tensor '{name}' in this file")
        return self.gguf.tensor_data(name)

    # -- validation ------------------------------------------------------------------------
    @property
    def report(self) -> ValidationReport:
        if self._report is None:
            self._report = self._check()
        return self._report

    def validate(self) -> ValidationReport:
        """Check every tensor against the hparams; raise ModelFileError on the first problem."""
        r = self.report
        if r.errors:
            more = f" (and {len(r.errors) - 1} more problems)" if len(r.errors) > 1 else ""
            raise ModelFileError(self.path, r.errors[0] + more)
        return r

    def _check(self) -> ValidationReport:
        hp, t = self.hparams, self.tensors
        errors: list[str] = hparams_errors(hp)
        warnings: list[str] = []
        emb = t.get("token_embd.weight")
        if emb is not None and emb.ne[1] != self.n_vocab:
            errors.append(f"vocabulary mismatch: tokenizer has {self.n_vocab} tokens but "
                          f"token_embd.weight has {emb.ne[1]} rows")
        if self.mtp.status == "missing":
            warnings.append(
                f"{hp.arch}.nextn_predict_layers = {hp.n_layer_nextn} but block {hp.n_layer} "
                "has no tensors: treated as a trunk-only model without MTP "
                "(llama.cpp refuses this file)")
        specs = expected_tensors(hp, self.n_vocab, t, mtp_only=self.mtp.status == "mtp-only",
                                 include_mtp=self.mtp.status != "missing")
        errs, unused = check_tensors(specs, t)
        errors.extend(errs)
        if unused:
            shown = ", ".join(quote_name(n) for n in unused[:5]) + (
                ", ..." if len(unused) > 5 else "")
            warnings.append(f"{len(unused)} tensor(s) not used by {hp.arch}: {shown} "
                            "(llama.cpp refuses files with unused tensors)")
        return ValidationReport(tuple(errors), tuple(warnings), tuple(unused), tuple(specs))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ModelFile({str(self.path)!r}, arch={self.hparams.arch}, "
                f"n_layer={self.hparams.n_layer}, mtp={self.mtp.status})")


@dataclass(frozen=True)
class Model:
    """A runnable model: the trunk file and, if separate, the MTP sidecar file."""

    trunk: ModelFile
    mtp_file: ModelFile | None = None

    @property
    def hparams(self) -> HParams:
        return self.trunk.hparams

    @property
    def mtp_source(self) -> Literal["grafted", "separate"] | None:
        """Which file the MTP head is taken from (a sidecar wins over a grafted block)."""
        if self.mtp_file is not None:
            return "separate"
        return "grafted" if self.trunk.mtp.status == "grafted" else None

    @property
    def mtp_owner(self) -> ModelFile | None:
        """The file whose ``blk.N.*`` tensors form the MTP head, if any."""
        if self.mtp_file is not None:
            return self.mtp_file
        return self.trunk if self.trunk.mtp.status == "grafted" else None

    @property
    def files(self) -> tuple[ModelFile, ...]:
        return (self.trunk,) if self.mtp_file is None else (self.trunk, self.mtp_file)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MtpOnlyFileError(ModelFileError):
    """A model file was asked for but this one holds only an MTP head (``inspect`` describes
    it instead; ``run`` needs the trunk)."""


def open_model(trunk_path: str | os.PathLike, mtp_path: str | os.PathLike | None = None
               ) -> Model:
    """Open a model file and optionally its MTP sidecar, checking that they belong together."""
    trunk = ModelFile.open(trunk_path)
    try:
        if trunk.mtp.status == "mtp-only":
            raise MtpOnlyFileError(
                trunk.path, "is an MTP-only file (no trunk layers); pass it as the MTP file "
                "(--mtp) next to the full model")
        if mtp_path is None:
            return Model(trunk)
        mtp = ModelFile.open(mtp_path)
    except BaseException:
        trunk.close()
        raise
    try:
        check_mtp_sidecar(trunk, mtp)
    except BaseException:
        trunk.close()
        mtp.close()
        raise
    return Model(trunk, mtp)


# What a trunk and an MTP-only file must agree on, in the order they are checked. The head
# reads the trunk's hidden state (n_embd wide, of the last trunk layer: its block index is the
# trunk's n_layer), drafts token ids the trunk verifies (same vocabulary), and shares the
# trunk's attention shapes in llama.cpp's MTP context.
PAIR_KEYS = ("arch", "n_embd", "n_embd_out", "n_vocab", "tokens_sha256", "n_layer", "n_head",
             "n_head_kv", "head_dim", "n_expert", "tokenizer_model", "tokenizer_pre", "bos_id",
             "eos_id")


def pairing_facts(f: ModelFile) -> dict[str, object]:
    """This file's values of :data:`PAIR_KEYS` (the same for a trunk and its MTP file)."""
    hp, tok = f.hparams, f.tokenizer
    facts: dict[str, object] = {
        "arch": hp.arch, "n_embd": hp.n_embd, "n_embd_out": hp.n_embd_out,
        "n_vocab": f.n_vocab, "tokens_sha256": tok.tokens_sha256, "n_layer": hp.n_layer,
        "n_head": hp.n_head, "n_head_kv": hp.n_head_kv, "head_dim": hp.head_dim,
        "n_expert": hp.n_expert, "tokenizer_model": tok.model, "tokenizer_pre": tok.pre,
        "bos_id": tok.bos_id, "eos_id": tok.eos_id,
    }
    return {k: facts[k] for k in PAIR_KEYS}


def pair_mismatches(trunk: ModelFile, mtp: ModelFile) -> list[tuple[str, object, object]]:
    """Every ``(key, value in mtp, value in trunk)`` that differs between the two files."""
    a, b = pairing_facts(trunk), pairing_facts(mtp)
    return [(k, b[k], a[k]) for k in PAIR_KEYS if a[k] != b[k]]


def check_mtp_sidecar(trunk: ModelFile, mtp: ModelFile) -> None:
    """Raise ModelFileError naming ``mtp`` unless it is an MTP-only file for ``trunk``."""
    hm = mtp.hparams
    if hm.n_layer_nextn == 0:
        raise ModelFileError(mtp.path, "not an MTP file (nextn_predict_layers = 0)")
    if mtp.mtp.status == "grafted":
        raise ModelFileError(
            mtp.path, f"not an MTP-only file: it also holds the {hm.n_layer} trunk layers "
            "(a grafted model); use it as the model file instead")
    if mtp.mtp.status == "missing":
        raise ModelFileError(mtp.path, f"not an MTP file: nextn_predict_layers = "
                             f"{hm.n_layer_nextn} but it holds no MTP tensors")
    for what, b, a in pair_mismatches(trunk, mtp)[:1]:
        raise ModelFileError(
            mtp.path, f"MTP file does not belong to {trunk.path.name}: {what} {fmt_fact(b)} "
            f"here vs {fmt_fact(a)} in the model")


def fmt_fact(x: object) -> str:
    """A pairing value for messages: sha256 digests shortened, None as '-'."""
    if x is None:
        return "-"
    if isinstance(x, str) and len(x) == 64:
        return x[:12]
    return str(x)
