"""qla.reference (the pure-torch baselines) agrees with the test suite's own reference."""
import pytest
import torch

from conftest import make_inputs, reference, rel_err
from qla.reference import chunked, chunked_backward, recurrent, split_backward, split_forward


@pytest.mark.parametrize("gate", ["mild", "very_strong", "zero"])
def test_chunked_and_recurrent_match_reference(gate):
    x = make_inputs(2, 150, 2, 4, 16, 8, torch.float64, gate=gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rs = reference(*args, initial_state=x["initial_state"])
    # chunked(transfer=True): the chunk step in transfer form (docs/fused.md section 7), the same algebra.
    transfer = lambda *a, **kw: chunked(*a, transfer=True, **kw)
    for name, impl in (("chunked", chunked), ("recurrent", recurrent), ("chunked transfer form", transfer)):
        o, s = impl(*args, initial_state=x["initial_state"])
        assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12, name


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
@pytest.mark.parametrize("gate", ["mild", "zero"])
def test_split_forward_is_exact(pieces, gate):
    # Sequence splitting (docs/gdn.md section 5): pieces run from the scanned entering states
    # give the unsplit result, also with GVA, T not a multiple of the chunk and no initial state.
    x = make_inputs(2, 333, 2, 4, 16, 8, torch.float64, gate=gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for h0 in (x["initial_state"], None):
        ro, rs = reference(*args, initial_state=h0)
        o, s = split_forward(*args, initial_state=h0, pieces=pieces)
        assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12


def test_split_forward_warmup_needs_decay():
    # The warm-up shortcut (no A_p: rerun the last w chunks of the previous piece from zero) is
    # accurate where the gate decays (benchmark gates: about e^-3.2 per chunk, so each chunk of
    # warm-up buys ~1e-2); with g = 0 only the delta rule's own forgetting helps.
    x = make_inputs(1, 1024, 1, 1, 16, 16, torch.float64, gate="mild")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, _ = reference(*args, initial_state=x["initial_state"])
    errs = [rel_err(split_forward(*args, initial_state=x["initial_state"], pieces=4, warmup_chunks=w)[0], ro)
            for w in (1, 2, 3)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-6
    args[3] = torch.zeros_like(args[3])
    ro, _ = reference(*args, initial_state=x["initial_state"])
    o, _ = split_forward(*args, initial_state=x["initial_state"], pieces=4, warmup_chunks=1)
    assert rel_err(o, ro) > 1e-2


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
@pytest.mark.parametrize("gate", ["mild", "zero"])
def test_split_backward_is_exact(pieces, gate):
    # The backward cut into pieces (issue 14): each piece from the scanned entering state and the
    # state gradient leaving it, which crosses the boundaries through the transposed transfer
    # maps; equal to the unsplit backward, with and without h0 and dht, GVA, ragged T.
    x = make_inputs(2, 333, 2, 4, 16, 8, torch.float64, gate=gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(2, 333, 4, 8, dtype=torch.float64, generator=gen)
    dht = torch.randn(2, 4, 16, 8, dtype=torch.float64, generator=gen)
    for h0, dh in ((x["initial_state"], dht), (None, None)):
        want = chunked_backward(*args, do, dh, initial_state=h0)
        got = split_backward(*args, do, dh, initial_state=h0, pieces=pieces)
        for name, w, gt in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), want, got):
            assert rel_err(gt, w) < 1e-11, (name, rel_err(gt, w))


def test_split_backward_warmup_mirror_needs_decay():
    # The mirror of the forward's warm-up: the gradient leaving a piece from the first w chunks
    # of the next one run backward from zero; accurate where the gate decays, not with g = 0.
    x = make_inputs(1, 1024, 1, 1, 16, 16, torch.float64, gate="mild")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(1, 1024, 1, 16, dtype=torch.float64, generator=gen)
    want = chunked_backward(*args, do, None, initial_state=x["initial_state"])
    errs = [max(rel_err(gt, w) for gt, w in zip(split_backward(*args, do, None, initial_state=x["initial_state"],
                                                              pieces=4, warmup_chunks=wc), want))
            for wc in (1, 2, 3)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-5, errs
    args[3] = torch.zeros_like(args[3])
    want = chunked_backward(*args, do, None, initial_state=x["initial_state"])
    got = split_backward(*args, do, None, initial_state=x["initial_state"], pieces=4, warmup_chunks=1)
    assert max(rel_err(gt, w) for gt, w in zip(got, want)) > 1e-2
