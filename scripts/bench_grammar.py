"""Constrained output: which grammar library fits the sampler chain, and what a JSON schema
costs pyggspec per token (docs/benchmarks.md, "Constrained output").

``libs``: llguidance against outlines-core (both install without torch) on a llama.cpp
vocabulary: the one-time tokenizer/vocabulary build, compiling one JSON schema, and the mask
for each token of a JSON answer (median / max). ``engine``: tokens/s of ``Engine.generate``
with and without that schema (plain and draft-mtp), paired, in this process.

    python3 scripts/bench_grammar.py libs VOCAB.gguf [--pad 248320]
    python3 scripts/bench_grammar.py engine MODEL.gguf [-n 64] [--reps 3]
    PYTHONPATH=CHECKOUT python3 scripts/bench_grammar.py free MODEL.gguf [--mtp]

``free``: host ms per decode step without a grammar, for a before/after comparison of two
checkouts (it uses only what every checkout has).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import numpy as np

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
ANSWER = {"name": "Alice Smith", "age": 42, "tags": ["one", "two", "three"]}


def libs(path: str, pad: int) -> dict:
    import llama_cpp as ll
    import llguidance as lg
    import llguidance.llamacpp as lgl
    import outlines_core as oc

    p = ll.llama_model_default_params()
    p.vocab_only = True
    model = ll.llama_model_load_from_file(path.encode(), p)
    vocab = ll.llama_model_get_vocab(model)
    n = ll.llama_vocab_n_tokens(vocab)
    V = max(n, pad)
    eos = ll.llama_vocab_eos(vocab)
    out: dict = {"vocab": path, "n_tokens": n, "n_vocab": V}

    t0 = time.perf_counter()
    tok = lgl.lltokenizer_from_vocab(vocab, n_vocab=V)
    out["llguidance_tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    ids = tok.tokenize_str(json.dumps(ANSWER))
    t0 = time.perf_counter()
    m = lg.LLMatcher(tok, lg.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    out["llguidance_compile_ms"] = (time.perf_counter() - t0) * 1e3
    words = np.zeros((V + 31) // 32, np.int32)
    ts = []
    for t in ids:
        a = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        ts.append(time.perf_counter() - a)
        assert m.consume_token(t), m.get_error()
    out["llguidance_mask_us"] = (statistics.median(ts) * 1e6, max(ts) * 1e6)

    buf = ctypes.create_string_buffer(256)
    t0 = time.perf_counter()
    pieces: dict[bytes, list[int]] = {}
    for i in range(n):
        k = ll.llama_token_to_piece(vocab, i, buf, 256, 0, False)
        if i != eos and k > 0:
            pieces.setdefault(buf.raw[:k], []).append(i)
    voc = oc.Vocabulary(eos, pieces)
    out["outlines_vocabulary_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    guide = oc.Guide(oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), voc))
    out["outlines_compile_ms"] = (time.perf_counter() - t0) * 1e3
    ts = []
    for t in ids:
        a = time.perf_counter()
        guide.write_mask_into(words.ctypes.data, words.size, 4)
        ts.append(time.perf_counter() - a)
        guide.advance(t)
    out["outlines_mask_us"] = (statistics.median(ts) * 1e6, max(ts) * 1e6)
    out["answer_tokens"] = len(ids)
    return out


def engine(path: str, n: int, reps: int) -> dict:
    from pyggspec.config import SpecConfig
    from pyggspec.engine import Engine
    from pyggspec.sampling import SamplingParams

    # an array of short strings: long enough to fill -n, every token under the grammar
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}
    greedy = SamplingParams(temp=0.0)
    out: dict = {"model": path, "n": n, "reps": reps}
    for name, kw in (("plain", {}), ("draft-mtp", {"spec_type": "draft-mtp",
                                                   "spec": SpecConfig(n_max=3)})):
        with Engine(path, n_ctx=1024, **kw) as e:
            e.generate("Warm up", max_tokens=4, sampling=greedy, json_schema=schema)
            rates: dict[str, list[float]] = {"free": [], "schema": []}
            host: dict[str, list[float]] = {"free": [], "schema": []}
            for _ in range(reps):
                for mode in ("free", "schema"):
                    extra = {"json_schema": schema} if mode == "schema" else {}
                    r = e.generate("The list:", max_tokens=n, sampling=greedy, ignore_eos=True,
                                   **extra)
                    rates[mode].append(r.timings.predicted_n / r.timings.predicted_ms * 1e3)
                    host[mode].extend(r.timings.python_ms)
            ratios = [s / f for s, f in zip(rates["schema"], rates["free"])]
            out[name] = {"free_tps": statistics.median(rates["free"]),
                         "schema_tps": statistics.median(rates["schema"]),
                         "ratio": statistics.median(ratios), "ratios": ratios,
                         # the host (Python) share of a decode step: the grammar's cost
                         # without the device's, which other processes on the cores move
                         "free_python_ms": statistics.median(host["free"]),
                         "schema_python_ms": statistics.median(host["schema"])}
    return out


def free(path: str, n: int, mtp: bool) -> dict:
    import pyggspec
    from pyggspec.engine import Engine
    from pyggspec.sampling import SamplingParams

    greedy = SamplingParams(temp=0.0)
    with Engine(path, n_ctx=512, **({"spec_type": "draft-mtp"} if mtp else {})) as e:
        e.generate("Warm up", max_tokens=8, sampling=greedy)
        host: list[float] = []
        for _ in range(2):
            r = e.generate("The list:", max_tokens=n, sampling=greedy, ignore_eos=True)
            host.extend(r.timings.python_ms)
    return {"checkout": pyggspec.__file__, "mtp": mtp, "python_ms": statistics.median(host)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("libs", "engine", "free"))
    ap.add_argument("path")
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mtp", action="store_true")
    a = ap.parse_args()
    if a.what == "libs":
        res = libs(a.path, a.pad)
    elif a.what == "engine":
        res = engine(a.path, a.n, a.reps)
    else:
        res = free(a.path, a.n, a.mtp)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
