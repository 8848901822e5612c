"""A prompt with images as the trunk takes it: token ids, with :data:`EMBD_ROW` at the image
rows, and :class:`~pyggspec.models.batch.MediaRows` (the projector's embedding rows and every
row's M-RoPE position).

Why here: the worker evaluates rows without knowing about projectors; this is the one place
that turns libmtmd's chunks into those rows (encoding each image once), so the engine, the
server and the tests build image prompts the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyggspec.models.batch import EMBD_ROW, MediaRows
from pyggspec.vision.positions import prompt_positions
from pyggspec.vision.projector import Image, ImageChunk, Projector, PromptChunk, TextChunk

__all__ = ["PromptRows", "chunk_rows", "prompt_rows"]


@dataclass(frozen=True)
class PromptRows:
    """``tokens`` (EMBD_ROW at image rows) and their ``media`` (None: text only)."""

    tokens: list[int]
    media: MediaRows | None
    chunks: tuple[PromptChunk, ...]

    @property
    def n_images(self) -> int:
        return sum(isinstance(c, ImageChunk) for c in self.chunks)


def chunk_rows(projector: Projector, chunks: Sequence[PromptChunk]) -> PromptRows:
    """The rows of already tokenized chunks (each image encoded here), positions from 0."""
    tokens: list[int] = []
    embd: list[np.ndarray] = []
    is_embd: list[np.ndarray] = []
    images: list[tuple[int, int, str]] = []
    for c in chunks:
        if isinstance(c, TextChunk):
            tokens.extend(c.tokens)
            is_embd.append(np.zeros(c.n_tokens, bool))
        else:
            rows = projector.encode(c)
            images.append((len(tokens), c.n_tokens, c.id))
            tokens.extend([EMBD_ROW] * c.n_tokens)
            embd.append(rows)
            is_embd.append(np.ones(c.n_tokens, bool))
    if not embd:
        return PromptRows(tokens, None, tuple(chunks))
    pos, n_pos = prompt_positions(chunks, 0)
    media = MediaRows(np.concatenate(embd), np.concatenate(is_embd), pos, n_pos,
                      tuple(images))
    return PromptRows(tokens, media, tuple(chunks))


def prompt_rows(projector: Projector, prompt: str, images: Sequence[Image | bytes], *,
                add_special: bool = True) -> PromptRows:
    """``prompt`` with one ``<__media__>`` marker per image (none: the images go first,
    llama-mtmd-cli's rule), tokenized by libmtmd and encoded."""
    mark = projector.marker
    if images and mark not in prompt:
        prompt = mark * len(images) + prompt
    chunks = projector.tokenize(prompt, images, add_special=add_special)
    return chunk_rows(projector, chunks)
