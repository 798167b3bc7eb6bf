"""The units plan of the fused backward's reverse chain (bench/reverse_chain_model.py; docs/backward.md
section 10) on the CPU: its fp16 operands stay in range and the chain meets the gradient bound with
room, on the benchmark gates and on inputs far from them. No GPU needed."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import reverse_chain_model as rcm  # noqa: E402


def test_the_fp64_chain_is_the_cpu_backend_s_dh0():
    torch = pytest.importorskip("torch")
    qla = pytest.importorskip("qla")
    name, q, k, g, beta, do, dht, scale = rcm.cases(200)[0]
    dh0, _ = rcm.reverse_exact(q, k, g, beta, do, dht, scale)
    f = lambda x: x.double()[None]
    v = torch.randn(q.shape[0], q.shape[1], 128, dtype=torch.float64)[None]
    got = qla.chunk_gated_delta_rule_bwd(f(q), f(k), v, f(g), f(beta), f(do), dht=f(dht), scale=scale,
                                         initial_state=torch.zeros_like(f(dht)))[5][0]
    assert rcm.rel(got, dh0) < 1e-12


@pytest.mark.parametrize("case", range(10))
def test_planned_units_keep_fp16_in_range_and_the_chain_accurate(case):
    name, q, k, g, beta, do, dht, scale = rcm.cases(512)[case]
    ref_dh0, ref_du = rcm.reverse_exact(q, k, g, beta, do, dht, scale)
    dh0, du, worst = rcm.reverse_kernel(q, k, g, beta, do, dht, scale)
    assert worst < 2 ** 12, name  # fp16 holds 65504: a 16x margin at least
    assert rcm.rel(dh0, ref_dh0) < 1e-3, name  # the bound is 4e-3
    assert rcm.rel(du, ref_du) < 1e-3, name
