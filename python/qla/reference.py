"""Pure-torch implementations of the operator, used as references and baselines.

- ``recurrent``: the token-by-token definition (slow; any dtype, any device).
- ``chunked``: the chunked tensor-core form of docs (matrix products per chunk of 64),
  differentiable through torch autograd. It is the CPU baseline of ``python -m qla.bench``.
"""
from __future__ import annotations

from typing import Optional

import torch


def recurrent(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None):
    """o_t = scale S_t^T q_t with S_t = e^{g_t}(I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. B rows are sequences."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    S = initial_state if initial_state is not None else q.new_zeros(B, HV, K, V)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, HV, V)
    return o, S


def chunked(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None, chunk: int = 64):
    """The chunked (WY/UT) form with C = ``chunk``; same signature and result as ``recurrent``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    C = chunk
    pad = (-T) % C
    # [B, HV, NC, C, D]; padded tokens have k = 0, beta = 0, g = 0, so they leave the state alone.
    def heads(x, rep):
        x = x.repeat_interleave(rep, 2) if rep > 1 else x
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.permute(0, 2, 1, 3).reshape(B, HV, -1, C, x.shape[-1])

    qc, kc, vc = heads(q, G), heads(k, G), heads(v, 1)
    gc = torch.nn.functional.pad(g, (0, 0, 0, pad)).permute(0, 2, 1).reshape(B, HV, -1, C)
    bc = torch.nn.functional.pad(beta, (0, 0, 0, pad)).permute(0, 2, 1).reshape(B, HV, -1, C)
    NC = gc.shape[2]
    gamma = gc.cumsum(-1)
    diff = gamma[..., :, None] - gamma[..., None, :]  # gamma_i - gamma_j
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    # Gates as differences, masked before exp so that the upper triangle cannot overflow.
    decay_strict = torch.where(strict, diff, torch.full_like(diff, -float("inf"))).exp()
    decay_causal = torch.where(causal, diff, torch.full_like(diff, -float("inf"))).exp()
    L = bc[..., :, None] * decay_strict * (kc @ kc.transpose(-1, -2))
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    w = Tm @ ((bc * gamma.exp())[..., None] * kc)
    u = Tm @ (bc[..., None] * vc)
    P = (qc @ kc.transpose(-1, -2)) * decay_causal
    qg = qc * gamma.exp()[..., None]
    kg = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    S = initial_state if initial_state is not None else q.new_zeros(B, HV, K, V)
    outs = []
    for c in range(NC):
        U = u[:, :, c] - w[:, :, c] @ S
        outs.append(scale * (qg[:, :, c] @ S + P[:, :, c] @ U))
        S = gamma[:, :, c, -1, None, None].exp() * S + kg[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, HV, NC * C, V)[:, :, :T].permute(0, 2, 1, 3)
    return o, S
