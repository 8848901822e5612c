"""A small, real byte-level BPE vocabulary (GPT-2 style, as Qwen uses), trained here.

llama.cpp tokenizes with the GGUF's own merges, so a tiny but genuine BPE lets tests run real
text through real tokenization instead of fake ids. Layout follows the Qwen converter
(``_set_vocab_gpt2``): byte tokens and merge tokens are NORMAL, then the special tokens
(CONTROL), then ``[PAD{i}]`` tokens (UNUSED) up to the model's vocab_size.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from dataclasses import dataclass

from gguf import TokenType

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen's fill-in-the-middle tokens, in Qwen's id order (151659..151664 there), which
# llama.cpp finds by their text; added after the three above when a spec asks (fim_tokens)
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>")

# ChatML, the format Qwen chat templates render (without tools/thinking branches).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_N_MERGES = 480

# Built-in training text: plain English plus a little Python, so common words, spaces,
# indentation and punctuation all get merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Once upon a time there was a small model that wanted to predict the next token. It read the
same sentences again and again, and it learned that the words that follow each other in a
sentence are not random at all. When the model was ready, it wrote a story about a fox and a
dog who became friends. They walked in the forest, they talked about the weather, and they
shared their lunch under a tall tree. In the evening they went home, and the stars came out.
Speculative decoding lets a small draft head propose several tokens, and the target model
checks all of them in one batch. If the draft is right, we accept the tokens and move on; if
it is wrong, we keep the tokens that matched and roll the state back to the last good one.
This is the reason why the acceptance rate matters so much for the speed of generation.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Qwen.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14 42 1e-6 0.25 65536 248320.
def main(argv: list[str]) -> int:
    total = 0
    for index, value in enumerate(argv):
        if value.startswith("--"):
            continue
        total += len(value) * index
    print(f"total = {total}")
    return 0


class Tokenizer:
    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.vocab = vocab
        self.merges = {pair: rank for rank, pair in enumerate(merges)}

    def encode(self, text: str) -> list[int]:
        return [self.vocab[token] for token in self.split(text)]


if __name__ == "__main__":
    raise SystemExit(main(["--verbose", "hello", "world"]))
"""

# Qwen3.5's pre-tokenizer regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35) restricted to ASCII,
# which is all the corpus holds: letters [A-Za-z], numbers [0-9] (one digit per piece).
_PRETOKENIZE = re.compile(
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+"
    r"|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map (the byte tokens' spelling)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_order() -> list[int]:
    """Bytes in GPT-2 vocab order: printable ones first (id 0 is '!'), then the remapped."""
    return list(bytes_to_unicode().keys())


def train_bpe(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Learn up to ``n_merges`` merges; ties go to the lexicographically smallest pair."""
    b2u = bytes_to_unicode()
    counts = Counter(_PRETOKENIZE.findall(text))
    words: list[list[str]] = [[b2u[b] for b in w.encode("utf-8")] for w in counts]
    freqs = list(counts.values())
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in zip(words, freqs):
            for pair in itertools.pairwise(word):
                pairs[pair] += freq
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        joined = best[0] + best[1]
        for i, word in enumerate(words):
            if len(word) < 2:
                continue
            out: list[str] = []
            j = 0
            while j < len(word):
                if j + 1 < len(word) and word[j] == best[0] and word[j + 1] == best[1]:
                    out.append(joined)
                    j += 2
                else:
                    out.append(word[j])
                    j += 1
            words[i] = out
    return merges


@dataclass(frozen=True)
class Vocab:
    """Token list, types and merges exactly as ``tokenizer.ggml.*`` stores them."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    n_normal: int  # tokens [0, n_normal) are byte and merge tokens

    @property
    def endoftext_id(self) -> int:
        return self.n_normal

    @property
    def im_start_id(self) -> int:
        return self.n_normal + 1

    @property
    def im_end_id(self) -> int:
        return self.n_normal + 2

    # Special ids as the converter's SpecialVocab resolves them for Qwen3.5:
    # eos and pad from tokenizer_config.json (eos_token <|im_end|>, pad_token <|endoftext|>),
    # bos from config.json text_config.bos_token_id (= <|endoftext|>).
    @property
    def eos_id(self) -> int:
        return self.im_end_id

    @property
    def pad_id(self) -> int:
        return self.endoftext_id

    @property
    def bos_id(self) -> int:
        return self.endoftext_id

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a NORMAL token stands for (decodes the byte-level spelling)."""
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        return bytes(u2b[c] for c in self.tokens[token_id])


@functools.cache
def build_vocab(n_vocab: int, n_merges: int = DEFAULT_N_MERGES, fim: bool = False) -> Vocab:
    """Bytes + merges + 3 special tokens (+ Qwen's 6 FIM tokens with ``fim``), padded with
    ``[PAD{i}]`` to ``n_vocab``. The FIM tokens are CONTROL, as the converter types added
    tokens that look special (``<|...|>``)."""
    b2u = bytes_to_unicode()
    merges = train_bpe(CORPUS, n_merges)
    tokens = [b2u[b] for b in byte_order()]
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen:  # two merge paths can spell the same token; keep the first
            tokens.append(a + b)
            seen.add(a + b)
    n_normal = len(tokens)
    types = [int(TokenType.NORMAL)] * n_normal
    specials = SPECIAL_TOKENS + (FIM_TOKENS if fim else ())
    tokens += list(specials)
    types += [int(TokenType.CONTROL)] * len(specials)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab={n_vocab} is smaller than the {len(tokens)} real tokens")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return Vocab(
        tokens=tuple(tokens), token_types=tuple(types),
        merges=tuple(f"{a} {b}" for a, b in merges), n_normal=n_normal,
    )
