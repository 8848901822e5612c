"""Grammar-constrained sampling: llama-server's ``grammar`` (GBNF) and ``json_schema`` (and
Lark), compiled and matched by llguidance.

Why llguidance: it reads GBNF, JSON schema and Lark, compiles a schema in about a
millisecond and computes a 152k-token mask in ~20 us (docs/benchmarks.md, "Constrained
output"); outlines-core needed ~0.4 s to compile one schema over a real Qwen vocabulary and
reads no GBNF. Its matcher consumes tokens, rolls them back and answers how many of a list
of tokens it would take, which is what speculation needs.

Pieces, each made once where it can be:

* :class:`GrammarSpec` -- what a request asks (pure data, no llguidance).
* :class:`GrammarVocab` -- llguidance's view of the engine's vocabulary: built once per
  tokenizer (~1.3 s at 152k tokens, :func:`grammar_vocab`), shared by every request; a
  server builds it in the background as it starts (:func:`warm_grammar_vocab`), so its
  first constrained request does not pay for it.
* :class:`Grammar` -- a spec compiled and checked against that vocabulary, once per
  request (:func:`compile_grammar`; a bad grammar is a :class:`GrammarError` naming the
  field, before anything is queued).
* :class:`GrammarMatcher` -- one sequence's parser state, owned by its sampler chain. It
  only ever consumes *emitted* tokens; the mask of a verify row or a draft at ``prefix``
  (the drafts before it) is computed by consuming the prefix, reading the mask and rolling
  back, and cached until the chain's state changes. So a rejected draft never touches the
  state, and ``snapshot``/``restore`` are a token count.
* A spec with a ``trigger`` is a lazy grammar (llama-server's, for ``tool_choice: auto``):
  its matcher (:mod:`~pyggspec.sampling.lazy_grammar`) leaves the text free, computing no
  mask, until the trigger appears, and holds what follows it (``free`` rows add no bias).

In the chain the grammar is the first stage (llama.cpp applies the grammar to the raw
candidates when the sampled token does not fit it, which is the same as masking first):
forbidden tokens get ``-inf``. In a graph that is the addition of a ``[n_vocab, rows]``
bias input of 0 / -inf (exact in float32), so device sampling keeps working.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyggspec.errors import PyggspecError

log = logging.getLogger("pyggspec.grammar")

KINDS = ("gbnf", "json_schema", "lark", "regex")
# whitespace a JSON schema allows between tokens: llama.cpp's ``space`` rule
# (json-schema-to-grammar: ``space ::= | " " | "\n"{1,2} [ \t]{0,20}``). llguidance's own
# default is unbounded, and a model that likes whitespace then never closes the object.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
_MASK_CACHE = 64  # prefixes whose masks one matcher keeps between two accepted tokens


class GrammarError(PyggspecError, ValueError):
    """A grammar or schema that cannot be compiled; ``where`` names the request field
    (``grammar``, ``json_schema``, ``response_format``, ``--grammar-file``, ...)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint as a request states it: ``kind`` one of :data:`KINDS`, ``text`` the
    grammar (a JSON schema as JSON text). ``field`` names where it came from, for errors."""

    kind: str
    text: str
    field: str = "grammar"
    # free text up to and including this string before the grammar (a chat answer whose
    # prompt left a thinking block open: "</think>", then the JSON), as llama-server's chat
    # parser lets a reasoning model think before its response_format
    after: str = ""
    # a lazy grammar (llama-server's lazy grammar): free text until this string appears
    # (after ``after``, when given; the answer may end before either), then ``text`` holds
    # what follows it (:mod:`~pyggspec.sampling.lazy_grammar`); ``lead`` is the text in
    # front of the answer (a prefilled start), read before its first token
    trigger: str = ""
    lead: str = ""

    @classmethod
    def gbnf(cls, text: str, field: str = "grammar") -> GrammarSpec:
        return cls("gbnf", text, field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool,
                    field: str = "json_schema") -> GrammarSpec:
        """A JSON schema (an object, ``True``, or its JSON text)."""
        if isinstance(schema, str):
            text = schema
        else:
            try:
                text = json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise GrammarError(field, f"the schema is not JSON: {e}") from None
        return cls("json_schema", text, field)


def grammar_spec(grammar: str | GrammarSpec | None = None,
                 json_schema: Mapping[str, Any] | str | bool | None = None,
                 ) -> GrammarSpec | None:
    """The Python API's ``grammar=`` (GBNF text or a spec) / ``json_schema=`` keywords as
    one spec; both at once is an error (llama.cpp refuses both too)."""
    if grammar is not None and json_schema is not None:
        raise GrammarError("grammar", "give either a grammar or a JSON schema, not both")
    if isinstance(grammar, GrammarSpec):
        return grammar
    if grammar is not None:
        if not isinstance(grammar, str):
            raise GrammarError("grammar", f"must be GBNF text, got {type(grammar).__name__}")
        return GrammarSpec.gbnf(grammar)
    if json_schema is not None:
        return GrammarSpec.json_schema(json_schema)
    return None


class GrammarVocab:
    """llguidance's tokenizer for one vocabulary of ``n_vocab`` logits (padding ids have no
    bytes and are never allowed); ``eos`` are the end-of-generation ids a finished grammar
    allows (llama.cpp allows every EOG token at the end of a grammar)."""

    def __init__(self, lltokenizer: Any, n_vocab: int, eos: Sequence[int],
                 pieces: Sequence[bytes] | None = None) -> None:
        self.tok = lltokenizer
        self.n_vocab = n_vocab
        self.eos = tuple(eos)
        self.n_words = (n_vocab + 31) // 32
        # every token's bytes as llguidance sees them, in one buffer (a lazy grammar reads
        # the text of the tokens it does not mask): its bytes + 8 of offset per token
        if pieces is None:
            pieces = [lltokenizer.decode_bytes([t]) if t < lltokenizer.vocab_size else b""
                      for t in range(n_vocab)]
        pieces = list(pieces)[:n_vocab] + [b""] * max(0, n_vocab - len(pieces))
        self.blob = b"".join(pieces)
        self.offsets = np.zeros(n_vocab + 1, np.int64)
        np.cumsum([len(p) for p in pieces], out=self.offsets[1:])
        self.triggers: dict[bytes, Any] = {}  # lazy_grammar.TriggerIndex per trigger

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (control tokens with llguidance's 0xff prefix; padding: none)."""
        return self.blob[self.offsets[token]:self.offsets[token + 1]]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, n_vocab: int) -> GrammarVocab:
        """From a :class:`~pyggspec.tokenizer.Tokenizer`: token bytes as llama.cpp renders
        them, control tokens marked special (llguidance's 0xff prefix, as its own
        llama.cpp reader does), llama.cpp's tokenizer for the text llguidance forces,
        llama.cpp's end-of-generation ids. Padding ids past the tokenizer have no bytes."""
        import llguidance

        words = [b"\xff" + p if special else p for p, special in tokenizer.token_table()]
        words += [b""] * (n_vocab - len(words))
        eos = tokenizer.eog_ids()
        vocab, fn = tokenizer.native_tokenizer()
        tok = llguidance.LLTokenizer.from_llamacpp(tokens=words, vocab_ptr=vocab,
                                                   tokenize_fptr=fn, eos_token=eos,
                                                   slices=None)
        return cls(tok, n_vocab, eos, words)


_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_warming: weakref.WeakSet = weakref.WeakSet()  # tokenizers a warm-up thread was started for
_vocabs_lock = threading.Lock()


def grammar_vocab(tokenizer: Any, n_vocab: int) -> GrammarVocab:
    """The :class:`GrammarVocab` of a :class:`~pyggspec.tokenizer.Tokenizer`, built on the
    first request that needs it (or by :func:`warm_grammar_vocab`) and kept as long as the
    tokenizer lives. A caller arriving while it is built waits for it."""
    with _vocabs_lock:
        gv = _vocabs.get(tokenizer)
        if gv is None or gv.n_vocab != n_vocab:
            t0 = time.perf_counter()
            gv = GrammarVocab.from_tokenizer(tokenizer, n_vocab)
            _vocabs[tokenizer] = gv
            log.info("grammar: llguidance's tables for %d tokens built in %.2f s", n_vocab,
                     time.perf_counter() - t0)
        return gv


def warm_grammar_vocab(tokenizer: Any, n_vocab: int) -> threading.Thread | None:
    """Start building ``tokenizer``'s :class:`GrammarVocab` in a background thread (a server
    starting: else its first constrained request pays 1.3-2.3 s for it). /health and other
    requests are served meanwhile, sharing the CPU with it, and llguidance holds the GIL
    for its last ~0.5 s (at 248k tokens on 2 cores: a free request right after start took
    1.2 s instead of 0.4); a constrained request arriving before it is done waits in
    :func:`grammar_vocab`. Once per tokenizer: None when the table is built, or its
    thread started, already. The caller joins the thread before closing the tokenizer
    (llguidance keeps llama.cpp's vocabulary pointer)."""
    with _vocabs_lock:
        gv = _vocabs.get(tokenizer)
        if (gv is not None and gv.n_vocab == n_vocab) or tokenizer in _warming:
            return None
        _warming.add(tokenizer)
    t = threading.Thread(target=_warm, args=(tokenizer, n_vocab), daemon=True,
                         name="pyggspec-grammar-vocab")
    t.start()
    return t


def _warm(tokenizer: Any, n_vocab: int) -> None:
    try:
        grammar_vocab(tokenizer, n_vocab)
    except Exception:  # a request needing it builds it (and reports the error) then
        log.exception("grammar: building llguidance's tables at start failed")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled, checked grammar for one vocabulary (llguidance's grammar text); every
    sequence that uses it gets its own :meth:`matcher`."""

    spec: GrammarSpec
    vocab: GrammarVocab
    source: str

    def matcher(self) -> GrammarMatcher:
        """A matcher of a grammar without ``trigger`` (a lazy one's is
        :func:`pyggspec.sampling.lazy_grammar.matcher_for`'s: that module builds on this one)."""
        if self.spec.trigger:
            raise ValueError("a lazy grammar (with a trigger) is matched by "
                             "lazy_grammar.matcher_for")
        return GrammarMatcher(self)


def compile_grammar(spec: GrammarSpec, vocab: GrammarVocab) -> Grammar:
    """Translate and check ``spec`` against ``vocab``; :class:`GrammarError` (naming
    ``spec.field``) when llguidance refuses it."""
    import llguidance

    if spec.kind not in KINDS:
        raise GrammarError(spec.field, f"unknown grammar kind {spec.kind!r} "
                           f"(known: {', '.join(KINDS)})")
    if not spec.text.strip():
        raise GrammarError(spec.field, "the grammar is empty")
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(spec.field, "a JSON schema must be an object")
            schema = {} if schema is True else schema
            if spec.after:
                source = llguidance.LLMatcher.grammar_from_lark(_after_lark(spec.after,
                                                                            schema))
            else:
                source = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        else:
            source = llguidance.grammar_from(spec.kind, spec.text)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(spec.field, _one_line(f"invalid {_what(spec)}: {e}")) from None
    err = llguidance.LLMatcher.validate_grammar(source, vocab.tok)
    if err:
        raise GrammarError(spec.field, _one_line(f"invalid {_what(spec)}: {err}"))
    return Grammar(spec, vocab, source)


def _after_lark(after: str, schema: dict) -> str:
    """Lark for: any text up to and including ``after``, whitespace, then ``schema``."""
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return ("%llguidance {}\n"
            "start: prelude /[ \\t\\n]*/ body\n"
            f"prelude[suffix={json.dumps(after)}]: /(?s:.*)/\n"
            f"body: %json {json.dumps(schema)}\n")


def _what(spec: GrammarSpec) -> str:
    return {"gbnf": "grammar", "json_schema": "JSON schema", "lark": "Lark grammar",
            "regex": "regular expression"}[spec.kind]


def _one_line(s: str) -> str:
    s = " ".join(s.split())
    return s if len(s) <= 400 else s[:397] + "..."


class GrammarMatcher:
    """One sequence's grammar state (see the module docstring): ``n_consumed`` emitted
    tokens are consumed; masks at a prefix of drafts are computed on a rolled-back copy of
    the way there and cached per prefix until the next :meth:`accept` / :meth:`restore`."""

    def __init__(self, grammar: Grammar) -> None:
        import llguidance

        self.grammar = grammar
        self.vocab = grammar.vocab
        self._m = llguidance.LLMatcher(grammar.vocab.tok, grammar.source, log_level=0)
        if self._m.is_error():
            raise GrammarError(grammar.spec.field, _one_line(self._m.get_error()))
        self.n_consumed = 0
        self._masks: dict[tuple[int, ...], np.ndarray | None] = {}
        self._bias: dict[tuple[int, ...], np.ndarray] = {}
        self._eos_only: np.ndarray | None = None
        self._free: np.ndarray | None = None

    # --- the emitted tokens ----------------------------------------------------------------
    def accept(self, token: int) -> None:
        """Consume an emitted token (one the chain chose under this grammar's mask)."""
        self._m.consume_token(int(token))
        self.n_consumed += 1
        self._clear()

    def restore(self, n_consumed: int) -> None:
        """Back to the state after the first ``n_consumed`` emitted tokens."""
        if n_consumed < self.n_consumed:
            self._m.rollback(self.n_consumed - n_consumed)
            self.n_consumed = n_consumed
            self._clear()

    def _clear(self) -> None:
        if self._masks:
            self._masks.clear()
            self._bias.clear()

    @property
    def stopped(self) -> bool:
        """No token but end-of-generation can follow (or the matcher failed)."""
        return bool(self._m.is_stopped())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar takes from the current state."""
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    # --- masks ---------------------------------------------------------------------------
    def words(self, prefix: Sequence[int] = ()) -> np.ndarray | None:
        """The mask after ``prefix`` (drafts after the emitted tokens) as llguidance's
        bitmask (int32 words, bit i of the vocabulary = allowed), cached per prefix. None
        when the prefix itself breaks the grammar: a row after a forbidden draft, which no
        verify ever reads (the forbidden draft is rejected first): left unconstrained. A
        matcher in error, or a mask with nothing allowed, allows only end of generation."""
        key = tuple(prefix)
        if key in self._masks:
            return self._masks[key]
        m = self._m
        n = m.try_consume_tokens(list(key)) if key else 0
        if n < len(key):
            out = None
        elif m.is_error():
            out = self._eos_words()
        else:
            out = np.empty(self.vocab.n_words, np.int32)
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if not out.any():
                out = self._eos_words()
        if n:
            m.rollback(n)
        if len(self._masks) >= _MASK_CACHE:
            self._clear()
        self._masks[key] = out
        return out

    def free(self, prefix: Sequence[int] = ()) -> bool:
        """The grammar puts no constraint on the token after ``prefix`` (see :meth:`words`):
        the chain need not add the bias."""
        return self.words(prefix) is None

    def allowed(self, prefix: Sequence[int] = ()) -> np.ndarray | None:
        """bool[n_vocab]: the tokens the grammar allows after ``prefix`` (None: see
        :meth:`words`)."""
        w = self.words(prefix)
        return None if w is None else allowed_of(w, self.vocab.n_vocab)

    def bias(self, prefix: Sequence[int] = ()) -> np.ndarray:
        """float32[n_vocab] of 0 (allowed) / -inf (forbidden): what the chain adds to the
        logits, on the host and as the graph's input."""
        key = tuple(prefix)
        b = self._bias.get(key)
        if b is None:
            w = self.words(key)
            if w is None:
                if self._free is None:
                    self._free = np.zeros(self.vocab.n_vocab, np.float32)
                b = self._free
            else:
                b = bias_of(w, self.vocab.n_vocab)
            self._bias[key] = b
        return b

    def _eos_words(self) -> np.ndarray:
        if self._eos_only is None:
            bits = np.zeros(self.vocab.n_words * 32, np.bool_)
            bits[list(self.vocab.eos)] = True
            self._eos_only = np.packbits(bits, bitorder="little").view(np.int32)
        return self._eos_only


def allowed_of(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool[n_vocab] of a bitmask (int32 words, bit i = token i allowed)."""
    return np.unpackbits(words.view(np.uint8), count=n_vocab, bitorder="little").view(np.bool_)


def bias_of(words: np.ndarray, n_vocab: int) -> np.ndarray:
    """float32[n_vocab] of 0 (allowed) / -inf (forbidden) of a bitmask: 8 floats per mask
    byte from a table, ~10x faster than a select."""
    full = np.empty((words.size * 4, 8), np.float32)
    np.take(_BYTE_BIAS, words.view(np.uint8), axis=0, out=full)
    return full.reshape(-1)[:n_vocab]


def _byte_bias() -> np.ndarray:
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, np.float32(0), np.float32(-np.inf)).astype(np.float32)


_BYTE_BIAS = _byte_bias()  # [256, 8]: a mask byte's 8 tokens as 0 / -inf
