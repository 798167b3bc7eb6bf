"""qla.reference (the pure-torch baselines) agrees with the test suite's own reference."""
import pytest
import torch

from conftest import make_inputs, reference, rel_err
from qla.reference import chunked, recurrent


@pytest.mark.parametrize("gate", ["mild", "very_strong", "zero"])
def test_chunked_and_recurrent_match_reference(gate):
    x = make_inputs(2, 150, 2, 4, 16, 8, torch.float64, gate=gate)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rs = reference(*args, initial_state=x["initial_state"])
    for impl in (chunked, recurrent):
        o, s = impl(*args, initial_state=x["initial_state"])
        assert rel_err(o, ro) < 1e-12 and rel_err(s, rs) < 1e-12, impl.__name__
