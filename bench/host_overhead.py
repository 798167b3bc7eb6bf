"""Host time of the eager path: qla.chunk_gated_delta_rule from Python to the kernel launch.

Measured as the wall time of many back-to-back calls on a tiny problem while the GPU is kept
busy by a long kernel queued first, so the host-side cost is what the clock sees.
"""
import time

import torch
import torch.nn.functional as F

import qla

dev = "cuda"
T, H, HV, K = 64, 1, 1, 128
q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, HV, K, device=dev).bfloat16()
g = F.logsigmoid(torch.randn(1, T, HV, device=dev)) / 16
beta = torch.rand(1, T, HV, device=dev)
h0 = torch.randn(1, HV, K, K, device=dev)
cu = torch.tensor([0, T], dtype=torch.int32, device=dev)


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(20):  # keep the GPU busy so launches never wait on it... nor it on them
        big @ big
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


hi = lambda: qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
lo = lambda: qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu)
with torch.no_grad():
    print(f"host time per call, chunk_gated_delta_rule (no_grad): {per_call_us(hi):.1f} us")
    print(f"host time per call, chunk_gated_delta_rule_fwd:       {per_call_us(lo):.1f} us")
    empty = lambda: torch.empty(1, T, HV, K, device=dev)
    print(f"reference: one torch.empty:                          {per_call_us(empty):.1f} us")
