"""A numpy reference of the gated delta rule, step by step, states included.

It pins the semantics of ``ggml_gated_delta_net`` (and of our graphs that use it):
per V head h with K head ``h % H_k`` (tiled broadcast), key dim i, value dim j,

    S <- exp(g_t) * S
    S <- S + k_t (x) (beta_t * (v_t - S^T k_t))
    o_t = S^T (q_t / sqrt(S_dim))

Arrays use numpy order (the reverse of ggml's ne): q, k [B, T, H_k, S]; v [B, T, H, S];
g, beta [B, T, H]; state [B, H, S_v(j), S_k(i)] -- ggml stores S transposed.
"""

from __future__ import annotations

import numpy as np


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
    state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (outputs [B, T, H, S], states after each token [B, T, H, S, S])."""
    B, T, H, S = v.shape
    Hk = q.shape[2]
    out = np.zeros((B, T, H, S), dtype=np.float64)
    states = np.zeros((B, T, H, S, S), dtype=np.float64)
    scale = 1.0 / np.sqrt(S)
    for b in range(B):
        for h in range(H):
            M = state[b, h].astype(np.float64).T.copy()  # M[i, j] = S[i][j]
            for t in range(T):
                kk = k[b, t, h % Hk].astype(np.float64)
                qq = q[b, t, h % Hk].astype(np.float64) * scale
                M *= np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - M.T @ kk)
                M += np.outer(kk, delta)
                out[b, t, h] = M.T @ qq
                states[b, t, h] = M.T  # back to ggml's transposed storage
    return out, states
