"""Lazy grammars: free text until a trigger string appears, then a grammar holds the rest.

llama-server builds one for ``tool_choice: auto`` (its lazy grammar, triggered by
``<tool_call>``): generation is free, and costs nothing, until the model starts a call; from
there the grammar of the calls holds it. A :class:`~pyggspec.sampling.grammar.GrammarSpec`
with ``trigger`` is one: ``text`` is the grammar of what follows the trigger, and ``after``
(a thinking model's ``</think>``) is a gate before which the trigger does not count. The
answer may end anywhere before the trigger.

Why not one llguidance grammar (``start: FREE | FREE_T calls``, ``FREE: /(?s:.*)/ &
~/(?s:.*)<tool_call>(?s:.*)/``, ``FREE_T: FREE "<tool_call>"``): it compiles and matches
(llguidance 1.9.1 has no trigger of its own), but then every free step pays a mask and the
[n_vocab] bias row made from it. Measured (``Engine.generate``, greedy, 64 free tokens with
``ignore_eos``, 5 runs alternating in one process, twice, the 0.8B-shaped Q8_0 bench model
with 248,320 ids, 2 cores; median host share of a step, ``timings.python_ms``): without a
grammar 0.31-0.32 ms plain and 0.41-0.43 ms with draft-mtp; with that grammar 0.68-0.76 ms
and 0.78-0.83 ms; with this module 0.35-0.36 ms and 0.44-0.48 ms (what is left: the byte
scan of each token, the free check of each row); the tokens the same in all three. Over a
real Qwen vocabulary
(llama.cpp's ``ggml-vocab-qwen35.gguf``, 152k tokens padded to 248k) that grammar's free
mask took ~9 us and its bias row ~83 us per row. Here a free row computes nothing: no mask,
no bias, and drafts by the head's argmax, as without a grammar.

How, exactly (a row's constraint depends only on the tokens before it, so the output is the
same with and without speculation):

* Before the trigger the text is read in Python: the bytes of each token (as llguidance
  sees them) move a small state -- before the gate or not, and the last bytes that could
  start the trigger.
* The llguidance matcher of ``text`` consumes the text after the trigger: the tokens after
  the one that completes it, and before them the bytes that token has past the trigger
  (``>\\n`` after ``<tool_call``), tokenized again. So a token that completes the trigger and
  runs past it is taken where the grammar takes those bytes: the rows where one could come
  -- the text ends with the start of the trigger, or a token holds the whole trigger and
  more -- get a mask of the ones it does not take, checked once per request from
  candidates found once per vocabulary and trigger (:class:`TriggerIndex`). In Qwen's
  vocabularies ``<tool_call>`` is one token, so a model that writes it never needs one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pyggspec.sampling.grammar import (
    Grammar,
    GrammarMatcher,
    GrammarVocab,
    allowed_of,
    bias_of,
)

GATED, FREE, HELD = 0, 1, 2  # before the gate, free text, the grammar holds the text
_ROWS = 64  # prefixes whose rows one matcher keeps between two accepted tokens

State = tuple[int, bytes]  # (phase, the last bytes that may start the gate / the trigger)
Row = tuple[State, tuple[int, ...]]  # the state after a prefix, the held matcher's tokens


class TriggerIndex:
    """The tokens of one vocabulary that could complete ``trigger`` and run past it:
    ``inner`` hold the whole trigger with bytes after it, ``starts[k]`` begin with
    ``trigger[k:]`` and are longer (they finish it after text that ends in
    ``trigger[:k]``). Supersets: a row checks its candidates exactly."""

    def __init__(self, vocab: GrammarVocab, trigger: bytes) -> None:
        blob, off = vocab.blob, vocab.offsets
        lens = np.diff(off)
        n = len(trigger)
        pos = np.array([m.start() for m in re.finditer(re.escape(trigger), blob)], np.int64)
        tok = np.searchsorted(off, pos, side="right") - 1
        self.inner = (np.unique(tok[pos + n < off[tok + 1]]) if len(pos)
                      else np.zeros(0, np.int64))
        data = np.frombuffer(blob, np.uint8)
        first = np.full(len(lens), -1, np.int16)
        some = lens > 0
        first[some] = data[off[:-1][some]]
        self.starts: dict[int, np.ndarray] = {}
        for k in range(1, n):
            rest = trigger[k:]
            cand = np.flatnonzero((first == rest[0]) & (lens > len(rest)))
            self.starts[k] = np.array([t for t in cand.tolist()
                                       if blob.startswith(rest, int(off[t]))], np.int64)


def trigger_index(vocab: GrammarVocab, trigger: bytes) -> TriggerIndex:
    """``vocab``'s :class:`TriggerIndex` for ``trigger``, made on first use (~10 ms at 152k
    tokens) and kept with the vocabulary."""
    idx = vocab.triggers.get(trigger)
    if idx is None:
        idx = vocab.triggers[trigger] = TriggerIndex(vocab, trigger)
    return idx


class LazyGrammarMatcher:
    """A :class:`~pyggspec.sampling.grammar.GrammarMatcher` for a lazy grammar (see the
    module docstring), with the same interface: ``n_consumed`` emitted tokens are consumed
    (the free ones by the byte state, the rest by ``held``), a row's mask is taken at its
    draft prefix, and ``words`` / ``allowed`` answer None for a free row (:meth:`free`)."""

    def __init__(self, grammar: Grammar) -> None:
        spec = grammar.spec
        self.grammar = grammar
        self.vocab = grammar.vocab
        self.held = GrammarMatcher(grammar)  # the grammar of the text after the trigger
        self.trigger = spec.trigger.encode()
        self.gate = spec.after.encode()
        self.index = idx = trigger_index(self.vocab, self.trigger)
        # the trigger's starts a token could finish and run past (in Qwen's vocabularies
        # only "<tool_call": ">" + more)
        self._starts = [(k, self.trigger[:k]) for k, ts in idx.starts.items() if len(ts)]
        self._rows: dict[tuple[int, ...], Row | None] = {}
        self._bias: dict[tuple[int, ...], np.ndarray] = {}
        self._near: dict[tuple, tuple[np.ndarray, np.ndarray] | None] = {}
        self._extra: dict[bytes, tuple[int, ...] | None] = {}
        self._zeros: np.ndarray | None = None
        # once triggered: the emitted tokens up to the trigger's end, and the held
        # matcher's tokens of the bytes past it in the same token (or in the lead)
        self._held_from: int | None = None
        self._held_extra = 0
        st, extra = self._scan((GATED if self.gate else FREE, b""), spec.lead.encode())
        if st[0] == HELD:  # the text in front of the answer has started the call
            self._trigger(0, extra)
        self._states: list[State] = [st]

    # --- the emitted tokens ----------------------------------------------------------------
    @property
    def n_consumed(self) -> int:
        return len(self._states) - 1

    def accept(self, token: int) -> None:
        """Consume an emitted token (one the chain chose under this grammar's mask)."""
        st = self._states[-1]
        if st[0] == HELD:
            self.held.accept(token)
        else:
            st, extra = self._scan(st, self.vocab.token_bytes(token))
            if st[0] == HELD:
                self._trigger(len(self._states), extra)
        self._states.append(st)
        self._clear()

    def _trigger(self, n: int, extra: bytes) -> None:
        """The trigger is complete after ``n`` emitted tokens: the held matcher takes the
        bytes past it (the mask refuses a token whose bytes do not tokenize back)."""
        ids = self._extra_ids(extra) or ()
        for t in ids:
            self.held.accept(t)
        self._held_from, self._held_extra = n, len(ids)

    def restore(self, n_consumed: int) -> None:
        """Back to the state after the first ``n_consumed`` emitted tokens."""
        if n_consumed >= self.n_consumed:
            return
        del self._states[n_consumed + 1:]
        if self._held_from is not None:
            if n_consumed < self._held_from:
                self._held_from = None
                self.held.restore(0)
            else:
                self.held.restore(n_consumed - self._held_from + self._held_extra)
        self._clear()

    def _clear(self) -> None:
        self._rows.clear()
        self._bias.clear()

    @property
    def stopped(self) -> bool:
        """No token but end of generation can follow."""
        return self._states[-1][0] == HELD and self.held.stopped

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar takes from the current state."""
        st = self._states[-1]
        if st[0] == HELD:
            return self.held.valid_prefix(tokens)
        for i, t in enumerate(tokens):
            st, extra = self._scan(st, self.vocab.token_bytes(t))
            if st[0] == HELD:  # the held matcher has consumed nothing yet
                ids = self._extra_ids(extra)
                if ids is None:
                    return i
                n = self.held.valid_prefix(list(ids) + list(tokens[i + 1:]))
                return i if n < len(ids) else i + 1 + n - len(ids)
        return len(tokens)

    # --- reading the free text -----------------------------------------------------------
    def _scan(self, st: State, b: bytes) -> tuple[State, bytes]:
        """The state after a token's bytes ``b``, and the bytes of ``b`` past the trigger
        when it completes it."""
        phase, tail = st
        if phase == HELD:
            return st, b""
        s = tail + b
        start = 0
        if phase == GATED:
            i = s.find(self.gate)
            if i < 0:
                return (GATED, s[max(0, len(s) - len(self.gate) + 1):]), b""
            start = i + len(self.gate)
        j = s.find(self.trigger, start)
        if j < 0:
            return (FREE, s[max(start, len(s) - len(self.trigger) + 1):]), b""
        return (HELD, b""), s[j + len(self.trigger):]

    def _extra_ids(self, extra: bytes) -> tuple[int, ...] | None:
        """``extra`` (bytes past the trigger) as tokens for the held matcher; None when they
        do not tokenize back to themselves."""
        if not extra:
            return ()
        ids = self._extra.get(extra)
        if extra not in self._extra:
            tok = self.vocab.tok
            got = tuple(tok.tokenize_bytes(extra))
            ids = self._extra[extra] = got if tok.decode_bytes(list(got)) == extra else None
        return ids

    def _row(self, prefix: tuple[int, ...]) -> Row | None:
        """The state after ``prefix`` and the held matcher's tokens of it (None: the bytes
        past the trigger do not tokenize back), cached until the next accepted token."""
        if prefix in self._rows:
            return self._rows[prefix]
        st = self._states[-1]
        out: Row | None = (st, prefix) if st[0] == HELD else None
        if out is None:
            for i, t in enumerate(prefix):
                st, extra = self._scan(st, self.vocab.token_bytes(t))
                if st[0] == HELD:
                    ids = self._extra_ids(extra)
                    out = None if ids is None else (st, ids + tuple(prefix[i + 1:]))
                    break
            else:
                out = (st, ())
        if len(self._rows) >= _ROWS:
            self._clear()
        self._rows[prefix] = out
        return out

    def _near_trigger(self, st: State) -> tuple[np.ndarray, np.ndarray] | None:
        """(words, bias) of a row before the trigger: every token but those that complete
        the trigger with bytes past it the grammar does not take; None when there are none
        to refuse (the usual case: nothing to compute)."""
        phase, tail = st
        idx = self.index
        if phase == FREE:
            ks = tuple(k for k, p in self._starts if tail.endswith(p))
            if not ks and not len(idx.inner):
                return None
            key: tuple = (FREE, ks)
            cands = [idx.inner, *(idx.starts[k] for k in ks)]
        else:  # before the gate: only a token that holds the gate and then the trigger
            if not len(idx.inner):
                return None
            key, cands = (GATED, tail), [idx.inner]
        if key in self._near:
            return self._near[key]
        cand = np.unique(np.concatenate(cands)).tolist() if any(map(len, cands)) else []
        refused = []
        for t in cand:  # the held matcher is at its start (the emitted text is free)
            nxt, extra = self._scan(st, self.vocab.token_bytes(t))
            ids = self._extra_ids(extra) if nxt[0] == HELD else ()
            if ids is None or (ids and self.held.valid_prefix(ids) < len(ids)):
                refused.append(t)
        out = None
        if refused:
            bits = np.ones(self.vocab.n_words * 32, np.bool_)
            bits[refused] = False
            words = np.packbits(bits, bitorder="little").view(np.int32)
            out = (words, bias_of(words, self.vocab.n_vocab))
        self._near[key] = out
        return out

    # --- masks ---------------------------------------------------------------------------
    def words(self, prefix: Sequence[int] = ()) -> np.ndarray | None:
        """The mask after ``prefix`` as llguidance's bitmask; None for a free row (and a row
        whose prefix the grammar refuses, which no verify reads)."""
        row = self._row(tuple(prefix))
        if row is None:
            return None
        st, held = row
        if st[0] == HELD:
            return self.held.words(held)
        near = self._near_trigger(st)
        return None if near is None else near[0]

    def free(self, prefix: Sequence[int] = ()) -> bool:
        """No constraint on the token after ``prefix``: the chain adds no bias."""
        return self.words(prefix) is None

    def allowed(self, prefix: Sequence[int] = ()) -> np.ndarray | None:
        """bool[n_vocab] of :meth:`words` (None for a free row)."""
        w = self.words(prefix)
        return None if w is None else allowed_of(w, self.vocab.n_vocab)

    def bias(self, prefix: Sequence[int] = ()) -> np.ndarray:
        """float32[n_vocab] of 0 / -inf: what the chain adds (zeros for a free row)."""
        key = tuple(prefix)
        b = self._bias.get(key)
        if b is None:
            row = self._row(key)
            near = None
            if row is not None and row[0][0] == HELD:
                b = self.held.bias(row[1])
            elif row is not None:
                near = self._near_trigger(row[0])
            if b is None and near is not None:
                b = near[1]
            elif b is None:
                if self._zeros is None:
                    self._zeros = np.zeros(self.vocab.n_vocab, np.float32)
                b = self._zeros
            self._bias[key] = b
        return b


def matcher_for(grammar: Grammar) -> GrammarMatcher | LazyGrammarMatcher:
    """The matcher of any compiled grammar: lazy when its spec has a trigger."""
    return LazyGrammarMatcher(grammar) if grammar.spec.trigger else grammar.matcher()
