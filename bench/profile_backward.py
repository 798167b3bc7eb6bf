"""Per-kernel device time of one QLA backward (torch.profiler), for the design notes.

    python bench/profile_backward.py [--heads 16/32] [--layouts 1x32768,8192x4]
"""
import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import qla


def inputs(H, HV, lens, gen):
    T = sum(lens)
    dev = "cuda"
    q = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    k = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    v = torch.randn(1, T, HV, 128, generator=gen).bfloat16().to(dev)
    g = (F.logsigmoid(torch.randn(1, T, HV, generator=gen)) / 16).to(dev)
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen)).to(dev)
    do = torch.randn(1, T, HV, 128, generator=gen).bfloat16().to(dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return q, k, v, g, beta, do, cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--layouts", default="1x32768,8192x4")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    H, HV = (int(x) for x in args.heads.split("/"))
    for lay in args.layouts.split(","):
        a, c = (int(x) for x in lay.split("x"))
        lens = [c] if a == 1 else [a] * c  # "1x32768": one sequence; "8192x4": four of 8192
        q, k, v, g, beta, do, cu = inputs(H, HV, lens, gen)
        fn = lambda: qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, cu_seqlens=cu)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        tot = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name.replace("(anonymous namespace)::", "").replace("void ", "").split("(")[0]
                tot[name] += e.device_time / 5.0 / 1000.0
        print(f"== {args.heads} {lay}: per-kernel ms per call")
        for name, t in sorted(tot.items(), key=lambda x: -x[1]):
            print(f"  {t:8.3f}  {name[-60:]}")
        print(f"  {sum(tot.values()):8.3f}  total")


if __name__ == "__main__":
    main()
