"""QLA: Gated DeltaNet chunked-prefill kernels (exact CPU backend, Hopper CUDA backend).

    import qla
    o, final_state = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True)
"""
import os

import torch  # noqa: F401  (load torch's CUDA libraries before our extension: the reverse order crashed torch's import on the GPU machine)

from . import _C
from .api import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, l2norm
from .cp import CPContext, build_cp_context

__version__ = _C.version()
__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "l2norm",
           "has_cuda_backend", "prepare_cuda_device", "build_cp_context", "CPContext"]


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


def _prepare_with_torch() -> None:
    """The first call's one-time work, done ahead where that is safe. It has two parts (H200,
    bench/results/h200.md): this library's own CUDA runtime starting (about 1.8 ms: the
    runtime is linked statically, and its first call registers the kernels with the driver),
    and each kernel's loading into a context (about 0.2 ms each).
    - torch already holds a CUDA context on its current device (qla imported after a model was
      loaded, say): both parts now.
    - otherwise: the runtime part when torch initialises CUDA (a device-count query, which
      creates no context). Kernels are never loaded where that would create a context: it
      would take device memory on a GPU the process may not use (each rank's GPU 0).
    QLA_PREPARE_AT_IMPORT=0 turns all of it off; qla.prepare_cuda_device() does both parts."""
    if os.environ.get("QLA_PREPARE_AT_IMPORT", "1") == "0" or not has_cuda_backend():
        return

    def quiet(fn):
        try:
            fn()
        except Exception:  # no GPU, or not a Hopper one: the calls themselves say so
            pass

    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if torch.cuda.is_initialized():
        if has_context is not None and has_context(torch.cuda.current_device()):
            quiet(_C.prepare_cuda_device)
        else:
            quiet(_C.init_cuda_runtime)
        return
    lazy_call = getattr(torch.cuda, "_lazy_call", None)  # runs when torch initialises CUDA
    if lazy_call is not None:
        lazy_call(lambda: quiet(_C.init_cuda_runtime))


_prepare_with_torch()
