"""A state pool read and written in place (state_pool with indices) against the gather / call /
scatter an engine does without it: eager time per call (CUDA events around each call) and device
time from CUDA-graph replay (bench/grid.py's timers), on a chunked-prefill step of a few
sequences. Usage: python3 bench/pool_vs_gather.py"""
import torch
import torch.nn.functional as F

import qla
from grid import time_cuda, time_graph

dev = "cuda"
H, HV, D, lens, slots = 16, 32, 128, [1024, 512, 2048, 512], 64
T = sum(lens)
q = F.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).bfloat16()
k = F.normalize(torch.randn(1, T, H, D, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, HV, D, device=dev).bfloat16()
g = F.logsigmoid(torch.randn(1, T, HV, device=dev)) / 16
beta = torch.rand(1, T, HV, device=dev)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
pool = torch.randn(slots, HV, D, D, device=dev)
idx = torch.tensor([5, 17, 40, 63], dtype=torch.int32, device=dev)
idx64 = idx.long()


def in_place():
    qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, state_pool=pool, initial_state_indices=idx,
                               final_state_indices=idx)


def gather_scatter():
    h0 = pool.index_select(0, idx64)
    _, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    pool.index_copy_(0, idx64, ht)


with torch.no_grad():
    print(torch.cuda.get_device_name(), f"H={H} HV={HV} lens={lens}, pool of {slots}")
    for name, fn in (("pool in place", in_place), ("gather, call, scatter", gather_scatter)):
        eager = time_cuda([fn]).median_ms
        print(f"{name:24s} eager {eager:.3f} ms   graph replay {time_graph([fn], per_call_ms=eager).median_ms:.3f} ms")
