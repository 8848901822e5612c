"""llama.cpp with libmtmd as the oracle for image prompts: what llama-mtmd-cli / llama-server
compute for ``prompt`` + images on the same text GGUF and projector.

Why: pyggspec's trunk must reproduce llama.cpp's logits over image rows (issue 52, item 7).
The image chunks go through libmtmd's own ``mtmd_helper_eval_chunk_single`` (encode, then
decode the rows at llama.cpp's M-RoPE positions with llama.cpp's masks) into a context of the
fully loaded model (``pyggspec.testing.oracle.OracleModel``, repacking off); text chunks are
ordinary token batches at the positions libmtmd's helper gives them. libmtmd is reached only
through ``pyggspec.vision._mtmd``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyggspec.testing.oracle import OracleModel
from pyggspec.vision import _mtmd
from pyggspec.vision._mtmd import CHUNK_IMAGE, CHUNK_TEXT

__all__ = ["ImagePromptResult", "image_prompt"]


@dataclass(frozen=True)
class ImagePromptResult:
    """llama.cpp's outcome for one image prompt."""

    logits: np.ndarray  # float32 [n_vocab]: the prompt's last position
    n_past: int  # the position after the prompt
    n_rows: int  # KV rows the prompt filled (text tokens + image rows)
    greedy: list[int]  # greedy continuation (n_new tokens)
    greedy_logits: np.ndarray | None = None  # float32 [n_new, n_vocab]: after each of them


def image_prompt(model: str | os.PathLike[str], mmproj: str | os.PathLike[str], prompt: str,
                 images: Sequence[bytes], *, n_new: int = 0, n_ctx: int = 1024,
                 n_batch: int = 512, n_threads: int = 2,
                 add_special: bool = True) -> ImagePromptResult:
    """Run ``prompt`` (one ``<__media__>`` per image) through llama.cpp + libmtmd; the last
    position's logits and ``n_new`` greedy tokens after it."""
    with OracleModel(model) as om, om.context(n_ctx=n_ctx, n_batch=n_batch,
                                              n_threads=n_threads) as oc:
        ctx = _mtmd.Context(os.fspath(mmproj), om.model, use_gpu=False, n_threads=n_threads,
                            image_min_tokens=None, image_max_tokens=None)
        try:
            bitmaps = [ctx.bitmap(bytes(b)) for b in images]
            chunks = ctx.tokenize(prompt, bitmaps, add_special, True)
            if not chunks or chunks[-1].kind != CHUNK_TEXT:
                raise ValueError("the prompt must end with text (the logits are read there)")
            n_past, n_rows, last = 0, 0, None
            for c in chunks:
                if c.kind == CHUNK_IMAGE:
                    n_past = ctx.eval_image(c, oc.ctx, n_past, 0, n_batch)
                    oc.n_past = n_past
                elif c.kind == CHUNK_TEXT:
                    for i in range(0, len(c.tokens), n_batch):
                        last = oc.eval(c.tokens[i:i + n_batch], logits_all=False)[0]
                    n_past = oc.n_past
                else:
                    raise ValueError("audio chunks are not supported")
                n_rows += c.n_tokens
            assert last is not None
            logits = last.copy()
            out: list[int] = []
            rows: list[np.ndarray] = []
            nxt = last
            for _ in range(n_new):
                t = int(np.argmax(nxt))
                out.append(t)
                nxt = oc.eval([t], logits_all=False)[0]
                rows.append(nxt.copy())
            return ImagePromptResult(logits, n_past, n_rows, out,
                                     np.array(rows, np.float32).reshape(n_new, logits.size))
        finally:
            ctx.close()
