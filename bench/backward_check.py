"""Per-gradient diagnostics of the sm90 backward against the CPU backend on the same inputs.

Prints the relative L2 error of dq, dk, dv, dg, dbeta, dh0 (CUDA vs CPU backend, which is exact
up to its fp32 accumulation) for a few shapes and gate regimes, and whether any output kept NaN
from a poisoned allocator. A debugging aid next to tests/python/test_cuda_backward.py (which
compares against fp64 autograd and asserts the tolerances).

    python bench/backward_check.py
"""
import sys

import torch
import torch.nn.functional as F

import qla

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def inputs(lens, H, HV, gate, seed=0, B=None):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, 128, generator=gen).bfloat16()
    x = torch.randn(1, T, HV, generator=gen)
    g = {"mild": F.logsigmoid(x) / 16, "strong": F.logsigmoid(x), "zero": torch.zeros_like(x)}[gate]
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    h0 = torch.randn(len(lens), HV, 128, 128, generator=gen)
    do = torch.randn(1, T, HV, 128, generator=gen).bfloat16()
    dht = torch.randn(len(lens), HV, 128, 128, generator=gen) / 8
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, dht=dht, initial_state=h0, cu_seqlens=cu)


def run(x, device):
    a = {n: (t.to(device) if t is not None else None) for n, t in x.items()}
    if device == "cuda":  # poison the allocator: unwritten outputs show up as NaN
        blocks = [torch.full((1 << 26,), float("nan"), device="cuda") for _ in range(4)]
        del blocks
    out = qla.chunk_gated_delta_rule_bwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["do"], dht=a["dht"],
                                         initial_state=a["initial_state"], cu_seqlens=a["cu_seqlens"])
    return [t.float().cpu() for t in out]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    cases = [
        ("1x64 H1 HV1 mild", [64], 1, 1, "mild"),
        ("1x300 H2 HV4 mild", [300], 2, 4, "mild"),
        ("1x300 H2 HV4 strong", [300], 2, 4, "strong"),
        ("1x300 H2 HV4 zero", [300], 2, 4, "zero"),
        ("varlen 0,1,63,64,65,200,130 H1 HV4", [0, 1, 63, 64, 65, 200, 130], 1, 4, "mild"),
        ("1x2048 H2 HV4 mild", [2048], 2, 4, "mild"),
    ]
    worst = 0.0
    print(f"{'case':40s} " + " ".join(f"{n:>9s}" for n in NAMES) + "  nan")
    for name, lens, H, HV, gate in cases:
        x = inputs(lens, H, HV, gate)
        got = run(x, "cuda")
        ref = run(x, "cpu")
        errs = [rel(a, b) for a, b in zip(got, ref)]
        nan = any(bool(torch.isnan(t).any()) for t in got)
        worst = max(worst, max(errs))
        print(f"{name:40s} " + " ".join(f"{e:9.2e}" for e in errs) + f"  {nan}")
        sys.stdout.flush()
    print(f"worst {worst:.2e}")


if __name__ == "__main__":
    main()
