"""gpu_check's benchmark models: the shapes, their files, and the agreement kept per file.

Shapes (text model only; random weights with the constructed-agreement MTP head, DESIGN §5):

* ``0.8b``, ``9b``, ``tiny``: the shapes of rows 50-54 (Q8_0, one file per agreement).
* ``27b``: Qwen3.6-27B, dense ``qwen35`` (llama.cpp: 64 trunk layers -> LLM_TYPE_27B,
  ``src/models/qwen35.cpp``). From the Qwen/Qwen3.6-27B model card ("Language Model":
  hidden 5120, 64 layers as 16 x (3 x Gated DeltaNet + 1 x Gated Attention), Gated DeltaNet
  48 V / 16 QK heads of 128, Gated Attention 24 Q / 4 KV heads of 256, rotary dimension 64,
  FFN 17408, vocabulary 248320 padded, MTP trained; mirrored at
  shilu.ai/articles/qwen-hf/qwen-qwen3.6-27b) and the same numbers in THUDM/slime
  ``scripts/models/qwen3.5-27B.sh`` (num-layers 64, hidden 5120, ffn 17408, 24 heads, 4
  query groups, kv-channels 256, rotary-percent 0.25, rotary-base 1e7, untied embeddings,
  vocab 248320, norm eps 1e-6). Context 262144 (model card). mrope_section [11, 11, 10] as
  Qwen3.5 (rotary dimension 64 = 2 x 32): not found stated for 3.6, taken from Qwen3.5-0.8B.
* ``35b-a3b``: Qwen3.6-35B-A3B, MoE ``qwen35moe`` (llama.cpp: 40 trunk layers ->
  LLM_TYPE_35B_A3B, ``src/models/qwen35moe.cpp``). From its model card (quoted at
  mera.a-ai.ru/en/industrial/submits/181: hidden 2048, 40 layers as 10 x (3 x Gated
  DeltaNet -> MoE + 1 x Gated Attention -> MoE), Gated DeltaNet 32 V / 16 QK heads of 128,
  Gated Attention 16 Q / 2 KV heads of 256, rotary dimension 64, 256 experts, 8 routed + 1
  shared, expert intermediate 512, vocabulary 248320 padded) and THUDM/slime
  ``scripts/models/qwen3.5-35B-A3B.sh``, which ``qwen36-35B-A3B.sh`` sources ("the same
  language/MoE topology"): moe-ffn 512, shared expert 512 with its gate, top-8 of 256,
  linear heads 16 K / 32 V of 128, conv kernel 4, rotary 0.25 of 256, base 1e7, eps 1e-6.
* ``tiny-dense``, ``tiny-moe``: stand-ins for ``27b`` / ``35b-a3b`` off a GPU (n_embd 256,
  8 layers, 1024-token vocabulary), written and run exactly as those are: shared trunk
  layers, the same quantization type, one file per shape whose MTP head is rewritten for
  each agreement.

The large shapes (and their stand-ins) are written with ``shared_layers`` (each trunk layer
of a kind repeats the first one's weights, at its own offset: the GPU still reads every
layer's bytes) in a 4-bit type (``q4_k`` by default: every 2-D weight Q4_K, rows that do not
split into 256-blocks Q8_0; not llama-quantize's Q4_K_M mix, which keeps some tensors in
Q6_K), one file per shape: the agreements differ only in the MTP head's ``eh_proj``
(``AgreementPlan.fc``; the LM head and everything else do not depend on the agreement), so
:func:`model_path` rewrites that one tensor in place to move a file to another agreement.
Both shapes at Q4_K are ~35 GiB, inside the device's 64 GiB disk beside the builds, where
two agreements each (or Q8_0: ~62 GiB) would not fit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/: benchlib
sys.path.insert(0, str(HERE.parent.parent))  # the repo root: pyggspec

import benchlib

# Qwen3.5-9B text dimensions (Qwen/Qwen3.5-9B config.json: hidden 4096, 32 layers, FFN
# 12288, 16 Q / 4 KV heads of 256, Gated DeltaNet 16 QK / 32 V heads of 128, vocabulary
# 248,320); the rest as the 0.8B preset. The LM head is untied (constructed agreement).
NINE_B = {"name": "pyggspec-qwen35-9b-shape", "n_embd": 4096, "n_layer": 32, "n_head": 16,
          "n_head_kv": 4, "head_dim": 256, "n_ff": 12288, "d_state": 128, "n_group": 16,
          "dt_rank": 32}
# Qwen3.6-27B (see the module docstring for the sources)
QWEN36_27B = {"arch": "qwen35", "name": "pyggspec-qwen36-27b-shape", "n_embd": 5120,
              "n_layer": 64, "n_head": 24, "n_head_kv": 4, "head_dim": 256, "n_ff": 17408,
              "d_conv": 4, "d_state": 128, "n_group": 16, "dt_rank": 48}
# Qwen3.6-35B-A3B (see the module docstring for the sources); n_ff 0: the converter writes
# no feed_forward_length for Qwen3.5/3.6 MoE configs (no intermediate_size)
QWEN36_35B_A3B = {"arch": "qwen35moe", "name": "pyggspec-qwen36-35b-a3b-shape",
                  "n_embd": 2048, "n_layer": 40, "n_head": 16, "n_head_kv": 2,
                  "head_dim": 256, "n_ff": 0, "n_expert": 256, "n_expert_used": 8,
                  "n_ff_exp": 512, "n_ff_shexp": 512, "d_conv": 4, "d_state": 128,
                  "n_group": 16, "dt_rank": 32}
# the off-GPU stand-ins: the tiny presets widened to 256 (Q4_K's 256-blocks fit the rows of
# the embeddings, FFN and projections in), 8 layers (two of each kind shared), 1024 tokens
TINY_DENSE = {"name": "pyggspec-tiny-dense-standin", "n_embd": 256, "n_layer": 8,
              "n_ff": 512}
TINY_MOE = {"name": "pyggspec-tiny-moe-standin", "n_embd": 256, "n_layer": 8,
            "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256, "n_ff_shexp": 256}

# label in the table; the 4-bit shapes' labels get their type appended
LABELS = {"tiny": "tiny", "0.8b": "0.8B", "9b": "9B", "tiny-dense": "tiny-dense",
          "tiny-moe": "tiny-MoE", "27b": "27B", "35b-a3b": "35B-A3B"}
BIG = ("27b", "35b-a3b", "tiny-dense", "tiny-moe")  # one file per shape, patched per agreement
STANDIN = {"27b": "tiny-dense", "35b-a3b": "tiny-moe"}
QUANTS = ("q4_k", "q4_0", "q8_0")


def model_spec(shape: str, agreement: float, quant: str = "q4_k"):
    from pyggspec.testing import qwen35_0_8b, tiny_dense, tiny_moe

    if shape == "tiny":
        return tiny_dense(dtype="q8_0", agreement=agreement)
    if shape in ("0.8b", "9b"):
        return qwen35_0_8b(dtype="q8_0", agreement=agreement, **(NINE_B if shape == "9b" else {}))
    if shape == "tiny-dense":
        return tiny_dense(dtype=quant, agreement=agreement, shared_layers=True, **TINY_DENSE)
    if shape == "tiny-moe":
        return tiny_moe(dtype=quant, agreement=agreement, shared_layers=True, **TINY_MOE)
    extra = {"27b": QWEN36_27B, "35b-a3b": QWEN36_35B_A3B}[shape]
    return qwen35_0_8b(dtype=quant, agreement=agreement, shared_layers=True,
                       tied_embeddings=False, **extra)


def model_label(shape: str, agreement: float, quant: str = "q4_k") -> str:
    q = "Q8_0" if shape not in BIG else quant.upper()
    return f"{LABELS[shape]} a{agreement:.2f} {q}"


def eh_proj_name(spec) -> str:
    return f"blk.{spec.n_layer}.nextn.eh_proj.weight"


def _state_file(path: Path) -> Path:
    return path.with_name(path.name + ".agreement.json")


def model_path(shape: str, agreement: float, quant: str = "q4_k",
               log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Path:
    """The file of ``shape`` holding ``agreement``'s MTP head: written once (benchlib.CACHE);
    for the :data:`BIG` shapes one file per shape and type, its ``eh_proj`` rewritten in
    place when another agreement is asked for (no engine may have it open then)."""
    from pyggspec.testing import cached_model, write_model

    spec = model_spec(shape, agreement, quant)
    if shape not in BIG:
        return cached_model(spec, benchlib.CACHE)
    base = spec.replace(agreement=0.95)  # names the file whatever its head holds now
    path = benchlib.CACHE / f"gpu_check-{base.digest()}" / f"{spec.model_name}-{quant.upper()}.gguf"
    state = _state_file(path)
    want = {"agreement": agreement, "digest": spec.digest()}
    if path.exists() and state.exists():
        got = json.loads(state.read_text())
        if got == want:
            return path
        if got.get("agreement") is not None:  # another agreement's head: rewrite it
            t0 = time.monotonic()
            state.write_text(json.dumps({"agreement": None, "patching": want}))
            patch_agreement(path, spec)
            state.write_text(json.dumps(want))
            log(f"[models] {model_label(shape, agreement, quant)}: eh_proj rewritten in "
                f"{path.name} ({time.monotonic() - t0:.1f}s)")
            return path
    # none yet, or a rewrite that did not finish: write the whole file
    t0 = time.monotonic()
    for old in path.parent.glob("*.tmp"):
        old.unlink()
    write_model(path, spec)
    state.write_text(json.dumps(want))
    log(f"[models] {model_label(shape, agreement, quant)}: wrote {path} "
        f"({path.stat().st_size / 2**30:.2f} GiB, {time.monotonic() - t0:.0f}s)")
    return path


def patch_agreement(path: Path, spec) -> None:
    """Rewrite ``path``'s MTP ``eh_proj`` with ``spec``'s (the only tensor that depends on
    the agreement); its type and size must match."""
    from gguf import GGUFReader

    from pyggspec.testing import plan_tensors

    name = eh_proj_name(spec)
    entry = next(e for e in plan_tensors(spec, "full") if e.name == name)
    r = GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    offset, nbytes = int(t.data_offset), int(t.n_bytes)
    if int(t.tensor_type) != int(entry.qtype):
        raise RuntimeError(f"{path}: {name} is {t.tensor_type.name}, the spec makes "
                           f"{entry.qtype.name}")
    del r, t
    data = entry.data().tobytes()
    if len(data) != nbytes:
        raise RuntimeError(f"{path}: {name} holds {nbytes} bytes, the spec makes {len(data)}")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def file_bytes(shape: str, quant: str = "q4_k") -> int:
    """The file size a shape's model will have (from the tensor plan; nothing written)."""
    from gguf import quants

    from pyggspec.testing import plan_tensors

    spec = model_spec(shape, 0.95, quant).replace(agreement=None, tied_embeddings=False)
    total = 0
    for e in plan_tensors(spec, "full"):
        n = 1
        for d in e.shape:
            n *= d
        bs, ts = quants.GGML_QUANT_SIZES[e.qtype]
        total += n // bs * ts
    return total
