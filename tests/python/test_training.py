"""Training through qla.chunk_gated_delta_rule: a small Qwen3.5-style GDN layer (projections,
l2norm of q and k, the gate from A_log / dt_bias, beta sigmoid) learns a synthetic task: the
output is an exponential moving average (decay 0.8) of the inputs, which the layer can only
learn through its state and its gate.

- CPU backend: the loss must fall to 0.75 of its starting value within 150 steps. Training the
  output projection alone (the op's parameters frozen) stays at ~0.98 (measured), so the drop
  needs the gradients through the op and its preprocessing (measured ~0.64).
- GPU (issue 4, acceptance 5): the same run on CUDA and on the CPU backend, from the same
  initial weights and data, must give the same loss curve.
"""
import pytest
import torch
import torch.nn.functional as F

import qla

D_MODEL, H, HV, DK = 32, 1, 2, 128  # head dim 128: what the sm90 kernels support


class GDNLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(D_MODEL, H * DK, bias=False)
        self.k = torch.nn.Linear(D_MODEL, H * DK, bias=False)
        self.v = torch.nn.Linear(D_MODEL, HV * DK, bias=False)
        self.a = torch.nn.Linear(D_MODEL, HV, bias=False)  # gate input
        self.b = torch.nn.Linear(D_MODEL, HV, bias=False)  # beta logits
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1.0, 4.0, HV)))
        self.dt_bias = torch.nn.Parameter(torch.zeros(HV))
        self.o = torch.nn.Linear(HV * DK, D_MODEL, bias=False)

    def forward(self, x, dtype):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, DK).to(dtype)
        k = self.k(x).view(B, T, H, DK).to(dtype)
        v = self.v(x).view(B, T, HV, DK).to(dtype)
        o, _ = qla.chunk_gated_delta_rule(q, k, v, self.a(x), self.b(x), use_qk_l2norm_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                                          A_log=self.A_log, dt_bias=self.dt_bias)
        return self.o(o.float().reshape(B, T, HV * DK))


def ema_batch(gen, B=4, T=96, lam=0.8):
    """Inputs randn; target at step t: (1 - lam) sum_{s <= t} lam^(t - s) x_s, scaled to unit variance."""
    x = torch.randn(B, T, D_MODEL, generator=gen)
    y = torch.zeros_like(x)
    acc = torch.zeros(B, D_MODEL)
    for s in range(T):
        acc = lam * acc + (1 - lam) * x[:, s]
        y[:, s] = acc
    return x, y / y.std()


def train(device, steps, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = GDNLayer().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x, y = ema_batch(gen)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x, dtype), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_gdn_layer_trains_on_the_cpu_backend():
    losses = train("cpu", 150)
    assert all(torch.isfinite(torch.tensor(losses)))
    start, end = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert end < 0.75 * start, f"loss {start:.4f} -> {end:.4f}"


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs a Hopper (sm90) GPU")
def test_gdn_layer_trains_the_same_on_cuda_and_cpu():
    steps = 300
    cpu = train("cpu", steps, dtype=torch.bfloat16)
    gpu = train("cuda", steps, dtype=torch.bfloat16)
    # Curves, not single steps: the two backends round differently, so compare 25-step means.
    for i in range(0, steps, 25):
        c, g = sum(cpu[i:i + 25]) / 25, sum(gpu[i:i + 25]) / 25
        assert abs(g - c) <= 3e-2 * c, f"steps {i}-{i + 24}: cuda {g:.5f}, cpu {c:.5f}"
