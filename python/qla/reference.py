"""Pure-torch implementations of the operator, used as references and baselines.

- ``recurrent``: the token-by-token definition (slow; any dtype, any device).
- ``chunked``: the chunked tensor-core form of docs (matrix products per chunk of 64),
  differentiable through torch autograd. It is the CPU baseline of ``python -m qla.bench``.
- ``chunked_backward``: the chunked backward written out by hand (no autograd), step by step
  in the order the sm90 backward kernels compute it (docs/backward.md numbers the equations).
- ``split_forward``: the forward with each sequence cut into pieces that run in parallel
  (docs/gdn.md section 5; the plan for few-head long rows, docs/split.md).
- ``split_backward``: the backward cut the same way: the state gradient crosses the pieces
  through the transposed transfer maps, or through the warm-up mirror.
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


def split_forward(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None, pieces: int = 2,
                  chunk: int = 64, warmup_chunks: Optional[int] = None):
    """``chunked`` with every batch row cut into ``pieces`` pieces of whole chunks (the last may be
    shorter). A piece maps the state entering it linearly: S_end = A_p S_start + R_p.

    Exact (``warmup_chunks`` None): pass 1 gives every piece but the last its (A_p, R_p): R_p is
    the piece run from a zero state, A_p (K x K) the piece run on the identity with v = 0 (the
    same chain with K more columns and no input); pass 2 scans S_{p+1} = A_p S_p + R_p over the
    pieces; pass 3 runs every piece from its true entering state (outputs and final state).
    Passes 1 and 3 are parallel over pieces, pass 2 is P - 1 small matrix products.

    Approximate (``warmup_chunks`` = w): no A_p; the state entering piece p is the state after
    the last w chunks of piece p - 1 run from zero, which drops the older state's contribution,
    scaled by the exponential of the sum of g over those w chunks (right for decaying heads,
    wrong for heads with g ~ 0)."""
    bounds, starts = _split_states(q, k, v, g, beta, scale, initial_state, pieces, chunk, warmup_chunks)
    outs, S = [], None
    for (a, b), Sa in zip(bounds, starts):  # pass 3
        o, S = chunked(*[x[:, a:b] for x in (q, k, v, g, beta)], scale=scale, initial_state=Sa, chunk=chunk)
        outs.append(o)
    return torch.cat(outs, 1), S


def _piece_bounds(T: int, pieces: int, chunk: int):
    """[a, b) token ranges of the pieces: whole chunks, the last one shorter; one empty piece for T = 0."""
    per = -(-max(1, -(-T // chunk)) // pieces) * chunk  # tokens per piece (whole chunks)
    return [(a, min(a + per, T)) for a in range(0, T, per)] or [(0, 0)]


def _transfer_map(q, k, g, beta, scale, chunk):
    """A (K x K per row and head) of a piece: S_end = A S_start + R, the piece run on the identity with v = 0."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    eye = torch.eye(K, dtype=q.dtype, device=q.device).expand(B, HV, K, K).contiguous()
    _, A = chunked(q, k, q.new_zeros(B, T, HV, K), g, beta, scale=scale, initial_state=eye, chunk=chunk)
    return A


def _split_states(q, k, v, g, beta, scale, initial_state, pieces, chunk, warmup_chunks):
    """The pieces' bounds and the state entering each (passes 1 and 2 of split_forward)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    S0 = initial_state if initial_state is not None else q.new_zeros(B, HV, K, V)
    bounds = _piece_bounds(T, pieces, chunk)
    starts = [S0]
    for a, b in bounds[:-1]:
        args = [x[:, a:b] for x in (q, k, v, g, beta)]
        if warmup_chunks is None:
            _, R = chunked(*args, scale=scale, chunk=chunk)  # pass 1: from zero
            A = _transfer_map(args[0], args[1], args[3], args[4], scale, chunk)
            starts.append(A @ starts[-1] + R)  # pass 2 (a sequential scan in the kernels: P - 1 steps)
        else:
            w0 = max(a, b - warmup_chunks * chunk)
            _, Sw = chunked(*[x[:, w0:b] for x in (q, k, v, g, beta)], scale=scale, chunk=chunk)
            starts.append(Sw)
    return bounds, starts


def split_backward(q, k, v, g, beta, do, dht=None, scale: Optional[float] = None, initial_state=None,
                   pieces: int = 2, chunk: int = 64, warmup_chunks: Optional[int] = None):
    """``chunked_backward`` with every batch row cut into ``pieces`` pieces (as split_forward):
    (dq, dk, dv, dg, dbeta, dh0).

    A piece's gradients need only the state entering it (split_forward's scan) and the gradient
    of the state leaving it, dS_end. The state gradient runs backward, and a piece maps it
    linearly: dS_start = A_p^T dS_end + D_p, with A_p the forward transfer map and D_p the
    piece's backward from dS_end = 0 (its own outputs' part; it does not depend on the state).

    Exact (``warmup_chunks`` None): pass 1, parallel over pieces 1..P-1, D_p and A_p; pass 2 a
    reverse scan from dht, dS_end(p - 1) = A_p^T dS_end(p) + D_p; pass 3, parallel, every
    piece's backward from its entering state and its dS_end. The maps are the forward's, for
    pieces 1..P-1 (the forward's scan uses those of 0..P-2).

    Warm-up mirror (``warmup_chunks`` = w, states from split_forward's warm-up too): dS_end(p)
    is the backward of the first w chunks of piece p + 1 from dS = 0, which drops the later part
    of the gradient, scaled by the exponential of the sum of g over those w chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    bounds, starts = _split_states(q, k, v, g, beta, scale, initial_state, pieces, chunk, warmup_chunks)
    P = len(bounds)
    piece = lambda a, b: [x[:, a:b] for x in (q, k, v, g, beta)]
    ends = [None] * P
    ends[-1] = dht
    for p in range(P - 1, 0, -1):
        a, b = bounds[p]
        if warmup_chunks is None:
            *_, D = chunked_backward(*piece(a, b), do[:, a:b], None, scale=scale, chunk=chunk)
            At = _transfer_map(q[:, a:b], k[:, a:b], g[:, a:b], beta[:, a:b], scale, chunk).transpose(-1, -2)
            ends[p - 1] = D if ends[p] is None else At @ ends[p].to(D.dtype) + D
        else:
            w1 = min(b, a + warmup_chunks * chunk)
            *_, ends[p - 1] = chunked_backward(*piece(a, w1), do[:, a:w1], None, scale=scale, chunk=chunk)
    grads = [chunked_backward(*piece(a, b), do[:, a:b], ends[p], scale=scale, initial_state=starts[p], chunk=chunk)
             for p, (a, b) in enumerate(bounds)]
    cat = lambda i: torch.cat([gr[i] for gr in grads], 1)
    return cat(0), cat(1), cat(2), cat(3), cat(4), grads[0][5]


def chunked(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None, chunk: int = 64,
            transfer: bool = False):
    """The chunked (WY/UT) form with C = ``chunk``; same signature and result as ``recurrent``.
    ``transfer=True``: the same algebra in transfer form, one product with the state per chunk."""
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
    if transfer:
        # The transfer form (docs/fused.md section 7): U = u - w S substituted, so that the state
        # enters each chunk through one product, [M; G] S, whose factors (like B and H) do not
        # depend on the state: S' = e^Gamma S - M S + B, O = G S + H.
        M = kg.transpose(-1, -2) @ w                # [B, HV, NC, K, K]
        Bm = kg.transpose(-1, -2) @ u               # [B, HV, NC, K, V]
        Gm = scale * (qg - P @ w)                   # [B, HV, NC, C, K]
        Hm = scale * (P @ u)                        # [B, HV, NC, C, V]
        for c in range(NC):
            outs.append(Gm[:, :, c] @ S + Hm[:, :, c])
            S = gamma[:, :, c, -1, None, None].exp() * S - M[:, :, c] @ S + Bm[:, :, c]
    else:
        for c in range(NC):
            U = u[:, :, c] - w[:, :, c] @ S
            outs.append(scale * (qg[:, :, c] @ S + P[:, :, c] @ U))
            S = gamma[:, :, c, -1, None, None].exp() * S + kg[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, HV, NC * C, V)[:, :, :T].permute(0, 2, 1, 3)
    return o, S


def chunked_backward(q, k, v, g, beta, do, dht=None, scale: Optional[float] = None, initial_state=None,
                     chunk: int = 64):
    """Gradients of ``chunked`` / ``recurrent`` without autograd: (dq, dk, dv, dg, dbeta, dh0).

    do is the gradient of o [B, T, HV, V]; dht that of the final state [B, HV, K, V] (None: zero).
    dq, dk are summed over each GVA group; dh0 is returned even without initial_state.
    Equation numbers (B1)..(B33) refer to docs/backward.md. Notation per chunk of C tokens:
    Q, K [C, K], V, dO [C, V], S the state entering the chunk [K, V], dSn the gradient of the
    state leaving it. Every gate is exp of a difference of cumulative log-decays (<= 0).
    Phases: (0) chunk-parallel prep, (a) forward over chunks keeping the entering states,
    (b) reverse over chunks carrying dS, (c) chunk-parallel gradients.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    C = chunk
    pad = (-T) % C
    cdt = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32  # compute dtype
    state_dt = torch.float64 if cdt == torch.float64 else torch.float32
    dev = q.device

    # [B, HV, NC, C, D]; padded tokens have q = k = v = do = 0, beta = 0, g = 0: they change nothing.
    def heads(x, rep):
        x = x.to(cdt)
        x = x.repeat_interleave(rep, 2) if rep > 1 else x
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.permute(0, 2, 1, 3).reshape(B, HV, -1, C, x.shape[-1])

    def gates(x):
        return torch.nn.functional.pad(x.to(cdt), (0, 0, 0, pad)).permute(0, 2, 1).reshape(B, HV, -1, C)

    def tokens(x):  # [B, HV, NC, C, D] -> [B, T, HV, D]
        return x.reshape(B, HV, -1, x.shape[-1])[:, :, :T].permute(0, 2, 1, 3)

    Qc, Kc, Vc, dOc = heads(q, G), heads(k, G), heads(v, 1), heads(do, 1)
    gc, bc = gates(g), gates(beta)
    NC = gc.shape[2]
    tr = lambda x: x.transpose(-1, -2)
    rowdot = lambda x, y: (x * y).sum(-1)  # <x_i, y_i> per row i

    # ---------------- (0) chunk-parallel prep: nothing here involves S or dS ----------------
    gamma = gc.cumsum(-1)                                        # (B1) gamma_i = g_1 + ... + g_i
    Gam = gamma[..., -1:]                                        # (B2) Gamma = gamma_C
    diff = gamma[..., :, None] - gamma[..., None, :]             #      gamma_i - gamma_j
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril(0)
    ninf = torch.full_like(diff, -float("inf"))
    E_s = torch.where(strict, diff, ninf).exp()                  # (B3) E_ij = e^(gamma_i - gamma_j), i > j, else 0
    E_c = torch.where(causal, diff, ninf).exp()                  #      same with i >= j
    eg = gamma.exp()                                             # (B4) e^gamma_i = e^(gamma_i - 0) <= 1
    eGg = (Gam - gamma).exp()                                    #      e^(Gamma - gamma_i) <= 1
    eG = Gam.exp()[..., None]                                    #      e^Gamma, [B, HV, NC, 1, 1]
    L = bc[..., :, None] * E_s * (Kc @ tr(Kc))                   # (B5) L = strict(diag(beta) E o K K^T)
    eye = torch.eye(C, dtype=cdt, device=dev)
    Tm = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)  # (B6) (I+L)^-1
    Kb = (bc * eg)[..., None] * Kc                               # (B7) Kb = diag(beta e^gamma) K
    Vb = bc[..., None] * Vc                                      #      Vb = diag(beta) V
    W = Tm @ Kb                                                  # (B8) W = Tm Kb
    Uv = Tm @ Vb                                                 #      Uv = Tm Vb   (U = Uv - W S)
    P = scale * E_c * (Qc @ tr(Kc))                              # (B9) P = scale causal(E o Q K^T)
    Qg = eg[..., None] * Qc                                      # (B10) Qg = diag(e^gamma) Q
    Kd = eGg[..., None] * Kc                                     #      Kd = diag(e^(Gamma-gamma)) K

    # ------- (a) forward over chunks: keep only the state entering each chunk -------
    # The kernel keeps these NC states (K x V fp32 each) in a workspace of NC x K x V per
    # (sequence, value head), written by a recurrence kernel like gdn_recur with O switched off.
    S = initial_state.to(cdt) if initial_state is not None else torch.zeros(B, HV, K, V, dtype=cdt, device=dev)
    S_in = []
    for c in range(NC):
        S_in.append(S)
        U = Uv[:, :, c] - W[:, :, c] @ S                        # (B11) U = Uv - W S
        S = eG[:, :, c] * S + tr(Kd[:, :, c]) @ U               # (B12) S_next = e^Gamma S + Kd^T U
    # (O = scale Qg S + P U is not needed.)

    # ------- (b) reverse over chunks carrying dS (gradient of the state leaving the chunk) -------
    # Sequential chain per chunk: dU needs dS, dS_prev needs dU. The kernel writes dSn (the dS
    # entering this step) and dU of every chunk to the workspace for phase (c).
    dS = dht.to(cdt) if dht is not None else torch.zeros(B, HV, K, V, dtype=cdt, device=dev)
    dS_out, dU_all = [None] * NC, [None] * NC
    for c in reversed(range(NC)):
        dS_out[c] = dS
        dO = dOc[:, :, c]
        dU = tr(P[:, :, c]) @ dO + Kd[:, :, c] @ dS             # (B13) dU = P^T dO + Kd dSn
        dS = (eG[:, :, c] * dS + scale * tr(Qg[:, :, c]) @ dO   # (B14) dS = e^Gamma dSn + scale Qg^T dO
              - tr(W[:, :, c]) @ dU)                             #            - W^T dU
        dU_all[c] = dU
    dh0 = dS

    # ---------------- (c) chunk-parallel gradients (per chunk, given S, dSn, dU) ----------------
    if NC == 0:
        S_in_t = torch.zeros(B, HV, 0, K, V, dtype=cdt, device=dev)
        dSn, dU = S_in_t, torch.zeros(B, HV, 0, C, V, dtype=cdt, device=dev)
    else:
        S_in_t, dSn, dU = torch.stack(S_in, 2), torch.stack(dS_out, 2), torch.stack(dU_all, 2)
    U = Uv - W @ S_in_t                                          # (B15) U = Uv - W S (recomputed)
    # output path O = scale Qg S + P U
    dP = dOc @ tr(U)                                             # (B16) dP = dO U^T
    dA = scale * E_c * dP                                        # (B17) dA = scale causal(E o dP): grad of Q K^T
    dQ_S = scale * eg[..., None] * (dOc @ tr(S_in_t))            # (B18) dQ = scale diag(e^gamma) dO S^T
    dQ_P = dA @ Kc                                               #        + dA K
    dQ = dQ_S + dQ_P
    dK_P = tr(dA) @ Qc                                           # (B19) dK_P = dA^T Q
    # state path S_next = e^Gamma S + Kd^T U
    dK_d = eGg[..., None] * (U @ tr(dSn))                        # (B20) dK_d = diag(e^(Gamma-gamma)) U dSn^T
    # U = Uv - W S = Tm (Vb - Kb S)
    dW = -dU @ tr(S_in_t)                                        # (B21) dW = -dU S^T   (dUv = dU)
    dTm = dU @ tr(Vb) + dW @ tr(Kb)                              # (B22) dTm = dUv Vb^T + dW Kb^T
    dVb = tr(Tm) @ dU                                            # (B23) dVb = Tm^T dUv
    dKb = tr(Tm) @ dW                                            #        dKb = Tm^T dW
    dv = bc[..., None] * dVb                                     # (B24) dV = diag(beta) dVb
    dK_b = (bc * eg)[..., None] * dKb                            #        dK_b = diag(beta e^gamma) dKb
    # triangular inverse: d(I+L) = -Tm^T dTm Tm^T, L strictly lower
    dL = torch.where(strict, -(tr(Tm) @ dTm @ tr(Tm)), torch.zeros_like(dTm))  # (B25)
    # (equivalently dL = strict(-(dVb Uv^T + dKb W^T)), since Tm Vb = Uv and Tm Kb = W)
    dM = E_s * dL                                                # (B26) dM = E o dL: grad of beta_i (K K^T)_ij
    dK_Lr = bc[..., None] * (dM @ Kc)                            # (B27) dK_Lr = diag(beta) dM K
    dK_Lc = tr(dM) @ (bc[..., None] * Kc)                        #        dK_Lc = dM^T diag(beta) K
    dK = dK_P + dK_d + dK_b + dK_Lr + dK_Lc                      # (B28)
    # beta: from Vb, Kb and L (row dots, no division by beta)
    dbeta = rowdot(dVb, Vc) + eg * rowdot(dKb, Kc) + rowdot(dM @ Kc, Kc)  # (B29)
    # gates: a factor X = e^(a - b) x (a, b sums of g) passes dX o X to every g_t in a but not in b
    # (minus where in b but not in a). dg_t collects, without cancelling terms:
    R = torch.where(strict, dP * P, torch.zeros_like(dP)) + dL * L  # (B30) R = strict(dP o P) + dL o L
    #   (R_ij: gate e^(gamma_i - gamma_j) holds g_{j+1..i}; the diagonal of P has no gate: left out)
    a = rowdot(dQ_S, Qc) + rowdot(dK_b, Kc) + R.sum(-1) - R.sum(-2)  # (B31) a_i: gates holding g_{1..i}
    x = rowdot(dK_d, Kc)                                         # (B32) x_i: gate e^(Gamma-gamma_i) holds g_{i+1..C}
    eS = eG[..., 0, 0] * (dSn * S_in_t).sum((-1, -2))            #      e^Gamma <dSn, S>: holds all of g_{1..C}
    dg = (a.flip(-1).cumsum(-1).flip(-1)                         # (B33) dg_t = sum_{i>=t} a_i
          + (x.cumsum(-1) - x) + eS[..., None])                  #             + sum_{i<t} x_i + e^Gamma <dSn, S>
    # (= reverse cumsum of dgamma_i = a_i - x_i, plus dGamma = sum_i x_i + e^Gamma <dSn, S> at i = C; the
    # prefix form avoids cancelling the large x_C, R_ii terms: 6x smaller fp32 error at g ~ -5.)

    def group_sum(x):  # [B, T, HV, K] -> [B, T, H, K]
        return x.reshape(B, T, H, G, K).sum(3)

    unpad = lambda x: x.reshape(B, HV, -1)[:, :, :T].permute(0, 2, 1)
    return (group_sum(tokens(dQ)).to(q.dtype), group_sum(tokens(dK)).to(k.dtype), tokens(dv).to(v.dtype),
            unpad(dg).to(g.dtype), unpad(dbeta).to(beta.dtype), dh0.to(state_dt))
