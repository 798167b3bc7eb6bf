"""qla.reference (the pure-torch baselines) agrees with the test suite's own reference."""
import pytest
import torch

from conftest import make_inputs, reference, rel_err
from qla.reference import chunked, recurrent, split_forward


@pytest.mark.parametrize("gate", ["mild", "very_strong", "zero"])
def test_chunked_and_recurrent_match_reference(gate):
    x = make_inputs(2, 150, 2, 4, 16, 8, torch.float64, gate=gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rs = reference(*args, initial_state=x["initial_state"])
    for impl in (chunked, recurrent):
        o, s = impl(*args, initial_state=x["initial_state"])
        assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12, impl.__name__


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
