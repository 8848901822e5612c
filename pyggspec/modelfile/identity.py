"""What a saved slot state records about the model it came from (and checks on restore).

A slot's KV rows and recurrent state are only meaningful in the model that computed them:
restoring them into another (or the same shapes with other weights) would generate from
garbage without any error. So a slot file carries the model's identity -- arch, widths,
layer count, vocabulary size and :meth:`GGUFFile.fingerprint` of the file -- for the trunk
and for the file the MTP head comes from, and a restore compares them first
(:meth:`pyggspec.memory.slots.SlotMemory.import_state`).
"""

from __future__ import annotations

from typing import Any

from pyggspec.modelfile.model import Model, ModelFile


def file_identity(f: ModelFile) -> dict[str, Any]:
    """The compared facts of one GGUF (``file``, its name, only names it in messages)."""
    hp = f.hparams
    return {"arch": hp.arch, "n_vocab": f.n_vocab, "n_embd": hp.n_embd,
            "n_layer": hp.n_layer, "fingerprint": f.gguf.fingerprint(), "file": f.path.name}


def model_identity(model: Model) -> dict[str, Any]:
    """``{"trunk": ..., "mtp": ... | None}``: the trunk's identity and that of the file
    holding the MTP head (the trunk itself when grafted; None without a head)."""
    owner = model.mtp_owner
    return {"trunk": file_identity(model.trunk),
            "mtp": file_identity(owner) if owner is not None else None}
