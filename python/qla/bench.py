"""python -m qla.bench: run the op on Qwen3.5-shaped inputs on the best device present,
check it against a reference, and print throughput.

CPU (default when no GPU): B=1, T=4096, H=16, HV=32, K=V=128, fp32 on all cores, forward
and backward, beside the chunked fp32 torch implementation (qla.reference.chunked, its
backward through autograd) on the same threads. Use --tokens to shrink it.
CUDA: a few Qwen3.5 rows (bf16), checked against the CPU backend; the full grid with
the peers is bench/run_grid.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import qla
from qla import reference


def _inputs(B, T, H, HV, K, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen)) / 16
    g[:, :, torch.randperm(HV, generator=gen)[: HV // 4]] = 0.0  # 25% of value heads do not decay
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta, h0)]


def _time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def bench_cpu(T, repeats):
    B, H, HV, K, V = 1, 16, 32, 128, 128
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    q, k, v, g, beta, h0 = _inputs(B, T, H, HV, K, V, torch.float32, "cpu")
    print(f"CPU, {threads} threads: B={B} T={T} H={H} HV={HV} K={K} V={V} fp32 (token-heads = T*HV = {T * HV})")

    # Correctness: QLA against the chunked torch form evaluated in fp64.
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rht = reference.chunked(*(t.double() for t in (q, k, v, g, beta)), initial_state=h0.double())
    err_o, err_h = _rel(o, ro), _rel(ht, rht)
    print(f"check vs fp64 chunked reference: o rel-L2 {err_o:.2e}, final state {err_h:.2e}")

    # Forward.
    def qla_fwd():
        qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def torch_fwd():
        with torch.no_grad():
            reference.chunked(q, k, v, g, beta, initial_state=h0)

    # Backward: QLA low-level backward vs autograd through the chunked torch form.
    do = torch.randn_like(o)
    dht = torch.randn_like(ht) / 8

    def qla_bwd():
        qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    graph = {}

    def torch_graph():
        graph["out"] = reference.chunked(*leaves[:5], initial_state=leaves[5])

    def torch_bwd():
        torch.autograd.backward(graph["out"], (do, dht), retain_graph=True)

    torch_graph()
    rows = [
        ("forward", _time(qla_fwd, repeats), _time(torch_fwd, repeats)),
        ("backward", _time(qla_bwd, repeats), _time(torch_bwd, repeats)),
    ]
    print(f"{'pass':<9} {'qla ms':>10} {'torch ms':>10} {'qla Mtok-heads/s':>17} {'torch Mtok-heads/s':>19} "
          f"{'speedup':>8}")
    for name, tq, tt in rows:
        print(f"{name:<9} {tq * 1e3:10.1f} {tt * 1e3:10.1f} {T * HV / tq / 1e6:17.3f} {T * HV / tt / 1e6:19.3f} "
              f"{tt / tq:7.2f}x")
    ok = err_o < 1e-4 and err_h < 1e-4
    print("check:", "ok" if ok else "FAILED")
    return ok


QWEN_ROWS = [  # label, h_qk, h_v, layout (sequence lengths)
    ("35B/9B/4B TP1", 16, 32, [32768]),
    ("397B/122B TP1", 16, 64, [8192] * 4),
    ("397B/122B TP8", 2, 8, [32768]),
    ("2B/0.8B TP1", 16, 16, [1024] * 8),
]


def bench_cuda(repeats):
    dev = torch.device("cuda")
    print(f"CUDA: {torch.cuda.get_device_name(dev)}; bf16 q/k/v, fp32 gates and state")
    ok = True
    for label, H, HV, lens in QWEN_ROWS:
        T = sum(lens)
        q, k, v, g, beta, _ = _inputs(1, T, H, HV, 128, 128, torch.bfloat16, dev)
        N = len(lens)
        h0 = torch.randn(N, HV, 128, 128, device=dev)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        run = lambda: qla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu)
        o, ht = run()
        torch.cuda.synchronize()
        # Check against the exact CPU backend on a prefix of at most 2048 tokens (CPU time bounded):
        # the whole sequences that fit in it, or else the start of the first sequence.
        bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
        inside = [b for b in bounds if b <= 2048]
        cc = inside if len(inside) >= 2 else [0, min(T, 2048)]
        Tc = cc[-1]
        ro, _ = qla.chunk_gated_delta_rule_fwd(*(t[:, :Tc].cpu().float() for t in (q, k, v, g, beta)),
                                               initial_state=h0[: len(cc) - 1].cpu(),
                                               cu_seqlens=torch.tensor(cc, dtype=torch.int32))
        err = _rel(o[:, :Tc].cpu(), ro)
        ok &= err < 3e-3 and not torch.isnan(o).any().item()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"{label:<16} {'+'.join(map(str, lens)) if N <= 2 else f'{lens[0]}x{N}':>10}  {ms:8.3f} ms  "
              f"{T * HV / ms / 1e6:8.2f} Gtok-heads/s  rel-L2 vs CPU {err:.1e}")
    print("check:", "ok" if ok else "FAILED")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--tokens", type=int, default=4096, help="CPU sequence length (default 4096)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 else "cpu"
    ok = bench_cuda(max(args.repeats, 20)) if device == "cuda" else bench_cpu(args.tokens, args.repeats)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
