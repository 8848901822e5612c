"""llama.cpp's speculation flags as one click decorator, shared by ``run`` and ``serve``
(as :func:`~pyggspec.sampling.params.sampling_options` is for sampling)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from pyggspec.config import SpecConfig


@dataclass(frozen=True)
class SpecOptions:
    """What :func:`spec_options` hands the command."""

    spec_type: str  # "none" | "draft-mtp"
    draft_model: Path | None  # a separate MTP-only GGUF
    config: SpecConfig
    mtp_type_k: str
    mtp_type_v: str

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """The Engine arguments these flags set."""
        return {"mtp_path": self.draft_model, "spec_type": self.spec_type,
                "spec": self.config, "mtp_type_k": self.mtp_type_k,
                "mtp_type_v": self.mtp_type_v}


F = TypeVar("F", bound=Callable[..., Any])

_NAMES = ("spec_type", "draft_model", "n_max", "n_min", "p_min", "draft_adaptive",
          "draft_sampling", "draft_head", "draft_vocab", "rollback", "mtp_type_k", "mtp_type_v")


def spec_options(fn: F) -> F:
    """Add the speculation flags to a click command; it receives ``spec`` (a
    :class:`SpecOptions`) instead of the individual values."""
    opts = [
        click.option("--spec-type", "spec_type", type=click.Choice(["none", "draft-mtp"]),
                     default="none", show_default=True, help="Speculative decoding."),
        click.option("-md", "--spec-draft-model", "--model-draft", "draft_model",
                     type=click.Path(path_type=Path), default=None,
                     help="Separate MTP-only GGUF (mtp-*.gguf) for --spec-type draft-mtp."),
        click.option("--spec-draft-n-max", "n_max", type=click.IntRange(min=1), default=3,
                     show_default=True, help="Most tokens drafted per step."),
        click.option("--spec-draft-n-min", "n_min", type=click.IntRange(min=0), default=0,
                     show_default=True, help="Drop drafts shorter than this."),
        click.option("--spec-draft-p-min", "p_min", type=click.FloatRange(0.0, 1.0),
                     default=0.0, show_default=True,
                     help="Stop drafting below this probability: the head's softmax over the "
                          "full vocabulary for argmax drafts; for coupled draws, the chain's "
                          "probability of the drawn token (after its filters and temperature; "
                          "computed on the host from the head's logits)."),
        click.option("--spec-draft-adaptive/--spec-draft-fixed", "draft_adaptive",
                     default=False, show_default=True,
                     help="Choose each step's draft length from measured acceptance and "
                          "costs (--spec-draft-n-max the cap), or always draft n_max."),
        click.option("--spec-draft-sampling", "draft_sampling",
                     type=click.Choice(["coupled", "greedy"]), default="coupled",
                     show_default=True,
                     help="With --temp > 0: draw each draft through the sequence's own "
                          "sampler chain with the noise the target will use for that token "
                          "(coupled), or take the head's argmax (greedy, as llama.cpp). "
                          "Greedy decoding drafts the argmax either way."),
        click.option("--spec-draft-head", "draft_head", metavar="TYPE", default="",
                     help="Draft with a copy of the LM head in this ggml type (e.g. q4_0); "
                          "the target still verifies with its own weights."),
        click.option("--spec-draft-vocab", "draft_vocab", type=click.IntRange(min=0),
                     default=0, show_default=True,
                     help="Draft over the first N token ids only (0: all); the LM head "
                          "dominates a draft step. Not with --spec-draft-p-min."),
        click.option("--spec-rollback", "rollback",
                     type=click.Choice(["auto", "snapshot", "checkpoint"]), default="auto",
                     show_default=True, help="Recurrent-state rollback after partial "
                                             "acceptance."),
        click.option("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft", "mtp_type_k",
                     default="f16", show_default=True, help="MTP head KV cache type (K)."),
        click.option("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft", "mtp_type_v",
                     default="f16", show_default=True, help="MTP head KV cache type (V)."),
    ]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        v = {n: kwargs.pop(n) for n in _NAMES}
        if v["n_min"] > v["n_max"]:
            raise click.BadParameter(f"{v['n_min']} > --spec-draft-n-max {v['n_max']}",
                                     param_hint="'--spec-draft-n-min'")
        config = SpecConfig(n_max=v["n_max"], n_min=v["n_min"], p_min=v["p_min"],
                            rollback=v["rollback"], draft_vocab=v["draft_vocab"],
                            draft_head=v["draft_head"], adaptive=v["draft_adaptive"],
                            draft_sampling=v["draft_sampling"])
        kwargs["spec"] = SpecOptions(v["spec_type"], v["draft_model"], config,
                                     v["mtp_type_k"], v["mtp_type_v"])
        return fn(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper  # type: ignore[return-value]
