"""A generating sequence, the batch the scheduler hands the worker, and what a step returns.

Pure data (no numpy, no ggml). The scheduler is the only code that changes a
:class:`Sequence` (its ``update`` appends tokens and decides every finish); the worker
reads a :class:`Batch` and returns a :class:`StepOutput` (vLLM v1's request / scheduler
output / model runner output split).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

UNLIMITED = 1 << 40  # max_tokens of a request without a limit: the context ends it


class SeqStatus(enum.Enum):
    """Where a sequence is; the finished ones name their finish reason."""

    PREFILL = "prefill"  # holds a slot, its prompt is being evaluated
    RUNNING = "running"  # generating
    FINISHED_EOS = "eos"  # the target chose an end-of-generation token
    FINISHED_STOP = "stop"  # a stop string
    FINISHED_LENGTH = "length"  # max_tokens
    FINISHED_CONTEXT = "context"  # prompt + output reached n_ctx
    CANCELLED = "cancelled"
    FAILED = "failed"  # its step raised; the error went to its handle

    @property
    def finished(self) -> bool:
        return self not in (SeqStatus.PREFILL, SeqStatus.RUNNING)


def emit_room(n_ctx: int, n_held: int, budget: int) -> int:
    """How many more tokens a sequence may emit: the one length/context rule.

    A sequence holding ``n_held`` tokens (prompt + emitted) may emit a token only if it fits
    the context, so prompt + output never exceed ``n_ctx``: the last emitted token may take
    position ``n_ctx - 1`` (it is emitted but never evaluated; nothing needs its logits),
    and at most ``budget`` (-n) tokens are emitted. This is llama-server's rule (it stops
    once the evaluated tokens + 1 reach n_ctx). A speculative step drafts at most
    ``room - 1`` tokens, so it can emit exactly the tokens plain decoding would and stops
    at the same one; -n 0 samples nothing.
    """
    return max(0, min(budget, n_ctx - n_held))


@dataclass(frozen=True)
class LogprobRequest:
    """What a sequence asks to know of each token it emits: the ``n_top`` most likely
    alternatives besides the token itself, from the raw softmax of the logits or, with
    ``post_sampling``, from the sampler chain's distribution (llama-server's ``n_probs`` and
    ``post_sampling_probs``)."""

    n_top: int
    post_sampling: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target and the most likely tokens at
    its position with theirs (most likely first; ties: lowest id). ``-inf``: the token had
    probability 0 (a post-sampling filter removed it)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "logprob": self.logprob,
                "top": [{"id": i, "logprob": lp} for i, lp in self.top]}


@dataclass(eq=False)
class Sequence:
    """One request's generation in one slot (vLLM v1's Request, reduced to what we use).

    Prompt progress: ``n_cached`` tokens were reused from the slot's cache, ``n_done`` are
    in the cache (reused + evaluated). Once running, the last of ``out`` is the *pending*
    token: emitted, not yet evaluated by the target. Where ``n_done`` advances (admission,
    each prompt chunk) the scheduler reports it to the owner's handle (:func:`report_progress`).
    """

    id: str
    slot: int
    prompt: list[int]
    max_tokens: int  # UNLIMITED when the request has no limit
    is_stop: Callable[[int], bool]  # end-of-generation test (never true with ignore_eos)
    spec: bool = False  # speculates (its slot keeps an MTP cache)
    n_max: int | None = None  # its draft cap (None: the engine's)
    logprobs: LogprobRequest | None = None  # what to report of each token (None: nothing)
    n_cached: int = 0
    n_done: int = 0
    out: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.PREFILL
    stop_word: str | None = None
    owner: Any = None  # what the scheduler keeps with it (handle, text stream, timings)

    def room(self, n_ctx: int) -> int:
        """Tokens it may still emit (:func:`emit_room`)."""
        return emit_room(n_ctx, len(self.prompt) + len(self.out), self.max_tokens - len(self.out))

    def length_reason(self) -> SeqStatus:
        """Why a sequence with no room left ends: its limit, else the context."""
        return (SeqStatus.FINISHED_LENGTH if len(self.out) >= self.max_tokens
                else SeqStatus.FINISHED_CONTEXT)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


def report_progress(seq: Sequence) -> None:
    """Prompt progress for a request that asked for it (llama-server's ``return_progress``):
    the scheduler calls this where it advances ``n_done`` -- when the sequence is admitted
    (``n_done`` = the reused tokens) and after each prompt chunk -- and the owner's handle
    gets an event."""
    owner = seq.owner
    handle = getattr(owner, "handle", None)
    if handle is not None and seq.status is SeqStatus.PREFILL:
        handle._progress(len(seq.prompt), seq.n_cached, seq.n_done,
                         getattr(owner, "t_start", None))


@dataclass(frozen=True)
class PromptChunk:
    """``tokens`` of a sequence's prompt at positions ``pos0..``; ``sample``: the prompt
    ends here and its first token is wanted; ``warm``: the MTP cache takes the pairs;
    ``checkpoint``: keep a copy of the recurrent state after the chunk (prompt reuse)."""

    slot: int
    pos0: int
    tokens: list[int]
    last: bool
    sample: bool
    warm: bool
    checkpoint: bool = False
    logprobs: LogprobRequest | None = None  # report the sampled token's (None: nothing)


@dataclass(frozen=True)
class DecodeItem:
    """A running sequence's step: its pending token, how many drafts it may take
    (``room - 1`` capped by ``n_max``; 0 for a plain row) and its end-of-output test."""

    slot: int
    seq_id: str
    pending: int
    n_draft: int
    spec: bool
    is_stop: Callable[[int], bool]
    logprobs: LogprobRequest | None = None  # report each emitted token's (None: nothing)


@dataclass
class Batch:
    """One step's work: one ubatch of prompt chunks (equal lengths) and/or one decode or
    verify batch of running sequences."""

    prompt: list[PromptChunk] = field(default_factory=list)
    decode: list[DecodeItem] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompt or self.decode)


@dataclass
class SeqOutput:
    """What the target chose for one sequence in a step: ``tokens`` in order (the last
    one may be an end-of-generation token: nothing follows it), the drafts verified and
    accepted, the graph evaluations the sequence took part in, and, for a sequence that
    asked, each token's log-probabilities (``logprobs[i]`` is ``tokens[i]``'s)."""

    tokens: list[int] = field(default_factory=list)
    n_drafted: int = 0
    n_accepted: int = 0
    spec: bool = False  # a speculative row (its drafts count in the statistics)
    target_evals: int = 0
    mtp_evals: int = 0
    logprobs: list[TokenLogprob] | None = None
    # index in ``tokens`` of the token after which the sequence's grammar allows nothing
    # but end of generation: the output ends with it (None: no grammar, or not yet)
    grammar_end: int | None = None


@dataclass
class StepOutput:
    """The worker's answer to a :class:`Batch`: per slot what the target chose (the first
    token after a prompt, or a decode step's tokens), the slots whose work failed, the
    step's graph evaluations and its device time."""

    seqs: dict[int, SeqOutput] = field(default_factory=dict)
    failed: dict[int, BaseException] = field(default_factory=dict)
    target_evals: int = 0  # decode part only (prompt chunks are counted per sequence)
    mtp_evals: int = 0
    decode_ms: float = 0.0  # wall time of the decode/verify part
    device_ms: float = 0.0  # ... of which the devices ran graphs (the rest is Python)
