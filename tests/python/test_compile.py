"""torch.compile(fullgraph=True) traces the custom ops with no graph break."""
import torch

import qla
from conftest import make_inputs, reference, rel_err


def test_torch_compile_fullgraph_forward_and_backward():
    x = make_inputs(1, 40, 2, 4, 8, 8, torch.float32)

    def layer(q, k, v, a, b, h0):
        o, ht = qla.chunk_gated_delta_rule(q, k, v, a, torch.sigmoid(b), initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        return o.sum() + ht.square().mean()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    loss = compiled(*leaves)
    loss.backward()
    eager = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    loss_e = layer(*eager)
    loss_e.backward()
    assert rel_err(loss.detach(), loss_e.detach()) < 1e-6
    for a, b in zip(leaves, eager):
        assert rel_err(a.grad, b.grad) < 1e-5


def test_torch_compile_inductor_no_graph_break():
    x = make_inputs(1, 20, 1, 2, 8, 8, torch.float32)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, g, b: qla.chunk_gated_delta_rule(q, k, v, g, b)[0] * 2, fullgraph=True)
    o = f(x["q"], x["k"], x["v"], x["g"], x["beta"])
    ro, _ = reference(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert rel_err(o, 2 * ro) < 2e-5


def test_opcheck_custom_ops():
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree."""
    from qla import _ops

    x = make_inputs(1, 20, 1, 2, 8, 8, torch.float64)
    args = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].clone().requires_grad_()
    cu = torch.tensor([0, 7, 20], dtype=torch.int64)
    h0_2 = torch.randn(2, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(_ops.gdn_fwd, (*args, 0.5, h0, None, True, False, False, _ops.SPLIT_AUTO, 0, False, None))
    torch.library.opcheck(_ops.gdn_fwd, (*args, 0.5, h0_2, cu, True, True, False, _ops.SPLIT_ON, 1, True, cu))
    torch.library.opcheck(_ops.gdn_fwd, (*args, 0.5, None, None, False, False, True, _ops.SPLIT_OFF, 0, False, None))
    do = torch.randn(1, 20, 2, 8, dtype=torch.float64)
    dht = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    detached = [a.detach() for a in args]
    torch.library.opcheck(_ops.gdn_bwd, (*detached, 0.5, h0.detach(), None, do, dht, False))
    torch.library.opcheck(_ops.gdn_bwd, (*detached, 0.5, None, None, do, None, False))


def test_torch_compile_fullgraph_varlen_with_host_boundaries():
    # Host cu_seqlens (a CPU tensor here, cu_seqlens_cpu on CUDA): the API's value checks would be
    # data-dependent guards under compile, so the core checks those host values then.
    x = make_inputs(1, 40, 1, 2, 8, 8, torch.float32, n_states=3)
    cu = torch.tensor([0, 7, 7, 40], dtype=torch.int32)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, g, b, h0: qla.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0,
                                                                          output_final_state=True, cu_seqlens=cu),
                      fullgraph=True, backend="aot_eager")
    o, ht = f(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    ro, rht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                         output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, ro) and torch.equal(ht, rht)


def test_state_pool_under_torch_compile_and_opcheck():
    """The pool op (qla::gdn_fwd_pool, which declares the pool's mutation): traced with no graph
    break, the pool written as in eager, and opcheck's schema and fake checks."""
    from qla import _ops

    x = make_inputs(1, 30, 1, 2, 8, 8, torch.float32)
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    start = torch.randn(3, 2, 8, 8)
    idx = torch.tensor([2, 0], dtype=torch.int32)

    def step(q, k, v, g, b, pool):
        return qla.chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, state_pool=pool, initial_state_indices=idx,
                                          final_state_indices=idx)[0] * 2

    torch._dynamo.reset()
    pool_c, pool_e = start.clone(), start.clone()
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_c = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, pool_c)
    o_e = step(*args, pool_e)
    assert torch.equal(o_c, o_e) and torch.equal(pool_c, pool_e)
    assert not torch.equal(pool_e, start)
    torch.library.opcheck(_ops.gdn_fwd_pool, (*args, 0.5, start.clone(), idx, idx, cu, False, False, False,
                                              _ops.SPLIT_AUTO, 0, False, None))
    torch.library.opcheck(_ops.gdn_fwd_pool, (*args, 0.5, start.clone(), idx, None, cu, True, False, False,
                                              _ops.SPLIT_AUTO, 0, False, None))
