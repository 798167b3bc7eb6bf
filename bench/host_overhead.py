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

# Where the time goes: the op without the API's argument checks and preprocessing, then the
# binding alone (C++ validation, tensor maps, three launches) with the outputs preallocated.
from qla import _ops  # noqa: E402

scale = K ** -0.5
impl = lambda: _ops.forward_impl(q, k, v, g, beta, scale, h0, cu, True, False, False)
o = torch.empty(1, T, HV, K, dtype=q.dtype, device=dev)
ht = torch.empty(1, HV, K, K, device=dev)
shape = (1, T, H, HV, K, K)
descs = (_ops._desc(q), _ops._desc(k), _ops._desc(v), _ops._desc(g), _ops._desc(beta), _ops._desc(h0),
         _ops._cu_desc(cu), 1, _ops._desc(o), _ops._desc(ht))
ws_bytes = _ops._C.forward_workspace_size(shape, *descs, scale, 0, 1, False, _ops.SPLIT_AUTO, 0, False, 0,
                                          _ops._NO_POOLS)
ws = torch.empty((ws_bytes,), dtype=torch.uint8, device=dev)
stream = torch._C._cuda_getCurrentRawStream(0)
binding = lambda: _ops._C.forward(shape, *descs, scale, 0, 1, stream, ws.data_ptr(), ws_bytes, 0, False,
                                  _ops.SPLIT_AUTO, 0, False, 0, _ops._NO_POOLS)
with torch.no_grad():
    print(f"breakdown: _ops.forward_impl (no API checks):          {host_us(impl):.1f} us")
    print(f"breakdown: _C.forward alone (C++ checks + 3 launches):  {host_us(binding):.1f} us")

# The backward's eager path (one pair: the fused backward, states pass + reverse step +
# finish), from the low-level API with the forward's inputs given.
do = torch.randn_like(v)
dht = torch.randn_like(h0)
bwd = lambda: qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, initial_state=h0, cu_seqlens=cu)
bwd_op = lambda: _ops.gdn_bwd(q, k, v, g, beta, scale, h0, cu, do, dht, False)  # the same through the op
bwd_impl = lambda: _ops.backward_impl(q, k, v, g, beta, scale, h0, cu, do, dht, False)  # no API checks
with torch.no_grad():
    print(f"host time per call, chunk_gated_delta_rule_bwd (fused): {host_us(bwd):.1f} us")
    print(f"breakdown: _ops.gdn_bwd (the custom op's dispatcher):   {host_us(bwd_op):.1f} us")
    print(f"breakdown: _ops.backward_impl (no API checks):         {host_us(bwd_impl):.1f} us")
