"""The one module that calls libmtmd (llama.cpp's multimodal library), through
``llama_cpp.mtmd_cpp``.

Why ctypes here and not our cffi layer: ``llama_cpp.mtmd_cpp`` is the binding that ships with
the very ``libmtmd.so`` we must use (llama-cpp-python 0.3.36, pinned), struct layouts included
(``mtmd_context_params`` with its callbacks, ``mtmd_decoder_pos``); re-declaring them in
``pyggspec/ggml/`` would copy an ABI that changes with every llama.cpp release. libmtmd also
needs a ``llama_model *``, which only libllama makes (our :class:`~pyggspec.tokenizer.Tokenizer`
already holds a vocabulary-only one through ``llama_cpp``). Nothing of ggml crosses between
the two bindings: libmtmd runs the vision encoder on its own ggml backends and hands back
float rows, which we copy into numpy. So ``pyggspec/ggml/`` stays the only cffi user, and this
module the only libmtmd user; everything above it (``pyggspec.vision.projector``) is plain
Python.

Images are decoded with libmtmd's own stb_image (the same call
``mtmd_helper_bitmap_init_from_buf`` makes for an image) and keyed by the SHA-256 of their
bytes as that helper keys them; we do not call the helper itself because, for bytes stb_image
cannot decode, it goes on to try them as a video through an ``ffmpeg`` subprocess.

Logging: libmtmd's logger is global; we install one callback that keeps the lines of the call
in progress (errors become our messages; the compute buffer size is read from its log, the
only place libmtmd reports it). Calls are serialised by one lock for that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from pyggspec.tokenizer import _llama_cpp

CHUNK_TEXT, CHUNK_IMAGE, CHUNK_AUDIO = 0, 1, 2  # enum mtmd_input_chunk_type
_GGML_LOG_LEVEL_ERROR, _GGML_LOG_LEVEL_CONT = 4, 5
_LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)

_lock = threading.RLock()
_lines: list[tuple[int, str]] = []
_mod: ModuleType | None = None


@_LOG_CB
def _log(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
    """Keep libmtmd's lines (a CONT piece is glued to the line before it)."""
    if not text:
        return
    s = text.decode("utf-8", errors="replace")
    if level == _GGML_LOG_LEVEL_CONT and _lines:
        lv, prev = _lines[-1]
        _lines[-1] = (lv, prev + s)
    else:
        _lines.append((level, s))


def mtmd() -> ModuleType:
    """``llama_cpp.mtmd_cpp``, imported once (after ``llama_cpp`` keeps ggml's log callback),
    with libmtmd's logger pointed at :func:`_log`."""
    global _mod
    with _lock:
        if _mod is None:
            _llama_cpp()
            import llama_cpp.mtmd_cpp as m

            m.mtmd_log_set(_log, None)
            m.mtmd_helper_log_set(_log, None)  # the helpers have a logger of their own
            _mod = m
    return _mod


class MtmdError(Exception):
    """A libmtmd call failed; ``reason`` is its first error line, cleaned."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _clean(line: str) -> str:
    """``mtmd_init_from_file: error: mismatch ...`` -> ``mismatch ...`` (first line only)."""
    line = line.strip().splitlines()[0] if line.strip() else ""
    head, sep, rest = line.partition(": ")
    while sep and (head.isidentifier() or head == "error"):
        line = rest
        head, sep, rest = line.partition(": ")
    return line.rstrip(".")


@contextmanager
def _call() -> Iterator[list[tuple[int, str]]]:
    """Serialise one libmtmd call and yield the log lines it writes."""
    mtmd()
    with _lock:
        _lines.clear()
        yield _lines


def _first_error(lines: list[tuple[int, str]], default: str) -> str:
    for lv, s in lines:
        if lv == _GGML_LOG_LEVEL_ERROR and _clean(s):
            return _clean(s)
    return default


_COMPUTE_RE = re.compile(r"(\S+) compute buffer size =\s*([0-9.]+) MiB")


def _compute_buffers(lines: list[tuple[int, str]]) -> dict[str, int]:
    """The last size libmtmd logged per buffer type (its warmup may reserve twice, first with
    flash attention, then without)."""
    out: dict[str, int] = {}
    for _, s in lines:
        for m in _COMPUTE_RE.finditer(s):
            out[m.group(1)] = round(float(m.group(2)) * 1024 * 1024)
    return out


# ---------------------------------------------------------------------------------------------
# context


@dataclass(frozen=True)
class ContextFacts:
    """What libmtmd says about an opened projector."""

    uses_mrope: bool
    vision: bool
    audio: bool
    marker: str
    compute_buffers: dict[str, int]  # buffer type -> bytes, from libmtmd's warmup log


class Context:
    """An ``mtmd_context``: the projector loaded against a text model's ``llama_model``."""

    def __init__(self, mmproj: str, llama_model: Any, *, use_gpu: bool, n_threads: int | None,
                 image_min_tokens: int | None, image_max_tokens: int | None,
                 warmup: bool = True) -> None:
        m = mtmd()
        params = m.mtmd_context_params_default()
        params.use_gpu = bool(use_gpu)
        params.print_timings = False
        params.warmup = bool(warmup)
        if n_threads is not None:
            params.n_threads = int(n_threads)
        if image_min_tokens is not None:
            params.image_min_tokens = int(image_min_tokens)
        if image_max_tokens is not None:
            params.image_max_tokens = int(image_max_tokens)
        self._m = m
        self._model = llama_model  # kept alive: libmtmd holds the vocabulary pointer
        with _call() as lines:
            ctx = m.mtmd_init_from_file(mmproj.encode(), llama_model, params)
            log = list(lines)
        if not ctx:
            raise MtmdError(_first_error(log, "libmtmd could not load it"))
        self._ctx = ctx
        marker = m.mtmd_default_marker()
        self.facts = ContextFacts(
            uses_mrope=bool(m.mtmd_decode_use_mrope(ctx)),
            vision=bool(m.mtmd_support_vision(ctx)),
            audio=bool(m.mtmd_support_audio(ctx)),
            marker=marker.decode() if marker else "<__media__>",
            compute_buffers=_compute_buffers(log),
        )

    def _check(self) -> Any:
        if self._ctx is None:
            raise MtmdError("the projector is closed")
        return self._ctx

    def close(self) -> None:
        if self._ctx is not None:
            with _call():
                self._m.mtmd_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nobody to tell
            self.close()

    # -- images ----------------------------------------------------------------------------
    def bitmap(self, data: bytes) -> Bitmap:
        """Decode ``data`` (PNG, JPEG, BMP, GIF, ... as stb_image reads them) to RGB."""
        return Bitmap(self._m, data)

    # -- prompt -> chunks ------------------------------------------------------------------
    def tokenize(self, text: str, bitmaps: Sequence[Bitmap], add_special: bool,
                 parse_special: bool) -> list[Chunk]:
        """``mtmd_tokenize``: text with one marker per bitmap -> chunks, in order."""
        m, ctx = self._m, self._check()
        raw = text.encode("utf-8")
        inp = m.mtmd_input_text()
        inp.text = raw
        inp.text_len = len(raw)
        inp.add_special = bool(add_special)
        inp.parse_special = bool(parse_special)
        arr = (ctypes.c_void_p * max(len(bitmaps), 1))(*[b.handle for b in bitmaps])
        with _call() as lines:
            chunks = m.mtmd_input_chunks_init()
            try:
                rc = m.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
                log = list(lines)
                if rc != 0:
                    why = {1: "the number of images does not match the number of markers"}
                    raise MtmdError(_first_error(log, why.get(rc, f"mtmd_tokenize failed ({rc})")))
                out = [self._chunk(m.mtmd_input_chunks_get(chunks, i))
                       for i in range(m.mtmd_input_chunks_size(chunks))]
            finally:
                m.mtmd_input_chunks_free(chunks)
        return out

    def _chunk(self, ch: Any) -> Chunk:
        m = self._m
        kind = int(m.mtmd_input_chunk_get_type(ch))
        if kind == CHUNK_TEXT:
            n = ctypes.c_size_t()
            p = m.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            return Chunk(kind, tuple(p[i] for i in range(n.value)), n.value, n.value, 0, 0,
                         None, None, None)
        own = m.mtmd_input_chunk_copy(ch)  # outlives the chunk list; freed by ChunkHandle
        img = m.mtmd_input_chunk_get_tokens_image(own) if kind == CHUNK_IMAGE else None
        nx = int(m.mtmd_image_tokens_get_nx(img)) if img else 0
        ny = int(m.mtmd_image_tokens_get_ny(img)) if img else 0
        cid = m.mtmd_input_chunk_get_id(own)
        return Chunk(kind, (), int(m.mtmd_input_chunk_get_n_tokens(own)),
                     int(m.mtmd_input_chunk_get_n_pos(own)), nx, ny,
                     cid.decode() if cid else None, ChunkHandle(m, own),
                     bool(m.mtmd_decode_use_non_causal(self._check(), own)))

    def decoder_positions(self, chunk: Chunk, pos_0: int) -> np.ndarray:
        """libmtmd's own positions for an image chunk's rows: int32 [n_tokens, 4] as
        ``mtmd_decoder_pos`` (t, x, y, z) from ``mtmd_helper_image_get_decoder_pos``."""
        m = self._m
        if chunk.handle is None or chunk.kind != CHUNK_IMAGE:
            raise MtmdError("not an image chunk")
        img = m.mtmd_input_chunk_get_tokens_image(chunk.handle.ptr)
        out = (m.mtmd_decoder_pos * chunk.n_tokens)()
        with _call():
            m.mtmd_helper_image_get_decoder_pos(img, int(pos_0), out)
        return np.array([(p.t, p.x, p.y, p.z) for p in out], dtype=np.int64).astype(np.int32)

    # -- chunk -> embeddings ---------------------------------------------------------------
    def encode(self, chunk: Chunk, n_embd: int) -> np.ndarray:
        """``mtmd_encode_chunk`` + ``mtmd_get_output_embd``: float32 [n_tokens, n_embd]."""
        m, ctx = self._m, self._check()
        if chunk.handle is None:
            raise MtmdError("a text chunk has no embeddings to encode")
        with _call() as lines:
            rc = m.mtmd_encode_chunk(ctx, chunk.handle.ptr)
            log = list(lines)
            if rc != 0:
                raise MtmdError(_first_error(log, f"mtmd_encode_chunk failed ({rc})"))
            p = m.mtmd_get_output_embd(ctx)
            if not p:
                raise MtmdError("libmtmd returned no embeddings")
            n = chunk.n_tokens * n_embd
            buf = ctypes.cast(p, ctypes.POINTER(ctypes.c_float * n)).contents
            return np.frombuffer(buf, dtype=np.float32, count=n).reshape(
                chunk.n_tokens, n_embd).copy()


    # -- llama.cpp's own decode (the test oracle) -------------------------------------------
    def eval_image(self, chunk: Chunk, llama_context: Any, n_past: int, seq_id: int,
                   n_batch: int) -> int:
        """``mtmd_helper_eval_chunk_single`` on an image chunk: libmtmd encodes it and decodes
        its rows into ``llama_context`` (a full model's) at llama.cpp's positions; returns
        the position after it. For ``pyggspec.testing.oracle_vision`` only."""
        m, ctx = self._m, self._check()
        if chunk.handle is None or chunk.kind != CHUNK_IMAGE:
            raise MtmdError("not an image chunk")
        ll = _llama_cpp()
        new = ll.llama_pos(n_past)
        with _call() as lines:
            rc = m.mtmd_helper_eval_chunk_single(ctx, llama_context, chunk.handle.ptr,
                                                 int(n_past), int(seq_id), int(n_batch), False,
                                                 ctypes.byref(new))
            log = list(lines)
        if rc != 0:
            raise MtmdError(_first_error(log, f"mtmd_helper_eval_chunk_single failed ({rc})"))
        return int(new.value)


class Bitmap:
    """An ``mtmd_bitmap`` (RGB, 8 bits) with llama-server's id: the bytes' SHA-256 (hex)."""

    def __init__(self, m: ModuleType, data: bytes) -> None:
        self._m = m
        self.handle: Any = None
        lib = m._libmtmd
        load = lib.stbi_load_from_memory
        load.restype = ctypes.POINTER(ctypes.c_ubyte)
        load.argtypes = [ctypes.c_char_p, ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3 \
            + [ctypes.c_int]
        lib.stbi_failure_reason.restype = ctypes.c_char_p
        lib.stbi_image_free.argtypes = [ctypes.c_void_p]
        if not data:
            raise MtmdError("empty image")
        if len(data) >= 2**31:
            raise MtmdError("image larger than 2 GiB")
        nx, ny, nc = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        with _call():
            px = load(data, len(data), ctypes.byref(nx), ctypes.byref(ny), ctypes.byref(nc), 3)
            if not px:
                why = lib.stbi_failure_reason()
                raise MtmdError("cannot decode the image"
                                + (f" ({why.decode(errors='replace')})" if why else ""))
            try:
                self.handle = m.mtmd_bitmap_init(nx.value, ny.value, px)
            finally:
                lib.stbi_image_free(px)
        if not self.handle:
            raise MtmdError("libmtmd could not make a bitmap")
        self.width, self.height = nx.value, ny.value
        self.id = hashlib.sha256(data).hexdigest()
        m.mtmd_bitmap_set_id(self.handle, self.id.encode())

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._m.mtmd_bitmap_free(self.handle)
            self.handle = None


class ChunkHandle:
    """Owns one copied ``mtmd_input_chunk``."""

    def __init__(self, m: ModuleType, ptr: Any) -> None:
        self._m, self.ptr = m, ptr

    def __del__(self) -> None:
        if self.ptr:
            self._m.mtmd_input_chunk_free(self.ptr)
            self.ptr = None


@dataclass(frozen=True, eq=False)
class Chunk:
    """One chunk of a tokenized prompt, as libmtmd cut it."""

    kind: int  # CHUNK_TEXT / CHUNK_IMAGE / CHUNK_AUDIO
    tokens: tuple[int, ...]  # text chunks: the token ids
    n_tokens: int  # rows this chunk adds to the KV cache (image: merged patches)
    n_pos: int  # how far the position advances after it (image, M-RoPE: max(nx, ny))
    nx: int  # image: merged tokens per row
    ny: int  # image: rows
    id: str | None  # image: the bitmap id (SHA-256 of the bytes)
    handle: ChunkHandle | None
    non_causal: bool | None  # image: whether llama.cpp decodes it with non-causal attention
