"""A small sm90 forward and backward for compute-sanitizer: varlen with empty and ragged sequences, GVA."""
import torch
import torch.nn.functional as F

import qla

torch.manual_seed(0)
lens = [0, 1, 63, 64, 65, 130, 0]
T, H, HV, K = sum(lens), 2, 4, 128
dev = "cuda"
q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, HV, K, device=dev).bfloat16()
g = F.logsigmoid(torch.randn(1, T, HV, device=dev)) / 16
beta = torch.rand(1, T, HV, device=dev)
h0 = torch.randn(len(lens), HV, K, K, device=dev)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
for v_first in (False, True):
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       state_v_first=v_first)
torch.cuda.synchronize()
print("memcheck case ran; o finite:", bool(torch.isfinite(o).all()))
# Malformed device cu_seqlens (a decreasing step, last entry past T): NaN outputs, no access
# outside the tensors.
bad = torch.tensor([0, 200, 100, T + 64, T, T, T, T], dtype=torch.int32, device=dev)
o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=bad)
torch.cuda.synchronize()
print("malformed cu_seqlens: o all NaN:", bool(torch.isnan(o).all()), "state all NaN:", bool(torch.isnan(ht).all()))
# The backward on the same inputs (both state layouts), and with the malformed cu_seqlens: every
# gradient NaN, no access outside the tensors.
do = torch.randn_like(v)
for v_first in (False, True):
    h0v = h0.transpose(-1, -2).contiguous() if v_first else h0
    grads = qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=h0v / 8, initial_state=h0v, cu_seqlens=cu,
                                           state_v_first=v_first)
torch.cuda.synchronize()
print("backward ran; all finite:", all(bool(torch.isfinite(t).all()) for t in grads))
grads = qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht=h0 / 8, initial_state=h0, cu_seqlens=bad)
torch.cuda.synchronize()
print("malformed cu_seqlens, backward: all NaN:", all(bool(torch.isnan(t).all()) for t in grads))
