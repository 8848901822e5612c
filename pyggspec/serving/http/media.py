"""Images in requests, as llama-server takes them: the bytes of an ``image_url`` (a base64
``data:image/...`` URI, raw base64, ``file://NAME`` under ``--media-path``, or an http(s) URL
fetched as llama-server fetches it: 10 s, 10 MiB at most), and a
rendered prompt with one media marker per image -> token ids and image rows.

Why a marker of its own: llama-server renders each image part as a marker text that user
text cannot spell (``<__media_RANDOM__>``, or ``$LLAMA_MEDIA_MARKER``; /props reports it),
so a user who writes libmtmd's ``<__media__>`` gets text, not an image slot. The prompt is
cut at that marker; text pieces are tokenized as any prompt, each image by libmtmd (one
lock: a libmtmd context serves one thread at a time).
"""

from __future__ import annotations

import base64
import binascii
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyggspec.errors import PyggspecError
from pyggspec.serving.http.protocol import (
    invalid,
    media_marker,
    valid_filename,
)


def _b64(data: str, where: str) -> bytes:
    try:
        out = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError):
        raise invalid(f"'{where}': invalid base64 image data", where) from None
    if not out:
        raise invalid(f"'{where}': invalid base64 image data (empty)", where)
    return out


# llama-server's limits for a remote image (server-common.cpp, handle_media)
REMOTE_TIMEOUT_S = 10
REMOTE_MAX_BYTES = 10 << 20


def _download(url: str, where: str) -> bytes:
    """A remote image's bytes; any failure (status, network, size) is the client's 400."""
    try:
        with urllib.request.urlopen(urllib.request.Request(
                url, headers={"User-Agent": "pyggspec"}), timeout=REMOTE_TIMEOUT_S) as r:
            data = r.read(REMOTE_MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise invalid(f"'{where}': failed to download image (HTTP {e.code})", where) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise invalid(f"'{where}': failed to download image ({why})", where) from None
    if len(data) > REMOTE_MAX_BYTES:
        raise invalid(f"'{where}': the image at {url} is larger than "
                      f"{REMOTE_MAX_BYTES >> 20} MiB", where)
    return data


def image_bytes(url: str, media_path: str | None, where: str) -> bytes:
    """The bytes an image URL names (llama-server's ``handle_media``); 400 otherwise."""
    if url.startswith("http"):
        return _download(url, where)
    if url.startswith("file://"):
        if media_path is None:
            raise invalid("file:// URLs are not allowed unless --media-path is specified",
                          where)
        name = url[7:]
        if not valid_filename(name, subdirs=True):
            raise invalid(f"file path is not allowed: {name}", where)
        try:
            return (Path(media_path) / name.lstrip("/")).read_bytes()
        except OSError:
            raise invalid(f"file does not exist or cannot be opened: {name}", where) from None
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or "," in data:
            raise invalid(f"'{where}': invalid uri-encoded base64 value", where)
        if not head.startswith("data:image/"):
            raise invalid(f"'{where}': invalid uri format: {head} (images only)", where)
        if not head.endswith("base64"):
            raise invalid(f"'{where}': uri must be base64 encoded", where)
        return _b64(data, where)
    return _b64(url, where)


class Vision:
    """The server's projector behind one lock: prompt text with markers -> rows."""

    def __init__(self, projector: Any, tokenizer: Any, media_path: str | None) -> None:
        self.projector = projector
        self.tokenizer = tokenizer
        self.media_path = media_path
        self.marker = media_marker()
        self._lock = threading.Lock()

    def chunks(self, text: str, images: Sequence[bytes], where: str = "messages") -> list:
        """libmtmd's chunks of ``text`` (one marker per image), nothing encoded yet."""
        from pyggspec.vision.projector import TextChunk

        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise invalid(f"the prompt has {len(pieces) - 1} media marker(s) for "
                          f"{len(images)} image(s)", where)
        out: list = []
        p = self.projector
        with self._lock:
            try:
                for i, piece in enumerate(pieces):
                    ids = self.tokenizer.tokenize(piece, add_special=i == 0,
                                                  parse_special=True) if piece or i == 0 else []
                    if ids:
                        out.append(TextChunk(tuple(ids)))
                    if i < len(images):
                        out += p.tokenize(p.marker, [p.image(images[i])], add_special=False)
            except PyggspecError as e:
                raise invalid(f"image: {e.message}", where) from None
        return out

    def rows(self, chunks: Sequence[Any]) -> Any:
        """The chunks' :class:`~pyggspec.vision.rows.PromptRows` (images encoded)."""
        from pyggspec.vision.rows import chunk_rows

        with self._lock:
            try:
                return chunk_rows(self.projector, chunks)
            except PyggspecError as e:
                raise invalid(f"image: {e.message}") from None


def chunk_ids(chunks: Sequence[Any]) -> list[int]:
    """The token ids of chunks, EMBD_ROW at image rows (what a context check counts)."""
    from pyggspec.models.batch import EMBD_ROW

    ids: list[int] = []
    for c in chunks:
        ids += list(c.tokens) if hasattr(c, "tokens") else [EMBD_ROW] * c.n_tokens
    return ids


def extend_media(media: Any, n: int) -> Any:
    """``media`` with ``n`` text rows after the prompt (a continued answer's prompt)."""
    import dataclasses

    import numpy as np

    from pyggspec.vision.positions import text_positions

    return dataclasses.replace(media, is_embd=np.concatenate([media.is_embd, np.zeros(n, bool)]),
                               pos=np.concatenate([media.pos, text_positions(n, media.n_pos)],
                                                  axis=1), n_pos=media.n_pos + n)
