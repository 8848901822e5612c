"""The constructed-agreement model (DESIGN §5): real MTP acceptance without trained weights.

Construction (all in the HF form the writer then converts):

* ``f`` is a single cycle over the *cycle tokens* (NORMAL tokens that spell printable ASCII,
  so generation never emits a special/EOG token or a broken UTF-8 byte).
* ``lm_head[f(t)] = (logit_scale / n_embd) * rmsnorm(E[t])`` for every cycle token t, all other
  rows 0; output_norm is 1. With the trunk's layer outputs scaled down, the residual stream at
  the end of the trunk is ~``E[x]`` and the target predicts ``f(x)``.
* MTP ``fc`` (``eh_proj``) = ``[I | 0]``: it passes the normalised embedding of the token x_q
  and drops the hidden half; MTP layer outputs are scaled down too, so the head predicts
  ``f(x_q)`` = the target's own next token. Noise ``sigma * [G1 | G2] / sqrt(n_embd)`` on ``fc``
  lowers agreement; ``sigma`` is calibrated here by bisection on the numpy model.

Calibration model (ignores the scaled-down layers): for a cycle token t the MTP sees
``e = rmsnorm(E[t])`` and ``h = rmsnorm(E[f^-1(t)])`` (the previous position's post-norm hidden
state in a greedy run along the cycle); it agrees iff ``argmax(lm_head @ rmsnorm(fc @ [e; h]))
== f(t)``. The achieved rate is a multiple of 1/len(cycle); it is reported in
``AgreementPlan.achieved_rate`` and differs from the request by at most a few 1/len(cycle).
"""

from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from pyggspec.testing.spec import ModelSpec
from pyggspec.testing.vocab import Vocab, build_vocab


def rng_for(spec: ModelSpec, key: str) -> np.random.Generator:
    """An RNG that depends only on (seed, key): tensors can be generated in any order."""
    digest = hashlib.sha256(key.encode()).digest()
    return np.random.default_rng([spec.seed, int.from_bytes(digest[:8], "little")])


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm without weight, row-wise (ggml_rms_norm semantics), float32."""
    x = x.astype(np.float32, copy=False)
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return x / np.sqrt(ms + np.float32(eps))


_EMB_BLOCK = 4096  # rows per RNG stream: any row range can be generated on its own


def embedding_rows(spec: ModelSpec, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of HF ``embed_tokens``, float32, independent of what else is made."""
    out = np.empty((stop - start, spec.n_embd), dtype=np.float32)

    def fill(b: int) -> None:
        lo, hi = b * _EMB_BLOCK, min((b + 1) * _EMB_BLOCK, spec.n_vocab)
        block = rng_for(spec, f"model.embed_tokens.weight/{b}").standard_normal(
            (hi - lo, spec.n_embd), dtype=np.float32)
        a, z = max(lo, start), min(hi, stop)
        out[a - start:z - start] = block[a - lo:z - lo]

    blocks = range(start // _EMB_BLOCK, (stop + _EMB_BLOCK - 1) // _EMB_BLOCK)
    threads = min(16, os.cpu_count() or 1, len(blocks))
    if out.size >= 1 << 24 and threads > 1:  # independent streams: threads, the same rows
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fill, blocks))
    else:
        for b in blocks:
            fill(b)
    out *= np.float32(spec.embed_std)
    return out


def embeddings(spec: ModelSpec) -> np.ndarray:
    """HF ``embed_tokens`` [n_vocab, n_embd], float32 (shared by writer and calibration)."""
    return embedding_rows(spec, 0, spec.n_vocab)


def cycle_tokens(vocab: Vocab) -> np.ndarray:
    """NORMAL tokens whose bytes are all printable ASCII (space included)."""
    ids = [
        t for t in range(vocab.n_normal)
        if all(0x20 <= b < 0x7F for b in vocab.token_bytes(t))
    ]
    return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class AgreementPlan:
    """Everything the writer and the tests need to know about the constructed model."""

    cycle: np.ndarray  # cycle tokens in cycle order: f(cycle[i]) = cycle[i + 1]
    next_token: np.ndarray  # [n_vocab] f(t) as the ideal target predicts it; -1 = not computed
    sigma: float  # noise on fc
    target_rate: float
    achieved_rate: float  # numpy-calibrated MTP/target top-1 agreement over the cycle
    fc_noise: np.ndarray  # [n_embd, 2 * n_embd] unit-variance noise G = [G1 | G2]

    def lm_head(self, spec: ModelSpec, emb: np.ndarray) -> np.ndarray:
        """HF ``lm_head.weight`` [n_vocab, n_embd] realising f on the cycle."""
        w = np.zeros((spec.n_vocab, spec.n_embd), dtype=np.float32)
        src = self.cycle
        dst = np.roll(self.cycle, -1)
        w[dst] = rms_normalize(emb[src], spec.rms_eps) * np.float32(spec.logit_scale / spec.n_embd)
        return w

    def fc(self, spec: ModelSpec) -> np.ndarray:
        """HF ``mtp.fc.weight`` [n_embd, 2 * n_embd] = [I | 0] + noise."""
        d = spec.n_embd
        w = self.fc_noise * np.float32(self.sigma / np.sqrt(d))
        w[:, :d] += np.eye(d, dtype=np.float32)
        return w


def _mtp_agreement(
    spec: ModelSpec, e: np.ndarray, mixed: np.ndarray, head_c: np.ndarray, sigma: float,
) -> float:
    """Fraction of cycle tokens whose (noisy) MTP top-1 equals f(t); see module docstring.
    ``e`` = rmsnorm(E[t]) and ``mixed`` = ``e @ G1.T + h @ G2.T`` (:func:`_mtp_inputs`)."""
    s = np.float32(sigma / np.sqrt(spec.n_embd))
    x = e + s * mixed
    logits = rms_normalize(x, spec.rms_eps) @ head_c.T  # over cycle rows (all others are 0)
    best = np.argmax(logits, axis=1)
    m = len(e)
    want = (np.arange(m) + 1) % m  # row j of head_c is the logit of cycle[j]
    ok = (best == want) & (logits[np.arange(m), want] > 0.0)
    return float(np.mean(ok))


def _mtp_inputs(spec: ModelSpec, emb_c: np.ndarray, emb_prev: np.ndarray,
                noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``e`` and ``e @ G1.T + h @ G2.T`` for :func:`_mtp_agreement`: independent of sigma, so
    computed once per calibration (the same values as computing them for every sigma, which
    took ~1 min of the bisection at n_embd 5120)."""
    d = spec.n_embd
    e = rms_normalize(emb_c, spec.rms_eps)
    h = rms_normalize(emb_prev, spec.rms_eps)
    return e, e @ noise[:, :d].T + h @ noise[:, d:].T


@functools.lru_cache(maxsize=8)
def agreement_plan(spec: ModelSpec) -> AgreementPlan:
    """Build f and calibrate sigma for ``spec.agreement`` (deterministic from the seed)."""
    if spec.agreement is None:
        raise ValueError("spec.agreement is None: not a constructed-agreement model")
    vocab = build_vocab(spec.n_vocab)
    order = cycle_tokens(vocab)
    cycle = rng_for(spec, "agreement.cycle").permutation(order)
    n_real = vocab.n_normal + 3  # byte/merge tokens and the special tokens
    emb = embedding_rows(spec, 0, n_real)
    emb_c = emb[cycle]
    emb_prev = emb[np.roll(cycle, 1)]  # f^-1(cycle[i]) = cycle[i - 1]
    # row j: the LM-head row of token cycle[j] (see AgreementPlan.lm_head)
    head_c = rms_normalize(emb_prev, spec.rms_eps) * np.float32(spec.logit_scale / spec.n_embd)
    noise = rng_for(spec, "agreement.fc_noise").standard_normal(
        (spec.n_embd, 2 * spec.n_embd), dtype=np.float32)

    e, mixed = _mtp_inputs(spec, emb_c, emb_prev, noise)

    def rate(sigma: float) -> float:
        return _mtp_agreement(spec, e, mixed, head_c, sigma)

    target = spec.agreement
    sigma, achieved = 0.0, rate(0.0)
    if target < achieved:
        lo, hi = 0.0, 0.25
        while rate(hi) > target and hi < 1e4:
            lo, hi = hi, hi * 2.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if rate(mid) > target:
                lo = mid
            else:
                hi = mid
        # take whichever bracket end lands closer to the request
        r_lo, r_hi = rate(lo), rate(hi)
        sigma, achieved = (lo, r_lo) if abs(r_lo - target) <= abs(r_hi - target) else (hi, r_hi)

    # f over the real (non-PAD) tokens, as the ideal target predicts it
    real = np.arange(n_real)
    logits = rms_normalize(emb, spec.rms_eps) @ head_c.T  # non-cycle rows are all 0
    next_token = np.full(spec.n_vocab, -1, dtype=np.int64)
    next_token[real] = cycle[np.argmax(logits, axis=1)]
    first_zero_row = int(np.setdiff1d(np.arange(spec.n_vocab), cycle)[0])
    next_token[real[logits.max(axis=1) <= 0.0]] = first_zero_row
    return AgreementPlan(cycle, next_token, float(sigma), target, achieved, noise)
