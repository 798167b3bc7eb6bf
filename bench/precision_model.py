"""Precision model of the fused forward (docs/fused.md): the chunk products of that kernel
emulated on the CPU with their operands rounded as the tensor cores would see them, fp32
accumulation, o rounded to the input dtype at the end; errors are relative L2 against the
exact recurrence in fp64 (the CPU backend on fp64 inputs). It answers, before any kernel is
written, which operands need more than one 16-bit pass to meet the 3e-3 bound.

    python3 bench/precision_model.py [--T 4096] [--long 65536] [--schemes all] [--inverse]

Per chunk (C = 64 tokens, gamma = cumsum g, Gamma = gamma_last, S the entering d x v state):
    Tu = (I + L)^-1 diag(beta),  L_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j  (i > j, fp32)
    Y  = K S                                  product 1  (K, S)
    U  = Tu (V - diag(e^gamma) Y)             product 3  (Tu, Z)
    O  = diag(scale e^gamma) Q S + A U        products 2, 4  (Q, S; A, U)
    S' = e^Gamma S + K^T diag(e^(Gamma - gamma)) U   product 5  (K, X)
with A_ij = scale e^(gamma_i - gamma_j) q_i.k_j (i >= j). A scheme names the rounding of each
operand: "bf16", "fp16", "bf16x2" (hi + lo, two products), "fp32" (exact operand).

The first scheme, all "bf16", is checked against the current kernel with no correction
products (src/sm90/README.md: o 3.44e-3, state 2.69e-3 worst over its cases), which tells
how far the model can be trusted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "python"))

OPERANDS = ("K", "Q", "S", "Tu", "Z", "A", "U", "X")


def _round(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "fp32":
        return x
    if how == "bf16":
        return x.to(torch.bfloat16).float()
    if how == "fp16":
        return x.to(torch.float16).float()
    if how == "bf16x2":  # hi + lo: what two bf16 products with fp32 accumulation see
        hi = x.to(torch.bfloat16).float()
        return hi + (x - hi).to(torch.bfloat16).float()
    raise ValueError(f"rounding: expected fp32, bf16, fp16 or bf16x2, got {how!r}")


SCHEMES = {
    # name: rounding of each operand (unnamed ones: bf16)
    "bf16 (current kernel, no corrections)": {},
    "bf16, S and X hi/lo (current kernel's S_lo, X_lo)": {"S": "bf16x2", "X": "bf16x2"},
    "bf16, all hi/lo (fused.md v1)": {o: "bf16x2" for o in ("S", "Z", "A", "U", "X", "Tu")},
    "fp16 intermediates (K, Q converted)": {o: "fp16" for o in OPERANDS},
    "fp16 intermediates, S hi/lo in fp16": {**{o: "fp16" for o in OPERANDS}, "S": "fp16x2"},
}


def _round_any(x, how):
    if how == "fp16x2":
        hi = x.to(torch.float16).float()
        return hi + (x - hi).to(torch.float16).float()
    return _round(x, how)


def _chunk_parts(q, k, v, g, beta, c0, c1, scale, dtype=torch.float32):
    """One chunk's inputs [HV, n, .], gamma, Gamma, Tu and A in fp32 (unrounded), or in dtype."""
    n = c1 - c0
    Qc, Kc, Vc = (x[c0:c1].transpose(0, 1).to(dtype) for x in (q, k, v))  # [HV, n, .]
    gc, bc = g[c0:c1].t().to(dtype), beta[c0:c1].t().to(dtype)              # [HV, n]
    gam = gc.cumsum(-1)
    Gam = gam[:, -1:]
    diff = gam[:, :, None] - gam[:, None, :]
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    gate = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()
    KK = Kc @ Kc.transpose(1, 2)  # bf16 inputs, fp32 accumulation
    L = bc[:, :, None] * gate * KK
    eye = torch.eye(n, dtype=dtype)
    Tm = torch.linalg.solve_triangular(eye + L, eye.expand(Qc.shape[0], n, n), upper=False, unitriangular=True)
    Tu = Tm * bc[:, None, :]
    A = scale * torch.where(causal, diff, torch.full_like(diff, -torch.inf)).exp() * (Qc @ Kc.transpose(1, 2))
    return Qc, Kc, Vc, gam, Gam, Tu, A


def _run_chunks(q, k, v, g, beta, h0, scale, out_dtype, step):
    """The chunk loop both emulations share: q, k [T, HV, d] (already repeated over GVA groups),
    v [T, HV, dv], g, beta [T, HV], h0 [HV, d, dv]; one sequence. step(parts, S) -> (O of the
    chunk [HV, n, dv], S'), parts = _chunk_parts(...) + (scale,). Returns (o [T, HV, dv] rounded
    to out_dtype, final state)."""
    T, HV, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    S = h0.float().clone()
    o = torch.empty(T, HV, v.shape[-1])
    C = 64
    for c0 in range(0, T, C):
        c1 = min(T, c0 + C)
        Oc, S = step(_chunk_parts(q, k, v, g, beta, c0, c1, scale) + (scale,), S)
        o[c0:c1] = Oc.transpose(0, 1)
    return o.to(out_dtype).float(), S


def emulate(q, k, v, g, beta, h0, scheme, scale=None, out_dtype=torch.bfloat16):
    """The fused kernel's chunk algebra in fp32 with the scheme's operand rounding (shapes as in
    _run_chunks)."""
    r = {o: (lambda x, how=scheme.get(o, "bf16"): _round_any(x, how)) for o in OPERANDS}

    def step(parts, S):
        Qc, Kc, Vc, gam, Gam, Tu, A, scale = parts
        Y = r["K"](Kc) @ r["S"](S)
        Z = Vc - gam.exp()[:, :, None] * Y
        U = r["Tu"](Tu) @ r["Z"](Z)
        Oc = (scale * gam.exp())[:, :, None] * (r["Q"](Qc) @ r["S"](S)) + r["A"](A) @ r["U"](U)
        X = (Gam - gam).exp()[:, :, None] * U
        return Oc, Gam.exp()[:, :, None] * S + r["K"](Kc).transpose(1, 2) @ r["X"](X)

    return _run_chunks(q, k, v, g, beta, h0, scale, out_dtype, step)


def emulate_transfer(q, k, v, g, beta, h0, how="fp16", scale=None, out_dtype=torch.bfloat16):
    """The same chunk algebra in transfer form, one product with the state per chunk:
        S' = e^Gamma S - M S + B,  O = G S + H,   with W = A Tu and
        M = K^T diag(e^(Gamma - gamma)) Tu diag(e^gamma) K,  B = K^T diag(e^(Gamma - gamma)) Tu V,
        G = diag(scale e^gamma) Q - W diag(e^gamma) K,       H = W V,
    so that [M; G] S is the only product on the chain and M, G, B, H are chunk-parallel. Each
    chunk-parallel product takes `how`-rounded operands (its intermediates rounded again before
    the next product, as a kernel would stage them), fp32 accumulation; e^Gamma S stays fp32."""
    r = lambda x: _round_any(x, how)

    def step(parts, S):
        Qc, Kc, Vc, gam, Gam, Tu, A, scale = parts
        Tu, A = r(Tu), r(A)
        W = r(A @ Tu)
        d1, d2 = gam.exp()[:, :, None], (Gam - gam).exp()[:, :, None]
        Kr, Qr, Vr = r(Kc), r(Qc), r(Vc)
        F_ = r(d2 * (Tu @ (d1 * Kr)))            # diag(e^(Gamma-gamma)) Tu diag(e^gamma) K  [n, d]
        E = r(d2 * (Tu @ Vr))                     # diag(e^(Gamma-gamma)) Tu V                [n, dv]
        M = r(Kr.transpose(1, 2) @ F_)            # [d, d]
        B = Kr.transpose(1, 2) @ E                # [d, dv], fp32 (added, not multiplied)
        G = r((scale * d1) * Qr - W @ (d1 * Kr))  # [n, d]
        H = W @ Vr                                # [n, dv], fp32
        S16 = r(S)
        return G @ S16 + H, Gam.exp()[:, :, None] * S - M @ S16 + B

    return _run_chunks(q, k, v, g, beta, h0, scale, out_dtype, step)


def emulate_factored(q, k, v, g, beta, h0, how="fp16", scale=None, out_dtype=torch.bfloat16):
    """The transfer form with M left factored (docs/fused.md section 7, v3b): M S = K^T (F S), so
    the chain holds two products with the state per chunk and none of them is C x C:
        Y2 = F S,  X = E - Y2,  S' = e^Gamma S + K^T X,   O = G S + H,
    with F = diag(e^(Gamma - gamma)) Tu diag(e^gamma) K and E = diag(e^(Gamma - gamma)) Tu V
    (E - F S in one fp32 accumulator), G and H as in the transfer form. Operands as the kernel
    (fused_factored.cuh, removed after its measurement; at e37f87c) staged them: the Tu image, diag(e^(Gamma - gamma)) Tu, F's left
    operand and F, G, W, X, S, K, Q, V rounded to `how`, fp32 accumulation."""
    r = lambda x: _round_any(x, how)

    def step(parts, S):
        Qc, Kc, Vc, gam, Gam, Tu, A, scale = parts
        Tu, A = r(Tu), r(A)
        d1, d2 = gam.exp()[:, :, None], (Gam - gam).exp()[:, :, None]
        Kr, Qr, Vr = r(Kc), r(Qc), r(Vc)
        Wf = A @ Tu                                           # fp32 accumulator
        W = r(Wf)
        Tu2 = r(d2 * Tu)                                      # the kernel's Tu'' image
        F_ = r(r(Tu2 * d1.transpose(1, 2)) @ Kr)              # [n, d]
        G = r((scale * d1) * Qr - r(Wf * d1.transpose(1, 2)) @ Kr)  # [n, d]
        E = Tu2 @ Vr                                          # [n, dv], fp32 (with F S in one accumulator)
        S16 = r(S)
        X = r(E - F_ @ S16)
        return G @ S16 + W @ Vr, Gam.exp()[:, :, None] * S + Kr.transpose(1, 2) @ X

    return _run_chunks(q, k, v, g, beta, h0, scale, out_dtype, step)


def _exp2i(e):
    return torch.exp2(torch.as_tensor(e, dtype=torch.float32))


def _kernel_chunk(q, k, v, g, beta, c0, c1, scale, r):
    """What both fused recurrence kernels take from a chunk, with the inverse kernel's per-token
    exponents ek, eq (row norms of k, q near 1) and image exponent et: K', Q', the Tu' image,
    the gates, A' (fp32, from K', Q') and kn (inverse.cuh; fused_chunks.cuh)."""
    Qc, Kc, Vc, gam, Gam, Tu, A = _chunk_parts(q, k, v, g, beta, c0, c1, scale)
    flo = lambda x: torch.floor(torch.log2(x))
    bc = beta[c0:c1].t().float()
    kk, qq = (Kc * Kc).sum(-1), (Qc * Qc).sum(-1)
    ek = torch.where(kk > 0, -torch.div(flo(2 * kk), 2, rounding_mode="floor"), torch.zeros_like(kk)).clamp(-30, 30)
    eq = torch.where(qq > 0, -torch.div(flo(2 * qq), 2, rounding_mode="floor"), torch.zeros_like(qq)).clamp(-30, 30)
    bmax = (bc.abs() * _exp2i(-ek)).amax(-1)
    et = torch.where(bmax > 0, (-1 - flo(bmax)).clamp(-30, 30), torch.zeros_like(bmax))[:, None]  # [HV, 1]
    kn = torch.clamp(_exp2i(-ek).amax(-1), min=1)[:, None]
    Kp, Qp = r(_exp2i(ek)[..., None] * Kc), r(_exp2i(eq)[..., None] * Qc)
    Tup = r(_exp2i(et)[..., None] * _exp2i(-ek)[..., None] * Tu)  # the image: 2^et diag(2^-ek) Tu
    n = c1 - c0
    Ap = scale * torch.where(torch.tril(torch.ones(n, n, dtype=torch.bool)), gam[:, :, None] - gam[:, None, :],
                             torch.full_like(A, -torch.inf)).exp() * (Qp @ Kp.transpose(1, 2))
    return dict(Vc=Vc, gam=gam, Gam=Gam, ek=ek, eq=eq, et=et, kn=kn, Kp=Kp, Qp=Qp, Tup=Tup, Ap=Ap,
                eg=gam.exp(), egk=(Gam - gam).exp())


def _row_units(S, Vc, esc, kn, wsh):
    """chunk_units: the rows' units from max(max |S| kn 2^wsh, max |V| 2^esc), kept in
    [2^(6 + wsh), 2^(10 + wsh)): S's bound as with wsh = 0, V's (and X's) up to 2^wsh higher.
    Returns (f = new / old units, new esc)."""
    m = S.abs().amax(-1) * kn * _exp2i(wsh)
    mm = torch.maximum(m, Vc.float().abs().amax(1) * _exp2i(esc))
    ex = torch.floor(torch.log2(torch.where(mm > 0, mm, torch.ones_like(mm))))
    de = torch.where((mm > 0) & ((ex < 6 + wsh) | (ex >= 10 + wsh)), (8 + wsh - ex).clamp(-126, 127), torch.zeros_like(ex))
    ne = (esc + de).clamp(-120, 120)
    return _exp2i(ne - esc), ne


def _emulate_kernel(q, k, v, g, beta, h0, step, scale=None, out_dtype=torch.bfloat16):
    """The chunk loop of a kernel emulation with units: S^T [HV, v, d] in row units 2^esc;
    step(ch, S, esc, scale, r) -> (O^T in true units [HV, v, n], S^T, esc)."""
    T, HV, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    r = lambda x: x.to(torch.float16).float()  # fp16 operands; overflow gives inf
    S = h0.float().clone().transpose(1, 2).contiguous()
    esc = torch.zeros(HV, S.shape[1])
    o = torch.empty(T, HV, v.shape[-1])
    for c0 in range(0, T, 64):
        c1 = min(T, c0 + 64)
        Ot, S, esc = step(_kernel_chunk(q, k, v, g, beta, c0, c1, scale, r), S, esc, scale, r)
        o[c0:c1] = Ot.permute(2, 0, 1)
    return o.to(out_dtype).float(), (S * _exp2i(-esc)[..., None]).transpose(1, 2)


def emulate_factored_kernel(q, k, v, g, beta, h0, scale=None, out_dtype=torch.bfloat16):
    """the factored kernel's chunk step with its power-of-two units (fused_factored.cuh at e37f87c, removed):
    per-token exponents of K and Q, the image exponent et, O's extra dl, the rows' units of S^T
    and V^T with the window moved up in chunks of small beta; every fp16 operand rounded.
    Checks the units' algebra and range on inputs far from unit norm, not only the rounding."""
    def step(ch, S, esc, scale, r):
        es = max(0, int(torch.floor(torch.log2(torch.tensor(scale)))) + 1) if scale > 0 else 0
        et, Kp, Qp, Tup, eg, egk = ch["et"], ch["Kp"], ch["Qp"], ch["Tup"], ch["eg"], ch["egk"]
        dl = torch.clamp(13 - et - es, max=0)
        EgZ, EgP = eg * _exp2i(-ch["ek"]), scale * eg * _exp2i(et + dl)
        InvTok = _exp2i(-(ch["eq"] + et + dl))
        Wp = r(ch["Ap"]) @ Tup                                        # W' (fp32 accumulator)
        W2 = r(_exp2i(dl)[..., None] * Wp)                            # W'' image
        G2 = r(EgP[..., None] * Qp + r(-_exp2i(dl)[..., None] * Wp * EgZ[:, None, :]) @ Kp)
        Tu2 = r(egk[..., None] * Tup)                                 # Tu'' = D2 Tu' in place of Tu'
        F2 = r(r(-Tu2 * EgZ[:, None, :]) @ Kp)                        # -F' (2^et F: Tu''s range)
        f, esc = _row_units(S, ch["Vc"], esc, ch["kn"], torch.clamp(et - 1, 0, 4))
        S16 = r(S * f[..., None])
        V16 = r(ch["Vc"].float().transpose(1, 2) * _exp2i(esc)[..., None])  # V^T [HV, v, tok]
        X = r((V16 @ Tu2.transpose(1, 2) + S16 @ F2.transpose(1, 2)) * _exp2i(-et)[..., None])  # X'^T
        O2 = S16 @ G2.transpose(1, 2) + V16 @ W2.transpose(1, 2)      # O''^T
        S = S * f[..., None] * ch["Gam"].exp()[:, :, None] + X @ Kp
        return O2 * _exp2i(-esc)[..., None] * InvTok[:, None, :], S, esc

    return _emulate_kernel(q, k, v, g, beta, h0, step, scale, out_dtype)


def emulate_v2_kernel(q, k, v, g, beta, h0, scale=None, out_dtype=torch.bfloat16, shift=False):
    """gdn_fwd_chunks' chunk step (v2, src/sm90/fused_chunks.cuh) with its units, as above:
    [Y'|P'] = S16 [K'; Q']^T, Z = V16 - Y' e^gamma 2^-ek (fp16), [U'|O'] = [0 | P' scale e^gamma
    2^et] + Z [Tu'; W']^T, X = U' e^(Gamma - gamma) 2^-et (fp16), S += X K'. shift: the window
    moved up in chunks of small beta as in the factored kernel (a proposal for v2, not in it)."""
    def step(ch, S, esc, scale, r):
        et, Kp, Qp, Tup, eg, egk = ch["et"], ch["Kp"], ch["Qp"], ch["Tup"], ch["eg"], ch["egk"]
        EgZ, EgP, Egk = eg * _exp2i(-ch["ek"]), scale * eg * _exp2i(et), egk * _exp2i(-et)
        InvTok = _exp2i(-(ch["eq"] + et))
        W = r(r(ch["Ap"]) @ Tup)                                      # W' image
        f, esc = _row_units(S, ch["Vc"], esc, ch["kn"], torch.clamp(et - 1, 0, 4) if shift else torch.zeros_like(et))
        S16 = r(S * f[..., None])
        Y, P = S16 @ Kp.transpose(1, 2), S16 @ Qp.transpose(1, 2)     # [HV, v, tok]
        Z = r(ch["Vc"].float().transpose(1, 2) * _exp2i(esc)[..., None] - Y * EgZ[:, None, :])
        U = Z @ Tup.transpose(1, 2)
        O = P * EgP[:, None, :] + Z @ W.transpose(1, 2)
        X = r(U * Egk[:, None, :])
        S = S * f[..., None] * ch["Gam"].exp()[:, :, None] + X @ Kp
        return O * _exp2i(-esc)[..., None] * InvTok[:, None, :], S, esc

    return _emulate_kernel(q, k, v, g, beta, h0, step, scale, out_dtype)


def kernel_units_study(T) -> None:
    """emulate_factored_kernel and emulate_v2_kernel against the exact recurrence on the harness's range cases
    (tests/cuda/sm90_forward_test.cu): unit keys, |q| = |k| = 2^10 and 2^-12 (beta / max(1,
    |k|^2), as there), tiny beta (a chunk's beta near 1e-7: large et), large v and h0."""
    print("| case | factored o | factored state | v2 o | v2 state | v2 with the shift o | state |")
    print("|---|---|---|---|---|---|---|")
    for name, qn, kn_, bmul, vmag, hmag, gate in (("unit q, k", 1, 1, 1, 1, 1, "standard"),
                                                  ("strong decay", 1, 1, 1, 1, 1, "strong"),
                                                  ("|q| = |k| = 2^10", 2 ** 10, 2 ** 10, 1, 1, 1, "standard"),
                                                  ("|q| = |k| = 2^-12", 2 ** -12, 2 ** -12, 1, 1, 1, "standard"),
                                                  ("beta ~ 1e-7", 1, 1, 1e-7, 1, 1, "zero"),
                                                  ("beta ~ 1e-7, h0 = 0", 1, 1, 1e-7, 1, 0, "zero"),
                                                  ("beta ~ 0.01, h0 = 0", 1, 1, 1e-2, 1, 0, "standard"),
                                                  ("beta ~ 0.1", 1, 1, 0.1, 1, 1, "standard"),
                                                  ("beta in (0, 2) (negative eigenvalues)", 1, 1, 2, 1, 1, "zero"),
                                                  ("|v| ~ 1e5, |h0| ~ 1e6", 1, 1, 1, 1e5, 1e6, "standard")):
        q, k, v, g, beta, h0 = make_case(T, 2, gate, 11)
        q = (q.float() * qn).to(q.dtype)
        k = (k.float() * kn_).to(k.dtype)
        beta = (beta.float() * bmul / max(1.0, kn_ * kn_)).to(beta.dtype)
        v = (v.float() * vmag).to(v.dtype)
        h0 = h0 * hmag
        ro, rh = exact(q, k, v, g, beta, h0)
        o, h = emulate_factored_kernel(q, k, v, g, beta, h0)
        o2, h2 = emulate_v2_kernel(q, k, v, g, beta, h0)
        o3, h3 = emulate_v2_kernel(q, k, v, g, beta, h0, shift=True)
        print(f"| {name} | {rel(o, ro):.2e} | {rel(h, rh):.2e} | {rel(o2, ro):.2e} | {rel(h2, rh):.2e} | {rel(o3, ro):.2e} "
              f"| {rel(h3, rh):.2e} |", flush=True)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to tf32 (10 mantissa bits, round to nearest even on the 13 dropped bits)."""
    i = x.float().contiguous().view(torch.int32)
    i = (i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(torch.float32)


def inverse_blockwise(L: torch.Tensor, products: str) -> torch.Tensor:
    """(I + L)^-1 of strictly lower [.., 64, 64] L as the kernels compute it: the 16 x 16
    diagonal blocks by substitution in fp32, then each block column walked down,
    Tm_aw = -D_a^-1 sum_m L_am Tm_mw, with the block products' operands rounded as `products`
    says ("fp32": the FMA path of today's kernels; "tf32": mma.sync tf32)."""
    r = {"fp32": lambda x: x, "tf32": _tf32}[products]
    n = L.shape[-1]
    eye = torch.eye(16)
    T = torch.zeros_like(L)
    D = []
    for a in range(n // 16):
        blk = L[..., 16 * a:16 * a + 16, 16 * a:16 * a + 16]
        Da = torch.linalg.solve_triangular(eye + blk, eye.expand_as(blk), upper=False, unitriangular=True)
        D.append(Da)
        T[..., 16 * a:16 * a + 16, 16 * a:16 * a + 16] = Da
    for w in range(n // 16):
        for a in range(w + 1, n // 16):
            acc = torch.zeros_like(D[0])
            for m in range(w, a):
                acc = acc + r(L[..., 16 * a:16 * a + 16, 16 * m:16 * m + 16]) @ r(T[..., 16 * m:16 * m + 16, 16 * w:16 * w + 16])
            T[..., 16 * a:16 * a + 16, 16 * w:16 * w + 16] = -(r(D[a]) @ r(acc))
    return T


def inverse_doubling_fp16(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 of strictly lower [.., 64, 64] L by recursive doubling with fp16 block
    products (a peer's method, docs/fused.md section 8): the 8 x 8 diagonal blocks exact in fp32,
    then at 16, 32 and 64 the lower-left block of [[A, 0], [C, D]]^-1 as -D^-1 (C A^-1), every
    product on fp16-rounded operands with fp32 accumulation and its result kept in fp16."""
    h = lambda x: x.half().float()
    n = L.shape[-1]
    M = torch.eye(n) + L
    T = torch.zeros_like(L)
    for a in range(0, n, 8):  # level 1: exact 8 x 8 inverses
        blk = M[..., a:a + 8, a:a + 8]
        T[..., a:a + 8, a:a + 8] = torch.linalg.solve_triangular(blk, torch.eye(8).expand_as(blk), upper=False,
                                                                 unitriangular=True)
    T = h(T)
    b = 8
    while b < n:
        for a in range(0, n, 2 * b):
            Ai = T[..., a:a + b, a:a + b]
            Di = T[..., a + b:a + 2 * b, a + b:a + 2 * b]
            C = M[..., a + b:a + 2 * b, a:a + b]
            T[..., a + b:a + 2 * b, a:a + b] = h(-(Di @ h(h(C) @ Ai)))
        b *= 2
    return T


def inverse_study(cases) -> None:
    """Tu = (I + L)^-1 diag(beta) of every chunk of the cases, against fp64: the fp32 block
    products of today's kernels and tf32 ones (a tensor-core phase 2), each before and after
    the fp16 rounding of the image K2 reads."""
    print("| chunk inverse | " + " | ".join(c[0] for c in cases) + " |")
    print("|---|" + "---|" * len(cases))
    rows = {k: [] for k in ("fp32 block products", "tf32 block products",
                            "fp32 block products, fp16 image", "tf32 block products, fp16 image",
                            "fp16 doubling from 8 x 8 blocks (a peer's), fp16 image")}
    for label, T, gate, seed in cases:
        q, k, v, g, beta, h0 = make_case(min(T, 4096), 2, gate, seed)
        n = (k.shape[0] // 64) * 64
        K = k[:n].float().reshape(-1, 64, 2, k.shape[-1]).transpose(1, 2)        # [chunks, HV, 64, d]
        gam = g[:n].float().reshape(-1, 64, 2).transpose(1, 2).cumsum(-1)        # [chunks, HV, 64]
        b = beta[:n].float().reshape(-1, 64, 2).transpose(1, 2)
        diff = gam[..., :, None] - gam[..., None, :]
        lower = torch.tril(torch.ones(64, 64, dtype=torch.bool), -1)
        L = torch.where(lower, b[..., :, None] * diff.clamp(max=0).exp() * (K @ K.transpose(-1, -2)), torch.zeros(()))
        exact = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + L.double(),
                                              torch.eye(64, dtype=torch.float64).expand(L.shape), upper=False,
                                              unitriangular=True) * b.double()[..., None, :]
        for name, prod in (("fp32", "fp32"), ("tf32", "tf32")):
            Tu = inverse_blockwise(L, prod) * b[..., None, :]
            rows[f"{name} block products"].append(rel(Tu, exact))
            rows[f"{name} block products, fp16 image"].append(rel(Tu.half().float(), exact))
        Tu = inverse_doubling_fp16(L) * b[..., None, :]
        rows["fp16 doubling from 8 x 8 blocks (a peer's), fp16 image"].append(rel(Tu.half().float(), exact))
    for name, errs in rows.items():
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")


def make_case(T, HV, gate, seed, d=128, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, HV, d, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(T, HV, d, generator=gen), dim=-1).to(dtype)
    v = torch.randn(T, HV, d, generator=gen).to(dtype)
    x = torch.randn(T, HV, generator=gen)
    if gate == "standard":  # benchmarks.md: logsigmoid / 16, g = 0 on a quarter of the heads
        g = F.logsigmoid(x) / 16
        g[:, torch.randperm(HV, generator=gen)[: max(1, HV // 4)]] = 0
    elif gate == "strong":
        g = F.logsigmoid(x)
    else:
        g = torch.zeros_like(x)
    beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
    h0 = torch.randn(HV, d, d, generator=gen)
    return q, k, v, g, beta, h0


def exact(q, k, v, g, beta, h0):
    import qla  # the exact CPU backend, fp64 throughout on fp64 inputs

    f = lambda x: x.double()[None]
    o, ht = qla.chunk_gated_delta_rule_fwd(f(q), f(k), f(v), f(g), f(beta), initial_state=h0.double()[None],
                                           output_final_state=True)
    return o[0], ht[0]


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4, help="value heads per case")
    ap.add_argument("--long", type=int, default=65536, help="T of the g = 0 long case (0: skip)")
    ap.add_argument("--schemes", default="all", help="'all' or comma-separated indices into SCHEMES")
    ap.add_argument("--inverse", action="store_true", help="only the chunk inverse study (fp32 vs tf32 products)")
    ap.add_argument("--transfer", action="store_true", help="also the transfer form (emulate_transfer), fp16 operands")
    ap.add_argument("--factored", action="store_true", help="also the factored transfer form (emulate_factored), fp16")
    ap.add_argument("--kernel-units", action="store_true",
                    help="only gdn_fwd_factored's units on inputs far from unit norm (emulate_factored_kernel)")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    names = list(SCHEMES)
    if args.schemes != "all":
        names = [names[int(i)] for i in args.schemes.split(",")]
    cases = [(f"{gate} T={args.T}", args.T, gate, seed) for seed, gate in enumerate(("standard", "strong", "zero"))]
    if args.inverse:
        inverse_study(cases)
        return 0
    if args.kernel_units:
        kernel_units_study(args.T)
        return 0
    if args.long:
        cases.append((f"zero T={args.long}", args.long, "zero", 7))
    refs = {}
    for label, T, gate, seed in cases:
        t0 = time.time()
        x = make_case(T, args.heads if T == args.T else 2, gate, seed)
        refs[label] = (x, exact(*x))
        print(f"[ref] {label}: {time.time() - t0:.1f} s", flush=True)
    print("| scheme | " + " | ".join(f"{c[0]} o / state" for c in cases) + " | max o | max state |")
    print("|---|" + "---|" * (len(cases) + 2))
    for name in names:
        cells, mo, ms = [], 0.0, 0.0
        for label, *_ in cases:
            x, (ro, rh) = refs[label]
            o, h = emulate(*x, SCHEMES[name])
            eo, eh = rel(o, ro), rel(h, rh)
            mo, ms = max(mo, eo), max(ms, eh)
            cells.append(f"{eo:.2e} / {eh:.2e}")
        print(f"| {name} | " + " | ".join(cells) + f" | {mo:.2e} | {ms:.2e} |", flush=True)
    forms = [("transfer form, fp16 operands ([M; G] S on the chain)", emulate_transfer)] if args.transfer else []
    if args.factored:
        forms.append(("factored transfer form, fp16 operands (F S, then K^T X on the chain)", emulate_factored))
    for name, form in forms:
        cells, mo, ms = [], 0.0, 0.0
        for label, *_ in cases:
            x, (ro, rh) = refs[label]
            o, h = form(*x)
            eo, eh = rel(o, ro), rel(h, rh)
            mo, ms = max(mo, eo), max(ms, eh)
            cells.append(f"{eo:.2e} / {eh:.2e}")
        print(f"| {name} | " + " | ".join(cells) + f" | {mo:.2e} | {ms:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
