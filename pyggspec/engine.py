"""Engine: one model on its devices, sequence slots, batching, evaluation and generation.

The engine owns the weights, the caches and the scheduler, and splits requests into
ubatches of equal-length sequences (what the gated-delta-net graph needs). It is the
Python API behind the CLI: ``Engine(path).generate(...)``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from typing_extensions import Self

from pyggspec.compute import reserve_compute
from pyggspec.config import SpecConfig
from pyggspec.errors import PyggspecError
from pyggspec.ggml.device import Backend, cpu_device, devices, get_device
from pyggspec.ggml.sched import Scheduler
from pyggspec.memory import KVCache, RecurrentState
from pyggspec.modelfile import open_model
from pyggspec.models.qwen35 import StepResult, Target, UBatch
from pyggspec.sampling import SamplingParams, graph_sampling
from pyggspec.sampling.session import SequenceSamplers
from pyggspec.serving.request import Event, Request, RequestHandle
from pyggspec.speculative.loop import SpecStats

if TYPE_CHECKING:  # pragma: no cover
    from pyggspec.serving.scheduler import Scheduler as RequestScheduler

log = logging.getLogger("pyggspec.engine")


@dataclass
class Timings:
    """llama.cpp-style timings plus the host (Python) share of each decode step."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    python_ms: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        def per_s(n: int, ms: float) -> float:
            return n / (ms / 1000) if ms > 0 else 0.0

        py = float(np.median(self.python_ms)) if self.python_ms else 0.0
        return {
            "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
            "prompt_per_second": per_s(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_second": per_s(self.predicted_n, self.predicted_ms),
            "python_ms_per_step": py,
        }


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes (``token == -1``: trailing text)."""

    token: int
    text: str


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    n_prompt: int
    stop_reason: str  # "eos" | "stop" | "length" (-n) | "context" (prompt + output == n_ctx)
    timings: Timings
    cache_n: int = 0  # prompt tokens reused from the slot's cache

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "n_prompt": self.n_prompt,
                "n_gen": len(self.tokens), "stop_reason": self.stop_reason,
                "cache_n": self.cache_n, "timings": self.timings.to_dict()}


def _device_accepts(device: str, info) -> bool:
    """Placement's question to the binding: can ``device`` hold this weight at all."""
    return _accepts(device, info.type_name, tuple(info.ne[: info.n_dims]))


@functools.lru_cache(maxsize=1024)
def _accepts(device: str, type_name: str, ne: tuple[int, ...]) -> bool:
    """Asked once per (device, type, shape): every layer repeats the same few shapes, and
    an RPC device answers each question over the network."""
    return get_device(device).accepts(type_name, ne)


def _check_cache_types(types: Mapping[str, str]) -> None:
    """A KV cache type ggml cannot store is a one-line error naming its flag."""
    from pyggspec.memory.kv import KV_TYPES

    for flag, t in types.items():
        if str(t).lower() not in KV_TYPES:
            raise PyggspecError(flag, f"unsupported KV cache type {t!r} "
                                f"({', '.join(KV_TYPES)})")


class Engine:
    """A loaded model ready to evaluate and generate.

    ``n_parallel`` sequence slots share the weights; each has its own KV cells and
    recurrent state. Sequence ids are slot numbers ``0..n_parallel-1``.
    """

    def __init__(self, model_path: str | os.PathLike, *, mtp_path: str | os.PathLike | None = None,
                 n_ctx: int = 4096, n_parallel: int = 1, n_threads: int | None = None,
                 n_batch: int = 2048, n_ubatch: int = 512, n_gpu_layers: int | str | None = 0,
                 device: str | None = None, override_tensor: Sequence[tuple[str, str]] = (),
                 cpu_moe: bool = False, type_k: str = "f16", type_v: str = "f16",
                 use_mmap: bool = True, load_tokenizer: bool = True,
                 progress: bool | None = None, spec_type: str | None = None,
                 spec: SpecConfig | None = None, mtp_type_k: str = "f16",
                 mtp_type_v: str = "f16", draft_backend_sampling: bool = True,
                 sampling: SamplingParams | None = None, backend_sampling: bool | None = None,
                 repack: bool = True, ctx_checkpoints: int = 4,
                 checkpoint_min_step: int = 512) -> None:
        from pyggspec.weights import load_weights, plan_placement

        if min(n_ctx, n_parallel, n_batch, n_ubatch) < 1:
            raise PyggspecError(None, "need n_ctx, n_parallel, n_batch, n_ubatch >= 1")
        _check_cache_types({"-ctk": type_k, "-ctv": type_v, "-ctkd": mtp_type_k,
                            "-ctvd": mtp_type_v})
        self._closers: list = []
        self._scheduler: RequestScheduler | None = None
        self.model_path = os.fspath(model_path)
        if ctx_checkpoints < 0 or checkpoint_min_step < 1:
            raise PyggspecError("--ctx-checkpoints", "need ctx_checkpoints >= 0 and "
                                "checkpoint_min_step >= 1")
        # prompt reuse: recurrent-state copies saved along each prompt, per slot
        self.ctx_checkpoints = ctx_checkpoints
        self.checkpoint_min_step = checkpoint_min_step
        try:
            self.model = open_model(model_path, mtp_path)
            self._closers.append(self.model)
            trunk = self.model.trunk
            if not trunk.has_trunk:
                raise PyggspecError(model_path, "this is an MTP-only file; pass the trunk model "
                                    "with -m and this file with --spec-draft-model")
            self.hp = hp = trunk.hparams
            self.n_vocab = trunk.n_vocab
            self.n_ctx = n_ctx
            if hp.n_ctx_train and n_ctx > hp.n_ctx_train:
                self.n_ctx = hp.n_ctx_train
                log.warning("-c %d is more than the model's training context; using %d",
                            n_ctx, hp.n_ctx_train)
            self.n_parallel = n_parallel
            # -b is the logical batch (prompt chunks per sequence), -ub the physical one;
            # as in llama.cpp the physical batch is never larger than the logical one
            self.n_batch = n_batch
            self.n_ubatch = min(n_ubatch, n_batch)
            self.n_threads = n_threads or max(1, min(os.cpu_count() or 1, 8))
            if spec_type not in (None, "none", "draft-mtp"):
                raise PyggspecError("--spec-type", f"unsupported speculative type {spec_type!r} "
                                    "(none, draft-mtp)")
            self.spec_type = "draft-mtp" if spec_type == "draft-mtp" else None
            self._type_k, self._type_v = type_k, type_v
            self._mtp_types = (mtp_type_k, mtp_type_v)
            self.sampling = sampling or SamplingParams(temp=0.0)
            self.sampling.check_vocab(self.n_vocab)
            self.samplers: SequenceSamplers | None = None
            self.spec = spec or SpecConfig()
            grafted = False
            if self.spec_type:
                if self.spec.n_max < 1 or self.spec.n_min < 0 or self.spec.n_min > self.spec.n_max:
                    raise PyggspecError("--spec-draft-n-max", "need 1 <= n_min <= n_max "
                                        f"(got n_min={self.spec.n_min}, n_max={self.spec.n_max})")
                if self.model.mtp_file is None:
                    status = trunk.mtp.status
                    if status != "grafted":
                        raise PyggspecError(model_path, f"no MTP head (nextn_predict_layers = "
                                            f"{hp.n_layer_nextn}); pass --spec-draft-model "
                                            "mtp-….gguf")
                    grafted = True
            # a registered RPC device whose server is gone cannot take layers
            names = [d.name for d in devices() if d.reachable()]
            self.placement = plan_placement(trunk, names, n_gpu_layers, device, override_tensor,
                                            cpu_moe, include_mtp=grafted,
                                            accepts=_device_accepts)
            for name, dev in self.placement.refused.items():
                t = trunk.tensors[name]
                log.warning("%s cannot hold %s (%s, %.0f MiB) as an operand: keeping it on "
                            "the CPU", dev, name, t.type_name, t.nbytes / 2**20)
            self.weights = load_weights(self.model, self.placement, use_mmap=use_mmap,
                                        progress=progress, repack=repack)
            self._closers.append(self.weights)
            # None: chains in the graph unless the logits are on the CPU (graph_sampling)
            self._backend_sampling_arg = backend_sampling
            self.backend_sampling = graph_sampling(backend_sampling,
                                                   self.placement.output_device)
            if self.spec_type and self.spec.draft_head:
                self._add_draft_head(self.spec.draft_head)
            # verify/draft batches may run n_max + 2 positions past the committed ones
            kv_cells = self.n_ctx + (self.spec.n_max + 2 if self.spec_type else 0)

            layer_dev = {il: get_device(self.placement.layer_devices[il])
                         for il in range(hp.n_layer)}
            attn = {il: d for il, d in layer_dev.items() if not hp.is_recurrent(il)}
            recr = {il: d for il, d in layer_dev.items() if hp.is_recurrent(il)}
            self.kv = KVCache(attn, hp.n_embd_k_gqa, hp.n_embd_v_gqa, kv_cells, n_parallel,
                              type_k, type_v)
            self._closers.append(self.kv)
            self.rollback = self._choose_rollback(recr) if self.spec_type else None
            used = {self.placement.output_device, *self.placement.layer_devices[: hp.n_layer]}
            self.backends: list[Backend] = []
            for name in sorted(used - {"CPU"}):
                self.backends.append(get_device(name).open())
            self.backends.append(cpu_device().open(self.n_threads))
            self._closers.extend(self.backends)
            self.sched = Scheduler(self.backends)
            self._closers.append(self.sched)
            # the MTP head runs on its own scheduler (target and draft graphs never evict
            # each other's allocation)
            self.mtp_sched = Scheduler(self.backends) if self.spec_type else None
            if self.mtp_sched is not None:
                self._closers.append(self.mtp_sched)
            self._draft_argmax = draft_backend_sampling
            self.memory_plan = self._plan_memory()
            self._check_fit()
            planes = 1
            if self.rollback == "snapshot":
                planes = self.spec.n_max + 3  # current + one per verify row (padding included)
            elif self.rollback == "checkpoint":
                planes = 2
            self.rs = RecurrentState(recr, hp.n_embd_r, hp.n_embd_s, n_parallel, planes)
            self._closers.append(self.rs)
            self.target = Target(hp, self.weights, self.kv, self.rs, self.sched)
            self.target.step_rows = self._step_rows
            self._step_ub: dict[int, UBatch] = {}
            self._closers.append(self.target)
            self.mtp = None
            self.stats = SpecStats()
            if self.spec_type:
                self._init_mtp(kv_cells, mtp_type_k, mtp_type_v, draft_backend_sampling)
            # compute buffers at their worst case now, so they never grow while generating
            reserve_compute(self._compute, self.target, self.mtp)
            self.draft_policy = None
            if self.spec_type and self.spec.adaptive:
                self.draft_policy = self._make_draft_policy()
            self.tokenizer = None
            if load_tokenizer:
                from pyggspec.tokenizer import Tokenizer

                self.tokenizer = Tokenizer(model_path)
                self._closers.append(self.tokenizer)
            for s in range(n_parallel):
                self.clear(s)
        except BaseException:
            self.close()
            raise

    def _plan_memory(self):
        """Every component predicted before the states are allocated; compute buffers from
        ggml's sizing of the worst-case graphs on this engine's schedulers (reserved for
        real once the states exist, so :meth:`memory` reports the same numbers)."""
        from pyggspec.compute import GraphOptions, size_compute
        from pyggspec.memory.plan import plan_memory

        p = self.placement
        mtp_dev = None
        mtp_hp = None
        if self.spec_type:
            mtp_dev = self.weights.device_of(f"blk.{self.hp.n_layer}.nextn.eh_proj.weight")
            mtp_hp = self.model.mtp_file.hparams if self.model.mtp_file is not None else None
        opts = GraphOptions(self.n_ctx, self.n_parallel, self.n_ubatch,
                            self.spec.n_max if self.spec_type else 0, self.rollback,
                            self._type_k, self._type_v, *self._mtp_types,
                            device_argmax=self._draft_argmax,
                            draft_vocab=max(0, self.spec.draft_vocab))
        layer_devs = {il: get_device(p.layer_devices[il]) for il in range(self.hp.n_layer)}
        self._step_rows = opts.step_rows  # graphs up to this many rows keep their scheduler
        self._compute = size_compute(opts, self.hp, self.weights, layer_devs, self.sched,
                                     self.mtp_sched, mtp_hp, mtp_dev, self._sampling_sizing())
        return plan_memory(self.hp, self.n_vocab, dict(self.weights.bytes_by_device()),
                           p.layer_devices, p.output_device, n_ctx=self.n_ctx,
                           n_parallel=self.n_parallel, n_ubatch=self.n_ubatch,
                           type_k=self._type_k, type_v=self._type_v,
                           spec_n_max=opts.spec_n_max, rollback=self.rollback,
                           mtp_device=mtp_dev.name if mtp_dev is not None else None,
                           mtp_hp=mtp_hp, mtp_type_k=self._mtp_types[0],
                           mtp_type_v=self._mtp_types[1], compute=self._compute.by_device(),
                           step_graphs=self._compute.steps)

    def _sampling_sizing(self):
        """The device sampling the loop may add to graphs (None: chains run on the host)."""
        from pyggspec.compute import sampling_sizing

        coupled = bool(self.spec_type and self.spec.draft_sampling == "coupled"
                       and self._draft_argmax and self.spec.p_min == 0)
        return sampling_sizing(self.n_vocab, self.placement, self.weights, self.hp.n_layer,
                               backend_sampling=self._backend_sampling_arg,
                               coupled_drafts=coupled, default=self.sampling)

    def _check_fit(self) -> None:
        """Say so before allocating when states do not fit a device; snapshots degrade to
        checkpoints first (llama.cpp would run out of memory at allocation instead)."""
        for _ in range(2):
            too_big = []
            for dev_name, n in self.memory_plan.by_device().items():
                dev = get_device(dev_name)
                free, total = dev.memory()
                # weights are allocated (or mapped) already: count what is still to come
                need = n - self.memory_plan.components.get("weights", {}).get(dev_name, 0)
                if total and need > free:
                    too_big.append((dev_name, need, free))
            if not too_big:
                return
            if self.rollback == "snapshot" and self.spec.rollback == "auto":
                self.rollback = "checkpoint"
                self.memory_plan = self._plan_memory()
                continue
            dev_name, need, free = too_big[0]
            raise PyggspecError(dev_name, f"needs {need / 2**20:.1f} MiB more for caches, "
                                f"states and compute but only {free / 2**20:.1f} MiB are free; "
                                "lower -c/--parallel/--spec-draft-n-max or use "
                                "--spec-rollback checkpoint")

    def _choose_rollback(self, recr_devices: dict) -> str:
        """Snapshot planes when they fit on the devices holding the recurrent state,
        else checkpoints (two planes); an explicit choice is honoured."""
        want = self.spec.rollback
        if want in ("snapshot", "checkpoint"):
            return want
        if want != "auto":
            raise PyggspecError("--spec-rollback", f"expected auto, snapshot or checkpoint, "
                                f"got {want!r}")
        hp = self.hp
        per_plane = (hp.n_embd_r + hp.n_embd_s) * 4 * self.n_parallel
        need: dict[str, int] = {}
        for dev in recr_devices.values():
            need[dev.name] = need.get(dev.name, 0) + per_plane * (self.spec.n_max + 3)
        for name, n in need.items():
            dev = get_device(name)
            free, total = dev.memory()
            if not dev.is_cpu and total and n > free:
                return "checkpoint"
        return "snapshot"

    def _make_draft_policy(self):
        """Adaptive draft length: costs measured now on this device (one sequence of every
        row count a verify batch can have), refined by every step afterwards."""
        from pyggspec.speculative.adaptive import DraftLengthPolicy, calibrate
        from pyggspec.speculative.loop import padded_rows

        n_max = self.spec.n_max
        rows = {padded_rows(t, B) * B for B in range(1, self.n_parallel + 1)
                for t in range(1, n_max + 2)}
        costs = calibrate(self, sorted(rows))
        return DraftLengthPolicy(n_max, costs, padded_rows)

    def _add_draft_head(self, type_name: str) -> None:
        """A lower-bit copy of the MTP head's LM head for drafting (--spec-draft-head): a
        draft step reads the whole vocabulary's head, most of its cost."""
        from pyggspec.ggml.quantize import quantizable
        from pyggspec.models.mtp import MtpWeights

        ok, why = quantizable(type_name)
        if not ok:
            raise PyggspecError("--spec-draft-head", why)
        w = MtpWeights(self.weights, self.hp.n_layer)
        self.weights.add_requantized(w.DRAFT_HEAD, w.head_name, type_name)

    def _init_mtp(self, kv_cells: int, type_k: str, type_v: str, device_argmax: bool) -> None:
        from pyggspec.models.mtp import Mtp, MtpWeights
        from pyggspec.speculative.draft_mtp import MtpDrafter

        hp = self.hp
        block = hp.n_layer
        mtp_hp = self.model.mtp_file.hparams if self.model.mtp_file is not None else hp
        if mtp_hp.n_embd_out != hp.n_embd_out:
            raise PyggspecError(None, "MTP head width differs from the target's")
        w = MtpWeights(self.weights, block)
        dev = self.weights.device_of(f"blk.{block}.nextn.eh_proj.weight")
        self.mtp_kv = KVCache({block: dev}, mtp_hp.n_embd_k_gqa, mtp_hp.n_embd_v_gqa, kv_cells,
                              self.n_parallel, type_k, type_v, label="mtp-kv")
        self._closers.append(self.mtp_kv)
        dv = self.spec.draft_vocab
        if dv < 0:
            raise PyggspecError("--spec-draft-vocab", f"must be >= 0, got {dv}")
        if dv and self.spec.p_min > 0:
            raise PyggspecError("--spec-draft-vocab", "cannot be combined with "
                                "--spec-draft-p-min: p_min needs the full-vocabulary softmax")
        self.mtp = Mtp(mtp_hp, w, self.mtp_kv, self.mtp_sched, device_argmax=device_argmax,
                       draft_vocab=dv)
        self.mtp.step_rows = self._step_rows
        self._closers.append(self.mtp)
        head_dev = self.weights.device_of(w.head_name)
        chains_in_graph = device_argmax and graph_sampling(self._backend_sampling_arg,
                                                           head_dev.name)
        self.drafter = MtpDrafter(self.mtp, hp.n_embd, self.spec.n_min, self.spec.p_min,
                                  coupled=self.spec.draft_sampling == "coupled",
                                  device=head_dev, backend_sampling=chains_in_graph)

    # --- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.stop(drain=False)
        while self._closers:
            self._closers.pop().close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sequences --------------------------------------------------------------------
    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_parallel:
            raise PyggspecError(None, f"sequence id {seq_id} outside 0..{self.n_parallel - 1}")

    def seq_len(self, seq_id: int = 0) -> int:
        self._check_seq(seq_id)
        return int(self.kv.lengths[seq_id])

    def clear(self, seq_id: int) -> None:
        self._check_seq(seq_id)
        self.kv.clear(seq_id)
        self.rs.clear(seq_id)
        if self.mtp is not None:
            self.mtp_kv.clear(seq_id)

    def copy_seq(self, src: int, dst: int) -> None:
        self._check_seq(src)
        self._check_seq(dst)
        self.kv.copy(src, dst)
        self.rs.copy(src, dst)
        if self.mtp is not None:
            self.mtp_kv.copy(src, dst)

    # --- tokens -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._tok().tokenize(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok().detokenize(ids)

    def _tok(self):
        if self.tokenizer is None:
            raise PyggspecError(None, "engine was created with load_tokenizer=False")
        return self.tokenizer

    # --- evaluation ----------------------------------------------------------------------
    def decode(self, batch: Mapping[int, Sequence[int]], logits: str = "last",
               hidden: bool = False) -> dict[int, StepResult]:
        """Append tokens to several sequences at once; logits ``"last"`` or ``"all"`` rows.

        Sequences are grouped into ubatches of equal length (B sequences x T tokens), at
        most ``n_ubatch`` tokens each, in slot order.
        """
        if logits not in ("last", "all"):
            raise ValueError("logits must be 'last' or 'all'")
        pending: dict[int, np.ndarray] = {}
        for seq, toks in batch.items():
            self._check_seq(seq)
            arr = np.asarray(toks, dtype=np.int32).reshape(-1)
            if arr.size == 0:
                continue
            if arr.min() < 0 or arr.max() >= self.n_vocab:
                raise PyggspecError(None, f"sequence {seq}: token id out of range 0.."
                                    f"{self.n_vocab - 1}")
            if self.seq_len(seq) + arr.size > self.n_ctx:
                raise PyggspecError(None, f"sequence {seq}: context full ({self.n_ctx} tokens)")
            pending[seq] = arr
        out_logits: dict[int, list[np.ndarray]] = {s: [] for s in pending}
        out_hidden: dict[int, list[np.ndarray]] = {s: [] for s in pending}
        done = dict.fromkeys(pending, 0)
        while True:
            left = {s: a.size - done[s] for s, a in pending.items() if a.size > done[s]}
            if not left:
                break
            # one ubatch: the sequences sharing the smallest remaining count, chunked
            T = min(min(left.values()), self.n_ubatch)
            seqs = sorted(s for s, n in left.items() if n >= T)[: max(1, self.n_ubatch // T)]
            # ... and never across a sequence's logical batch (-b) boundary
            T = min(T, *(self.n_batch - done[s] % self.n_batch for s in seqs))
            tokens = np.stack([pending[s][done[s]: done[s] + T] for s in seqs])
            pos0 = np.array([self.seq_len(s) for s in seqs], dtype=np.int64)
            if logits == "all":
                outputs = np.arange(T * len(seqs), dtype=np.int32)
            else:
                outputs = np.array([i * T + T - 1 for i, s in enumerate(seqs)
                                    if done[s] + T == pending[s].size], dtype=np.int32)
                if outputs.size == 0:
                    outputs = np.array([T - 1], dtype=np.int32)  # keep the graph well-formed
            res = self.target.run(UBatch(tokens, pos0, tuple(seqs), outputs, hidden))
            rows = {int(r): i for i, r in enumerate(outputs)}
            for i, s in enumerate(seqs):
                if logits == "all":
                    out_logits[s].append(res.logits[i * T:(i + 1) * T])
                elif (i * T + T - 1) in rows and done[s] + T == pending[s].size:
                    out_logits[s].append(res.logits[rows[i * T + T - 1]][None])
                if hidden and res.hidden is not None:
                    out_hidden[s].append(res.hidden[i * T:(i + 1) * T])
                done[s] += T
        return {s: StepResult(np.concatenate(out_logits[s]) if out_logits[s] else
                              np.zeros((0, self.n_vocab), np.float32),
                              np.concatenate(out_hidden[s]) if hidden else None)
                for s in pending}

    def step(self, seq_id: int, token: int) -> np.ndarray:
        """Decode one token for one sequence and return its logits row (a copy).

        A low-level step outside the scheduler (which generation uses); the host arrays
        of the ubatch are kept per sequence.
        """
        self._check_seq(seq_id)
        if not 0 <= token < self.n_vocab:
            raise PyggspecError(None, f"sequence {seq_id}: token id {token} out of range 0.."
                                f"{self.n_vocab - 1}")
        n = int(self.kv.lengths[seq_id])
        if n + 1 > self.n_ctx:
            raise PyggspecError(None, f"sequence {seq_id}: context full ({self.n_ctx} tokens)")
        ub = self._step_ub.get(seq_id)
        if ub is None:
            ub = UBatch(np.zeros((1, 1), np.int32), np.zeros(1, np.int64), (seq_id,),
                        np.zeros(1, np.int32), state_src=np.zeros(1, np.int32),
                        state_dst=np.zeros((1, 1), np.int32))
            self._step_ub[seq_id] = ub
        ub.tokens[0, 0] = token
        ub.pos0[0] = n
        ub.state_src[0] = ub.state_dst[0, 0] = self.rs.row(seq_id)
        # a copy: on the CPU the graph's logits are read in place (valid until the next
        # graph), and a caller may keep this row past it, even past close()
        return self.target.run(ub, copy=False).logits[0].copy()

    def eval(self, tokens: Sequence[int], seq_id: int = 0) -> np.ndarray:
        """Append ``tokens`` to ``seq_id``; logits of every position, [n_tokens, n_vocab]."""
        return self.decode({seq_id: tokens}, logits="all")[seq_id].logits

    # --- generation -----------------------------------------------------------------------
    @property
    def scheduler(self) -> RequestScheduler:
        """The engine's :class:`~pyggspec.serving.scheduler.Scheduler`: every generation
        (these methods, the CLI, the server) goes through it."""
        if self._scheduler is None:
            from pyggspec.serving.scheduler import Scheduler as RequestScheduler

            self._scheduler = RequestScheduler(self)
            self.samplers = self._scheduler.samplers
        return self._scheduler

    def submit(self, request: Request) -> RequestHandle:
        """Queue a :class:`~pyggspec.serving.request.Request` (see ``scheduler``)."""
        return self.scheduler.submit(request)

    def _submit_all(self, prompts: Sequence[str | Sequence[int]], max_tokens: int,
                    ignore_eos: bool, sampling: SamplingParams | None,
                    **kw) -> list[RequestHandle]:
        """Validate every prompt first (nothing is queued when one is bad), then queue them;
        with no more prompts than slots, prompt i runs in slot i."""
        from pyggspec.serving.request import RequestError

        if max_tokens < 0:
            raise PyggspecError("-n", f"must be >= 0, got {max_tokens}")
        sched = self.scheduler
        pin = len(prompts) <= self.n_parallel
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.tokenize(p) if isinstance(p, str) else p
            req = Request(ids, max_tokens=max_tokens, sampling=sampling, ignore_eos=ignore_eos,
                          slot=i if pin else None, **kw)
            try:
                req.prompt = sched._validate(req)
            except RequestError as err:
                raise PyggspecError(None, f"prompt {i}: {err.message}") from None
            reqs.append(req)
        return [sched.submit(r) for r in reqs]

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128,
               ignore_eos: bool = False,
               sampling: SamplingParams | None = None) -> Iterator[Piece]:
        """Generate for one prompt, one :class:`Piece` (token id + text) at a time, with the
        engine's sampling and speculation settings.

        When the iterator ends, ``self.last_result`` holds the :class:`GenerationResult`;
        closing it early cancels the request.
        """
        t0 = time.perf_counter()
        (h,) = self._submit_all([prompt], max_tokens, ignore_eos, sampling)
        try:
            for ev in h:
                yield Piece(ev.tokens[0] if ev.tokens else -1, ev.text)
        finally:
            h.cancel()
        self.last_result = self._collect([h], t0)[0]

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128,
                       ignore_eos: bool = False, on_tokens=None,
                       sampling: SamplingParams | None = None) -> list[GenerationResult]:
        """Generate for several prompts at once, in shared batches (one slot each; more
        prompts than slots wait for a free one).

        With ``spec_type="draft-mtp"`` every sequence speculates with its own drafts and
        acceptance; ``on_tokens(index, tokens)`` is called as tokens are emitted.
        """
        t0 = time.perf_counter()
        handles = self._submit_all(prompts, max_tokens, ignore_eos, sampling)
        if on_tokens is not None:
            for i, h in enumerate(handles):
                h.add_callback(lambda item, i=i: on_tokens(i, list(item.tokens))
                               if isinstance(item, Event) and item.tokens else None)
        return self._collect(handles, t0)

    def _collect(self, handles: list[RequestHandle], t0: float) -> list[GenerationResult]:
        """Wait for the results; ``self.stats`` becomes their speculation counts summed.
        A failed request raises what failed (e.g. the device error)."""
        from pyggspec.serving.request import RequestFailed

        try:
            results = [h.result() for h in handles]
        except RequestFailed as err:
            for h in handles:
                h.cancel()
            if isinstance(err.__cause__, PyggspecError):
                raise err.__cause__ from None
            raise
        wall = (time.perf_counter() - t0) * 1000
        timings = Timings()
        timings.prompt_n = sum(r.timings.prompt_n for r in results)
        timings.prompt_ms = max(r.timings.prompt_ms for r in results)
        timings.predicted_n = sum(r.timings.predicted_n for r in results)
        timings.predicted_ms = max(0.0, wall - timings.prompt_ms)
        timings.python_ms = max((r.timings.python_ms for r in results), key=len)
        stats = SpecStats()
        for r in results:
            if r.spec is not None:
                stats.merge(r.spec)
        self.stats = stats
        return [GenerationResult(r.text, list(r.tokens), r.n_prompt, r.stop_reason, timings,
                                 r.timings.cache_n) for r in results]

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128,
                 ignore_eos: bool = False,
                 sampling: SamplingParams | None = None) -> GenerationResult:
        """Generate for one prompt and return the result (text, tokens, timings)."""
        return self.generate_batch([prompt], max_tokens, ignore_eos, sampling=sampling)[0]

    def create_completion(self, prompt: str | Sequence[int], **kw) -> dict | Iterator[dict]:
        """llama-cpp-python's ``Llama.create_completion`` (same arguments and dict shapes;
        ``stream=True`` returns an iterator of chunks), run on the scheduler."""
        from pyggspec.serving.completion import create_completion

        return create_completion(self, prompt, **kw)

    def create_chat_completion(self, messages: Sequence[Mapping], **kw) -> dict | Iterator[dict]:
        """llama-cpp-python's ``Llama.create_chat_completion``: the GGUF's chat template,
        then :meth:`create_completion`'s machinery; chat dict shapes."""
        from pyggspec.serving.completion import create_chat_completion

        return create_chat_completion(self, messages, **kw)

    def make_samplers(self, sampling: SamplingParams | None = None) -> SequenceSamplers:
        """Sampler chains for the slots, planned against the output device."""
        out_dev = get_device(self.placement.output_device)
        return SequenceSamplers(sampling or self.sampling, self.n_vocab, out_dev,
                                self.backend_sampling, self.target.register_plan,
                                output_split=self.placement.output_split)

    def _device_ms(self) -> float:
        total = self.target.compute_ms_total + self.target.build_ms_total
        if self.mtp is not None:
            total += self.mtp.compute_ms_total + self.mtp.build_ms_total
        return total

    def device_report(self) -> dict:
        """What the devices could not do as asked: ops that ran on the CPU instead of the
        device holding their weights (probed per graph before ggml splits it), weights a
        device cannot hold at all (kept on the CPU by the placement) and the known-broken
        device rules in force (``pyggspec.ggml.quirks``)."""
        from pyggspec.ggml import quirks

        fbs: dict = {}
        for s in (self.sched, self.mtp_sched):
            if s is not None:
                fbs.update(s.fallbacks)
        names = sorted({b.device.name for b in self.backends})
        return {
            "fallbacks": [{"device": f.device, "op": f.op, "node": f.node,
                           "shape": list(f.shape)} for f in fbs.values()],
            "quirks": [{"device": n, "key": q.key, "line": q.line(n)}
                       for n in names for q in quirks.applied(n)],
            "refused": dict(self.placement.refused),  # weights a device cannot hold: on the CPU
        }

    def memory(self) -> dict:
        """Bytes per component and device, as allocated (same keys as the prediction in
        ``self.memory_plan`` and ``pyggspec inspect``)."""
        from pyggspec.memory.plan import MemoryPlan

        m = MemoryPlan()
        for dev, n in self.weights.bytes_by_device().items():
            m.add("weights", dev, n)
        for dev, n in self.kv.bytes_by_device().items():
            m.add("kv", dev, n)
        extra = "snapshots" if self.rollback == "snapshot" else "checkpoints"
        for dev, n in self.rs.bytes_by_device().items():
            one = n // self.rs.n_planes
            m.add("recurrent", dev, one)
            m.add(extra, dev, n - one)
        for dev, n in self.sched.buffer_sizes().items():
            m.add("compute", dev, n)
        for dev, n in self.sched.spawned_buffer_sizes().items():
            m.add("step_graphs", dev, n)
        if self.mtp is not None:
            for dev, n in self.mtp_kv.bytes_by_device().items():
                m.add("mtp_kv", dev, n)
            for dev, n in self.mtp_sched.buffer_sizes().items():
                m.add("compute", dev, n)
            for dev, n in self.mtp_sched.spawned_buffer_sizes().items():
                m.add("step_graphs", dev, n)
        if self._scheduler is not None and self._scheduler.checkpoint_bytes():
            m.add("prompt_checkpoints", "host", self._scheduler.checkpoint_bytes())
        if self.samplers is not None and self.samplers.stats.buffer_bytes:
            m.add("sampling", self.placement.output_device, self.samplers.stats.buffer_bytes)
        return m.to_dict()
