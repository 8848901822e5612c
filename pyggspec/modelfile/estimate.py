"""Memory arithmetic from hparams alone (pure functions), so ``inspect`` can say what a context
and a number of parallel sequences will cost before anything is allocated.

Formulas follow REFERENCE §2.6: attention layers keep K and V rows of ``n_head_kv * head_dim``
per token (type ``-ctk/-ctv``, default f16); each gated-delta-net layer keeps, per sequence, a
conv state of ``n_embd_r`` and an SSM state of ``n_embd_s`` f32 values, times ``1 + n_snapshots``
when rollback snapshots are kept. The MTP block has its own KV cache (default f16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyggspec.modelfile.gguf import ggml_type
from pyggspec.modelfile.hparams import HParams


def kv_row_bytes(hp: HParams, type_k: str = "f16", type_v: str = "f16") -> int:
    """K + V bytes of one token in one attention layer."""
    tk, tv = ggml_type(type_k), ggml_type(type_v)
    return tk.row_bytes(hp.n_embd_k_gqa) + tv.row_bytes(hp.n_embd_v_gqa)


def kv_bytes_per_seq(hp: HParams, n_ctx: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """Trunk attention KV bytes for one sequence of ``n_ctx`` tokens."""
    return hp.n_attention_layers * n_ctx * kv_row_bytes(hp, type_k, type_v)


def mtp_kv_bytes_per_seq(hp: HParams, n_ctx: int, type_k: str = "f16",
                         type_v: str = "f16") -> int:
    """The MTP context's own KV cache (only the ``n_layer_nextn`` MTP blocks)."""
    return hp.n_layer_nextn * n_ctx * kv_row_bytes(hp, type_k, type_v)


def recurrent_bytes_per_seq(hp: HParams, n_snapshots: int = 0) -> int:
    """Conv + SSM state bytes (f32) for one sequence, with ``n_snapshots`` rollback planes."""
    return hp.n_recurrent_layers * (hp.n_embd_r + hp.n_embd_s) * 4 * (1 + n_snapshots)


@dataclass(frozen=True)
class MemoryEstimate:
    n_ctx: int
    n_parallel: int
    type_k: str
    type_v: str
    kv_per_seq: int
    mtp_kv_per_seq: int
    recurrent_per_seq: int
    weights_by_device: dict[str, int]

    @property
    def per_seq(self) -> int:
        return self.kv_per_seq + self.mtp_kv_per_seq + self.recurrent_per_seq

    @property
    def state_total(self) -> int:
        return self.per_seq * self.n_parallel

    @property
    def weights_total(self) -> int:
        return sum(self.weights_by_device.values())

    @property
    def total(self) -> int:
        return self.weights_total + self.state_total

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(per_seq=self.per_seq, state_total=self.state_total,
                 weights_total=self.weights_total, total=self.total)
        return d


def estimate_memory(hp: HParams, weights_by_device: dict[str, int], n_ctx: int,
                    n_parallel: int = 1, mtp: HParams | None = None, type_k: str = "f16",
                    type_v: str = "f16", n_snapshots: int = 0) -> MemoryEstimate:
    """Weights (from a placement) plus per-sequence state for ``n_parallel`` sequences.

    ``mtp`` is the hparams of the file holding the MTP head (the trunk's own for a grafted
    head, the sidecar's otherwise; None when no MTP head is used).
    """
    return MemoryEstimate(
        n_ctx=n_ctx, n_parallel=n_parallel, type_k=type_k, type_v=type_v,
        kv_per_seq=kv_bytes_per_seq(hp, n_ctx, type_k, type_v),
        mtp_kv_per_seq=mtp_kv_bytes_per_seq(mtp, n_ctx) if mtp is not None else 0,
        recurrent_per_seq=recurrent_bytes_per_seq(hp, n_snapshots),
        weights_by_device=dict(weights_by_device),
    )
