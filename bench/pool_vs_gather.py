"""A state pool read and written in place (state_pool with indices) against the gather / call /
scatter an engine does without it: eager time per call (host included) and device time from
CUDA-graph replay, on a chunked-prefill step of a few sequences. Usage: python3 bench/pool_vs_gather.py"""
import torch
import torch.nn.functional as F

import qla

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


def eager_ms(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def graph_ms(fn, n=20, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (n * reps)


with torch.no_grad():
    print(torch.cuda.get_device_name(), f"H={H} HV={HV} lens={lens}, pool of {slots}")
    for name, fn in (("pool in place", in_place), ("gather, call, scatter", gather_scatter)):
        print(f"{name:24s} eager {eager_ms(fn):.3f} ms   graph replay {graph_ms(fn):.3f} ms")
