"""What every handler shares: the server's configuration and :class:`ServerState`.

``ServerState`` holds the scheduler (the one thread that owns the engine), what the server
reads from the engine once at start (tokenizer, context, vocabulary, speculation), the chat
template, the model's metadata and the front end's own counters. Its methods are the steps
every generation handler takes: tokenize the prompt, check it fits, submit it to the
scheduler (refusals become HTTP errors), and count and log the result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pyggspec.sampling import SamplingParams
from pyggspec.sampling.grammar import GrammarError
from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.http.chat import ChatTemplate
from pyggspec.serving.http.metrics import ServeMetrics
from pyggspec.serving.http.model_info import ModelInfo
from pyggspec.serving.http.protocol import ApiError, GenParams, context_error, invalid
from pyggspec.serving.http.vertex import VertexAI
from pyggspec.serving.request import (
    QueueFull,
    RequestError,
    RequestFailed,
    RequestHandle,
    Result,
    SchedulerClosed,
)
from pyggspec.serving.request import Request as GenRequest

log = logging.getLogger("pyggspec.serve")


@dataclass
class ServerConfig:
    """What the server adds to the engine: names, defaults, access."""

    model_id: str  # what /v1/models reports and responses echo when a request names none
    model_path: str = ""
    aliases: tuple[str, ...] = ()  # -a A,B,...: llama-server lists them in /v1/models
    tags: tuple[str, ...] = ()  # --tags: informational, listed in /v1/models
    endpoint_slots: bool = True  # --no-slots: GET /slots answers 501, as llama-server
    api_key: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int | None = None  # default output limit (-n); None: until EOG/context
    synthetic: bool = False  # the built-in demo model
    jinja: bool = True
    chat_template: str | None = None  # override of the file's template
    slot_save_path: str | None = None  # --slot-save-path: POST /slots/{id}?action= (None: 501)
    spm_infill: bool = False  # --spm-infill: /infill puts the suffix before the prefix
    # chat answers (llama-server's flags of the same names; see chat_request.py)
    reasoning_format: str = "auto"  # none | auto | deepseek | deepseek-legacy
    reasoning: str = "auto"  # on | off | auto: the template's enable_thinking
    reasoning_budget: int = -1  # thinking tokens before </think> is forced; -1: no limit
    reasoning_budget_message: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    skip_chat_parsing: bool = False  # all of the answer is content
    prefill_assistant: bool = True  # a trailing assistant message is continued
    endpoint_metrics: bool = True  # serve's --metrics (off there, as llama-server): else 501
    verbose: bool = False  # serve's --verbose: responses carry __verbose unless asked not to
    vertex: VertexAI | None = None  # AIP_MODE=PREDICTION: Vertex AI's /predict (vertex.py)
    media_path: str | None = None  # --media-path: image_url file:// names are read here


class ServerState:
    """Everything the handlers share: scheduler, engine, tokenizer, template, counters."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.config = config
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the engine has no tokenizer (load_tokenizer=False); the server "
                             "needs one")
        self.n_ctx: int = int(self.engine.n_ctx)
        self.n_vocab: int = int(self.engine.n_vocab)
        self.n_parallel: int = int(self.engine.n_parallel)
        self.backend_sampling = bool(getattr(self.engine, "backend_sampling", False))
        self.template = ChatTemplate(self.tokenizer, config.chat_template, config.jinja)
        self._eog: list[int] | None = None
        spec = getattr(self.engine, "spec", None)
        self.speculative = bool(getattr(self.engine, "spec_type", None))
        self.n_max = int(spec.n_max) if spec is not None and self.speculative else 0
        self.metrics = ServeMetrics(self.n_max)
        self.model_info = ModelInfo.of(self.engine)
        self.created = oa.now()
        self.vision = None  # media.Vision over the engine's projector (--mmproj), or None
        if getattr(self.engine, "projector", None) is not None:
            from pyggspec.serving.http.media import Vision

            self.vision = Vision(self.engine.projector, self.tokenizer, config.media_path)
        self.started = False
        self._pending: set[asyncio.Future] = set()

    # --- before submitting -----------------------------------------------------------------
    def tokenize_prompt(self, parts: list[Any]) -> list[int]:
        """llama-server's rule: text is tokenized with special tokens parsed; BOS (where
        the vocabulary adds one) only when the prompt starts with text."""
        ids: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, str):
                ids.extend(self.tokenizer.tokenize(p, add_special=(i == 0),
                                                   parse_special=True))
            else:
                ids.append(int(p))
        return ids

    def prompt_rows(self, parts: list[Any], gen: GenParams) -> tuple[list[int], Any]:
        """A parsed prompt's ids (EMBD_ROW at image rows), checked against the context, and
        its image rows (None: text only); images are encoded once the prompt fits."""
        from pyggspec.serving.http.media import _b64, chunk_ids
        from pyggspec.serving.http.protocol import ImagePrompt, no_projector

        if not (parts and isinstance(parts[0], ImagePrompt)):
            ids = self.tokenize_prompt(parts)
            self.check_context(ids, gen)
            return ids, None
        if self.vision is None:
            raise no_projector("prompt.multimodal_data")
        p = parts[0]
        data = [_b64(d, "prompt.multimodal_data") for d in p.data]
        chunks = self.vision.chunks(p.text, data, "prompt")
        ids = chunk_ids(chunks)
        self.check_context(ids, gen)
        return ids, self.encode(chunks).result().media

    def encode(self, chunks: list[Any]) -> Future:
        """The chunks' images encoded on the engine's thread (:meth:`Scheduler.on_engine_thread`
        says why): a future of their :class:`~pyggspec.vision.rows.PromptRows`."""
        vision = self.vision
        return self.scheduler.on_engine_thread(lambda: vision.rows(chunks))

    def prompt_text(self, ids: list[int]) -> str:
        """A prompt as llama-server shows it (``__verbose``, ``echo``): its text rows
        detokenized with their special tokens, image rows (negative ids) left out, as
        ``server_tokens::detokenize`` leaves them out."""
        return self.tokenizer.detokenize([t for t in ids if t >= 0])

    def text_ids(self, text: str) -> list[int]:
        """``text``'s tokens without special tokens (``logit_bias`` keyed by text, as
        llama-server's ``common_tokenize(vocab, text, false)``)."""
        return self.tokenizer.tokenize(text, add_special=False, parse_special=False)

    def check_context(self, ids: list[int], gen: GenParams) -> None:
        """The engine's emit rule: the prompt fits and leaves room for one token when any
        is asked for (llama-server's exceed_context_size_error otherwise)."""
        if not ids:
            raise invalid("the prompt is empty (no tokens)", "prompt")
        want = gen.max_tokens is None or gen.max_tokens > 0
        if len(ids) > self.n_ctx or (want and len(ids) >= self.n_ctx):
            raise context_error(len(ids), self.n_ctx, room=len(ids) <= self.n_ctx)

    def model_name(self, body: Mapping[str, Any]) -> str:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise invalid("'model' must be a string", "model")
        return m or self.config.model_id

    def settings(self, gen: GenParams) -> dict[str, Any]:
        """llama-server's ``generation_settings`` for ``gen`` on this server."""
        return oa.generation_settings(gen, n_ctx=self.n_ctx, model_id=self.config.model_id,
                                      speculative=self.speculative, n_max=self.n_max,
                                      backend_sampling=self.backend_sampling,
                                      eog=self.eog_ids() if gen.ignore_eos else ())

    def eog_ids(self) -> list[int]:
        """The vocabulary's end-of-generation ids (one pass over it, then kept)."""
        if self._eog is None:
            self._eog = self.tokenizer.eog_ids()
        return self._eog

    # --- submitting and finishing ----------------------------------------------------------
    async def submit(self, ids: list[int], gen: GenParams, rid: str,
                     cache_prompt: bool = True, progress: bool | None = None,
                     media: Any = None) -> RequestHandle:
        """Queue the request (off the event loop: submit may wait for the scheduler's lock
        while a step runs); scheduler refusals become HTTP errors. ``progress``: the
        handle's events include prompt progress (default: when streamed, which is where
        ``return_progress`` and ``timings_per_token`` are read, see ``LiveTimings``)."""
        if gen.slot is not None and gen.slot >= self.n_parallel:
            raise invalid(f"'id_slot' must be -1 (any slot) or 0..{self.n_parallel - 1}, "
                          f"got {gen.slot}", "id_slot")
        if gen.n_draft_max is not None and gen.n_draft_max > self.n_max:
            raise invalid(f"'speculative.n_max' must be at most the server's "
                          f"--spec-draft-n-max ({self.n_max}), got {gen.n_draft_max}",
                          "speculative.n_max")
        req = GenRequest(prompt=ids, max_tokens=gen.max_tokens, sampling=gen.sampling,
                         stop=gen.stop, ignore_eos=gen.ignore_eos, speculative=gen.speculative,
                         n_draft_max=gen.n_draft_max, cache_prompt=cache_prompt, id=rid,
                         logprobs=gen.n_probs, post_sampling_probs=gen.post_sampling_probs,
                         grammar=gen.grammar, slot=gen.slot,
                         progress=gen.stream if progress is None else progress,
                         media=media)
        try:
            return await asyncio.to_thread(self.scheduler.submit, req)
        except RequestError as e:
            raise invalid(e.message) from None
        except GrammarError as e:  # compiled in submit (off the event loop)
            raise invalid(f"'{e.where}': {e.message}", e.where) from None
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e.message}; retry later") from None
        except SchedulerClosed as e:
            raise ApiError(503, f"server is shutting down: {e.message}") from None

    def record_when_done(self, handle: Any) -> None:
        """Count a request whose client left (cancelled) once the scheduler has ended it."""

        async def wait() -> None:
            try:
                self.finished(await handle.aresult(), 0.0, None)
            except RequestFailed:
                pass

        self._pending.add(task := asyncio.ensure_future(wait()))
        task.add_done_callback(self._pending.discard)

    def finished(self, result: Result, t_start: float, t_first: float | None) -> None:
        """Count a finished request and log its one line."""
        self.metrics.record_result(result)
        if t_first is not None:
            self.metrics.record_ttft(t_first - t_start)
        t = result.timings
        spec = ""
        if result.spec is not None and result.spec.n_drafted:
            spec = (f", draft acceptance {result.spec.acceptance:.3f} "
                    f"({result.spec.n_accepted}/{result.spec.n_drafted})")
        log.info("%s: slot %d, prompt %d (+%d cached) tokens %.1f ms, %d tokens %.1f ms "
                 "(%.2f t/s), %s%s", result.id, result.slot, t.prompt_n, t.cache_n,
                 t.prompt_ms, t.predicted_n, t.predicted_ms,
                 t.predicted_n / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0,
                 result.stop_reason, spec)
