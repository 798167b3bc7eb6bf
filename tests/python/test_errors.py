"""Bad input gets a ValueError/TypeError naming the argument, what was expected and what came."""
import pytest
import torch

import qla
from conftest import make_inputs


def _args(**over):
    x = make_inputs(1, 10, 2, 4, 8, 8, torch.float32)
    kw = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"])
    kw.update(over)
    return kw


def _call(**over):
    kw = _args(**over)
    return qla.chunk_gated_delta_rule(**kw)


BAD_TENSOR_CASES = [
    (dict(q=torch.randn(10, 2, 8)), ValueError, r"q: expected a 4-D tensor, got 3-D"),
    (dict(g=torch.randn(1, 10, 4, 1)), ValueError, r"g: expected a 3-D tensor"),
    (dict(k=torch.randn(1, 11, 2, 8)), ValueError, r"k: expected shape \[1, 10, 2, 8\]"),
    (dict(v=torch.randn(2, 10, 4, 8)), ValueError, r"v: expected batch and length \[1, 10"),
    (dict(v=torch.randn(1, 10, 3, 8)), ValueError, r"multiple of the q/k heads"),
    (dict(q=torch.randn(1, 10, 0, 8), k=torch.randn(1, 10, 0, 8)), ValueError, r"at least one q/k head"),
    (dict(q=torch.randn(1, 10, 2, 0), k=torch.randn(1, 10, 2, 0)), ValueError, r"head dims K and V of at least 1, got K=0"),
    (dict(v=torch.randn(1, 10, 4, 0)), ValueError, r"head dims K and V of at least 1, got K=8, V=0"),
    (dict(beta=torch.rand(1, 10, 2)), ValueError, r"beta: expected shape \[1, 10, 4\]"),
    (dict(q=torch.randn(1, 10, 2, 8).int()), TypeError, r"q: expected dtype in"),
    (dict(k=torch.randn(1, 10, 2, 8).double()), TypeError, r"k: expected dtype torch.float32"),
    (dict(q=torch.randn(1, 10, 2, 16)[..., ::2]), ValueError, r"q: expected a contiguous last dimension"),
    (dict(initial_state=torch.randn(1, 4, 8, 7)), ValueError, r"initial_state: expected shape \[1, 4, 8, 8\]"),
    (dict(initial_state=torch.randn(1, 4, 8, 8).half()), TypeError, r"initial_state: expected dtype float32"),
    (dict(initial_state=[1.0]), TypeError, r"initial_state: expected a torch.Tensor"),
    (dict(q="nope"), TypeError, r"q: expected a torch.Tensor, got str"),
    (dict(v=torch.randn(1, 10, 4, 8, device="meta")), ValueError, r"v: expected a tensor on cpu"),
    (dict(beta=torch.rand(1, 10, 4).half()), None, None),  # valid (16-bit gates): the quick check must agree
]


@pytest.mark.parametrize("over,exc,msg", [c for c in BAD_TENSOR_CASES if c[1] is not None])
def test_bad_tensor_arguments(over, exc, msg):
    with pytest.raises(exc, match=msg):
        _call(**over)


def _check_args(kw, cu=None, state_v_first=False):
    return (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["initial_state"], cu, state_v_first)


@pytest.mark.parametrize("over,exc,msg", BAD_TENSOR_CASES)
def test_quick_check_accepts_only_what_the_full_checks_accept(over, exc, msg):
    # The eager path's quick check (host time) must never let a bad call through: on every
    # bad input it defers (None) to the full checks, on a valid one it returns their N.
    args = _check_args(_args(**over))
    quick = qla.api._quick_check(*args, None)
    if exc is None:
        assert quick is not None and quick == qla.api._check_inputs_full(*args)
    else:
        assert quick is None


@pytest.mark.parametrize("variant", ["plain", "gva_strided", "state_v_first", "no_state", "fp64", "cpu_cu"])
def test_quick_check_agrees_on_valid_inputs(variant):
    x = make_inputs(1, 10, 2, 4, 8, 8, torch.float32)
    kw = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"])
    cu, svf = None, False
    if variant == "gva_strided":  # q, k views with a head stride of 16 (a packed qkv projection)
        qk = torch.randn(1, 10, 2, 2, 8)
        kw["q"], kw["k"] = qk[:, :, :, 0], qk[:, :, :, 1]
    elif variant == "state_v_first":
        svf = True
    elif variant == "no_state":
        kw["initial_state"] = None
    elif variant == "fp64":
        kw = {n: (t.double() if t is not None else None) for n, t in kw.items()}
    elif variant == "cpu_cu":  # host cu_seqlens values need the full checks: quick defers
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        kw["initial_state"] = torch.randn(2, 4, 8, 8)
    args = _check_args(kw, cu, svf)
    quick = qla.api._quick_check(*args, None)
    full = qla.api._check_inputs_full(*args)
    assert quick == (None if variant == "cpu_cu" else full)


@pytest.mark.parametrize("cu,msg", [
    (torch.tensor([[0, 10]], dtype=torch.int32), r"cu_seqlens: expected a 1-D int32 or int64 tensor"),
    (torch.tensor([0.0, 10.0]), r"cu_seqlens: expected a 1-D int32 or int64 tensor"),
    (torch.tensor([1, 10], dtype=torch.int32), r"first entry to be 0, got 1"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), r"non-decreasing values, got 6 then 4"),
    (torch.tensor([0, 4, 9], dtype=torch.int64), r"last entry to equal T=10"),
    (torch.tensor([0], dtype=torch.int32), r"cu_seqlens: expected at least two entries \(0, ..., T=10\) for 10 tokens, got one"),
])
def test_bad_cu_seqlens(cu, msg):
    n = cu.numel() - 1 if cu.dim() == 1 else 1
    x = make_inputs(1, 10, 2, 4, 8, 8, torch.float32, n_states=max(n, 1))
    with pytest.raises(ValueError, match=msg):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)


def test_cu_seqlens_cpu_must_match_cu_seqlens_in_length():
    # The core reads N + 1 host values: a shorter host copy must be refused, not read past.
    x = make_inputs(1, 10, 2, 4, 8, 8, torch.float32, n_states=2)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu: expected 3 entries \(those of cu_seqlens\), got 2"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
                                   cu_seqlens_cpu=torch.tensor([0, 10]))


def test_cu_seqlens_requires_batch_one():
    x = make_inputs(2, 10, 2, 4, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected batch size 1 .* got q with B=2"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))


def test_tensors_on_different_devices():
    meta = torch.empty(1, 10, 4, 8, device="meta")
    with pytest.raises(ValueError, match=r"v: expected a tensor on cpu \(the device of q\), got one on meta"):
        _call(v=meta)


def test_unknown_keyword_and_gate_arguments():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus'\]"):
        _call(bogus=1)
    with pytest.raises(ValueError, match=r"A_log: expected a \[HV\] tensor when use_gate_in_kernel=True"):
        _call(use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"dt_bias: expected a tensor with HV=4 elements"):
        _call(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(3))
    with pytest.raises(ValueError, match=r"chunk_size: expected 16, 32 or 64"):
        _call(chunk_size=48)
    with pytest.raises(ValueError, match=r"allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True"):
        _call(allow_neg_eigval=True)
    with pytest.raises(TypeError, match=r"cp_context: expected a qla.CPContext \(qla.build_cp_context\), got object"):
        _call(cp_context=object())
    with pytest.raises(ValueError, match=r"transpose_state_layout: pass state_v_first only"):
        _call(transpose_state_layout=True, state_v_first=True)


def test_preprocessing_arguments_are_checked_before_use():
    x = _args()
    with pytest.raises(TypeError, match=r"g: expected a torch.Tensor, got list"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], [0.0], x["beta"], use_gate_in_kernel=True,
                                   A_log=torch.zeros(4))
    with pytest.raises(TypeError, match=r"q: expected a torch.Tensor, got NoneType"):
        qla.chunk_gated_delta_rule(None, x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    with pytest.raises(ValueError, match=r"A_log: expected a tensor on cpu \(the device of g\), got one on meta"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True,
                                   A_log=torch.zeros(4, device="meta"))
    # FLA's flags take truthy values, as there
    o1, _ = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=1)
    o2, _ = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    assert torch.equal(o1, o2)


def test_lazily_negated_views_are_refused_and_size_one_dims_take_any_stride():
    x = _args()
    # a real view with torch's neg bit (as conj().imag gives), the other sign in memory
    neg_v = torch._neg_view(x["v"])
    assert neg_v.is_neg()
    with pytest.raises(ValueError, match=r"v: expected a tensor without a lazy negation"):
        _call(v=neg_v)
    o_resolved, _ = _call(v=neg_v.resolve_neg())
    o_minus, _ = _call(v=-x["v"])
    assert torch.equal(o_resolved, o_minus)
    # K = 1 with a last stride of 2 (a transposed size-1 dimension, which torch calls contiguous)
    q1 = torch.randn(1, 10, 1, 2).transpose(2, 3)  # [1, 10, 2, 1]
    k1 = torch.randn(1, 10, 1, 2).transpose(2, 3)
    assert q1.stride(-1) == 2 and q1.is_contiguous()
    o, _ = qla.chunk_gated_delta_rule(q1, k1, x["v"], x["g"], x["beta"])
    o_ref, _ = qla.chunk_gated_delta_rule(q1.clone(memory_format=torch.contiguous_format).reshape(1, 10, 2, 1).clone(),
                                          k1.reshape(1, 10, 2, 1).clone(), x["v"], x["g"], x["beta"])
    assert torch.equal(o, o_ref)


def test_scale_argument():
    with pytest.raises(TypeError, match=r"scale: expected a real number or None, got str"):
        _call(scale="0.1")
    with pytest.raises(TypeError, match=r"scale: expected a real number or None, got a torch.Tensor"):
        _call(scale=torch.tensor(0.1))
    with pytest.raises(TypeError, match=r"scale: expected a real number or None, got bool"):
        _call(scale=True)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"scale: expected a finite number, got"):
            _call(scale=bad)
    with pytest.raises(ValueError, match=r"scale: expected a finite number, got one too large for a float"):
        _call(scale=10 ** 400)
    with pytest.raises(ValueError, match=r"scale: expected \|scale\| <= 3.4e38 \(fp32, the precision of the computation "
                                         r"for float32 inputs\), got 1e\+39"):
        _call(scale=1e39)
    o_int, _ = _call(scale=1)  # an int is a real number
    o_float, _ = _call(scale=1.0)
    assert torch.equal(o_int, o_float)


def test_split_arguments():
    with pytest.raises(TypeError, match=r"split: expected None \(automatic\), True or False, got str"):
        _call(split="yes")
    with pytest.raises(TypeError, match=r"split_chunks: expected an int .* got float"):
        _call(split_chunks=2.0)
    with pytest.raises(ValueError, match=r"split_chunks: expected at least 1 .* got 0"):
        _call(split=True, split_chunks=0)
    with pytest.raises(ValueError, match=r"split_chunks: expected None with split=False"):
        _call(split=False, split_chunks=4)
    with pytest.raises(TypeError, match=r"batch_invariant: expected True or False, got int"):
        _call(batch_invariant=1)
    o, _ = _call(split=True, split_chunks=1, batch_invariant=True)  # CPU calls accept and ignore the options
    assert torch.allclose(o, _call(split=False)[0])


def test_backward_argument_errors():
    x = make_inputs(1, 10, 2, 4, 8, 8, torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=r"do: expected shape \[1, 10, 4, 8\]"):
        qla.chunk_gated_delta_rule_bwd(*args, torch.randn(1, 10, 4, 7))
    with pytest.raises(ValueError, match=r"dht: expected shape \[1, 4, 8, 8\]"):
        qla.chunk_gated_delta_rule_bwd(*args, torch.randn(1, 10, 4, 8), torch.randn(1, 4, 8, 9))
    do = torch.randn(1, 10, 4, 8)
    with pytest.raises(TypeError, match=r"split: expected None \(automatic\), True or False, got str"):
        qla.chunk_gated_delta_rule_bwd(*args, do, split="yes")
    with pytest.raises(ValueError, match=r"split_chunks: expected at least 1 .* got 0"):
        qla.chunk_gated_delta_rule_bwd(*args, do, split=True, split_chunks=0)
    with pytest.raises(TypeError, match=r"batch_invariant: expected True or False, got int"):
        qla.chunk_gated_delta_rule_bwd(*args, do, batch_invariant=1)
    # CPU calls accept and ignore the options: the same gradients.
    plain = qla.chunk_gated_delta_rule_bwd(*args, do)
    opts = qla.chunk_gated_delta_rule_bwd(*args, do, split=True, split_chunks=1, batch_invariant=True)
    for a, b in zip(plain, opts):
        assert torch.equal(a, b)


def test_head_dim_over_256_is_refused_by_the_core():
    x = make_inputs(1, 2, 1, 1, 300, 8, torch.float32)
    with pytest.raises(ValueError, match=r"head dims up to 256"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])


def test_errors_do_not_modify_inputs():
    kw = _args()
    before = {n: t.clone() for n, t in kw.items()}
    with pytest.raises(ValueError):
        qla.chunk_gated_delta_rule(**kw, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    for n, t in kw.items():
        assert torch.equal(t, before[n])


def test_random_malformed_inputs_only_raise_value_or_type_errors():
    """Shapes, ranks, dtypes and cu_seqlens perturbed at random: every call either succeeds or
    raises ValueError/TypeError (never another exception, a crash or a hang)."""
    import random

    rnd = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32]

    def tensor(*shape):
        shape = [max(0, s + rnd.choice([0, 0, 0, 0, 1, -1])) for s in shape]
        if rnd.random() < 0.05:
            shape = shape[:-1]
        return torch.randn(*shape).to(rnd.choice(dtypes) if rnd.random() < 0.1 else torch.float32)

    for _ in range(400):
        B, T, H, HV = rnd.choice([0, 1, 2]), rnd.choice([0, 1, 5]), rnd.choice([0, 1, 2]), rnd.choice([0, 1, 2, 4])
        K, V = rnd.choice([0, 1, 4]), rnd.choice([0, 1, 4])
        q, k, v = tensor(B, T, H, K), tensor(B, T, H, K), tensor(B, T, HV, V)
        g, beta = -tensor(B, T, HV).abs(), tensor(B, T, HV)
        h0 = tensor(B, HV, K, V) if rnd.random() < 0.5 else None
        cu = None
        if rnd.random() < 0.3:
            vals = sorted(rnd.sample(range(T + 2), k=min(T + 2, rnd.choice([1, 2, 3]))))
            cu = torch.tensor(vals, dtype=rnd.choice([torch.int32, torch.int64, torch.float32]))
        try:
            o, _ = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                              output_final_state=rnd.random() < 0.5, state_v_first=rnd.random() < 0.2)
            assert o.shape == (q.shape[0], q.shape[1], v.shape[2], v.shape[3])
            if o.numel() and rnd.random() < 0.3:
                qla.chunk_gated_delta_rule_bwd(q, k, v, g, beta, torch.randn_like(o), initial_state=h0,
                                               cu_seqlens=cu)
        except (ValueError, TypeError):
            pass
