"""The fused reverse step's arithmetic, modelled on the CPU before the kernel (docs/backward.md,
"The fused reverse step" and its slot table, bench/fused_reverse_layout.py).

Per chunk, last to first, the chain's dU and dS and every gradient of the chunk, in the products
and operand types the slot table plans: fp16 (11 significant bits; the kernel's power-of-two
units keep it in range, so the model rounds without a range limit) for the sequential operands
and the inverse (S', dSn', U', dU', Z, W^T, dW, T') and for the chain's Qg (in bf16 its rounding
accumulates down the chain: dg 1.65e-3 and dh0 1.91e-3 at T = 2048 against 4.9e-4 and 5.7e-4),
bf16 for the chunk-local ones (Pg, dA, dM, dVb and dKb as dL's register operands), the inputs
q, k, v, dO exact (bf16 is exact in either type). The rewrites the table relies on are in the products themselves:
- dv = Tu^T dU with Tu = Tm diag(beta) formed as a register operand (no Tu' tile);
- W^T = K^T diag(beta e^g) Tm^T from K and T' (no W tile from the inverse kernel);
- dL = strict(-(dVb V^T + (dKb K^T) diag(e^g)) diag(beta) Tm^T): no Uv or W tile.
With rounded=False every operand stays fp32 and the model must match the fp64 chunked backward
to the fp32 floor (the algebra); with rounded=True its errors are what the kernel's operand types
cost. CPU only:

    python3 bench/fused_reverse_model.py [--T 2048] [--HV 2] [--gva 2]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backward_precision import f16, make_case, rel  # noqa: E402


def fused_reverse(q, k, v, g, beta, do, dht, h0, scale, rounded=True, C=64, s_bf16=False, tail=""):
    """(dq, dk, dv, dg, dbeta, dh0) for B = 1, q/k heads = value heads, T a multiple of C.
    s_bf16: the states pass's S' in bf16 (an image with no units) instead of fp16, and dU' rounded
    to bf16 where it meets S' (dW = -dU S^T: a wgmma's operands share one type).
    tail: the dk tail's fp16 tiles (each with a unit, so a warpgroup reduction in the step) taken
    to bf16 (no unit) instead, by letter: t T' where dKb and dL read it, w dW''', x X'', b Tb''
    (dK_b = Tb''^T dW''' as a product, not diag(beta e^g) dKb), k dK_b as diag(beta e^g) times dKb
    read back from its bf16 tile (no Tb'' product), v and r dU' and dW''' rounded to bf16 where dVb
    and dKb read them (register operands against a bf16 T'). The kernel's operands of one product
    share a type, so a usable set pairs them: t needs v and r (or w), and w needs b or k."""
    f = torch.float32
    h = f16 if rounded else (lambda x: x)                                  # fp16 operand
    b = (lambda x: x.to(torch.bfloat16).float()) if rounded else (lambda x: x)  # bf16 operand
    _, T, HV, D = q.shape
    NC = T // C
    hd = lambda x: x.to(f).permute(0, 2, 1, 3).reshape(HV, NC, C, x.shape[-1])
    Q, K, V, dO = hd(q), hd(k), hd(v), hd(do)
    gam = g.to(f).permute(0, 2, 1).reshape(HV, NC, C).cumsum(-1)
    bet = beta.to(f).permute(0, 2, 1).reshape(HV, NC, C)
    tr = lambda x: x.transpose(-1, -2)
    rowdot = lambda x, y: (x * y).sum(-1)
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    causal = torch.ones(C, C, dtype=torch.bool).tril(0)
    eye = torch.eye(C)
    # The chunk inverse (the inverse kernel's T') and the entering states (the states pass's S').
    Es_all = torch.where(strict, (gam[..., :, None] - gam[..., None, :]), torch.tensor(-float("inf"))).exp()
    Tm_all = torch.linalg.solve_triangular(eye + bet[..., :, None] * Es_all * (K @ tr(K)), eye.expand(HV, NC, C, C),
                                           upper=False, unitriangular=True)
    S = h0.to(f)[0].clone()
    S_in = []
    for c in range(NC):
        S_in.append(S)
        eg = gam[:, c].exp()
        Wc = Tm_all[:, c] * (bet[:, c] * eg)[:, None, :] @ K[:, c]
        Uc = Tm_all[:, c] * bet[:, c][:, None, :] @ V[:, c] - Wc @ S
        S = gam[:, c, -1:, None].exp() * S + tr(K[:, c]) @ ((gam[:, c, -1:] - gam[:, c]).exp()[..., None] * Uc)
    dq, dk, dv = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    dg, dbeta = torch.zeros(HV, NC, C), torch.zeros(HV, NC, C)
    dSn = dht.to(f)[0].clone()
    for c in reversed(range(NC)):
        q_, k_, v_, do_ = Q[:, c], K[:, c], V[:, c], dO[:, c]
        gm, bt = gam[:, c], bet[:, c]
        eg, eG = gm.exp(), gm[:, -1:].exp()
        egk = (gm[:, -1:] - gm).exp()  # e^(Gamma - gamma)
        diff = gm[..., :, None] - gm[..., None, :]
        Ec = torch.where(causal, diff, torch.tensor(-float("inf"))).exp()
        Es = torch.where(strict, diff, torch.tensor(-float("inf"))).exp()
        Tm = h(Tm_all[:, c])
        Ss, dSs = (b if s_bf16 else h)(S_in[c]), h(dSn)  # S' (the states pass's image), dSn' (the chain's copy)
        # A: the gated scores (the chain's A and P's image).
        P = scale * Ec * (q_ @ tr(k_))
        Pg = b(P)
        # K: dU = Kd dSn + Pg^T dO (Kd a register operand from K).
        dU = h(egk[..., None] * k_) @ dSs + tr(Pg) @ do_
        dUs = h(dU)
        # A: Z = V - diag(e^g) K S, U = Tu Z; W^T = K^T diag(beta e^g) Tm^T.
        Zs = h(v_ - eg[..., None] * (k_ @ Ss))
        Us = h(h(Tm * bt[:, None, :]) @ Zs)
        Wts = h(h(tr(k_) * (bt * eg)[:, None, :]) @ tr(Tm))
        # S: the state gradient entering the chunk.
        dS = eG[..., None] * dSn + tr(h(scale * eg[..., None] * q_)) @ do_ - Wts @ dUs
        # K: dv; A: dP, dA, dq.
        dv[:, c] = tr(h(Tm * bt[:, None, :])) @ dUs
        dP = do_ @ tr(Us)
        dA = b(scale * Ec * dP)
        dQ_S = scale * eg[..., None] * (do_ @ tr(Ss))
        dq[:, c] = dQ_S + dA @ k_
        # K: dK_P, dK_d, dW, dVb, dKb.
        dK_d = egk[..., None] * (Us @ tr(dSs))
        Tt = b(Tm_all[:, c]) if "t" in tail else Tm
        dWs = (b if "w" in tail else h)(-((b(dUs) if s_bf16 else dUs) @ tr(Ss)))  # (a bf16 S' pairs with dU' in bf16 here)
        dVb = tr(Tt) @ b(dUs) if "v" in tail else tr(Tm) @ dUs
        dKb = tr(Tt) @ (b(dWs) if "r" in tail else dWs)
        if "b" in tail:
            dK_b = tr(b(Tm_all[:, c] * (bt * eg)[:, None, :])) @ dWs
        elif "k" in tail:
            dK_b = (bt * eg)[..., None] * b(dKb)
        else:
            dK_b = (bt * eg)[..., None] * dKb
        # dL from dVb, dKb as bf16 register operands against V and K, the sum against Tm^T.
        X = b(dVb) @ tr(v_) + (b(dKb) @ tr(k_)) * eg[:, None, :]
        dL = torch.where(strict, -((b if "x" in tail else h)(X * bt[:, None, :]) @ tr(Tt)), torch.zeros(()))
        dMs = b(Es * dL)
        dMK = dMs @ k_
        dk[:, c] = tr(dA) @ q_ + dK_d + dK_b + bt[..., None] * dMK + tr(b(dMs * bt[..., None])) @ k_
        # dbeta, dg (B29-B33), in fp32 from the accumulators.
        L = torch.where(strict, bt[..., :, None] * Es * (k_ @ tr(k_)), torch.zeros(()))
        dbeta[:, c] = rowdot(dVb, v_) + eg * rowdot(dKb, k_) + rowdot(dMK, k_)
        R = torch.where(strict, dP * P, torch.zeros(())) + dL * L
        a = rowdot(dQ_S, q_) + rowdot(dK_b, k_) + R.sum(-1) - R.sum(-2)
        x = rowdot(dK_d, k_)
        eS = eG[:, 0] * (dSn * S_in[c]).sum((-1, -2))
        dg[:, c] = a.flip(-1).cumsum(-1).flip(-1) + (x.cumsum(-1) - x) + eS[:, None]
        dSn = dS
    tok = lambda t: t.reshape(HV, T, t.shape[-1]).permute(1, 0, 2)[None]
    un = lambda t: t.reshape(HV, T).permute(1, 0)[None]
    return tok(dq), tok(dk), tok(dv), un(dg), un(dbeta), dSn[None]


def errors(T, HV, rounded, s_bf16=False, tail=""):
    """Worst relative L2 per gradient over the three gate cases, against the fp64 chunked backward."""
    from qla import reference
    scale = 128 ** -0.5
    worst = [0.0] * 6
    for i, gate in enumerate(("benchmark", "strong", "zero")):
        q, k, v, g, beta, do, dht, h0 = make_case(gate, T, HV, 100 + i)
        ref = reference.chunked_backward(q.double(), k.double(), v.double(), g.double(), beta.double(), do.double(),
                                         dht.double(), scale=scale, initial_state=h0.double())
        out = fused_reverse(q, k, v, g, beta, do, dht, h0, scale, rounded=rounded, s_bf16=s_bf16, tail=tail)
        worst = [max(w, rel(o, r)) for w, o, r in zip(worst, out, ref)]
    return worst


def gva_errors(T, HV, G):
    """With GVA (G value heads per q/k head; one CTA per value head): the worst relative L2 of dq
    and dk over the gate cases when each value head's share is summed over its group in fp32 and
    the sum rounded to bf16 once (fp32 partials), against rounding each share to bf16 first (a
    bf16 tensor per value head and a group-sum kernel), both with the outputs' bf16 rounding."""
    from qla import reference
    scale = 128 ** -0.5
    bf = lambda x: x.to(torch.bfloat16).double()
    worst = {"fp32 partials": [0.0, 0.0], "bf16 per value head": [0.0, 0.0]}
    for i, gate in enumerate(("benchmark", "strong", "zero")):
        q, k, v, g, beta, do, dht, h0 = make_case(gate, T, HV, 200 + i)
        q, k = q[:, :, ::G], k[:, :, ::G]  # H = HV / G q/k heads, each shared by G value heads
        ref = reference.chunked_backward(q.double(), k.double(), v.double(), g.double(), beta.double(), do.double(),
                                         dht.double(), scale=scale, initial_state=h0.double())
        qe, ke = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
        dq, dk, *_ = fused_reverse(qe, ke, v, g, beta, do, dht, h0, scale, rounded=True)
        for name, share in (("fp32 partials", lambda x: x.double()), ("bf16 per value head", bf)):
            for j, (x, r) in enumerate(((dq, ref[0]), (dk, ref[1]))):
                summed = share(x).reshape(*x.shape[:2], -1, G, x.shape[-1]).sum(3)
                worst[name][j] = max(worst[name][j], rel(bf(summed), r))
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--HV", type=int, default=2)
    ap.add_argument("--gva", type=int, default=0, help="also G value heads a q/k head: dq, dk's group sums")
    ap.add_argument("--tail", action="store_true", help="also the dk tail's fp16 tiles in bf16 (fused_reverse's tail)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    print(f"T={args.T} HV={args.HV} K=V=128, worst relative L2 over gates benchmark/strong/zero")
    print(f"{'':14}" + "".join(f"{n:>10}" for n in names))
    for label, rounded, sb in (("fp32 algebra", False, False), ("planned types", True, False),
                               ("S' in bf16", True, True)):
        print(f"{label:14}" + "".join(f"{e:10.2e}" for e in errors(args.T, args.HV, rounded, sb)), flush=True)
    if args.tail:  # with S' in bf16, as the step runs bf16 inputs
        for label, tail in (("+ T' bf16", "t"), ("+ T' X''", "tx"), ("+ T' dW'''", "tw"), ("+ T' dW''' X''", "twx"),
                            ("+ and Tb''", "twxb"),
                            ("+ dK_b of dKb''", "twxk"),
                            ("+ T' v r X''", "tvrx")):
            print(f"{label:14}" + "".join(f"{e:10.2e}" for e in errors(args.T, args.HV, True, True, tail)), flush=True)
    if args.gva:
        print(f"GVA, {args.gva} value heads a q/k head, dq and dk with the outputs' bf16 rounding:")
        for name, (eq, ek) in gva_errors(args.T, args.HV * args.gva, args.gva).items():
            print(f"  {name:20} dq {eq:.2e} dk {ek:.2e}", flush=True)


if __name__ == "__main__":
    main()
