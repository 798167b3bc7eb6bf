"""torch.library custom ops over the C++ core (qla._C).

Two ops, ``qla::gdn_fwd`` and ``qla::gdn_bwd``, with fake (meta) implementations so
that torch.compile traces them without a graph break, and autograd wiring the
backward op to the forward. Preprocessing (l2norm, gate, beta sigmoid) is not here:
it is plain torch in qla/api.py, so its gradients come from torch.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _C

_DTYPE_CODE = {
    torch.float16: 0,
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
}
_NONE = (0, 2, 0, 0, 0)
_NO_POOLS = (0, 4, 0, 4, 0, 0)  # the binding's Pools: no state-pool indices


def _desc(t: Optional[torch.Tensor], name: Optional[str] = None) -> tuple:
    """(data_ptr, dtype code, three leading strides) as the binding expects: 4-D tensors give
    the strides of their first three dimensions ((b, t, h) or (n, hv, row) for a state),
    3-D [B, T, HV] tensors those of b and t (heads are the contiguous last dimension). An input
    (named) is checked for a pending negation here, inside the ops (never traced), where the
    tensors are real."""
    if t is None:
        return _NONE
    if name is not None and t.is_neg():  # torch's lazy negation (conj().imag, say): memory holds the other sign
        raise ValueError(f"{name}: expected a tensor without a lazy negation, got one with torch's neg bit set "
                         f"(call .resolve_neg() first)")
    st = t.stride()  # one call: each tensor attribute read costs ~0.1-0.5 us of host time
    return (t.data_ptr(), _DTYPE_CODE[t.dtype], st[0], st[1], st[2] if len(st) == 4 else 0)


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """States (final state, dh0) are fp32, fp64 for fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _num_seqs(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def state_shape(q, v, n, state_v_first):
    K, V = q.shape[-1], v.shape[-1]
    return (n, v.shape[2], V, K) if state_v_first else (n, v.shape[2], K, V)


# The workspace size depends on the shapes, whether cu_seqlens is given (the chunk count), the
# dtype, the device and the forward's options, and on the host lengths when those are given
# (then it is asked every call): the core is asked once per key.
_WORKSPACE_BYTES: dict = {}


def _run_cuda(run, query, key, shape, descs, scale, layout, dev, *extra):
    """One CUDA call of the core (forward or backward): its workspace (size cached per key;
    key None: asked every call), then the launch on the current stream of the tensors' device
    (extra: the call's trailing options, which also choose its path and so its workspace).
    The core works on the current CUDA device, so a call on tensors of another device makes
    theirs current for its duration."""
    if dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev.index):
            return _run_cuda(run, query, key, shape, descs, scale, layout, dev, *extra)
    ws_bytes = None if key is None else _WORKSPACE_BYTES.get(key)
    if ws_bytes is None:
        ws_bytes = query(shape, *descs, scale, layout, 1, *extra)
        if key is not None:
            _WORKSPACE_BYTES[key] = ws_bytes
    ws = torch.empty((ws_bytes,), dtype=torch.uint8, device=dev) if ws_bytes else None
    run(shape, *descs, scale, layout, 1, torch._C._cuda_getCurrentRawStream(dev.index),
        0 if ws is None else ws.data_ptr(), ws_bytes, 0, *extra)


SPLIT_AUTO, SPLIT_OFF, SPLIT_ON = 0, 1, 2  # the core's SplitMode


def _pools(state_pool, initial_state_indices, final_state_indices) -> tuple:
    """The binding's Pools tuple: each index tensor's (data_ptr, dtype code), then the pool's
    slot count for each."""
    if state_pool is None:
        return _NO_POOLS
    slots = state_pool.shape[0]
    i, f = initial_state_indices, final_state_indices
    return (0 if i is None else i.data_ptr(), 4 if i is None else _DTYPE_CODE[i.dtype],
            0 if f is None else f.data_ptr(), 4 if f is None else _DTYPE_CODE[f.dtype], slots, slots)


def forward_impl(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first,
                 qk_normalized, split_mode=SPLIT_AUTO, split_chunks=0, batch_invariant=False, cu_seqlens_host=None,
                 state_pool=None, initial_state_indices=None, final_state_indices=None):
    """The forward itself; returns (o, final state or None). Called through the custom op
    (autograd, torch.compile) or directly (eager calls that need no graph: the dispatcher
    costs more than the launch). qk_normalized: q and k rows have unit l2 norm (the caller
    applied l2norm), a hint that saves the CUDA forward a pass over q. split_mode,
    split_chunks: the CUDA forward's sequence splitting (SPLIT_*; pieces of at most
    split_chunks chunks of 64 tokens with SPLIT_ON, 0: automatic). batch_invariant: each
    sequence's result independent of the rest of the call (the core's batch_invariant).
    cu_seqlens_host: cu_seqlens as a contiguous int64 CPU tensor (or None), from which the CUDA
    forward plans its path and pieces by the true longest sequence instead of the bound T; it
    changes the workspace, so the size is then asked every call instead of cached.
    state_pool (with initial_state_indices and/or final_state_indices, [N] int tensors): sequence
    n starts from state_pool[initial_state_indices[n]] (zeros where negative; initial_state is
    then None) and its final state is written into state_pool[final_state_indices[n]] in place
    (nowhere where negative; the returned final state is then None)."""
    B, T, H, K = q.shape
    _, _, HV, V = v.shape
    n = _num_seqs(q, cu_seqlens)
    dev = q.device
    # empty_like parses fewer arguments than torch.empty (host time): o is v's shape and dtype
    # (v has q's dtype), the final state initial_state's when their dtypes agree.
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    ht = None
    if initial_state_indices is not None:
        initial_state = state_pool  # read through the indices
    if final_state_indices is not None:
        ht, output_final_state = state_pool, False  # written in place through the indices
    if output_final_state:
        sdt = state_dtype(q)
        if initial_state is not None and initial_state_indices is None and initial_state.dtype is sdt:
            ht = torch.empty_like(initial_state, memory_format=torch.contiguous_format)
        else:
            ht = torch.empty(state_shape(q, v, n, state_v_first), dtype=sdt, device=dev)
    shape = (B, T, H, HV, K, V)
    descs = (_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(g, "g"), _desc(beta, "beta"),
             _desc(initial_state, "initial_state"), _cu_desc(cu_seqlens), n, _desc(o), _desc(ht))
    layout = 1 if state_v_first else 0
    pools = _pools(state_pool, initial_state_indices, final_state_indices)
    if final_state_indices is not None:
        ht = None  # (in the pool)
    if dev.type != "cuda":
        _C.forward(shape, *descs, scale, layout, 0, 0, 0, 0, 0, qk_normalized, split_mode, split_chunks,
                   batch_invariant, 0, pools)
        return o, ht
    if cu_seqlens_host is None:
        # Beside the shapes and options, what else chooses the path or the workspace: a pool both
        # read and written (a split call copies h0), and for fp16 with unit rows declared, a scale
        # outside the window the two-pass forward takes (path_rule in gdn_fwd_sm90.cu).
        key, host_ptr = ("fwd", shape, n, cu_seqlens is None, q.dtype, dev.index, qk_normalized, split_mode,
                         split_chunks, batch_invariant, pools[0] != 0 and pools[2] != 0 and pools[4] > 0,
                         q.dtype is torch.float16 and qk_normalized and not (1 / 64 <= abs(scale) <= 16384)), 0
    else:
        key, host_ptr = None, cu_seqlens_host.data_ptr()
    _run_cuda(_C.forward, _C.forward_workspace_size, key, shape, descs, scale, layout, dev, qk_normalized, split_mode,
              split_chunks, batch_invariant, host_ptr, pools)
    return o, ht


@torch.library.custom_op("qla::gdn_fwd", mutates_args=())
def gdn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    output_final_state: bool,
    state_v_first: bool,
    qk_normalized: bool,
    split_mode: int,
    split_chunks: int,
    batch_invariant: bool,
    cu_seqlens_host: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    o, ht = forward_impl(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first,
                         qk_normalized, split_mode, split_chunks, batch_invariant, cu_seqlens_host)
    return o, (ht if ht is not None else q.new_empty((0,), dtype=torch.float32))  # an op returns tensors


@torch.library.custom_op("qla::gdn_fwd_pool", mutates_args=("state_pool",))
def gdn_fwd_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    initial_state_indices: Optional[torch.Tensor],
    final_state_indices: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    output_final_state: bool,
    state_v_first: bool,
    qk_normalized: bool,
    split_mode: int,
    split_chunks: int,
    batch_invariant: bool,
    cu_seqlens_host: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with a state pool (forward_impl's state_pool): inference only, no autograd."""
    o, ht = forward_impl(q, k, v, g, beta, scale, None, cu_seqlens, output_final_state, state_v_first, qk_normalized,
                         split_mode, split_chunks, batch_invariant, cu_seqlens_host, state_pool, initial_state_indices,
                         final_state_indices)
    return o, (ht if ht is not None else q.new_empty((0,), dtype=torch.float32))


@gdn_fwd_pool.register_fake
def _gdn_fwd_pool_fake(q, k, v, g, beta, scale, state_pool, initial_state_indices, final_state_indices, cu_seqlens,
                       output_final_state, state_v_first, qk_normalized, split_mode, split_chunks, batch_invariant,
                       cu_seqlens_host):
    o = q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    if output_final_state and final_state_indices is None:
        return o, q.new_empty(state_shape(q, v, _num_seqs(q, cu_seqlens), state_v_first), dtype=state_dtype(q))
    return o, q.new_empty((0,), dtype=torch.float32)


def needs_dispatch(*tensors) -> bool:
    """True when the call must go through the custom op: under torch.compile, or when
    autograd has to record it."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def _cu_desc(cu: Optional[torch.Tensor]) -> tuple:
    if cu is None:
        return _NONE
    return (cu.data_ptr(), _DTYPE_CODE[cu.dtype], 1, 0, 0)


@gdn_fwd.register_fake
def _gdn_fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first,
                  qk_normalized, split_mode, split_chunks, batch_invariant, cu_seqlens_host):
    B, T = q.shape[0], q.shape[1]
    o = q.new_empty((B, T, v.shape[2], v.shape[3]))
    if output_final_state:
        ht = q.new_empty(state_shape(q, v, _num_seqs(q, cu_seqlens), state_v_first), dtype=state_dtype(q))
    else:
        ht = q.new_empty((0,), dtype=torch.float32)
    return o, ht


@torch.library.custom_op("qla::gdn_bwd", mutates_args=())
def gdn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    state_v_first: bool,
    split_mode: int = SPLIT_AUTO,
    split_chunks: int = 0,
    batch_invariant: bool = False,
    cu_seqlens_host: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward (split_mode, split_chunks, batch_invariant: the CUDA backward's splitting
    and batch invariance, as the forward's; SPLIT_ON or batch_invariant also make it take the
    fused backward, which splits; cu_seqlens_host: as the forward's)."""
    return backward_impl(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_v_first, split_mode,
                         split_chunks, batch_invariant, cu_seqlens_host)


def backward_impl(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_v_first, split_mode=SPLIT_AUTO,
                  split_chunks=0, batch_invariant=False, cu_seqlens_host=None):
    """gdn_bwd's body: the eager low-level API calls it directly (no dispatcher round trip, as
    forward_impl for the forward); torch.compile goes through the op. cu_seqlens_host: as
    forward_impl's (the fused backward plans its pieces from the true lengths; without them a
    varlen call plans for sequences of the mean length and refines that on the device)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    n = _num_seqs(q, cu_seqlens)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    dbeta = torch.empty(beta.shape, dtype=beta.dtype, device=beta.device)
    dh0 = torch.empty(state_shape(q, v, n, state_v_first), dtype=state_dtype(q), device=q.device)
    shape = (B, T, H, HV, K, V)
    descs = (_desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(g, "g"), _desc(beta, "beta"),
             _desc(initial_state, "initial_state"), _cu_desc(cu_seqlens), n, _desc(do, "do"), _desc(dht, "dht"),
             _desc(dq), _desc(dk), _desc(dv), _desc(dg), _desc(dbeta), _desc(dh0))
    layout = 1 if state_v_first else 0
    dev = q.device
    if dev.type != "cuda":
        _C.backward(shape, *descs, scale, layout, 0, 0, 0, 0, 0, split_mode, split_chunks, batch_invariant, 0)
        return dq, dk, dv, dg, dbeta, dh0
    if cu_seqlens_host is None:
        key, host_ptr = ("bwd", shape, n, cu_seqlens is None, q.dtype, dev.index, split_mode, split_chunks,
                         batch_invariant), 0
    else:
        key, host_ptr = None, cu_seqlens_host.data_ptr()  # (the workspace follows the lengths)
    _run_cuda(_C.backward, _C.backward_workspace_size, key, shape, descs, scale, layout, dev, split_mode, split_chunks,
              batch_invariant, host_ptr)
    return dq, dk, dv, dg, dbeta, dh0


@gdn_bwd.register_fake
def _gdn_bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, state_v_first, split_mode=SPLIT_AUTO,
                  split_chunks=0, batch_invariant=False, cu_seqlens_host=None):
    n = _num_seqs(q, cu_seqlens)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        g.new_empty(g.shape),
        beta.new_empty(beta.shape),
        q.new_empty(state_shape(q, v, n, state_v_first), dtype=state_dtype(q)),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first = inputs[:10]
    # (cu_seqlens_host, a CPU tensor or None, too: the backward plans its pieces from it as the forward did)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, inputs[14])
    ctx.scale = scale
    # The backward splits as asked of the forward, and is batch-invariant where it was.
    ctx.split_mode, ctx.split_chunks, ctx.batch_invariant = inputs[11], inputs[12], inputs[13]
    ctx.state_v_first = state_v_first
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_host = ctx.saved_tensors
    if not ctx.output_final_state or dht is None or dht.numel() == 0:
        dht = None
    dq, dk, dv, dg, dbeta, dh0 = gdn_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do.contiguous(),
        None if dht is None else dht.contiguous(), ctx.state_v_first, ctx.split_mode, ctx.split_chunks,
        ctx.batch_invariant, cu_seqlens_host,
    )
    # One gradient per gdn_fwd input: none for scale, cu_seqlens and the options.
    return (dq, dk, dv, dg, dbeta, None, (dh0 if initial_state is not None else None), None, None, None, None, None,
            None, None, None)


gdn_fwd.register_autograd(_backward, setup_context=_setup_context)
