"""llama.cpp (through ``llama_cpp``) as the test oracle: load, tokenize, logits, MTP logits.

Uses the low-level API because the high-level ``Llama`` cannot turn off CPU weight repacking,
which crashes on Q8_0 weights on these machines (DESIGN §10): every full load here sets
``use_extra_bufts = False`` (llama.cpp's ``--no-repack``). llama.cpp's log output is silenced
unless ``PYGGSPEC_ORACLE_LOG=1``.

The nextn/MTP entry points (``llama_set_embeddings_nextn``, ``llama_get_embeddings_nextn_ith``)
are exported by libllama (``src/llama-ext.h``, C++ linkage) but not wrapped by llama_cpp
0.3.36, so they are bound here with ctypes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import llama_cpp as _llama
except ImportError:  # pragma: no cover - the oracle is optional for users
    _llama = None  # type: ignore[assignment]

_log_cb: Any = None
_ext: dict[str, Any] = {}


def available() -> bool:
    """True when ``llama_cpp`` imports (tests skip the oracle otherwise)."""
    return _llama is not None


def _lib() -> Any:
    if _llama is None:
        raise RuntimeError("llama_cpp is not installed: the oracle needs llama-cpp-python")
    return _llama


def _init_once() -> None:
    global _log_cb
    if _log_cb is not None:
        return
    # pyggspec's binding first: it sets ggml's switches for known-broken devices
    # (pyggspec/ggml/quirks.py) before llama.cpp can initialise one
    from pyggspec.ggml import binding

    binding.load()
    ll = _lib()
    ll.llama_backend_init()
    if os.environ.get("PYGGSPEC_ORACLE_LOG") != "1":
        @ll.llama_log_callback
        def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            return None
        _log_cb = _quiet
        ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
    else:
        _log_cb = True
    f = _ext_symbol("llama_set_embeddings_nextn", "P13llama_contextbb")
    g = _ext_symbol("llama_get_embeddings_nextn_ith", "P13llama_contexti")
    if f is not None and g is not None:
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        g.argtypes, g.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)
        _ext["set_nextn"], _ext["get_nextn_ith"] = f, g


def _ext_symbol(name: str, itanium_args: str) -> Any:
    """A ``llama-ext.h`` function: that header has no ``extern "C"``, so libllama exports
    these under their C++ (Itanium ABI) names; try the plain name first."""
    cdll = _lib().llama_cpp._lib
    for sym in (name, f"_Z{len(name)}{name}{itanium_args}"):
        try:
            return getattr(cdll, sym)
        except AttributeError:
            continue
    return None


def _nextn(key: str) -> Any:
    if key not in _ext:
        raise RuntimeError("this libllama exports no nextn (MTP) entry points")
    return _ext[key]


class OracleModel:
    """A ``llama_model`` loaded with repacking off. Use as a context manager."""

    def __init__(
        self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, load_mtp: bool = False,
        vocab_only: bool = False, repack: bool = False, devices: Sequence[str] | None = None,
    ) -> None:
        """``devices``: ggml device names the layers may go to (with ``n_gpu_layers``);
        None lets llama.cpp use every registered one."""
        _init_once()
        ll = _lib()
        self.path = Path(path)
        p = ll.llama_model_default_params()
        if devices is not None and n_gpu_layers != 0:
            from pyggspec.ggml.device import get_device

            addrs = [get_device(d).address for d in devices]
            self._devices = (ctypes.c_void_p * (len(addrs) + 1))(*addrs, None)
            p.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        elif n_gpu_layers == 0:
            # An explicit empty device list: CPU only, and llama.cpp does not probe other
            # registered devices (a dead RPC server registered by another test aborts a load).
            self._no_devices = (ctypes.c_void_p * 1)(None)
            p.devices = ctypes.cast(self._no_devices, ctypes.c_void_p)
        p.n_gpu_layers = n_gpu_layers
        p.vocab_only = vocab_only
        p.load_mtp = load_mtp
        # repack=True is llama.cpp's default; it crashes where llama_cpp's build put AMX
        # buffers in the list and the host cannot run them (ask amx_probe first)
        p.use_extra_bufts = bool(repack)
        p.use_mmap = True
        self.model = ll.llama_model_load_from_file(os.fsencode(self.path), p)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.vocab = ll.llama_model_get_vocab(self.model)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "model", None):
            _lib().llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> OracleModel:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hparams ----------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return int(_lib().llama_model_n_layer(self.model))

    @property
    def n_layer_nextn(self) -> int:
        return int(_lib().llama_model_n_layer_nextn(self.model))

    @property
    def n_embd(self) -> int:
        return int(_lib().llama_model_n_embd(self.model))

    @property
    def n_vocab(self) -> int:
        return int(_lib().llama_vocab_n_tokens(self.vocab))

    # -- tokenizer --------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = False,
                 parse_special: bool = True) -> list[int]:
        ll = _lib()
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n})")
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = True) -> bytes:
        ll = _lib()
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            raise RuntimeError(f"llama_token_to_piece({token}) failed ({n})")
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, special: bool = True) -> bytes:
        return b"".join(self.token_bytes(t, special=special) for t in tokens)

    # -- contexts ---------------------------------------------------------------------------
    def context(self, *, n_ctx: int = 512, n_batch: int = 512, n_threads: int = 2,
                mtp: bool = False, nextn: bool = False, n_seq_max: int = 1) -> OracleContext:
        """A decoding context; ``mtp=True`` makes the MTP-type (draft head) context."""
        return OracleContext(self, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, mtp=mtp,
                             nextn=nextn, n_seq_max=n_seq_max)


class OracleContext:
    """One ``llama_context``. ``eval`` returns logits for every position it is given."""

    def __init__(self, model: OracleModel, *, n_ctx: int, n_batch: int, n_threads: int,
                 mtp: bool, nextn: bool, n_seq_max: int) -> None:
        ll = _lib()
        self.model = model
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_batch, n_batch
        p.n_threads = p.n_threads_batch = n_threads
        p.n_seq_max = n_seq_max
        p.no_perf = True
        if mtp:
            p.ctx_type = ll.LLAMA_CONTEXT_TYPE_MTP
        self.ctx = ll.llama_init_from_model(model.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a {'MTP ' if mtp else ''}context")
        self.mtp = mtp
        self.n_past = 0
        if nextn or mtp:
            # target: dense rows for every batch position; MTP ctx: rows of output tokens
            _nextn("set_nextn")(self.ctx, True, bool(mtp))

    def close(self) -> None:
        if getattr(self, "ctx", None):
            _lib().llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> OracleContext:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def eval(self, tokens: Sequence[int], *, logits_all: bool = True) -> np.ndarray:
        """Decode ``tokens`` after what was decoded before; logits [n, n_vocab] (or [1, ...])."""
        if self.mtp:
            raise RuntimeError("use mtp_eval on an MTP context")
        ll = _lib()
        n = len(tokens)
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if (logits_all or i == n - 1) else 0
            batch.n_tokens = n
            rc = ll.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
        finally:
            ll.llama_batch_free(batch)
        self.n_past += n
        rows = range(n) if logits_all else [n - 1]
        return self._logits(rows)

    def _logits(self, rows: Sequence[int]) -> np.ndarray:
        ll = _lib()
        nv = self.model.n_vocab
        out = np.empty((len(rows), nv), dtype=np.float32)
        for j, i in enumerate(rows):
            ptr = ll.llama_get_logits_ith(self.ctx, i)
            out[j] = np.ctypeslib.as_array(ptr, shape=(nv,))
        return out

    def hidden_nextn(self, i: int) -> np.ndarray:
        """Post-``output_norm`` hidden row of batch position ``i`` (needs ``nextn=True``)."""
        ptr = _nextn("get_nextn_ith")(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"no nextn embedding for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).copy()

    def mtp_eval(self, tokens: Sequence[int], hidden: np.ndarray, pos0: int) -> np.ndarray:
        """MTP head over pairs (tokens[k], hidden[k]) at positions pos0 + k; logits per row.

        ``hidden[k]`` must be the target's post-norm hidden state of the position *before*
        ``tokens[k]`` (DESIGN §9), e.g. ``[pending, h_0, ..., h_{n-2}]`` for a prompt.
        """
        if not self.mtp:
            raise RuntimeError("mtp_eval needs an MTP context")
        ll = _lib()
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        n, d = hidden.shape
        batch = ll.llama_batch_ext_init(self.ctx)
        try:
            for k in range(n):
                idx = ll.llama_batch_ext_add_token(batch, 0, int(tokens[k]))
                if idx < 0:
                    raise RuntimeError(f"llama_batch_ext_add_token failed ({idx})")
                pos = (ll.llama_pos * 4)(pos0 + k, pos0 + k, pos0 + k, 0)
                ll.llama_batch_ext_set_pos(batch, idx, pos)
                row = hidden[k]
                embd = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, d)
                if not ll.llama_batch_ext_set_embd_token(batch, idx, embd):
                    raise RuntimeError("llama_batch_ext_set_embd_token failed")
                ll.llama_batch_ext_set_output_logits(batch, idx, True)
            rc = ll.llama_process(self.ctx, ll.LLAMA_PROCESS_TYPE_DECODE, batch)
            if rc != 0:
                raise RuntimeError(f"llama_process failed ({rc})")
        finally:
            ll.llama_batch_ext_free(batch)
        return self._logits(range(n))


def prompt_logits(path: str | os.PathLike[str], tokens: Sequence[int], *,
                  n_ctx: int = 512, n_threads: int = 2) -> np.ndarray:
    """Logits [len(tokens), n_vocab] of one prompt decoded in one batch."""
    with OracleModel(path) as m, m.context(n_ctx=n_ctx, n_threads=n_threads) as c:
        return c.eval(tokens)


def greedy(path: str | os.PathLike[str], tokens: Sequence[int], n_new: int, *,
           n_ctx: int = 512, n_threads: int = 2) -> list[int]:
    """Greedy continuation (ties: lowest id) of ``tokens`` by ``n_new`` tokens."""
    out: list[int] = []
    with OracleModel(path) as m, m.context(n_ctx=n_ctx, n_threads=n_threads) as c:
        logits = c.eval(tokens, logits_all=False)
        for _ in range(n_new):
            t = int(np.argmax(logits[-1]))
            out.append(t)
            logits = c.eval([t], logits_all=False)
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Max absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def oracle_greedy(path: str | os.PathLike[str], prompt: list[int], n: int,
                  **model_kw) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits of the prompt and of ``n`` greedy steps, and the greedy tokens."""
    with OracleModel(path, **model_kw) as om, om.context(n_ctx=256, n_batch=256,
                                                         n_threads=2) as oc:
        lg = oc.eval(prompt)
        rows, toks = [lg], []
        for _ in range(n):
            toks.append(int(lg[-1].argmax()))
            lg = oc.eval([toks[-1]])
            rows.append(lg)
    return np.concatenate(rows), toks
