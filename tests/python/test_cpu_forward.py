"""CPU backend forward through the public API against the fp64 reference."""
import pytest
import torch

import qla
from conftest import make_inputs, reference, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}

CASES = [
    # name, B, T, H, HV, K, V, cu_seqlens, gate, beta, with_h0
    ("T1", 2, 1, 1, 1, 16, 8, None, "mild", "random", True),
    ("T_not_multiple_of_64", 2, 150, 2, 2, 16, 16, None, "mild", "random", True),
    ("gva2", 1, 80, 2, 4, 8, 12, None, "mild", "random", True),
    ("gva4", 1, 70, 1, 4, 12, 8, None, "mild", "random", True),
    ("varlen_zero_lengths", 1, 140, 2, 4, 8, 8, [0, 0, 1, 64, 64, 140, 140], "mild", "random", True),
    ("no_initial_state", 2, 65, 1, 2, 8, 8, None, "mild", "random", False),
    ("strong_decay", 1, 100, 1, 2, 16, 8, None, "very_strong", "random", True),
    ("g_zero", 1, 100, 1, 2, 16, 8, None, "zero", "random", True),
    ("beta_zero", 1, 40, 1, 1, 8, 8, None, "mild", 0.0, True),
    ("beta_one", 1, 40, 1, 1, 8, 8, None, "mild", 1.0, True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_reference(case, dtype):
    name, B, T, H, HV, K, V, cu, gate, beta_kind, with_h0 = case
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    n = B if cu is None else len(cu) - 1
    x = make_inputs(B, T, H, HV, K, V, dtype, gate, beta_kind, n_states=n, seed=hash(name) % 1000)
    h0 = x["initial_state"] if with_h0 else None
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu_t)
    ro, rht = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, cu_seqlens=cu_t)
    assert o.dtype == dtype and o.shape == (B, T, HV, V)
    assert ht.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(o, ro) < TOL[dtype]
    assert rel_err(ht, rht) < max(TOL[dtype], 2e-5)  # the state stays fp32 for 16-bit inputs


def test_scale_and_no_final_state():
    x = make_inputs(1, 30, 1, 1, 8, 8, torch.float64)
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.7)
    assert ht is None
    ro, _ = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.7)
    assert rel_err(o, ro) < 1e-12


def test_varlen_equals_separate_calls():
    cu = [0, 17, 17, 90, 128]
    x = make_inputs(1, 128, 2, 4, 16, 16, torch.float32, n_states=4)
    cu_t = torch.tensor(cu, dtype=torch.int64)
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True, cu_seqlens=cu_t)
    for n in range(4):
        s = slice(cu[n], cu[n + 1])
        on, hn = qla.chunk_gated_delta_rule(x["q"][:, s], x["k"][:, s], x["v"][:, s], x["g"][:, s],
                                            x["beta"][:, s], initial_state=x["initial_state"][n:n + 1],
                                            output_final_state=True)
        torch.testing.assert_close(o[:, s], on, rtol=0, atol=0)
        torch.testing.assert_close(ht[n:n + 1], hn, rtol=0, atol=0)


def test_chained_calls_equal_one_call():
    x = make_inputs(2, 100, 1, 2, 16, 8, torch.float64)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True)
    o1, h1 = qla.chunk_gated_delta_rule(*[a[:, :37] for a in args], initial_state=x["initial_state"],
                                        output_final_state=True)
    o2, h2 = qla.chunk_gated_delta_rule(*[a[:, 37:] for a in args], initial_state=h1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-13
    assert rel_err(h2, ht) < 1e-13


def test_gva_equals_explicit_repeat():
    x = make_inputs(1, 60, 2, 8, 8, 8, torch.float32)
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True)
    qr, kr = x["q"].repeat_interleave(4, 2), x["k"].repeat_interleave(4, 2)
    o2, ht2 = qla.chunk_gated_delta_rule(qr, kr, x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                         output_final_state=True)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht2, rtol=0, atol=0)


def test_state_v_first_equals_transpose():
    x = make_inputs(2, 50, 1, 2, 16, 8, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True)
    o2, ht2 = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
                                         output_final_state=True, state_v_first=True)
    assert ht2.shape == (2, 2, 8, 16)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht.transpose(-1, -2), ht2, rtol=0, atol=0)


def test_strided_inputs_from_a_fused_projection():
    """q, k, v as slices of one packed projection (non-contiguous heads, contiguous last dim)."""
    B, T, H, K = 1, 40, 2, 8
    qkv = torch.randn(B, T, 3, H, K)
    q, k, v = qkv[:, :, 0], torch.nn.functional.normalize(qkv[:, :, 1], dim=-1), qkv[:, :, 2]
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, 2 * H))[..., ::2]
    beta = torch.rand(B, T, H)
    assert not q.is_contiguous() and g.stride(-1) == 2
    g = g.contiguous()
    o, _ = qla.chunk_gated_delta_rule(q, k, v, g, beta)
    ro, _ = reference(q, k, v, g, beta)
    assert rel_err(o, ro) < 2e-5


def test_inputs_are_not_modified():
    x = make_inputs(1, 40, 2, 4, 8, 8, torch.bfloat16)
    before = {n: t.clone() for n, t in x.items()}
    qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True)
    for n, t in x.items():
        assert torch.equal(t, before[n]), n


def test_empty_sequence_length_returns_empty_outputs():
    x = make_inputs(1, 0, 2, 4, 8, 8, torch.float32)
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True)
    assert o.shape == (1, 0, 4, 8)
    torch.testing.assert_close(ht, x["initial_state"])
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)
    assert ht.shape == (1, 4, 8, 8) and not ht.any()


def test_empty_call_is_differentiable_and_keeps_the_state_dtype():
    # No tokens: o and the final state stay in autograd's graph (zero gradients for every token
    # input, dh0 = dht), and the final state takes the dtype a call with tokens gives.
    x = make_inputs(1, 0, 2, 4, 8, 8, torch.float64)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"].float().requires_grad_()
    o, ht = qla.chunk_gated_delta_rule(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=h0,
                                       output_final_state=True)
    assert o.shape == (1, 0, 4, 8) and ht.dtype == torch.float64
    (o.sum() + (ht * 3).sum()).backward()
    for n, t in leaves.items():
        assert t.grad is not None and t.grad.shape == t.shape, n
    assert h0.grad.dtype == torch.float32 and torch.equal(h0.grad, torch.full_like(h0, 3.0))


def test_preprocessing_options_match_manual_preprocessing():
    B, T, H, HV, K, V = 1, 30, 2, 4, 8, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, V)
    a, b = torch.randn(B, T, HV), torch.randn(B, T, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    o, _ = qla.chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      allow_neg_eigval=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    beta = 2 * torch.sigmoid(b)
    qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    ro, _ = reference(qn, kn, v, g, beta)
    assert rel_err(o, ro) < 1e-5


def test_fla_keyword_arguments_are_accepted():
    x = make_inputs(1, 20, 1, 1, 8, 8, torch.float32, n_states=2)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    o, _ = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                      cu_seqlens_cpu=cu, chunk_indices=None, chunk_size=32)
    ro, _ = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
    assert rel_err(o, ro) < 2e-5


def test_transpose_state_layout_is_the_old_name_of_state_v_first():
    x = make_inputs(1, 20, 1, 1, 8, 4, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].transpose(-1, -2).contiguous()
    o, ht = qla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o2, ht2 = qla.chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True,
                                             transpose_state_layout=True)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht2, rtol=0, atol=0)


def test_low_level_forward_matches_high_level():
    x = make_inputs(1, 33, 1, 2, 8, 8, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = qla.chunk_gated_delta_rule_fwd(*args, initial_state=x["initial_state"], output_final_state=True)
    o2, ht2 = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht2, rtol=0, atol=0)
