"""QLA: Gated DeltaNet chunked-prefill kernels (exact CPU backend, Hopper CUDA backend).

    import qla
    o, final_state = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True)
"""
import os

import torch  # noqa: F401  (load torch's CUDA libraries before our extension: the reverse order crashed torch's import on the GPU machine)

from . import _C
from .api import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, l2norm

__version__ = _C.version()
__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "l2norm",
           "has_cuda_backend", "prepare_cuda_device"]


def has_cuda_backend() -> bool:
    """Whether this build carries the sm90 (Hopper) kernels, compiled ahead of time for
    sm_90a. False when nvcc was not found at build time: CUDA tensors then raise an error."""
    return bool(_C.cuda_compiled())


def prepare_cuda_device() -> None:
    """Optional: does on the current CUDA device the one-time work of a first call (loads the
    sm90 kernels, sets their shared-memory limits), so that the first call there costs what
    the next one does. For an engine's start-up; the calls do what is still missing
    themselves. Raises ValueError without a CUDA backend or on a device that is not 9.x."""
    _C.prepare_cuda_device()


def _prepare_if_cuda_is_up() -> None:
    """At import, when torch already holds a CUDA context on its current device (qla imported
    after a model was loaded, say), do the first call's one-time work now: about 2.5 ms on an
    H200, which the first call would otherwise spend. Never creates a context (that would take
    device memory on a GPU the process may not use); QLA_PREPARE_AT_IMPORT=0 turns it off."""
    if os.environ.get("QLA_PREPARE_AT_IMPORT", "1") == "0" or not has_cuda_backend():
        return
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    try:
        if torch.cuda.is_initialized() and has_context is not None and has_context(torch.cuda.current_device()):
            _C.prepare_cuda_device()
    except Exception:  # not a Hopper GPU: the calls themselves say so
        pass


_prepare_if_cuda_is_up()
