"""llama-server's ``POST /infill``: fill-in-the-middle code completion.

The request gives the code before the cursor (``input_prefix``), after it
(``input_suffix``), the start of the middle already typed (``prompt``) and other files of the
project (``input_extra``: ``[{"filename", "text"}]``). The prompt is built exactly as
llama.cpp b11549 builds it (``format_prompt_infill`` in ``tools/server/server-common.cpp``),
Qwen2.5-Coder's repository-level FIM layout::

    [extra: <|repo_name|>myproject\\n <|file_sep|>FILE\\nTEXT ... <|file_sep|>filename\\n]
    [BOS] <|fim_prefix|>PREFIX PROMPT <|fim_suffix|>SUFFIX <|fim_middle|>

with its cuts: the prefix keeps its last ``3 * (n_batch / 4)`` tokens, the suffix its first
``n_batch / 4 - 2 - len(prompt)``, the extra context its last
``n_ctx - n_batch - 2 * n_predict`` (``n_predict``: the server's ``-n``; -1 by default), and
with ``--spm-infill`` the suffix goes first. The FIM tokens are those llama.cpp finds in the
vocabulary (:attr:`pyggspec.tokenizer.Tokenizer.fim`); a model without prefix, suffix and
middle tokens gets llama-server's 501. The answer is ``/completion``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pyggspec.serving.http import openai_api as oa
from pyggspec.serving.http.completions import answer_llama
from pyggspec.serving.http.protocol import ApiError, get_bool, invalid, parse_gen, read_body
from pyggspec.serving.http.state import ServerState

# llama.cpp's separator of extra chunks when the vocabulary has no <|file_sep|>
CHUNK_PREFIX = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject\n"  # llama.cpp's fixed project name (a TODO there)
FILE_NAME = "filename\n"  # and the current file's name


def missing_fim(fim: Any) -> str:
    """llama-server's list of what the vocabulary lacks for /infill ('' when nothing)."""
    return "".join(f"{what} token is missing. " for what, t in
                   (("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid)) if t is None)


def tokenize_mixed(tok: Any, v: str | Sequence[Any]) -> list[int]:
    """llama.cpp's ``tokenize_mixed`` without special tokens: a string, or an array of
    strings and token ids, each string tokenized on its own."""
    if isinstance(v, str):
        return tok.tokenize(v, add_special=False, parse_special=False)
    out: list[int] = []
    for p in v:
        if isinstance(p, str):
            out.extend(tok.tokenize(p, add_special=False, parse_special=False))
        else:
            out.append(int(p))
    return out


def format_infill(tok: Any, prefix: str | Sequence[Any], suffix: str | Sequence[Any],
                  extra: Sequence[dict[str, str]], prompt: list[int], *, n_batch: int,
                  n_predict: int, n_ctx: int, spm: bool = False) -> list[int]:
    """The /infill prompt's token ids, as llama.cpp's ``format_prompt_infill``
    (``prompt``: the already tokenized ``prompt`` field). ``tok``: a
    :class:`~pyggspec.tokenizer.Tokenizer` (its ``fim`` tokens, ``add_bos``, ``bos``)."""
    fim = tok.fim

    def plain(text: str) -> list[int]:
        return tok.tokenize(text, add_special=False, parse_special=False)

    t_prefix, t_suffix = tokenize_mixed(tok, prefix), tokenize_mixed(tok, suffix)
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *plain(REPO_NAME)]
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *plain(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_tokens += plain(CHUNK_PREFIX)
        extra_tokens += plain(chunk.get("text", ""))
    if fim.sep is not None:
        extra_tokens += [fim.sep, *plain(FILE_NAME)]
    q = n_batch // 4
    n_prefix_take = min(len(t_prefix), 3 * q)
    n_suffix_take = min(len(t_suffix), max(0, q - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    t_prefix = [fim.pre, *t_prefix[len(t_prefix) - n_prefix_take:], *prompt]
    t_suffix = [fim.suf, *t_suffix[:n_suffix_take]]
    first, last = (t_suffix, t_prefix) if spm else (t_prefix, t_suffix)
    if tok.add_bos and tok.bos is not None:
        first = [tok.bos, *first]
    return [*extra_tokens[len(extra_tokens) - n_extra_take:], *first, *last, fim.mid]


def _check(body: dict[str, Any], n_vocab: int) -> list[dict[str, str]]:
    """llama-server's checks of the /infill fields (400s); returns ``input_extra``."""
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise invalid('"prompt" must be a string', "prompt")
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise invalid(f'"{key}" is required', key)
        v = body[key]
        ok = isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)
                                   and 0 <= p < n_vocab) for p in v))
        if not ok:
            raise invalid(f'"{key}" must be a string, or an array of strings and token ids '
                          f"(0..{n_vocab - 1})", key)
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise invalid('"input_extra" must be an array of {"filename": string, "text": string}',
                      "input_extra")
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid('extra_context chunk must contain a "text" field with a string value',
                          "input_extra")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid("extra_context chunk's \"filename\" field must be a string",
                          "input_extra")
    return extra


def install(app: FastAPI, state: ServerState) -> None:
    """Add ``POST /infill`` to ``app``."""
    cfg = state.config

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        t_start = time.perf_counter()
        tok = state.tokenizer
        missing = missing_fim(tok.fim)
        if missing:
            raise ApiError(501, f"Infill is not supported by this model: {missing}")
        body = await read_body(request)
        extra = _check(body, state.n_vocab)
        model = state.model_name(body)
        gen = parse_gen(body, cfg.sampling, state.n_vocab, cfg.n_predict,
                        tokenize=state.text_ids)
        n_predict = -1 if cfg.n_predict is None else cfg.n_predict

        def build() -> tuple[list[int], str]:
            prompt = tok.tokenize(body.get("prompt", ""), add_special=False, parse_special=True)
            ids = format_infill(tok, body["input_prefix"], body["input_suffix"], extra,
                                prompt, n_batch=int(state.engine.n_batch),
                                n_predict=n_predict, n_ctx=state.n_ctx, spm=cfg.spm_infill)
            return ids, tok.detokenize(ids)  # echoed as "prompt", as llama-server does

        ids, echo = await asyncio.to_thread(build)
        state.check_context(ids, gen)
        settings = state.settings(gen)
        handle = await state.submit(ids, gen, oa.new_id("cmpl"),
                                    get_bool(body, "cache_prompt", True))
        return await answer_llama(state, request, handle, t_start, gen, model, settings, echo)
