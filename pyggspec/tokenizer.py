"""Tokenizer: llama.cpp's own vocabulary code, through ``llama_cpp``, on the same GGUF.

Why llama.cpp and not a Python BPE: token ids must be exactly llama.cpp's (the oracle, the
numerics tests and users' prompts all depend on it), including its pre-tokenizer regexes and
special-token parsing. The model is loaded *vocabulary only* (no tensors), which also works for
an MTP-only sidecar file (it carries the full vocabulary).

Logging: llama.cpp and ggml share one global log callback. Importing ``llama_cpp`` installs a
Python callback that prints everything; we put back whatever ggml had before the import
(pyggspec's binding installs a C callback that ggml worker threads can call without the GIL),
and silence loading, keeping llama.cpp's error lines for our error messages.
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import importlib.util
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pyggspec.errors import BindingError, ModelFileError

if TYPE_CHECKING:
    from typing_extensions import Self

_LOG_CB_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_GGML_LOG_LEVEL_ERROR = 4  # enum ggml_log_level
_llama: ModuleType | None = None
_llama_lock = threading.Lock()
_load_errors: list[str] = []


@_LOG_CB_TYPE
def _quiet_log(level: int, text: bytes | None, user_data: ctypes.c_void_p) -> None:
    """Swallow llama.cpp's load chatter; keep error lines for the exception message."""
    if level == _GGML_LOG_LEVEL_ERROR and text:
        _load_errors.append(text.decode("utf-8", errors="replace").strip())


@functools.cache
def _ggml_base() -> ctypes.CDLL | None:
    """llama-cpp-python's libggml-base, opened without importing ``llama_cpp``.

    The soname file first: wheels ship ``libggml-base.so`` and ``.so.0`` as separate copies,
    and opening the other one by path would load a second, unrelated ggml-base.
    """
    spec = importlib.util.find_spec("llama_cpp")
    for d in (spec.submodule_search_locations or []) if spec else []:
        for name in ("libggml-base.so.0", "libggml-base.0.dylib", "libggml-base.so",
                     "libggml-base.dylib", "ggml-base.dll"):
            p = Path(d) / "lib" / name
            if p.is_file():
                try:
                    return ctypes.CDLL(str(p))
                except OSError:
                    return None
    return None


def _get_log(base: ctypes.CDLL) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
    cb, ud = ctypes.c_void_p(), ctypes.c_void_p()
    base.ggml_log_get.argtypes = [ctypes.POINTER(ctypes.c_void_p)] * 2
    base.ggml_log_get(ctypes.byref(cb), ctypes.byref(ud))
    return cb, ud


def _llama_cpp() -> ModuleType:
    """Import ``llama_cpp`` once, keeping ggml's log callback as it was before the import."""
    global _llama
    with _llama_lock:
        if _llama is None:
            base = _ggml_base()
            saved = _get_log(base) if base is not None else None
            try:
                import llama_cpp
            except ImportError as e:
                raise BindingError(None, f"llama_cpp (llama-cpp-python) is needed for the "
                                   f"tokenizer: {e}") from None
            if base is not None and saved is not None:
                base.ggml_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                base.ggml_log_set(*saved)
            llama_cpp.llama_backend_init()
            _llama = llama_cpp
    return _llama


@contextmanager
def _quiet(ll: ModuleType) -> Iterator[list[str]]:
    """Silence llama.cpp for the duration; yields the error lines logged meanwhile."""
    base = _ggml_base()
    saved = _get_log(base) if base is not None else None
    _load_errors.clear()
    ll.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    try:
        yield _load_errors
    finally:
        if saved is not None:
            # llama_log_set sets ggml's callback and llama's own: both follow the saved one
            ll.llama_log_set(ctypes.cast(saved[0], _LOG_CB_TYPE), saved[1])


def _reason(line: str) -> str:
    """llama.cpp's first error line without its ``function_name:`` / ``error loading model:``
    prefixes: ``bad GGUF version: 0``."""
    head, sep, rest = line.partition(": ")
    while sep and (head.isidentifier() or head == "error loading model"):
        line = rest
        head, sep, rest = line.partition(": ")
    return line


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens (None: it has none): prefix, suffix,
    middle, pad, repository name and file separator (llama.cpp's FIM_PRE ... FIM_SEP)."""

    pre: int | None
    suf: int | None
    mid: int | None
    pad: int | None
    rep: int | None
    sep: int | None


class Tokenizer:
    """The vocabulary of one GGUF, loaded by llama.cpp without any tensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(self.path, "no such file" if not self.path.exists()
                                 else "not a regular file")
        ll = _llama_cpp()
        self._ll = ll
        params = ll.llama_model_default_params()
        params.vocab_only = True
        params.use_mmap = True
        # An explicit empty device list: llama.cpp otherwise asks every registered device for
        # its free memory, and a dead RPC server registered earlier aborts the process.
        no_devices = (ctypes.c_void_p * 1)(None)
        params.devices = ctypes.cast(no_devices, ctypes.c_void_p)
        with _quiet(ll) as errors:
            model = ll.llama_model_load_from_file(os.fsencode(self.path), params)
        if not model:
            why = _reason(errors[0]) if errors else "llama.cpp could not load it"
            raise ModelFileError(self.path, f"cannot load the vocabulary: {why}")
        self._model = model
        self._finalizer = weakref.finalize(self, ll.llama_model_free, model)
        self._vocab = ll.llama_model_get_vocab(model)
        self.n_vocab: int = int(ll.llama_vocab_n_tokens(self._vocab))
        self.bos: int | None = self._tok(ll.llama_vocab_bos(self._vocab))
        self.eos: int | None = self._tok(ll.llama_vocab_eos(self._vocab))
        self.eot: int | None = self._tok(ll.llama_vocab_eot(self._vocab))
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(self._vocab))
        # fill-in-the-middle tokens as llama.cpp resolves them (tokenizer.ggml.fim_*_token_id,
        # else by their text: Qwen's <|fim_prefix|> ..., CodeLlama's <PRE> ...)
        v = self._vocab
        self.fim = FimTokens(*(self._tok(f(v)) for f in (
            ll.llama_vocab_fim_pre, ll.llama_vocab_fim_suf, ll.llama_vocab_fim_mid,
            ll.llama_vocab_fim_pad, ll.llama_vocab_fim_rep, ll.llama_vocab_fim_sep)))
        tmpl = ll.llama_model_chat_template(model, None)
        self.chat_template: str | None = tmpl.decode("utf-8", errors="replace") if tmpl else None
        self._eog: dict[int, bool] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}

    @staticmethod
    def _tok(t: int) -> int | None:
        return None if t < 0 else int(t)  # LLAMA_TOKEN_NULL = -1

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ModelFileError(self.path, "tokenizer is closed")

    def _check_id(self, t: int) -> int:
        if not 0 <= t < self.n_vocab:  # llama.cpp would throw through C (abort)
            raise ValueError(f"token id {t} out of range (vocabulary of {self.n_vocab})")
        return int(t)

    # -- text -> ids -----------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS where the vocab asks for them,
        ``parse_special`` turns ``<|im_start|>`` etc. into their single control ids."""
        self._check_open()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 8
        for _ in range(2):
            buf = (ctypes.c_int32 * cap)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special,
                                        parse_special)
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):  # INT32_MIN: too many tokens for an int32 count
                break
            cap = -n
        raise ValueError(f"tokenizing {len(data)} bytes failed (llama_tokenize returned {n})")

    # -- ids -> text -----------------------------------------------------------------------
    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """Raw bytes of one token (may be part of a UTF-8 character). ``special`` renders
        control tokens (``<|im_end|>``); without it they are empty."""
        key = (self._check_id(token), special)
        piece = self._pieces.get(key)
        if piece is None:
            self._check_open()
            cap = 32
            while True:
                buf = ctypes.create_string_buffer(cap)
                n = self._ll.llama_token_to_piece(self._vocab, key[0], buf, cap, 0, special)
                if n >= 0:
                    piece = buf.raw[:n]
                    break
                cap = -n
            self._pieces[key] = piece
        return piece

    def detokenize(self, ids: Sequence[int] | Iterable[int], special: bool = True) -> str:
        """Text of ``ids`` via llama_detokenize (invalid UTF-8 becomes U+FFFD)."""
        self._check_open()
        toks = [self._check_id(t) for t in ids]
        if not toks:
            return ""
        arr = (ctypes.c_int32 * len(toks))(*toks)
        cap = max(16, 8 * len(toks))
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = self._ll.llama_detokenize(self._vocab, arr, len(toks), buf, cap, False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = -n

    def detokenizer(self, special: bool = True) -> Detokenizer:
        return Detokenizer(self, special)

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ``<|im_end|>``, ... as llama.cpp decides)."""
        t = self._check_id(token)
        e = self._eog.get(t)
        if e is None:
            self._check_open()
            e = self._eog[t] = bool(self._ll.llama_vocab_is_eog(self._vocab, t))
        return e

    def eog_ids(self) -> list[int]:
        """Every end-of-generation id (llama.cpp's set: EOS, EOT, ``<|im_end|>``, ...), for
        a grammar that must allow them at its end. One pass over the vocabulary: callers
        keep the answer (the grammar vocabulary is built once per tokenizer)."""
        self._check_open()
        is_eog, v = self._ll.llama_vocab_is_eog, self._vocab
        return [t for t in range(self.n_vocab) if is_eog(v, t)]

    def token_table(self) -> list[tuple[bytes, bool]]:
        """Every token's bytes (control tokens rendered) and whether it is a control token
        (``<|im_end|>``, ...). User-defined tokens such as Qwen's ``<think>`` or
        ``<tool_call>`` are text here, as llama.cpp's grammars match them (llguidance's own
        llama.cpp reader makes them special, so a grammar's "</think>" could not match the
        token the model writes). One pass over the vocabulary: callers keep the answer."""
        self._check_open()
        ll, v = self._ll, self._vocab
        control = ll.LLAMA_TOKEN_ATTR_CONTROL
        out = []
        for t in range(self.n_vocab):
            piece = self.token_to_piece(t, special=True)
            out.append((piece, bool(ll.llama_vocab_get_attr(v, t) & control)))
        self._pieces.clear()  # the table is kept by the caller; do not hold it twice
        return out

    def native_tokenizer(self) -> tuple[Any, int]:
        """(llama.cpp's vocabulary handle, the address of ``llama_tokenize``): for native
        code that tokenizes with this vocabulary (llguidance); valid while this is open."""
        self._check_open()
        fn = ctypes.cast(self._ll.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        return self._vocab, int(fn)

    # -- chat ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, *, jinja: bool = False,
                            builtin: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the GGUF's chat template.

        llama.cpp's ``llama_chat_apply_template`` first (it recognises the common templates by
        their markers); a template it does not know, non-string content, extra ``kwargs`` or
        ``jinja=True`` render the template itself with jinja2 (HF-compatible environment).
        ``builtin``: one of llama.cpp's template names (:meth:`builtin_chat_templates`, e.g.
        ``llama3``) to render with instead of the file's template (ValueError when llama.cpp
        cannot render these messages with it).
        """
        if builtin is not None:
            out = self._llama_chat(messages, add_generation_prompt, builtin)
            if out is None:
                raise ValueError(f"llama.cpp's {builtin!r} template cannot render these "
                                 "messages")
            return out
        if self.chat_template is None:
            raise ModelFileError(self.path, "the file has no chat template "
                                 "(tokenizer.chat_template)")
        if not jinja and not kwargs and all(isinstance(m.get("content"), str)
                                            and isinstance(m.get("role"), str)
                                            for m in messages):
            out = self._llama_chat(messages, add_generation_prompt)
            if out is not None:
                return out
        return self._jinja_chat(messages, add_generation_prompt, **kwargs)

    def builtin_chat_templates(self) -> list[str]:
        """The names of llama.cpp's built-in chat templates (``llama3``, ``command-r``, ...)."""
        ll = self._ll
        n = ll.llama_chat_builtin_templates(None, 0)
        arr = (ctypes.c_char_p * n)()
        ll.llama_chat_builtin_templates(arr, n)
        return [a.decode() for a in arr]

    def _llama_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool, name: str | None = None) -> str | None:
        ll = self._ll
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (ll.llama_chat_message * max(len(keep), 1))()
        for i, (r, c) in enumerate(keep):
            arr[i].role, arr[i].content = r, c
        tmpl = (name or self.chat_template).encode()  # type: ignore[union-attr]
        cap = max(256, 2 * sum(len(r) + len(c) for r, c in keep) + 256)
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = ll.llama_chat_apply_template(tmpl, arr, len(keep), add_generation_prompt, buf,
                                             cap)
            if n < 0:
                return None  # template not recognised by llama.cpp
            if n <= cap:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = n
        return None

    def _jinja_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                    **kwargs: Any) -> str:
        import jinja2

        piece = self.token_to_piece
        try:
            tmpl = compile_chat_template(self.chat_template or "")
            return tmpl.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=piece(self.bos).decode("utf-8", "replace") if self.bos is not None
                else "",
                eos_token=piece(self.eos).decode("utf-8", "replace") if self.eos is not None
                else "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ModelFileError(self.path, f"chat template failed: {e}") from None

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free llama.cpp's vocabulary (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, n_vocab={self.n_vocab})"


class Detokenizer:
    """Streaming detokenization: :meth:`add` returns only complete UTF-8 characters.

    A character split over tokens (byte-level BPE splits CJK and emoji) is held back until its
    last byte arrives; :meth:`flush` emits what is left (U+FFFD for an incomplete tail), so
    ``"".join(add(t) for t in ids) + flush() == tokenizer.detokenize(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far

    def add(self, token: int) -> str:
        out = self._dec.decode(self.tokenizer.token_to_piece(token, self.special))
        self.text += out
        return out

    def extend(self, tokens: Iterable[int]) -> str:
        return "".join(self.add(t) for t in tokens)

    def flush(self) -> str:
        """Emit any held-back bytes (as U+FFFD) and reset for the next stream."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        self.text += out
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._dec.getstate()[0])



def compile_chat_template(source: str) -> Any:
    """A GGUF chat template as a sandboxed Jinja2 template with the helpers HF templates
    use (``raise_exception``, ``tojson`` with its keyword arguments, ``strftime_now``).
    Raises ``jinja2.TemplateSyntaxError`` when it does not compile."""
    import json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
