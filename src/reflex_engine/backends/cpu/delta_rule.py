"""The gated delta rule on numpy, two ways: token by token (the definition, for decode) and in
chunks (the WY / UT-transform form of Yang et al., "Gated Delta Networks", for prompts).

Head-major arrays: q, k (H, T, dk), v (H, T, dv), g, beta (H, T), state S (H, dk, dv). Per head
and token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q. Both return (o (H, T, dv), S).
"""
from __future__ import annotations

import numpy as np

CHUNK = 64


def recurrent(q, k, v, g, beta, state):
    s = state.copy()
    out = np.empty(v.shape, np.float32)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[:, None, None]
        delta = beta[:, t, None] * (v[:, t] - np.einsum("hkv,hk->hv", s, k[:, t]))
        s += k[:, t, :, None] * delta[:, None, :]
        out[:, t] = np.einsum("hkv,hk->hv", s, q[:, t])
    return out, s


def chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Within a chunk of L tokens, with c the cumulative log-decay from its start, the corrections
    D = (I + A)^-1 beta (V - exp(c) K S0), A[t, j] = beta_t exp(c_t - c_j) k_t.k_j for j < t,
    solve all L delta-rule steps at once; the outputs are exp(c) Q S0 + (Q K^T decayed, j <= t) D
    and the state passes to the next chunk as exp(c_L) S0 + (exp(c_L - c) K)^T D."""
    s = state.copy()
    out = np.empty(v.shape, np.float32)
    for a in range(0, q.shape[1], chunk):
        b = min(q.shape[1], a + chunk)
        qc, kc, vc, bc = q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b, None]
        c = np.cumsum(g[:, a:b], axis=1)  # (H, L)
        n = b - a
        lower = np.tril(np.ones((n, n), bool))
        gap = np.where(lower, c[:, :, None] - c[:, None, :], -np.inf)  # c_t - c_j where j <= t, the rest masked
        decay = np.exp(gap).astype(np.float32)  # (H, L, L)
        system = (kc @ kc.transpose(0, 2, 1)) * decay * bc  # beta_t exp(c_t - c_j) k_t.k_j
        system[:, np.arange(n), np.arange(n)] = 1  # I + strictly lower part
        grow = np.exp(c)[:, :, None].astype(np.float32)
        d = np.linalg.solve(system, bc * (vc - grow * (kc @ s)))  # (H, L, dv)
        out[:, a:b] = grow * (qc @ s) + ((qc @ kc.transpose(0, 2, 1)) * decay) @ d
        s = np.exp(c[:, -1])[:, None, None].astype(np.float32) * s \
            + (kc * np.exp(c[:, -1:] - c)[:, :, None].astype(np.float32)).transpose(0, 2, 1) @ d
    return out, s
