#!/usr/bin/env python3
"""How much of real text a draft head's hot vocabulary holds (docs/benchmarks.md row 39).

Tokenizes text found on this machine (licence texts, Python's standard library, its CJK
codec test files) with a real tokenizer (default: Qwen3.5's, from the llama.cpp sources
install.sh downloads) and reports, per corpus, the share of tokens that fall inside

* the first N token ids (``--spec-draft-vocab N``: a fixed prefix), and
* the hot set as pyggspec keeps it (``speculative/hot_vocab.py``: learnt from the tokens
  seen, chosen again by its own rule), each token counted against the set of its time.

    python3 scripts/hot_vocab_coverage.py
    python3 scripts/hot_vocab_coverage.py --vocab other-model.gguf --rows 16384 32768

A token outside the set cannot be drafted right, so (1 - share) bounds what the set costs
in acceptance per draft position. Not a speed benchmark.
"""

from __future__ import annotations

import argparse
import glob
import sys
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = (ROOT / ".cache/llama-cpp-python-0.3.36/vendor/llama.cpp/models/"
         "ggml-vocab-qwen35.gguf")


def corpora(limit: int) -> dict[str, str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    cjk = lib / "test" / "cjkencodings"

    def read(paths) -> str:
        out, n = [], 0
        for p in paths:
            try:
                t = Path(p).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            out.append(t)
            n += len(t)
            if n > limit:
                break
        return "\n".join(out)[:limit]

    return {
        "English (licence texts)": read(sorted(glob.glob("/usr/share/common-licenses/*"))),
        "Python code (stdlib)": read(sorted(lib.glob("*.py"))),
        "English prose (pydoc topics)": read(sorted((lib / "pydoc_data").glob("*.py"))),
        "Chinese": read([cjk / f for f in ("gb2312-utf8.txt", "big5-utf8.txt",
                                           "gb18030-utf8.txt")]),
        "Japanese": read([cjk / f for f in ("euc_jp-utf8.txt", "shift_jis-utf8.txt",
                                            "euc_jisx0213-utf8.txt")]),
        "Korean": read([cjk / f for f in ("euc_kr-utf8.txt", "cp949-utf8.txt")]),
    }


def learnt_share(ids: np.ndarray, n_vocab: int, rows: int, chunk: int = 16) -> float:
    """Share of ``ids`` inside pyggspec's hot set at their time (fed ``chunk`` at a time,
    as a decode loop commits a few tokens per step)."""
    from pyggspec.speculative.hot_vocab import HotVocab

    h = HotVocab(n_vocab, rows)
    hit = 0
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        hit += int(h.member[part].sum())
        if h.observe(part, emitted=True):
            h.choose()
    return hit / max(len(ids), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=Path, default=VOCAB, help="GGUF whose tokenizer to use")
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--limit", type=int, default=400_000, help="characters per corpus")
    args = ap.parse_args()
    from pyggspec.tokenizer import Tokenizer

    tok = Tokenizer(args.vocab)
    n_vocab = tok.n_vocab
    print(f"tokenizer: {args.vocab.name} ({n_vocab} ids)")
    print("| corpus | tokens | " + " | ".join(
        f"first {k} / learnt {k}" for k in args.rows) + " |")
    print("|---|---:|" + "---:|" * len(args.rows))
    for name, text in corpora(args.limit).items():
        ids = np.array(tok.tokenize(text, add_special=False), np.int64)
        cells = [f"{(ids < k).mean():.3f} / {learnt_share(ids, n_vocab, k):.3f}"
                 for k in args.rows]
        print(f"| {name} | {len(ids)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
