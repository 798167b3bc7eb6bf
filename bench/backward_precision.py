"""Precision plan for the sm90 backward (issue 4), measured before writing the kernels.

The planned kernels (docs/backward.md section 5) run every matrix product on bf16 wgmma with
fp32 accumulators. Inputs (q, k, v, do) are bf16 already, so they enter the products exactly;
every other operand (states, their gradients, U, dU, Tm, W, the gated scores ...) must be
rounded to 16 bits, either once ("h", bf16 hi only) or as a hi + lo pair ("hl", two products,
about 16 mantissa bits). This script runs the chunked backward of docs/backward.md in fp32 with
those roundings applied at each product operand, compares every gradient with the fp64 chunked
backward on the same bf16 inputs (qla.reference.chunked_backward; itself checked against
autograd through the recurrence), and prints the relative L2 error per gradient for:

- "fp32":     no operand rounding (the floor of the fp32 algebra)
- "all h":    every non-input operand bf16 hi only (what a plain bf16 kernel would do)
- "all hl":   every non-input operand hi + lo
- "fwd":      hi + lo except W (hi only), the forward's choice
- "fwd, X h": the "fwd" set with one more operand X hi only (which ones can be cheap)
- "all h, X hl": every operand hi only but X (which hi + lo pair buys the most)
- "all f16":  every non-input operand rounded once to fp16's 11 significant bits with no
              range limit: the fused forward's scheme (fp16 wgmma operands carried in exact
              power-of-two units, docs/fused.md), planned for the fused backward (issue 14);
              bf16 inputs are exact in fp16. Also "all f16, X hl16" (one operand as an fp16
              hi + lo pair, ~22 bits) and "all f16, X h" (one operand bf16 only)

Targets: issue 4 had dq, dk, dv, dbeta, dh0 <= 5e-3 and dg <= 1e-2; issue 14 (the fused
backward) every gradient <= 4e-3, which the printed ok / OVER now checks. CPU only:

    python3 bench/backward_precision.py [--T 512] [--HV 2]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from qla import reference  # noqa: E402

OPERANDS = ["Tu", "Tw", "W", "S", "X", "P", "dS", "dOg", "dU", "U", "dA", "dW", "dVb", "dKb", "Uv", "dM", "bK"]


def rnd(mode, name, x):
    m = mode.get(name, "f")
    if m == "f":
        return x
    if m in ("f16", "hl16"):
        hi = f16(x)
        return hi if m == "f16" else hi + f16(x - hi)
    hi = x.to(torch.bfloat16).float()
    if m == "h":
        return hi
    return hi + (x - hi).to(torch.bfloat16).float()  # hi + lo: the sum of two bf16 products


def f16(x):
    """x rounded to nearest at fp16's 11 significant bits, without fp16's exponent range (the
    kernels keep operands in range with exact power-of-two units)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2048.0) / 2048.0, e)


def chunked_backward_rounded(q, k, v, g, beta, do, dht, h0, scale, mode, C=64):
    """docs/backward.md (B1)-(B33) for B = 1, H = HV, T a multiple of C, every product in fp32
    with its non-input operands rounded per `mode`. Returns (dq, dk, dv, dg, dbeta, dh0)."""
    f = torch.float32
    _, T, HV, K = q.shape
    V = v.shape[-1]
    NC = T // C
    r = lambda n, x: rnd(mode, n, x)
    hd = lambda x: x.to(f).permute(0, 2, 1, 3).reshape(1, HV, NC, C, x.shape[-1])  # [1, HV, NC, C, D]
    Q, Kc, Vc, dO = hd(q), hd(k), hd(v), hd(do)
    gc = g.to(f).permute(0, 2, 1).reshape(1, HV, NC, C)
    bc = beta.to(f).permute(0, 2, 1).reshape(1, HV, NC, C)
    tr = lambda x: x.transpose(-1, -2)
    rowdot = lambda x, y: (x * y).sum(-1)
    gamma = gc.cumsum(-1)
    Gam = gamma[..., -1:]
    diff = gamma[..., :, None] - gamma[..., None, :]
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril(0)
    ninf = torch.full_like(diff, -float("inf"))
    E_s, E_c = torch.where(strict, diff, ninf).exp(), torch.where(causal, diff, ninf).exp()
    eg, eGg, eG = gamma.exp(), (Gam - gamma).exp(), Gam.exp()[..., None]
    # prep: products of exact inputs (K K^T, Q K^T) in fp32; Tm in fp32 (substitution)
    L = bc[..., :, None] * E_s * (Kc @ tr(Kc))
    eye = torch.eye(C)
    Tm = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    W = r("Tw", Tm * (bc * eg)[..., None, :]) @ Kc         # W = (Tm diag(beta e^gamma)) K
    Uv = r("Tu", Tm * bc[..., None, :]) @ Vc               # Uv = (Tm diag(beta)) V
    P = scale * E_c * (Q @ tr(Kc))
    # (a) states
    S = h0.to(f).clone()
    S_in = []
    for c in range(NC):
        S_in.append(S)
        U = Uv[:, :, c] - r("W", W[:, :, c]) @ r("S", S)
        S = eG[:, :, c] * S + tr(Kc[:, :, c]) @ r("X", eGg[:, :, c, :, None] * U)
    # (b) state gradient
    dS = dht.to(f).clone()
    dSo, dUa = [None] * NC, [None] * NC
    for c in reversed(range(NC)):
        dSo[c] = dS
        dU = tr(r("P", P[:, :, c])) @ dO[:, :, c] + eGg[:, :, c, :, None] * (Kc[:, :, c] @ r("dS", dS))
        dS = (eG[:, :, c] * dS + scale * tr(Q[:, :, c]) @ r("dOg", eg[:, :, c, :, None] * dO[:, :, c])
              - tr(r("W", W[:, :, c])) @ r("dU", dU))
        dUa[c] = dU
    dh0 = dS
    S_in, dSn, dU = torch.stack(S_in, 2), torch.stack(dSo, 2), torch.stack(dUa, 2)
    # (c) chunk-parallel gradients
    U = Uv - r("W", W) @ r("S", S_in)
    dP = dO @ tr(r("U", U))
    dA = scale * E_c * dP
    dQ_S = scale * eg[..., None] * (dO @ tr(r("S", S_in)))
    dQ = dQ_S + r("dA", dA) @ Kc
    dK_P = tr(r("dA", dA)) @ Q
    dK_d = eGg[..., None] * (r("U", U) @ tr(r("dS", dSn)))
    dW = -(r("dU", dU) @ tr(r("S", S_in)))
    dVb = tr(r("Tu", Tm)) @ r("dU", dU)   # Tm^T as an operand (same rounding as the Tm images)
    dKb = tr(r("Tu", Tm)) @ r("dW", dW)
    dv = bc[..., None] * dVb
    dK_b = (bc * eg)[..., None] * dKb
    dL = torch.where(strict, -(r("dVb", dVb) @ tr(r("Uv", Uv)) + r("dKb", dKb) @ tr(r("W", W))), torch.zeros_like(L))
    dM = E_s * dL
    dK_Lr = bc[..., None] * (r("dM", dM) @ Kc)
    dK_Lc = tr(r("dM", dM)) @ r("bK", bc[..., None] * Kc)
    dK = dK_P + dK_d + dK_b + dK_Lr + dK_Lc
    dbeta = rowdot(dVb, Vc) + eg * rowdot(dKb, Kc) + rowdot(dM @ Kc, Kc)
    R = torch.where(strict, dP * P, torch.zeros_like(dP)) + dL * L
    a = rowdot(dQ_S, Q) + rowdot(dK_b, Kc) + R.sum(-1) - R.sum(-2)
    x = rowdot(dK_d, Kc)
    eS = eG[..., 0, 0] * (dSn * S_in).sum((-1, -2))
    dg = a.flip(-1).cumsum(-1).flip(-1) + (x.cumsum(-1) - x) + eS[..., None]
    tok = lambda t: t.reshape(1, HV, T, t.shape[-1]).permute(0, 2, 1, 3)
    un = lambda t: t.reshape(1, HV, T).permute(0, 2, 1)
    return tok(dQ), tok(dK), tok(dv), un(dg), un(dbeta), dh0


def make_case(gate, T, HV, seed):
    gen = torch.Generator().manual_seed(seed)
    K = V = 128
    q = F.normalize(torch.randn(1, T, HV, K, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, HV, K, generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, V, generator=gen).bfloat16()
    x = torch.randn(1, T, HV, generator=gen)
    g = {"benchmark": F.logsigmoid(x) / 16, "strong": F.logsigmoid(x), "zero": torch.zeros_like(x)}[gate]
    if gate == "benchmark":
        g[:, :, 0] = 0  # a non-decaying head, as in the benchmark's 25%
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    do = torch.randn(1, T, HV, V, generator=gen).bfloat16()
    dht = torch.randn(1, HV, K, V, generator=gen) / 8
    h0 = torch.randn(1, HV, K, V, generator=gen)
    return q, k, v, g, beta, do, dht, h0


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--HV", type=int, default=2)
    ap.add_argument("--only-f16", action="store_true", help="the fp16 configurations (and fp32, fwd) only")
    ap.add_argument("--local-bf16", action="store_true",
                    help="fp16 everywhere but the gradients kernel's chunk-local operands, which go bf16 (no units)")
    ap.add_argument("--min-f16", action="store_true",
                    help="fp16 for the sequential operands and the inverse only, the rest bf16")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    scale = 128 ** -0.5
    cases = {}
    for i, gate in enumerate(("benchmark", "strong", "zero")):
        c = make_case(gate, args.T, args.HV, 100 + i)
        q, k, v, g, beta, do, dht, h0 = c
        ref = reference.chunked_backward(q.double(), k.double(), v.double(), g.double(), beta.double(), do.double(),
                                         dht.double(), scale=scale, initial_state=h0.double())
        cases[gate] = (c, ref)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    fwd = {n: "hl" for n in OPERANDS}
    fwd["W"] = "h"
    configs = [("fp32", {}), ("all h", {n: "h" for n in OPERANDS}), ("all hl", {n: "hl" for n in OPERANDS}),
               ("fwd", fwd)]
    configs += [(f"fwd, {n} h", {**fwd, n: "h"}) for n in OPERANDS if fwd[n] != "h"]
    allh = {n: "h" for n in OPERANDS}
    configs += [(f"all h, {n} hl", {**allh, n: "hl"}) for n in OPERANDS]
    all16 = {n: "f16" for n in OPERANDS}
    configs += [("all f16", all16)]
    configs += [(f"all f16, {n} hl16", {**all16, n: "hl16"}) for n in OPERANDS]
    configs += [(f"all f16, {n} h", {**all16, n: "h"}) for n in ("P", "dOg", "bK", "Uv")]
    if args.only_f16:
        configs = [c for c in configs if "f16" in c[0] or c[0] in ("fp32", "fwd")]
    if args.min_f16:
        # fp16 (in units) only where the sequential quantities and the chunk's inverse enter a
        # product, every other operand plain bf16 (no unit): how far a bf16 kernel with fp16 chains goes.
        seq = ["S", "dS", "U", "dU", "X", "Tu", "Tw", "W"]
        base = {**{n: "h" for n in OPERANDS}, **{n: "f16" for n in seq}}
        configs = [("all f16", all16), ("f16 " + "/".join(seq), base),
                   ("... + P", {**base, "P": "f16"}), ("... + P/dOg", {**base, "P": "f16", "dOg": "f16"}),
                   ("... + P/dOg/dA", {**base, "P": "f16", "dOg": "f16", "dA": "f16"})]
    if args.local_bf16:
        # The chunk-local operands that the gradients kernel forms itself and today carries in
        # fp16 with a unit from a CTA max reduction each: as bf16 they need no unit at all.
        local = ["dA", "dW", "dVb", "dKb", "Uv", "dM"]
        configs = [("all f16", all16), (f"all f16, {'/'.join(local)} h", {**all16, **{n: "h" for n in local}}),
                   (f"all f16, {'/'.join(local[1:])} h", {**all16, **{n: "h" for n in local[1:]}})]
        configs += [(f"all f16, {n} h", {**all16, n: "h"}) for n in local]
        configs += [(f"all f16, {'/'.join(local)}/U h", {**all16, **{n: "h" for n in local + ['U']}}),
                    (f"all f16, {'/'.join(local)}/P h", {**all16, **{n: "h" for n in local + ['P']}})]
    print(f"T={args.T} HV={args.HV} K=V=128, worst relative L2 over gates benchmark/strong/zero")
    print(f"{'config':<14}" + "".join(f"{n:>10}" for n in names) + "   worst case")
    for label, mode in configs:
        worst = [0.0] * 6
        wcase = [""] * 6
        for gate, (c, ref) in cases.items():
            q, k, v, g, beta, do, dht, h0 = c
            out = chunked_backward_rounded(q, k, v, g, beta, do, dht, h0, scale, mode)
            for i in range(6):
                e = rel(out[i], ref[i])
                if e > worst[i]:
                    worst[i], wcase[i] = e, gate
        ok = all(w <= 4e-3 for w in worst)  # issue 14: every gradient at most 4e-3
        print(f"{label:<14}" + "".join(f"{w:10.2e}" for w in worst) + f"   {'ok ' if ok else 'OVER'} "
              + ",".join(sorted(set(wcase))), flush=True)


if __name__ == "__main__":
    main()
