"""Units model of the fused backward's reverse chain (docs/backward.md section 10, build step 2),
before the kernel: the chain dht -> dh0 with every product on fp16 operands carried in
power-of-two units, fp32 accumulation, against the same algebra in fp64. It checks that the
planned units keep every fp16 operand in range (no overflow, nothing that matters in the
subnormals) on inputs far from the benchmark distribution, not only the rounding.

    python3 bench/reverse_chain_model.py [--T 4096]

Per chunk, last to first (C = 64 tokens, gamma = cumsum g, Gamma = gamma_last; dSn the gradient
of the state leaving the chunk, dS the one entering it; rows v of the transposed forms):
    dU^T = dO^T A + dSn^T Kd^T,      Kd = diag(e^(Gamma - gamma)) K,  A_ij = scale e^(gamma_i - gamma_j) q_i.k_j (i >= j)
    dS^T = e^Gamma dSn^T + dO^T Qg - dU^T W,   Qg = diag(scale e^gamma) Q,  W = Tu diag(e^gamma) K
The kernel's operands (the inverse kernel's per-token exponents: K = 2^-ek K', Q = 2^-eq Q',
the Tu image 2^et diag(2^-ek) Tu; precision_model._kernel_chunk):
    row units R_v = 2^esc_v of dS^T, chosen per chunk from max(|dSn^T row v| kn, |D row v|)
    D    = R_v scale 2^-eq_i dO^T          (registers, fp16: the A operand of two products)
    A''  = e^(gamma_i - gamma_j) Q'_i.K'_j (aux, fp16, i >= j)
    Kd'  = e^(Gamma - gamma_j) K'_j        (aux, fp16)
    Qg'  = e^gamma_i Q'_i                  (aux, fp16)
    W'   = 2^-ek_j W = 2^-et Tu' diag(e^gamma 2^-ek) K'   (aux: an fp16 product, then fp16)
    dU'  = D A'' + dSn' Kd'^T = R_v 2^ek_j dU^T            (fp32, then fp16 for the next product)
    dS'  = e^Gamma f dS' + D Qg' - dU' W'  (f: the change of units)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "python"))

from precision_model import _chunk_parts, _exp2i, _kernel_chunk, make_case  # noqa: E402

C = 64


def reverse_exact(q, k, g, beta, do, dht, scale):
    """The reverse chain in fp64: q, k [T, HV, d], g, beta [T, HV], do [T, HV, dv], dht [HV, d, dv].
    Returns (dh0 [HV, d, dv], dU [T, HV, dv])."""
    T = q.shape[0]
    dS = dht.double().clone()
    dU_all = torch.empty(T, *do.shape[1:], dtype=torch.float64)
    for c0 in reversed(range(0, T, C)):
        c1 = min(T, c0 + C)
        Qc, Kc, _, gam, Gam, Tu, A = _chunk_parts(q, k, k, g, beta, c0, c1, scale, torch.float64)  # (no V in the chain)
        dO = do[c0:c1].transpose(0, 1).double()  # [HV, n, dv]
        dU = A.transpose(1, 2) @ dO + (Gam - gam).exp()[:, :, None] * (Kc @ dS)
        W = Tu @ (gam.exp()[:, :, None] * Kc)
        dS = Gam.exp()[:, :, None] * dS + Qc.transpose(1, 2) @ ((scale * gam.exp())[:, :, None] * dO) \
            - W.transpose(1, 2) @ dU
        dU_all[c0:c1] = dU.transpose(0, 1)
    return dS, dU_all


def _units(dSt, D_raw, esc, kn, lo, hi):
    """The rows' units: max(max |dS^T row| kn, max |D row| at the current units) kept in
    [2^lo, 2^hi), else put back at 2^((lo + hi) / 2). D_raw: scale 2^-eq dO^T in true units."""
    m = torch.maximum(dSt.abs().amax(-1) * kn, D_raw.abs().amax(-1) * _exp2i(esc))
    ex = torch.floor(torch.log2(torch.where(m > 0, m, torch.ones_like(m))))
    mid = (lo + hi) // 2
    de = torch.where((m > 0) & ((ex < lo) | (ex >= hi)), (mid - ex).clamp(-126, 127), torch.zeros_like(ex))
    ne = (esc + de).clamp(-120, 120)
    return _exp2i(ne - esc), ne


def reverse_kernel(q, k, g, beta, do, dht, scale, lo=2, hi=6, w_exp=False):
    """The planned kernel's chain (see the top of this file). w_exp: the W' image with its own
    per-chunk exponent (folded into dU' before its fp16 rounding). Returns (dh0, dU, worst): worst
    is the largest |value| any fp16 operand took (65504 is fp16's largest)."""
    T, HV, d = q.shape
    r = lambda x: x.to(torch.float16).float()
    dSt = dht.float().transpose(1, 2).contiguous()  # [HV, v, d], row units 2^esc
    esc = torch.zeros(HV, dSt.shape[1])
    dU_all = torch.empty(T, HV, do.shape[-1])
    worst = 0.0

    def fp16(x):
        nonlocal worst
        worst = max(worst, x.abs().max().item())
        return r(x)

    for c0 in reversed(range(0, T, C)):
        c1 = min(T, c0 + C)
        n = c1 - c0
        ch = _kernel_chunk(q, k, do[c0:c1] * 0, g, beta, c0, c1, scale, r)  # (v unused: the chain needs no V)
        ek, eq, et, Kp, Qp, Tup, gam, Gam = (ch[x] for x in ("ek", "eq", "et", "Kp", "Qp", "Tup", "gam", "Gam"))
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        A2 = fp16(torch.where(causal, (gam[:, :, None] - gam[:, None, :]), torch.full((HV, n, n), -torch.inf)).exp()
                  * (Qp @ Kp.transpose(1, 2)))
        Kd = fp16((Gam - gam).exp()[:, :, None] * Kp)
        Qg = fp16(gam.exp()[:, :, None] * Qp)
        Wacc = Tup @ fp16((gam.exp() * _exp2i(-ek))[:, :, None] * Kp)  # [HV, n, d] = 2^et W'
        if w_exp:
            wm = Wacc.abs().amax((1, 2))
            ew = torch.where(wm > 0, -torch.floor(torch.log2(torch.where(wm > 0, wm, torch.ones_like(wm)))),
                             torch.zeros_like(wm))  # W'' = 2^ew W'_acc in [1, 2)
            W2 = fp16(_exp2i(ew)[:, None, None] * Wacc)
            fold = _exp2i(-(et[:, 0] + ew))  # dU' W' = (2^-(et + ew) dU') W''
        else:
            W2 = fp16(_exp2i(-et)[..., None] * Wacc)
            fold = torch.ones(HV)
        kn = torch.clamp(Kd.abs().norm(dim=-1).amax(-1), min=1)[:, None]
        D_raw = (scale * _exp2i(-eq))[:, None, :] * do[c0:c1].permute(1, 2, 0).float()  # [HV, v, tok]
        f, esc = _units(dSt, D_raw, esc, kn, lo, hi)
        dSn16 = fp16(dSt * f[..., None])
        D = fp16(_exp2i(esc)[..., None] * D_raw)
        accU = D @ A2 + dSn16 @ Kd.transpose(1, 2)  # [HV, v, tok] = R_v 2^ek_j dU^T
        dU16 = fp16(accU * fold[:, None, None])
        dSt = dSt * (f[..., None] * Gam.exp()[:, :, None]) + D @ Qg - dU16 @ W2
        dU_all[c0:c1] = (accU * _exp2i(-esc)[..., None] * _exp2i(-ek)[:, None, :]).permute(2, 0, 1)
    return (dSt * _exp2i(-esc)[..., None]).transpose(1, 2), dU_all, worst


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def cases(T):
    """(name, q, k, g, beta, do, dht, scale): the benchmark distribution and the far ones."""
    out = []
    for gate in ("standard", "strong", "zero"):
        q, k, v, g, beta, h0 = make_case(T, 2, gate, seed=5)
        gen = torch.Generator().manual_seed(6)
        do = torch.randn(v.shape, generator=gen).to(v.dtype)
        dht = torch.randn(h0.shape, generator=gen) / 8
        out.append((f"{gate} gates", q, k, g, beta, do, dht, 128 ** -0.5))
    q, k, v, g, beta, h0 = make_case(T, 2, "standard", seed=7)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(v.shape, generator=gen).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen) / 8
    s = 128 ** -0.5
    bf = lambda x: x.to(torch.bfloat16)
    out += [
        ("large dO (1e5), dht 0", q, k, g, beta, bf(do.float() * 1e5), dht * 0, s),
        ("tiny dO (1e-6), large dht (1e6)", q, k, g, beta, bf(do.float() * 1e-6), dht * 1e6, s),
        ("large q, k (|k| 2^10, beta / |k|^2)", bf(q.float() * 1024), bf(k.float() * 1024), g, beta / 2 ** 20, do, dht, s),
        ("small q, k (|k| 2^-12)", bf(q.float() / 4096), bf(k.float() / 4096), g, beta, do, dht, s),
        ("tiny beta (1e-7)", q, k, g, beta * 1e-7, do, dht, s),
        ("scale 1e4", q, k, g, beta, do, dht, 1e4),
        ("scale 1e-4", q, k, g, beta, do, dht, 1e-4),
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"T = {args.T}, HV = 2, K = V = 128; relative L2 against the fp64 chain; worst |fp16 operand|")
    print("| case | units window | dh0 | dU | worst operand |")
    print("|---|---|---|---|---|")
    for name, q, k, g, beta, do, dht, scale in cases(args.T):
        ref_dh0, ref_dU = reverse_exact(q, k, g, beta, do, dht, scale)
        for lo, hi, w_exp in ((2, 6, False), (2, 6, True), (6, 10, True)):
            dh0, dU, worst = reverse_kernel(q, k, g, beta, do, dht, scale, lo, hi, w_exp)
            print(f"| {name} | [2^{lo}, 2^{hi}){', W exponent' if w_exp else ''} | {rel(dh0, ref_dh0):.2e} | "
                  f"{rel(dU, ref_dU):.2e} | {worst:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
