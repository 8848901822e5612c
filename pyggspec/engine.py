"""Engine: the facade over one loaded model -- configuration in, generations out.

``Engine(path, **kw)`` (or ``Engine(path, config=EngineConfig(...))``) puts the parts
together (:mod:`pyggspec.assemble`), hands them to a :class:`~pyggspec.worker.Worker` and
runs every generation through one :class:`~pyggspec.serving.scheduler.Scheduler`::

    engine.step()  =  batch = scheduler.schedule(); out = worker.run(batch);
                      scheduler.update(batch, out)

It is the Python API behind the CLI and the server: ``generate / stream / generate_batch /
submit / create_completion``, plus low-level evaluation (``decode / eval / decode_token``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from typing_extensions import Self

from pyggspec.assemble import Parts, assemble
from pyggspec.config import EngineConfig, SpecConfig
from pyggspec.errors import PyggspecError
from pyggspec.modelfile.identity import model_identity
from pyggspec.models.batch import MediaRows, StepResult
from pyggspec.sampling import SamplingParams
from pyggspec.sampling.grammar import GrammarSpec, grammar_spec
from pyggspec.serving.request import (
    Event,
    Generation,
    Request,
    RequestFailed,
    RequestHandle,
    RequestTimings,
    Result,
)
from pyggspec.serving.scheduler import Scheduler, SchedulerLimits
from pyggspec.serving.sequence import TokenLogprob
from pyggspec.speculative.stats import SpecStats
from pyggspec.worker import Worker

__all__ = ["Engine", "EngineConfig", "Generation", "Piece", "Result", "SlotFileResult",
           "SpecConfig", "Stream"]

log = logging.getLogger("pyggspec.engine")


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes (``token == -1``: trailing text);
    ``logprob``: the token's log-probabilities when the stream asked (``logprobs=k``)."""

    token: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class SlotFileResult:
    """What a slot action did: the slot, its tokens saved / restored / erased, the file's
    bytes written or read (0 for erase) and the time it took (not counting the wait for
    the slot)."""

    slot: int
    n_tokens: int
    n_bytes: int
    ms: float


class Stream:
    """What :meth:`Engine.stream` returns: iterate it for :class:`Piece` objects; when it
    ends, ``result`` is the request's :class:`~pyggspec.serving.request.Result`. Closing it
    early cancels the request."""

    def __init__(self, engine: Engine, handle: RequestHandle) -> None:
        self._engine = engine
        self._handle = handle
        self._t0 = time.perf_counter()  # the call's start: its timings count from here
        self.result: Result | None = None

    def __iter__(self) -> Iterator[Piece]:
        try:
            for ev in self._handle:
                yield Piece(ev.tokens[0] if ev.tokens else -1, ev.text,
                            ev.logprobs[0] if ev.logprobs else None)
        finally:
            self._handle.cancel()
        self.result = self._engine._collect([self._handle], self._t0)[0]


class Engine:
    """A loaded model ready to evaluate and generate.

    ``Engine(model_path, **settings)`` or ``Engine(model_path, config=EngineConfig(...))``
    (not both). ``model_path`` is a Qwen3.5/3.6 GGUF (MTP head grafted or not). The
    keyword settings are the fields of :class:`~pyggspec.config.EngineConfig`, with
    llama.cpp's flag in brackets; the ones most used:

    - ``spec_type`` (``--spec-type``): ``None`` for plain decoding, ``"draft-mtp"`` to
      draft with the MTP head, ``"ngram-simple"`` / ``"ngram-mod"``, or several joined by
      commas (the first kind with a proposal drafts).
    - ``spec`` (``--spec-draft-*``): a :class:`~pyggspec.config.SpecConfig`: ``n_max``
      (the cap on drafts per step, 3), ``adaptive=False`` for llama.cpp's fixed length
      (default: the draft-length rule chooses 0..n_max each step), ``rollback``.
    - ``mtp_path`` (``-md``): an MTP-only GGUF when the head is in its own file.
    - ``sampling``: the default :class:`~pyggspec.sampling.params.SamplingParams`
      (greedy, ``temp=0``, unless given); each call may pass its own.
    - ``n_ctx`` (``-c``, 4096; 0: the training context), ``n_parallel`` (``-np``, 1:
      sequence slots sharing the weights, each with its own KV cells and recurrent state;
      sequence ids are slot numbers ``0..n_parallel-1``), ``n_threads`` (``-t``).
    - ``n_gpu_layers`` (``-ngl``: a number, ``"all"`` or ``"auto"``), ``device``
      (``-dev``), ``override_tensor`` (``-ot``), ``repack`` (``-nr`` turns it off).
    - ``fit`` (``--fit``, on), ``fit_target`` (``-fitt``, MiB kept free per device,
      1024), ``fit_ctx`` (``-fitc``, 4096): with an offload device, an unset
      ``n_gpu_layers`` (None / ``"auto"``), no ``override_tensor``/``cpu_moe`` and
      ``n_ctx=0`` are chosen to fit its free memory (``config`` then holds the choice).
    - ``load_tokenizer`` (False for token ids only), ``progress`` (load progress on
      stderr; None: when stderr is a terminal).

    A bad setting raises :class:`~pyggspec.config.ConfigError` (a ``ValueError``) naming
    its flag; a bad file a :class:`~pyggspec.errors.PyggspecError`. Use it as a context
    manager, or call :meth:`close`, to free the device memory.

    Generation: :meth:`generate` (one prompt -> :class:`~pyggspec.serving.request.Result`),
    :meth:`stream` (:class:`Piece` by piece), :meth:`generate_batch` (several prompts in
    shared batches), :meth:`submit` (a queued :class:`~pyggspec.serving.request.Request`).
    Evaluation: :meth:`eval`, :meth:`decode`. With speculation the tokens are the same as
    plain decoding's (greedy, and seeded sampling with the default coupled drafts).
    """

    def __init__(self, model_path: str | os.PathLike, config: EngineConfig | None = None,
                 **kw: Any) -> None:
        if config is not None and kw:
            raise TypeError("pass either config or keyword arguments, not both")
        self.config = cfg = config if config is not None else EngineConfig.from_kwargs(**kw)
        self.model_path = os.fspath(model_path)
        self._parts: Parts = assemble(self.model_path, cfg)
        self.config = cfg = self._parts.cfg  # with what --fit chose for what was unset
        try:
            self.worker = Worker(self._parts)
            self.tokenizer = None
            if cfg.load_tokenizer:
                from pyggspec.tokenizer import Tokenizer

                self.tokenizer = Tokenizer(self.model_path)
                self._parts.closers.append(self.tokenizer)
            self.projector = None  # the vision projector (mmproj=): image inputs
            if cfg.mmproj is not None:
                from pyggspec.vision.projector import Projector

                self.projector = Projector(cfg.mmproj, self.tokenizer or self.model_path,
                                           offload=cfg.mmproj_offload,
                                           n_threads=cfg.threads,
                                           image_min_tokens=cfg.image_min_tokens,
                                           image_max_tokens=cfg.image_max_tokens)
                self._parts.closers.append(self.projector)
            self.scheduler = Scheduler(
                self.worker, SchedulerLimits(
                    self.n_ctx, self.n_vocab, cfg.n_parallel, cfg.n_ubatch, cfg.n_batch,
                    cfg.speculative, cfg.spec.n_max, cfg.ctx_checkpoints,
                    cfg.checkpoint_min_step),
                self.tokenizer, self.memory)
            for s in range(cfg.n_parallel):
                self.worker.clear(s)
        except BaseException:
            self._parts.close()
            raise

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step for every queued and running request: schedule -> run ->
        update (see :class:`~pyggspec.serving.scheduler.Scheduler`). False when idle."""
        return self.scheduler.step()

    # --- what the engine is made of (read-only views) -------------------------------------------
    model = property(lambda self: self._parts.model)
    hp = property(lambda self: self._parts.hp)
    n_vocab = property(lambda self: self._parts.n_vocab)
    n_ctx = property(lambda self: self._parts.n_ctx, doc="-c, capped at the training context")
    fit = property(lambda self: self._parts.fit,
                   doc="What --fit chose (memory.autofit.Fitted: .table(), .to_dict()), or "
                       "None when it had nothing to fit")
    n_parallel = property(lambda self: self.config.n_parallel)
    n_batch = property(lambda self: self.config.n_batch)
    n_ubatch = property(lambda self: self.config.n_ubatch)
    n_threads = property(lambda self: self.config.threads)
    spec = property(lambda self: self.config.spec)
    spec_type = property(lambda self: self.config.spec_type)
    sampling = property(lambda self: self.config.sampling)
    ctx_checkpoints = property(lambda self: self.config.ctx_checkpoints)
    checkpoint_min_step = property(lambda self: self.config.checkpoint_min_step)
    placement = property(lambda self: self._parts.placement)
    weights = property(lambda self: self._parts.weights)
    backend_sampling = property(lambda self: self._parts.backend_sampling)
    rollback = property(lambda self: self._parts.rollback)
    memory_plan = property(lambda self: self._parts.memory_plan)
    backends = property(lambda self: self._parts.backends)
    sched = property(lambda self: self._parts.sched)
    mtp_sched = property(lambda self: self._parts.mtp_sched)
    kv = property(lambda self: self._parts.kv)
    rs = property(lambda self: self._parts.rs)
    mtp_kv = property(lambda self: self._parts.mtp_kv)
    target = property(lambda self: self._parts.target)
    mtp = property(lambda self: self._parts.mtp)
    drafter = property(lambda self: self._parts.drafter)
    samplers = property(lambda self: self._parts.samplers)
    draft_lengths = property(lambda self: self.worker.lengths,
                             doc="the draft-length rule (None: fixed lengths)")

    # --- lifecycle ----------------------------------------------------------------
    def close(self) -> None:
        """Stop the scheduler (requests still running are cancelled) and free the
        weights, caches and graphs. The engine cannot be used afterwards."""
        sched = getattr(self, "scheduler", None)
        if sched is not None and sched.running:
            sched.stop(drain=False)
        self._parts.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- sequences --------------------------------------------------------------------
    def seq_len(self, seq_id: int = 0) -> int:
        """Tokens held in slot ``seq_id``'s cache."""
        self.worker.check_slot(seq_id)
        return self.worker.memory.length(seq_id)

    def clear(self, seq_id: int) -> None:
        """Empty slot ``seq_id`` (its KV cells, recurrent state and MTP cache)."""
        self.worker.clear(seq_id)

    def copy_seq(self, src: int, dst: int) -> None:
        """Make slot ``dst`` hold what slot ``src`` holds (a shared prefix, forked)."""
        self.worker.copy(src, dst)

    # --- slot files (llama-server's --slot-save-path) ------------------------------------
    @cached_property
    def model_identity(self) -> dict[str, Any]:
        """What a slot file records about this model and checks on restore
        (:func:`pyggspec.modelfile.identity.model_identity`), and the projector (a slot's
        image rows are only the same image under the projector that encoded them)."""
        p = self.projector
        return {**model_identity(self._parts.model),
                "projector": None if p is None else {"file": p.path.name,
                                                     "fingerprint": p.info.fingerprint}}

    def slot_action(self, action: str, slot: int,
                    path: str | os.PathLike | None = None) -> Future:
        """``"save"`` ``slot``'s whole state to ``path``, ``"restore"`` it from ``path``,
        or ``"erase"`` it, on the scheduler's thread once the slot is idle (as
        llama-server defers them). A :class:`concurrent.futures.Future` of a
        :class:`SlotFileResult`; a file that cannot be restored here fails it with
        :class:`~pyggspec.memory.slotfile.SlotFileError` (the slot is left as it was)."""
        self.worker.check_slot(slot)
        if action not in ("save", "restore", "erase"):
            raise ValueError(f"slot action must be save, restore or erase, not {action!r}")
        if action != "erase" and path is None:
            raise ValueError(f"slot action {action} needs a path")
        worker = self.worker

        def run() -> SlotFileResult:
            t0 = time.perf_counter()
            if action == "erase":
                n, nbytes = worker.memory.length(slot), 0
                worker.clear(slot)
            elif action == "save":
                n, nbytes = worker.save_slot(slot, path, self.model_identity)
            else:
                n, nbytes = worker.load_slot(slot, path, self.model_identity)
            return SlotFileResult(slot, n, nbytes, (time.perf_counter() - t0) * 1000)

        return self.scheduler.slot_action(slot, run)

    def save_slot(self, slot: int, path: str | os.PathLike) -> SlotFileResult:
        """Write ``slot``'s state (tokens, KV rows, recurrent state, checkpoints, MTP
        cache and carry-over) to ``path``, once the slot is idle."""
        return self.slot_action("save", slot, path).result()

    def restore_slot(self, slot: int, path: str | os.PathLike) -> SlotFileResult:
        """Make ``slot`` hold the state saved in ``path``: a request whose prompt starts
        with its tokens continues from there (prompt reuse)."""
        return self.slot_action("restore", slot, path).result()

    def erase_slot(self, slot: int) -> SlotFileResult:
        """Empty ``slot`` (``n_tokens``: the tokens it held)."""
        return self.slot_action("erase", slot).result()

    # --- tokens -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """``text`` as the model's token ids (``add_special``: with its BOS if it has one)."""
        return self._tok().tokenize(text, add_special=add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ``ids``."""
        return self._tok().detokenize(ids)

    def _tok(self):
        if self.tokenizer is None:
            raise PyggspecError(None, "engine was created with load_tokenizer=False")
        return self.tokenizer

    # --- low-level evaluation ---------------------------------------------------------------
    def decode(self, batch: Mapping[int, Sequence[int]], logits: str = "last",
               hidden: bool = False, media: Mapping[int, MediaRows] | None = None
               ) -> dict[int, StepResult]:
        """Append tokens to several sequences at once; logits ``"last"`` or ``"all"`` rows
        (:meth:`Worker.decode <pyggspec.worker.Worker.decode>`; ``media``: image rows,
        :func:`pyggspec.vision.rows.prompt_rows`)."""
        return self.worker.decode(batch, logits, hidden, media)

    def decode_token(self, seq_id: int, token: int) -> np.ndarray:
        """Decode one token for one sequence and return its logits row (a copy); outside
        the scheduler, which generation uses."""
        return self.worker.step(seq_id, token)

    def eval(self, tokens: Sequence[int], seq_id: int = 0) -> np.ndarray:
        """Append ``tokens`` to ``seq_id``; logits of every position, [n_tokens, n_vocab]."""
        return self.decode({seq_id: tokens}, logits="all")[seq_id].logits

    # --- generation -----------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Queue a :class:`~pyggspec.serving.request.Request` (see ``scheduler``)."""
        return self.scheduler.submit(request)

    def image_rows(self, prompt: str, images: Sequence[bytes | str | os.PathLike]):
        """``prompt`` with its images as the trunk takes them
        (:class:`~pyggspec.vision.rows.PromptRows`): one ``<__media__>`` marker per image
        places it (no marker: the images go first); each image is bytes or a file path.
        Encoded on the engine's thread (:meth:`Scheduler.on_engine_thread` says why)."""
        if self.projector is None:
            raise PyggspecError("--mmproj", "an image needs the model's vision projector: "
                                "load it with --mmproj FILE (mmproj= in the engine config)")
        if not isinstance(prompt, str):
            raise PyggspecError(None, "a prompt with images must be text (token ids cannot "
                                "say where the images go)")
        from pyggspec.vision.rows import prompt_rows

        p = self.projector
        imgs = [p.image(bytes(im)) if isinstance(im, (bytes, bytearray, memoryview))
                else p.load_image(im) for im in images]
        return self.scheduler.on_engine_thread(lambda: prompt_rows(p, prompt, imgs)).result()

    def _submit_all(self, prompts: Sequence[str | Sequence[int]],
                    max_tokens: int | Sequence[int], ignore_eos: bool,
                    sampling: SamplingParams | None,
                    images: Sequence[Sequence[Any] | None] | None = None,
                    **kw) -> list[RequestHandle]:
        """Validate every prompt first (nothing is queued when one is bad), then queue them;
        with no more prompts than slots, prompt i runs in slot i. ``max_tokens``: for all,
        or per prompt; ``images``: per prompt (None or empty: none)."""
        from pyggspec.serving.request import RequestError

        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
        if min(limits, default=0) < 0:
            raise PyggspecError("-n", f"must be >= 0, got {min(limits)}")
        if images is not None and len(images) != len(prompts):
            raise PyggspecError(None, f"{len(images)} image lists for {len(prompts)} prompts")
        sched = self.scheduler
        pin = len(prompts) <= self.n_parallel
        reqs = []
        for i, (p, limit) in enumerate(zip(prompts, limits, strict=True)):
            media = None
            if images is not None and images[i]:
                rows = self.image_rows(p, images[i])  # type: ignore[arg-type]
                ids, media = rows.tokens, rows.media
            else:
                ids = self.tokenize(p) if isinstance(p, str) else p
            req = Request(ids, max_tokens=limit, sampling=sampling, ignore_eos=ignore_eos,
                          slot=i if pin else None, media=media, **kw)
            try:
                req.prompt = sched.validate(req)
            except RequestError as err:
                raise PyggspecError(None, f"prompt {i}: {err.message}") from None
            reqs.append(req)
        return [sched.submit(r) for r in reqs]

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128,
               ignore_eos: bool = False, sampling: SamplingParams | None = None,
               logprobs: int | None = None, post_sampling_probs: bool = False,
               grammar: str | GrammarSpec | None = None,
               json_schema: Mapping[str, Any] | str | None = None,
               images: Sequence[bytes | str | os.PathLike] | None = None) -> Stream:
        """Generate for one prompt, one :class:`Piece` (token id + text, and its
        log-probabilities with ``logprobs``; ``grammar`` / ``json_schema`` / ``images``:
        see :meth:`generate`) at a time, with the engine's sampling and speculation
        settings (see :class:`Stream`)."""
        (h,) = self._submit_all([prompt], max_tokens, ignore_eos, sampling,
                                images=[images] if images else None,
                                logprobs=logprobs, post_sampling_probs=post_sampling_probs,
                                grammar=grammar_spec(grammar, json_schema))
        return Stream(self, h)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128,
                       ignore_eos: bool = False, on_tokens=None,
                       sampling: SamplingParams | None = None, logprobs: int | None = None,
                       post_sampling_probs: bool = False,
                       grammar: str | GrammarSpec | None = None,
                       json_schema: Mapping[str, Any] | str | None = None,
                       images: Sequence[Sequence[bytes | str | os.PathLike] | None] | None = None
                       ) -> Generation:
        """Generate for several prompts at once, in shared batches (one slot each; more
        prompts than slots wait for a free one). ``images``: each prompt's images (see
        :meth:`generate`), or None.

        With ``spec_type="draft-mtp"`` every sequence speculates with its own drafts and
        acceptance; ``on_tokens(index, tokens)`` is called as tokens are emitted. Returns
        the results in prompt order, with the call's timings and speculation counts
        (``logprobs``, ``grammar``, ``json_schema``: see :meth:`generate`; every prompt
        gets the same constraint).
        """
        t0 = time.perf_counter()
        handles = self._submit_all(prompts, max_tokens, ignore_eos, sampling, images=images,
                                   logprobs=logprobs, post_sampling_probs=post_sampling_probs,
                                   grammar=grammar_spec(grammar, json_schema))
        if on_tokens is not None:
            for i, h in enumerate(handles):
                h.add_callback(lambda item, i=i: on_tokens(i, list(item.tokens))
                               if isinstance(item, Event) and item.tokens else None)
        return self._collect(handles, t0)

    def _collect(self, handles: list[RequestHandle], t0: float) -> Generation:
        """Wait for the results. A failed request raises what failed (e.g. the device
        error)."""
        try:
            results = [h.result() for h in handles]
        except RequestFailed as err:
            for h in handles:
                h.cancel()
            if isinstance(err.__cause__, PyggspecError):
                raise err.__cause__ from None
            raise
        wall = (time.perf_counter() - t0) * 1000
        timings = RequestTimings()
        timings.prompt_n = sum(r.timings.prompt_n for r in results)
        timings.prompt_ms = max(r.timings.prompt_ms for r in results)
        timings.cache_n = sum(r.timings.cache_n for r in results)
        timings.predicted_n = sum(r.timings.predicted_n for r in results)
        timings.predicted_ms = max(0.0, wall - timings.prompt_ms)
        timings.python_ms = max((r.timings.python_ms for r in results), key=len)
        stats = SpecStats()
        for r in results:
            if r.spec is not None:
                stats.merge(r.spec)
        timings.draft_n, timings.draft_n_accepted = stats.n_drafted, stats.n_accepted
        return Generation(results, timings, stats)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128,
                 ignore_eos: bool = False, sampling: SamplingParams | None = None,
                 logprobs: int | None = None, post_sampling_probs: bool = False,
                 grammar: str | GrammarSpec | None = None,
                 json_schema: Mapping[str, Any] | str | None = None,
                 images: Sequence[bytes | str | os.PathLike] | None = None) -> Result:
        """Generate for one prompt and return its result (text, tokens, timings, ``spec``:
        its speculation counts).

        ``images`` (bytes or file paths) need the engine's projector (``mmproj=``); each
        ``<__media__>`` marker in the text prompt places the next image, and without a
        marker they go first (llama-mtmd-cli's rules). The image rows are prefilled like
        text (chunked by -ub / -b), at llama.cpp's M-RoPE positions; with draft-mtp the MTP
        head's cache takes each image row's embedding paired with the target's hidden row
        before it (as llama.cpp b11549), so drafts after the image see it.

        ``logprobs=k`` (llama-server's ``n_probs``) fills ``result.logprobs``: per emitted
        token its log-probability and the k most likely tokens at its position, from the
        raw softmax of the target's logits (``post_sampling_probs``: from the sampler
        chain's distribution). They are the target's values for the token it emitted, the
        same with and without speculation; a request that asks samples on the host.

        ``grammar`` (GBNF text, llama.cpp's ``--grammar``, or a
        :class:`~pyggspec.sampling.grammar.GrammarSpec`) or ``json_schema`` (a schema
        object or its JSON) constrains the output; it ends where the grammar is complete.
        Compiled once per request (llguidance); a bad one raises
        :class:`~pyggspec.sampling.grammar.GrammarError`. The same tokens with and
        without speculation."""
        return self.generate_batch([prompt], max_tokens, ignore_eos, sampling=sampling,
                                   logprobs=logprobs,
                                   post_sampling_probs=post_sampling_probs,
                                   grammar=grammar, json_schema=json_schema,
                                   images=[images] if images else None)[0]

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
        rs = self.rs
        for dev, n in rs.bytes_by_device().items():
            row = n // rs.n_rows  # every row of every layer on this device
            m.add("recurrent", dev, row * rs.n_slots)
            # checkpoint rollback's spare plane; snapshot rollback's arena
            m.add("checkpoints", dev, row * rs.n_slots * (rs.n_planes - 1))
            m.add("snapshots", dev, row * (rs.n_rows - rs.n_slots * rs.n_planes))
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
        ck = self.worker.memory.checkpoint_bytes()
        if ck:
            m.add("prompt_checkpoints", "host", ck)
        from pyggspec.sampling.graph import SharedRevid

        for dev, n in SharedRevid.bytes_on({b.device.name for b in self.backends}).items():
            m.add("sampling", dev, n)
        return m.to_dict()
