"""CPU backward: gradcheck in fp64, and the low-level backward against autograd of the reference."""
import pytest
import torch

import qla
from conftest import make_inputs, reference, rel_err


def _fp64_leaves(x, T, n_states=None):
    names = ("q", "k", "v", "g", "beta", "initial_state")
    return [x[n].detach().clone().requires_grad_() for n in names]


@pytest.mark.parametrize("state_v_first", [False, True])
def test_gradcheck_all_inputs(state_v_first):
    x = make_inputs(1, 9, 1, 2, 4, 3, torch.float64)
    if state_v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    leaves = _fp64_leaves(x, 9)

    def f(q, k, v, g, beta, h0):
        return qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          state_v_first=state_v_first)

    assert torch.autograd.gradcheck(f, leaves)


def test_gradcheck_varlen_gva_across_checkpoint_blocks():
    cu = torch.tensor([0, 0, 70, 75], dtype=torch.int64)
    x = make_inputs(1, 75, 1, 2, 3, 2, torch.float64, n_states=3)
    leaves = _fp64_leaves(x, 75)

    def f(q, k, v, g, beta, h0):
        return qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, leaves, fast_mode=True)


def test_gradcheck_through_preprocessing():
    B, T, H, HV, K, V = 1, 7, 1, 2, 4, 3
    gen = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()
    q, k, v, a, b = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, HV, V), mk(B, T, HV), mk(B, T, HV)
    A_log, dt_bias = mk(HV), mk(HV)

    def f(q, k, v, a, b, A_log, dt_bias):
        o, _ = qla.chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True,
                                          use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                                          A_log=A_log, dt_bias=dt_bias)
        return o

    assert torch.autograd.gradcheck(f, (q, k, v, a, b, A_log, dt_bias))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_level_backward_matches_reference_autograd(dtype, tol):
    B, T, H, HV, K, V = 1, 150, 2, 4, 16, 16
    x = make_inputs(B, T, H, HV, K, V, dtype)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    do = torch.randn(B, T, HV, V).to(dtype)
    dht = torch.randn(B, HV, K, V) / 8
    dq, dk, dv, dg, dbeta, dh0 = qla.chunk_gated_delta_rule_bwd(*args, do, dht, initial_state=x["initial_state"])
    leaves = [a.detach().double().requires_grad_() for a in args + [x["initial_state"]]]
    ro, rht = reference(*leaves[:5], initial_state=leaves[5])
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    for name, got, leaf in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), (dq, dk, dv, dg, dbeta, dh0), leaves):
        assert got.dtype == leaf.grad.dtype or got.dtype == (args + [x["initial_state"]])[
            ("dq", "dk", "dv", "dg", "dbeta", "dh0").index(name)].dtype
        assert rel_err(got, leaf.grad) < tol, name


def test_backward_without_initial_state_or_final_gradient():
    x = make_inputs(2, 40, 1, 1, 8, 8, torch.float64)
    args = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, _ = qla.chunk_gated_delta_rule(*args)
    o.sum().backward()
    leaves = [a.detach().clone().requires_grad_() for a in args]
    ro, _ = reference(*leaves)
    ro.sum().backward()
    for a, l in zip(args, leaves):
        assert rel_err(a.grad, l.grad) < 1e-12


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float16])
def test_16bit_gates_forward_and_gradient_dtypes(gate_dtype):
    """g and beta may come in 16 bits; their gradients come back in the same dtype."""
    x = make_inputs(1, 70, 1, 2, 8, 8, torch.float32)
    g, beta = x["g"].to(gate_dtype), x["beta"].to(gate_dtype)
    leaves = [x["q"].clone().requires_grad_(), x["k"].clone().requires_grad_(), x["v"].clone().requires_grad_(),
              g.clone().requires_grad_(), beta.clone().requires_grad_()]
    o, _ = qla.chunk_gated_delta_rule(*leaves, initial_state=x["initial_state"])
    ro, _ = reference(*(t.detach() for t in leaves), initial_state=x["initial_state"])
    assert rel_err(o, ro) < 2e-5  # the reference sees the same rounded gates
    do = torch.randn_like(o)
    o.backward(do)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ro, _ = reference(*ref_leaves, initial_state=x["initial_state"])
    ro.backward(do.double())
    for got, ref in zip(leaves, ref_leaves):
        assert got.grad.dtype == got.dtype
        # 16-bit gradients carry their own rounding (~2^-9 relative for bf16)
        assert rel_err(got.grad, ref.grad) < (4e-3 if got.dtype == torch.bfloat16 else 1e-3)
