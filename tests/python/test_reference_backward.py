"""qla.reference.chunked_backward (the hand-written chunked backward, no autograd) against
autograd through qla.reference.recurrent and against the CPU backend's backward."""
import itertools

import pytest
import torch

import qla
from conftest import make_inputs, rel_err
from qla.reference import chunked_backward, recurrent

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The per-chunk products are tiny: torch's intra-op threads cost ~25x here (2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(got, ref, tol):
    """Relative L2 error below tol; a gradient that is exactly zero (e.g. dk with beta = 0) must stay ~0."""
    if ref.double().norm() == 0:
        return got.double().norm().item() <= tol
    return rel_err(got, ref) < tol


def _case(B, T, H, HV, K, V, dtype, gate, beta_kind, use_h0, use_dht, seed=0):
    x = make_inputs(B, T, H, HV, K, V, dtype, gate=gate, beta_kind=beta_kind, seed=seed)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(dtype)
    state_dt = torch.float64 if dtype == torch.float64 else torch.float32
    dht = (torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64) / 4).to(state_dt) if use_dht else None
    h0 = x["initial_state"] if use_h0 else None
    return args, do, dht, h0


def _autograd(args, do, dht, h0):
    """Gradients by autograd through the token-by-token recurrence (fp64)."""
    leaves = [a.detach().double().requires_grad_() for a in args]
    h0_leaf = (h0.detach().double() if h0 is not None else
               torch.zeros(do.shape[0], do.shape[2], args[0].shape[-1], do.shape[-1], dtype=torch.float64))
    h0_leaf.requires_grad_()
    o, ht = recurrent(*leaves, initial_state=h0_leaf)
    outs, grads = [o], [do.double()]
    if dht is not None:
        outs.append(ht)
        grads.append(dht.double())
    torch.autograd.backward(outs, grads)
    return [a.grad for a in leaves] + [h0_leaf.grad]


def _check(got, refs, tol, label):
    for name, a, r in zip(NAMES, got, refs):
        assert a.shape == r.shape, (label, name, a.shape, r.shape)
        assert _close(a, r, tol), (label, name, rel_err(a, r))


# Every gate x beta x GVA combination; state options and chunk size cycle through the cases.
_GRID = list(itertools.product(["mild", "very_strong", "zero"], ["random", 0, 1], [1, 2, 4]))


@pytest.mark.parametrize("i", range(len(_GRID)))
def test_fp64_matches_autograd_and_cpu_backend(i):
    gate, beta_kind, group = _GRID[i]
    use_h0, use_dht = [(True, True), (False, False), (True, False), (False, True)][i % 4]
    chunk = (16, 64)[i % 2]
    H = 2 if group < 4 else 1
    args, do, dht, h0 = _case(2, 150, H, H * group, 8, 12, torch.float64, gate, beta_kind, use_h0, use_dht, seed=i)
    with torch.inference_mode():  # no autograd graph anywhere in chunked_backward
        got = chunked_backward(*args, do, dht, initial_state=h0, chunk=chunk)
    label = (gate, beta_kind, group, use_h0, use_dht, chunk)
    _check(got, _autograd(args, do, dht, h0), 1e-10, label)
    cpu = qla.chunk_gated_delta_rule_bwd(*args, do, dht, initial_state=h0)
    _check(got, cpu, 1e-10, label)


@pytest.mark.parametrize("T,chunk", [(1, 16), (5, 64), (64, 64), (128, 64), (150, 64), (150, 16), (47, 16)])
@pytest.mark.parametrize("use_h0,use_dht", [(True, True), (False, False)])
def test_fp64_lengths_and_chunks(T, chunk, use_h0, use_dht):
    args, do, dht, h0 = _case(1, T, 2, 4, 16, 8, torch.float64, "strong", "random", use_h0, use_dht, seed=T)
    got = chunked_backward(*args, do, dht, initial_state=h0, chunk=chunk)
    _check(got, _autograd(args, do, dht, h0), 1e-10, (T, chunk))


def test_fp64_strong_decay_and_beta_extremes_with_custom_scale():
    """g = -5 + 0.5 randn gives e^Gamma ~ e^-320 over a chunk of 64: gates must stay differences."""
    args, do, dht, h0 = _case(2, 150, 1, 2, 16, 16, torch.float64, "very_strong", 1, True, True, seed=3)
    args[4] = args[4] * 2.0  # beta = 2 (allow_neg_eigval range)
    got = chunked_backward(*args, do, dht, scale=0.3, initial_state=h0, chunk=64)
    assert all(torch.isfinite(x).all() for x in got)
    _check(got, _autograd_scaled(args, do, dht, h0, 0.3), 1e-10, "beta2")
    _check(got, qla.chunk_gated_delta_rule_bwd(*args, do, dht, scale=0.3, initial_state=h0), 1e-10, "beta2 cpu")


def _autograd_scaled(args, do, dht, h0, scale):
    leaves = [a.detach().double().requires_grad_() for a in args]
    h0_leaf = h0.detach().double().requires_grad_()
    o, ht = recurrent(*leaves, scale=scale, initial_state=h0_leaf)
    torch.autograd.backward([o, ht], [do.double(), dht.double()])
    return [a.grad for a in leaves] + [h0_leaf.grad]


def test_dl_identity():
    """docs/backward.md: -Tm^T dTm Tm^T = -(dVb Uv^T + dKb W^T) (the cheaper form for the kernel)."""
    gen = torch.Generator().manual_seed(0)
    C, d = 16, 8
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    Tm = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + r(C, C).tril(-1) * 0.3)
    Vb, Kb, dUv, dW = r(C, d), r(C, d), r(C, d), r(C, d)
    dTm = dUv @ Vb.T + dW @ Kb.T
    lhs = -Tm.T @ dTm @ Tm.T
    rhs = -((Tm.T @ dUv) @ (Tm @ Vb).T + (Tm.T @ dW) @ (Tm @ Kb).T)
    assert rel_err(lhs, rhs) < 1e-12


def test_fp32_d128_matches_cpu_backend():
    args, do, dht, h0 = _case(1, 256, 2, 4, 128, 128, torch.float32, "mild", "random", True, True, seed=11)
    got = chunked_backward(*args, do, dht, initial_state=h0, chunk=64)
    assert got[0].dtype == torch.float32 and got[5].dtype == torch.float32
    cpu = qla.chunk_gated_delta_rule_bwd(*args, do, dht, initial_state=h0)
    _check(got, cpu, 1e-4, "d128 fp32")
