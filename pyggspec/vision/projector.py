"""The vision projector (mmproj GGUF): its facts, and images -> chunks -> embedding rows.

Why this shape: libmtmd does everything image-specific (decoding, resizing to the projector's
token budget, patching, the ViT and the merger); pyggspec only has to place the rows it
returns into the trunk's batches, at the positions llama.cpp gives them. So a
:class:`Projector` is a thin, checked wrapper around one libmtmd context
(``pyggspec.vision._mtmd``), and :func:`read_projector_info` reads what a plan needs from the
GGUF alone (no libmtmd, no weights loaded), for ``pyggspec inspect``.

libmtmd needs a ``llama_model`` for the text side (vocabulary for the text chunks and the
``<|vision_start|>`` / ``<|vision_end|>`` tokens, rope type for the positions). We give it the
vocabulary-only model our :class:`~pyggspec.tokenizer.Tokenizer` already loaded from the same
text GGUF: no tensors are read twice, and the token ids are llama.cpp's. With a vocab-only
model libmtmd's own width check does not run (``llama_model_n_embd_inp`` is 0 there), so the
projector's output width is checked here against the text GGUF's ``embedding_length``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pyggspec.errors import ModelFileError, PyggspecError
from pyggspec.modelfile.gguf import GGUFFile
from pyggspec.vision import _mtmd
from pyggspec.vision._mtmd import CHUNK_IMAGE, CHUNK_TEXT, Chunk, MtmdError

log = logging.getLogger("pyggspec.vision")

if TYPE_CHECKING:
    from typing_extensions import Self

    from pyggspec.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_PROJECTORS",
    "Image",
    "ImageError",
    "Projector",
    "ProjectorInfo",
    "read_projector_info",
]

# Projector types pyggspec runs, with libmtmd's default image token budget for each (merged
# tokens per image; clip.cpp: set_limit_image_tokens(8, 4096) for Qwen2/2.5/3-VL). The budget
# is libmtmd's; it is repeated here only so that inspect can print it without loading the
# projector, and tests check it against libmtmd's own preprocessing.
SUPPORTED_PROJECTORS: dict[str, tuple[int, int]] = {"qwen3vl_merger": (8, 4096)}
# the encoded rows kept for images sent again (a few images of a 0.8B-VL's 1,024-wide rows)
ENCODED_BYTES = 64 << 20


class ImageError(PyggspecError):
    """An image that cannot be used (corrupt or unsupported bytes, too large)."""


@dataclass(frozen=True)
class ProjectorInfo:
    """What an mmproj GGUF is, from its metadata and tensor index."""

    path: Path
    projector_type: str  # clip.projector_type, e.g. "qwen3vl_merger"
    n_embd: int  # width of the rows it outputs (must equal the text model's n_embd)
    projection_dim: int | None  # clip.vision.projection_dim as the converter wrote it
    n_embd_vision: int  # ViT width
    n_layer: int
    n_head: int
    n_ff: int
    image_size: int  # the learned position grid's side in pixels
    patch_size: int
    n_merge: int  # spatial merge (2: 2x2 patches -> one row)
    n_deepstack: int
    image_min_tokens: int | None  # libmtmd's default budget (None: type not supported)
    image_max_tokens: int | None
    weights_bytes: int
    n_tensors: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type -> tensor count
    file_size: int = 0
    fingerprint: str = ""  # GGUFFile.fingerprint: which projector made a slot's image rows

    @property
    def supported(self) -> bool:
        return self.projector_type in SUPPORTED_PROJECTORS


def read_projector_info(path: str | os.PathLike[str]) -> ProjectorInfo:
    """Read an mmproj GGUF's facts; ``ModelFileError`` if it is not a vision projector."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(p, "no such file" if not p.exists() else "not a regular file")
    g = GGUFFile(p)
    try:
        arch = g.get("general.architecture")
        if arch != "clip" or g.get("general.type", "mmproj") != "mmproj":
            what = "a text model" if arch and arch != "clip" else f"architecture {arch!r}"
            raise ModelFileError(p, f"not a projector (mmproj) file: {what}; make one with "
                                 "convert_hf_to_gguf.py --mmproj")
        if not g.get("clip.has_vision_encoder", False):
            raise ModelFileError(p, "the projector has no vision encoder")
        ptype = str(g.get("clip.vision.projector_type") or g.get("clip.projector_type") or "")
        deep = g.get("clip.vision.is_deepstack_layers") or []
        n_deep = sum(bool(x) for x in deep)
        bias = g.tensors.get("mm.2.bias")
        if bias is not None:
            n_out = int(bias.ne[0]) * (1 + n_deep)
        else:
            n_out = int(g.get("clip.vision.projection_dim", 0) or 0)
        types: dict[str, int] = {}
        for t in g.tensors.values():
            types[t.type_name] = types.get(t.type_name, 0) + 1
        budget = SUPPORTED_PROJECTORS.get(ptype)

        def u(key: str) -> int:
            return int(g.get(key, 0) or 0)

        pd = g.get("clip.vision.projection_dim")
        return ProjectorInfo(
            path=p, projector_type=ptype, n_embd=n_out,
            projection_dim=None if pd is None else int(pd),
            n_embd_vision=u("clip.vision.embedding_length"),
            n_layer=u("clip.vision.block_count"), n_head=u("clip.vision.attention.head_count"),
            n_ff=u("clip.vision.feed_forward_length"), image_size=u("clip.vision.image_size"),
            patch_size=u("clip.vision.patch_size"),
            n_merge=int(g.get("clip.vision.spatial_merge_size", 2) or 2), n_deepstack=n_deep,
            image_min_tokens=budget[0] if budget else None,
            image_max_tokens=budget[1] if budget else None,
            weights_bytes=sum(t.nbytes for t in g.tensors.values()),
            n_tensors=len(g.tensors), tensor_types=dict(sorted(types.items())),
            file_size=g.file_size, fingerprint=g.fingerprint(),
        )
    finally:
        g.close()


def _text_n_embd(model_path: Path) -> tuple[str, int]:
    g = GGUFFile(model_path)
    try:
        arch = str(g.get("general.architecture") or "")
        return arch, int(g.get(f"{arch}.embedding_length", 0) or 0)
    finally:
        g.close()


@dataclass(frozen=True)
class Image:
    """A decoded image: its size and id (the SHA-256 of its bytes, as llama-server keys
    cached image rows)."""

    width: int
    height: int
    id: str
    _bitmap: _mtmd.Bitmap = field(repr=False, compare=False)


@dataclass(frozen=True, eq=False)
class TextChunk:
    """Text tokens of a tokenized prompt (llama.cpp's ids)."""

    tokens: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_pos(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, eq=False)
class ImageChunk:
    """One image's rows: ``n_tokens`` = ``nx * ny`` merged patches, row-major; the position
    advances by ``n_pos`` (``max(nx, ny)`` under M-RoPE) past it."""

    n_tokens: int
    n_pos: int
    nx: int
    ny: int
    id: str
    non_causal: bool
    _chunk: Chunk = field(repr=False)


PromptChunk = TextChunk | ImageChunk


class Projector:
    """An mmproj GGUF opened with libmtmd against a text model's vocabulary.

    ``model``: the text GGUF's path, or its already open :class:`Tokenizer` (shared, not
    closed here). ``offload``: let libmtmd run the encoder on its GPU device (llama-server's
    default; ``--no-mmproj-offload`` turns it off). ``image_min_tokens`` /
    ``image_max_tokens``: override the projector's token budget per image (llama-server's
    ``--image-min-tokens`` / ``--image-max-tokens``).
    """

    def __init__(self, mmproj: str | os.PathLike[str], model: str | os.PathLike[str] | Tokenizer,
                 *, offload: bool = True, n_threads: int | None = None,
                 image_min_tokens: int | None = None, image_max_tokens: int | None = None
                 ) -> None:
        from pyggspec.tokenizer import Tokenizer

        self.path = Path(mmproj)
        self.info = read_projector_info(self.path)
        if not self.info.supported:
            raise ModelFileError(self.path, f"projector type {self.info.projector_type!r} is "
                                 f"not supported (pyggspec runs "
                                 f"{', '.join(SUPPORTED_PROJECTORS)})")
        self._own_tok = not isinstance(model, Tokenizer)
        tok = Tokenizer(model) if self._own_tok else model  # type: ignore[arg-type]
        self.tokenizer: Tokenizer = tok  # type: ignore[assignment]
        try:
            arch, n_embd = _text_n_embd(tok.path)
            if arch not in ("qwen35", "qwen35moe"):
                raise ModelFileError(tok.path, f"architecture {arch!r}: image inputs need a "
                                     "Qwen3.5/3.6 text model (qwen35, qwen35moe)")
            if n_embd != self.info.n_embd:
                raise ModelFileError(self.path, f"projector outputs rows of {self.info.n_embd}, "
                                     f"the text model {tok.path.name} takes {n_embd} (n_embd): "
                                     "not this model's projector")
            for name, v in (("image_min_tokens", image_min_tokens),
                            ("image_max_tokens", image_max_tokens)):
                if v is not None and v < 1:
                    raise ValueError(f"{name} must be >= 1, not {v}")
            try:
                # the Tokenizer's vocabulary-only llama_model (see the module docstring)
                self._ctx = _mtmd.Context(str(self.path), tok._model, use_gpu=offload,
                                          n_threads=n_threads,
                                          image_min_tokens=image_min_tokens,
                                          image_max_tokens=image_max_tokens)
            except MtmdError as e:
                raise ModelFileError(self.path, f"libmtmd cannot load the projector: "
                                     f"{e.reason}") from None
        except BaseException:
            if self._own_tok:
                tok.close()
            raise
        self.n_embd: int = n_embd
        self._encoded: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()
        facts = self._ctx.facts
        self.uses_mrope: bool = facts.uses_mrope
        self.marker: str = facts.marker  # "<__media__>"
        # libmtmd reports its compute buffer only in its log (bytes, 2-decimal MiB precision)
        self.compute_buffers: dict[str, int] = dict(facts.compute_buffers)

    # -- images ----------------------------------------------------------------------------
    def image(self, data: bytes, name: str | os.PathLike[str] | None = None) -> Image:
        """Decode image bytes (PNG, JPEG, BMP, GIF, TGA, ... as libmtmd's stb_image reads
        them). ``name`` is only for the error message."""
        try:
            bm = self._ctx.bitmap(bytes(data))
        except MtmdError as e:
            raise ImageError(name if name is not None else "image", e.reason) from None
        return Image(bm.width, bm.height, bm.id, bm)

    def load_image(self, path: str | os.PathLike[str]) -> Image:
        """:meth:`image` of a file's bytes."""
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise ImageError(p, e.strerror or str(e)) from None
        return self.image(data, p)

    # -- prompt ----------------------------------------------------------------------------
    def tokenize(self, prompt: str, images: Sequence[Image | bytes], *,
                 add_special: bool = True, parse_special: bool = True) -> list[PromptChunk]:
        """Cut ``prompt`` into text and image chunks as libmtmd does: each :attr:`marker`
        takes the next image, in order; an image's chunk is wrapped in the projector's
        begin/end tokens (``<|vision_start|>`` ... ``<|vision_end|>``, in the text chunks).
        The number of markers must equal the number of images."""
        imgs = [im if isinstance(im, Image) else self.image(im) for im in images]
        n_marks = prompt.count(self.marker)
        if n_marks != len(imgs):
            raise ImageError(None, f"the prompt has {n_marks} {self.marker} marker(s) for "
                             f"{len(imgs)} image(s)")
        try:
            chunks = self._ctx.tokenize(prompt, [im._bitmap for im in imgs], add_special,
                                        parse_special)
        except MtmdError as e:
            raise ImageError(None, e.reason) from None
        out: list[PromptChunk] = []
        for c in chunks:
            if c.kind == CHUNK_TEXT:
                out.append(TextChunk(c.tokens))
            elif c.kind == CHUNK_IMAGE:
                out.append(ImageChunk(c.n_tokens, c.n_pos, c.nx, c.ny, c.id or "",
                                      bool(c.non_causal), c))
            else:
                raise ImageError(None, "libmtmd returned an audio chunk (not supported)")
        return out

    def encode(self, chunk: ImageChunk) -> np.ndarray:
        """The image's embedding rows: float32 [n_tokens, n_embd], row-major over the merged
        patch grid (the rows the trunk takes in place of token embeddings).

        The newest images' rows are kept (up to :data:`ENCODED_BYTES`), keyed by content:
        a later chat turn sends the same image again, and its rows come from the slot's
        cache, so encoding it again would be the turn's dearest work for nothing."""
        key = (chunk.id, chunk.nx, chunk.ny) if chunk.id else None
        if key is not None and key in self._encoded:
            self._encoded.move_to_end(key)
            return self._encoded[key]
        t0 = time.perf_counter()
        try:
            rows = self._ctx.encode(chunk._chunk, self.n_embd)
        except MtmdError as e:
            raise ImageError(None, f"encoding the image failed: {e.reason}") from None
        # llama-server logs the same ("image slice encoded in N ms"): the request's prompt
        # time does not hold the encoding, so this is where a user sees what it cost.
        log.info("image encoded in %.0f ms (%d rows)", (time.perf_counter() - t0) * 1e3,
                 rows.shape[0])
        if key is not None and rows.nbytes <= ENCODED_BYTES:
            rows.setflags(write=False)
            self._encoded[key] = rows
            while sum(r.nbytes for r in self._encoded.values()) > ENCODED_BYTES:
                self._encoded.popitem(last=False)
        return rows

    def decoder_positions(self, chunk: ImageChunk, pos_0: int) -> np.ndarray:
        """libmtmd's own (t, x, y, z) positions of the chunk's rows from ``pos_0``,
        int32 [n_tokens, 4] (``mtmd_helper_image_get_decoder_pos``; the reference for
        :func:`pyggspec.vision.positions.image_positions`)."""
        return self._ctx.decoder_positions(chunk._chunk, pos_0)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the libmtmd context (and the tokenizer when this projector opened it)."""
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.close()
        if self._own_tok:
            self.tokenizer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Projector({str(self.path)!r}, type={self.info.projector_type}, "
                f"n_embd={self.n_embd})")
