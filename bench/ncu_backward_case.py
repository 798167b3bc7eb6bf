import torch, torch.nn.functional as F, qla
gen = torch.Generator().manual_seed(0)
T, H, HV = 4096, 16, 32
q = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
k = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).bfloat16().cuda()
v = torch.randn(1, T, HV, 128, generator=gen).bfloat16().cuda()
g = (F.logsigmoid(torch.randn(1, T, HV, generator=gen)) / 16).cuda()
beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen)).cuda()
do = torch.randn(1, T, HV, 128, generator=gen).bfloat16().cuda()
for _ in range(2):
    qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, do)
torch.cuda.synchronize()
