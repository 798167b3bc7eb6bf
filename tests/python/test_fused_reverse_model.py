"""The fused reverse step's arithmetic (bench/fused_reverse_model.py) against the fp64 chunked
backward, CPU only: the rewritten products are the same algebra, and the planned operand types
keep every gradient within the fused backward's bound."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fused_reverse_model as frm  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def test_the_rewritten_products_are_the_chunked_backward_s_algebra():
    # dv = Tu^T dU, W^T from K and T', dL from dVb V^T and dKb K^T: every gradient at the fp32
    # floor against fp64 (a wrong rewrite is off by O(1)).
    for name, e in zip(NAMES, frm.errors(256, 2, rounded=False)):
        assert e < 1e-5, (name, e)


def test_the_planned_operand_types_stay_within_the_bound():
    # fp16 for the sequential operands, the inverse and the chain's Qg; bf16 for the chunk-local
    # ones. The fused backward's bound is 4e-3; the chain's gradients (dg, dh0) stay near 5e-4,
    # which a bf16 Qg would not (1.6-1.9e-3 at T = 2048).
    errs = dict(zip(NAMES, frm.errors(256, 2, rounded=True)))
    for name, e in errs.items():
        assert e < 2.5e-3, (name, e)
    assert errs["dg"] < 1e-3 and errs["dh0"] < 1e-3, errs


def test_the_states_image_in_bf16_stays_within_the_bound():
    # The states pass's S' as a bf16 image (no units: what a bf16 input tile pairs with in one
    # wgmma), dU' in bf16 where it meets S' (dW), costs little: every gradient under 2.5e-3 at
    # T = 256 (1.90e-3 at most at T = 2048).
    errs = dict(zip(NAMES, frm.errors(256, 2, rounded=True, s_bf16=True)))
    for name, e in errs.items():
        assert e < 2.5e-3, (name, e)


def test_gva_group_sums_stay_within_the_bound():
    # dq and dk with GVA (a CTA per value head): each value head's share summed over its group,
    # in fp32 or after rounding each share to bf16; both under the 4e-3 bound with the outputs'
    # bf16 rounding, the bf16 shares a little worse (2.3e-3 and 2.9e-3 on dq at T = 2048).
    w = frm.gva_errors(256, 2, 2)
    for name, errs in w.items():
        assert max(errs) < 4e-3, (name, errs)
    assert w["fp32 partials"][0] <= w["bf16 per value head"][0] * 1.05, w
