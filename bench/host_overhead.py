"""Host time of the eager path: qla.chunk_gated_delta_rule from Python to the kernel launch.

Each sample times one call with the host clock on an idle GPU (synchronised before and
after, outside the timed region), so the number is what the call costs the CPU thread,
not the kernel. Median of many samples.
"""
import statistics
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


def host_us(fn, n=500):
    for _ in range(20):
        fn()
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


hi = lambda: qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
lo = lambda: qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu)
with torch.no_grad():
    print(f"host time per call, chunk_gated_delta_rule (no_grad): {host_us(hi):.1f} us")
    print(f"host time per call, chunk_gated_delta_rule_fwd:       {host_us(lo):.1f} us")
    print(f"reference: one torch.empty:                          {host_us(lambda: torch.empty(1, T, HV, K, device=dev)):.1f} us")
    print(f"reference: one tiny torch add (one launch):          {host_us(lambda: g + 1):.1f} us")
