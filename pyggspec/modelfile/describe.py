"""What ``inspect`` says about an MTP-only GGUF (``convert_hf_to_gguf.py --mtp``).

Such a file holds one MTP (NextN) block, the tensors it shares with the trunk
(``token_embd``, ``output_norm``, ``output``) and the full model's metadata, but no trunk
layers. It cannot run alone, yet it is a valid file: this describes the head and says which
trunk files it pairs with (:data:`~pyggspec.modelfile.model.PAIR_KEYS`), and, given a trunk,
whether that one does.
"""

from __future__ import annotations

from typing import Any

from pyggspec.errors import ModelFileError
from pyggspec.modelfile.estimate import mtp_kv_bytes_per_seq
from pyggspec.modelfile.hparams import HParams
from pyggspec.modelfile.model import ModelFile, pair_mismatches, pairing_facts


def hparams_summary(hp: HParams, n_vocab: int) -> dict:
    """The shape keys every ``inspect`` JSON starts with (trunk and MTP-only alike)."""
    return {
        "arch": hp.arch,
        "model_type": hp.model_type,
        "n_embd": hp.n_embd,
        "n_embd_out": hp.n_embd_out,
        "n_vocab": n_vocab,
        "n_ctx_train": hp.n_ctx_train,
        "n_layer": hp.n_layer,
        "n_layer_nextn": hp.n_layer_nextn,
        "n_layer_all": hp.n_layer_all,
        "n_head": hp.n_head,
        "n_head_kv": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "n_rot": hp.n_rot,
        "rope": {"freq_base": hp.rope_freq_base, "sections": list(hp.rope_sections),
                 "scaling": hp.rope_scaling_type, "freq_scale": hp.rope_freq_scale},
        "rms_eps": hp.rms_eps,
        "n_ff": hp.n_ff,
    }

def describe_mtp_only(mf: ModelFile, trunk: ModelFile | None = None, *, n_ctx: int = 4096,
                      n_parallel: int = 1, type_k: str = "f16", type_v: str = "f16"
                      ) -> dict[str, Any]:
    """A JSON-ready description of the MTP-only file ``mf`` (and its pairing with ``trunk``)."""
    hp, info = mf.hparams, mf.mtp
    if info.status != "mtp-only":
        raise ValueError(f"{mf.path} is not an MTP-only file (MTP status {info.status})")

    def row(name: str) -> dict[str, Any]:
        t = mf.tensors[name]
        return {"name": name, "type": t.type_name, "ne": list(t.shape), "bytes": t.nbytes}

    block = set(info.block_tensors)
    mtp = info.to_dict()
    mtp.update(
        source="separate", file=str(mf.path),
        head_tensors=[row(n) for n in mf.tensors if n in block],
        shared_tensors=[row(n) for n in mf.tensors if n not in block],
        head_bytes=sum(mf.tensors[n].nbytes for n in block),
        pairs_with=pairing_facts(mf),
        pair=None if trunk is None else _pair(mf, trunk),
    )
    warnings = [f"{mf.path.name}: {w}" for w in mf.report.warnings]
    if trunk is not None and trunk.mtp.status == "grafted":
        warnings.append(f"{trunk.path.name}: has its own grafted MTP block; paired with "
                        f"{mf.path.name}, that block is ignored")
    kv = mtp_kv_bytes_per_seq(hp, n_ctx, type_k, type_v)
    return {
        "file": str(mf.path),
        "files": [{"path": str(mf.path), "bytes": mf.total_bytes, "n_tensors": len(mf.tensors),
                   "gguf_version": mf.gguf.version}],
        "name": mf.name,
        **hparams_summary(hp, mf.n_vocab),
        "moe": ({"n_expert": hp.n_expert, "n_expert_used": hp.n_expert_used,
                 "n_ff_exp": hp.n_ff_exp, "n_ff_shexp": hp.n_ff_shexp} if hp.is_moe else None),
        "mtp": mtp,
        "tied_output": mf.tied_output,
        "tensor_types": mf.bytes_by_type(),
        "n_tensors": len(mf.tensors),
        "total_bytes": mf.total_bytes,
        "tokenizer": mf.tokenizer.to_dict(),
        "memory": {"n_ctx": n_ctx, "n_parallel": n_parallel, "type_k": type_k,
                   "type_v": type_v, "weights_total": mf.total_bytes,
                   "mtp_kv_per_seq": kv, "mtp_kv_total": kv * n_parallel},
        "warnings": warnings,
    }


def _pair(mf: ModelFile, trunk: ModelFile) -> dict[str, Any]:
    if not trunk.has_trunk:
        raise ModelFileError(trunk.path, "is an MTP-only file too, not a trunk model")
    mism = pair_mismatches(trunk, mf)
    return {
        "trunk": str(trunk.path),
        "trunk_mtp": trunk.mtp.status,
        "ok": not mism,
        "mismatches": [{"key": k, "here": b, "trunk": a} for k, b, a in mism],
    }
