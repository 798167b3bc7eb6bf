"""QLA: Gated DeltaNet chunked-prefill kernels (exact CPU backend, Hopper CUDA backend).

    import qla
    o, final_state = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True)
"""
import torch  # noqa: F401  (load torch's CUDA libraries before our extension: the reverse order crashed torch's import on the GPU machine)

from . import _C
from .api import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd, l2norm

__version__ = _C.version()
__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "l2norm"]
