"""SM clock and board power while the CUDA forward runs back to back (3 s per shape, nvidia-smi every
50 ms): whether a chunk step is slower with every SM busy because the clock drops (power) or
because the memory system is shared. Run on the device: python3 bench/clock_under_load.py"""
import subprocess, time, torch, torch.nn.functional as F, qla
def inputs(N, T, H, HV):
    q = F.normalize(torch.randn(1, N * T, H, 128, device="cuda"), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, N * T, H, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, N * T, HV, 128, device="cuda").bfloat16()
    g = F.logsigmoid(torch.randn(1, N * T, HV, device="cuda")) / 16
    beta = torch.rand(1, N * T, HV, device="cuda")
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32, device="cuda")
    return q, k, v, g, beta, cu, cu.cpu()
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader", "-lms", "50"],
                       stdout=open("/tmp/clock_smi.log", "w"))
for name, shape in (("16/64 8192x4", (4, 8192, 16, 64)), ("16/32 1x32768", (1, 32768, 16, 32)), ("16/64 8192x4 again", (4, 8192, 16, 64))):
    q, k, v, g, beta, cu, cuh = inputs(*shape)
    run = lambda: qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cuh, output_final_state=True)
    for _ in range(5): run()
    torch.cuda.synchronize()
    t0 = time.time(); n = 0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    while time.time() - t0 < 3.0:
        for _ in range(20): run()
        n += 20
        torch.cuda.synchronize()
    e.record(); torch.cuda.synchronize()
    print(f"{name}: {s.elapsed_time(e) / n:.3f} ms per call over {n} calls, {time.strftime('%H:%M:%S')}", flush=True)
    time.sleep(0.5)
smi.terminate(); time.sleep(0.2)
print(open("/tmp/clock_smi.log").read())
