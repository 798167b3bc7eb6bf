"""Shared helpers: an independent fp64 torch reference of the recurrence and input makers."""
import pytest
import torch
import torch.nn.functional as F


def reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """fp64 token-by-token recurrence (the definition), differentiable through torch autograd.

    q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV]; initial_state [N,HV,K,V].
    Returns (o [B,T,HV,V] fp64, final state [N,HV,K,V] fp64).
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    q = q.repeat_interleave(G, dim=2)
    k = k.repeat_interleave(G, dim=2)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs = [None] * T * B
    finals = []
    for n, (b, t0, t1) in enumerate(spans):
        if initial_state is not None:
            S = initial_state[n].double()
        else:
            S = torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
        for t in range(t0, t1):
            S = S * g[b, t].exp()[:, None, None]
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            outs[b * T + t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    o = torch.stack(outs).reshape(B, T, HV, V) if T * B > 0 else torch.zeros(B, T, HV, V, dtype=torch.float64)
    return o, torch.stack(finals)


def make_inputs(B, T, H, HV, K, V, dtype=torch.float32, gate="mild", beta_kind="random", n_states=None,
                device="cpu", seed=0):
    """Inputs drawn as the benchmark distribution: l2-normalised q/k, randn v, log-sigmoid gates."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    x = torch.randn(B, T, HV, generator=gen, dtype=torch.float64)
    if gate == "mild":
        g = F.logsigmoid(x) / 16
    elif gate == "strong":
        g = F.logsigmoid(x)
    elif gate == "very_strong":
        g = -5.0 + 0.5 * x
    else:
        g = torch.zeros_like(x)
    if beta_kind == "random":
        beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=torch.float64))
    else:
        beta = torch.full((B, T, HV), float(beta_kind), dtype=torch.float64)
    n = B if n_states is None else n_states
    h0 = torch.randn(n, HV, K, V, generator=gen, dtype=torch.float64)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(
        q=q.to(dtype).to(device), k=k.to(dtype).to(device), v=v.to(dtype).to(device),
        g=g.to(gate_dtype).to(device), beta=beta.to(gate_dtype).to(device),
        initial_state=h0.to(state_dtype).to(device),
    )


def capture_cuda_graph(fn):
    """Runs fn once on a side stream (warm-up: allocations, workspace sizes), then captures it.
    Returns (graph, what the captured call returned)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def rel_err(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    assert not torch.isnan(x).any(), "NaN in output"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
