"""Public API: FLA-compatible ``chunk_gated_delta_rule`` and the low-level fwd/bwd."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import _ops

_QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_GATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t, ndim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {t.dim()}-D with shape {_fmt_shape(t)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")


_TENSOR = torch.Tensor
_QKV_DTYPE_SET = frozenset(_QKV_DTYPES)
_GATE_DTYPE_SET = frozenset(_GATE_DTYPES)
_INDEX_DTYPE_SET = frozenset(_INDEX_DTYPES)


def _same_place(t, cpu: bool, index: int) -> bool:
    # CPU, or the CUDA device `index`; any other device type (meta, ...) takes the full checks.
    return t.is_cpu if cpu else (t.is_cuda and t.get_device() == index)


def _quick_check(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu):
    """The common, valid call in a few attribute reads (host time is part of the op's cost):
    returns N, or None when anything is unusual or wrong. It accepts only what
    _check_inputs_full accepts (tests/python/test_errors.py checks both on the same inputs);
    None sends the call to the full checks, which name the bad argument."""
    T_ = _TENSOR
    if type(q) is not T_ or type(k) is not T_ or type(v) is not T_ or type(g) is not T_ or type(beta) is not T_:
        return None
    dt = q.dtype
    if dt not in _QKV_DTYPE_SET or k.dtype is not dt or v.dtype is not dt:
        return None
    if g.dtype not in _GATE_DTYPE_SET or beta.dtype not in _GATE_DTYPE_SET:
        return None
    qs, vs = q.shape, v.shape
    if len(qs) != 4 or len(vs) != 4 or k.shape != qs:
        return None
    B, T, H, _ = qs
    HV = vs[2]
    if vs[0] != B or vs[1] != T or H == 0 or HV == 0 or HV % H or g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        return None
    if q.numel() == 0 or v.numel() == 0:
        return None
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or g.stride(-1) != 1 or beta.stride(-1) != 1:
        return None
    cpu = q.is_cpu
    index = -1 if cpu else q.get_device()
    if not cpu and not q.is_cuda:
        return None
    if not (_same_place(k, cpu, index) and _same_place(v, cpu, index) and _same_place(g, cpu, index)
            and _same_place(beta, cpu, index)):
        return None
    if cu_seqlens is None:
        N = B
    else:
        # Host values (a CPU cu_seqlens or cu_seqlens_cpu) are checked by the full path.
        if cu_seqlens_cpu is not None or cpu or type(cu_seqlens) is not T_ or B != 1:
            return None
        cs = cu_seqlens.shape
        if (len(cs) != 1 or cs[0] < 2 or cu_seqlens.dtype not in _INDEX_DTYPE_SET or cu_seqlens.stride(0) != 1
                or not _same_place(cu_seqlens, cpu, index)):
            return None
        N = cs[0] - 1
    if initial_state is not None:
        h = initial_state
        if type(h) is not T_ or h.numel() == 0 or h.stride(-1) != 1 or not _same_place(h, cpu, index):
            return None
        if not (h.dtype is torch.float32 or (h.dtype is torch.float64 and dt is torch.float64)):
            return None
        K, V = qs[3], vs[3]
        if h.shape != ((N, HV, V, K) if state_v_first else (N, HV, K, V)):
            return None
    return N


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu=None) -> int:
    """Validates the kernel-level inputs; returns N (the number of sequences)."""
    N = _quick_check(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    if N is not None:
        return N
    return _check_inputs_full(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)


def _check_inputs_full(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu=None) -> int:
    """Every check, each error naming the argument, what was expected and what came."""
    _check_tensor("q", q, 4, _QKV_DTYPES)
    _check_tensor("k", k, 4, _QKV_DTYPES)
    _check_tensor("v", v, 4, _QKV_DTYPES)
    _check_tensor("g", g, 3, _GATE_DTYPES)
    _check_tensor("beta", beta, 3, _GATE_DTYPES)
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if t is not None and isinstance(t, torch.Tensor) and t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (the device of q), got one on {t.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad, t = ("k", k) if k.dtype != q.dtype else ("v", v)
        raise TypeError(f"{bad}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {_fmt_shape(q)} (the shape of q), got {_fmt_shape(k)}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected batch and length [{B}, {T}, ...] like q, got {_fmt_shape(v)}")
    HV = v.shape[2]
    if H == 0 or HV == 0:
        raise ValueError(f"q, v: expected at least one q/k head and one value head, got H={H}, HV={HV}")
    if HV % H != 0:
        raise ValueError(f"v: expected the number of value heads ({HV}) to be a multiple of the q/k heads ({H})")
    if K == 0 or v.shape[3] == 0:
        raise ValueError(f"q, v: expected head dims K and V of at least 1, got K={K}, V={v.shape[3]}")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            raise ValueError(f"{name}: expected shape [{B}, {T}, {HV}] ([B, T, HV]), got {_fmt_shape(t)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:  # (a dimension of one: any stride)
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got stride {t.stride(-1)}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"cu_seqlens: expected a 1-D int32 or int64 tensor, got {cu_seqlens.dim()}-D {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens: expected batch size 1 when cu_seqlens is given, got q with B={B}")
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens: expected at least one entry (0), got an empty tensor")
        if cu_seqlens.shape[0] == 1 and T > 0:  # [0] alone cannot end at T: known without the values
            raise ValueError(f"cu_seqlens: expected at least two entries (0, ..., T={T}) for {T} tokens, got one")
        if cu_seqlens.stride(0) != 1:
            raise ValueError("cu_seqlens: expected a contiguous tensor")
        host = cu_seqlens_cpu
        if host is None and cu_seqlens.device.type == "cpu":
            host = cu_seqlens
        # Value checks need host values: free on CPU, never a device sync. Under torch.compile
        # they would be data-dependent guards; the core checks the same host values then.
        if host is not None and not torch.compiler.is_compiling():
            vals = host.tolist() if isinstance(host, torch.Tensor) else list(host)
            if len(vals) != cu_seqlens.shape[0]:  # the core reads N + 1 host values
                raise ValueError(f"cu_seqlens_cpu: expected {cu_seqlens.shape[0]} entries (those of cu_seqlens), "
                                 f"got {len(vals)}")
            if vals[0] != 0:
                raise ValueError(f"cu_seqlens: expected the first entry to be 0, got {vals[0]}")
            for i in range(len(vals) - 1):
                if vals[i + 1] < vals[i]:
                    raise ValueError(
                        f"cu_seqlens: expected non-decreasing values, got {vals[i]} then {vals[i + 1]} at index {i + 1}")
            if vals[-1] != T:
                raise ValueError(f"cu_seqlens: expected the last entry to equal T={T} (tokens in q), got {vals[-1]}")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state: expected a torch.Tensor, got {type(initial_state).__name__}")
        want = _ops.state_shape(q, v, N, state_v_first)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            raise ValueError(
                f"initial_state: expected shape {list(want)} ({layout}), got {_fmt_shape(initial_state)}")
        if initial_state.dtype != torch.float32 and not (
                initial_state.dtype == torch.float64 and q.dtype == torch.float64):
            raise TypeError(
                f"initial_state: expected dtype float32 (or float64 with float64 inputs), got {initial_state.dtype}")
        if initial_state.numel() > 0 and initial_state.shape[-1] > 1 and initial_state.stride(-1) != 1:
            raise ValueError("initial_state: expected a contiguous last dimension (stride 1)")
    return N


def _resolve_scale(scale, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if type(scale) is not float and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        kind = "a torch.Tensor" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale: expected a real number or None, got {kind}")
    try:
        scale = float(scale)
    except OverflowError:
        raise ValueError("scale: expected a finite number, got one too large for a float") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return scale


def _empty_outputs(q, k, v, g, beta, N, output_final_state, initial_state, state_v_first):
    """A call without tokens: o has no elements; the final state is h0 (zeros without one), in
    the dtype a call with tokens gives. Both stay in autograd's graph like theirs: o from every
    token input (zero gradients), the final state from h0."""
    o = v.new_zeros(v.shape)  # [B, T, HV, V] in q's dtype
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        o = o + (q.sum() + k.sum() + v.sum() + g.sum() + beta.sum()).to(o.dtype) * 0
    if not output_final_state:
        return o, None
    sdt = _ops.state_dtype(q)
    if initial_state is not None:
        return o, initial_state.to(sdt, copy=True)
    return o, q.new_zeros(_ops.state_shape(q, v, N, state_v_first), dtype=sdt)


def _check_bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected True or False, got {type(x).__name__}")
    return x


def _host_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu) -> Optional[torch.Tensor]:
    """cu_seqlens_cpu (already checked) as the contiguous int64 CPU tensor the CUDA forward plans
    from, or None (no host copy, no cu_seqlens, or a CPU call, which has no plan)."""
    if cu_seqlens_cpu is None or cu_seqlens is None or q.device.type != "cuda":
        return None
    if isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.dtype is torch.int64 \
            and cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.is_contiguous():
        return cu_seqlens_cpu
    return torch.as_tensor(cu_seqlens_cpu, dtype=torch.int64, device="cpu").contiguous()


def _split_args(split, split_chunks) -> Tuple[int, int]:
    """The CUDA forward's splitting options as the core's (SplitMode, split_chunks)."""
    if split is not None and not isinstance(split, bool):
        raise TypeError(f"split: expected None (automatic), True or False, got {type(split).__name__}")
    if split_chunks is None:
        return (_ops.SPLIT_AUTO if split is None else _ops.SPLIT_ON if split else _ops.SPLIT_OFF), 0
    if isinstance(split_chunks, bool) or not isinstance(split_chunks, int):
        raise TypeError(f"split_chunks: expected an int (chunks of 64 tokens per piece), got {type(split_chunks).__name__}")
    if split_chunks < 1:
        raise ValueError(f"split_chunks: expected at least 1 (chunks of 64 tokens per piece), got {split_chunks}")
    if split is False:
        raise ValueError("split_chunks: expected None with split=False (no pieces), got " + str(split_chunks))
    return _ops.SPLIT_ON, split_chunks


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    split: Optional[bool] = None,
    split_chunks: Optional[int] = None,
    batch_invariant: bool = False,
    state_pool: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    final_state_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Low-level forward on already-preprocessed inputs (no autograd).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (natural-log decay, <= 0), beta: [B, T, HV];
    initial_state: [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first). Returns
    (o [B, T, HV, V] in q's dtype, final_state or None). States are fp32, or fp64 when
    the inputs are fp64. split, split_chunks, batch_invariant, state_pool and its indices: as
    in chunk_gated_delta_rule.
    """
    split_mode, split_chunks = _split_args(split, split_chunks)
    batch_invariant = _check_bool("batch_invariant", batch_invariant)
    if state_pool is not None or initial_state_indices is not None or final_state_indices is not None:
        with torch.no_grad():
            return _pool_call(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                              split_mode, split_chunks, batch_invariant, cu_seqlens_cpu, False, state_pool,
                              initial_state_indices, final_state_indices)
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    scale = _resolve_scale(scale, q.shape[-1])
    if q.numel() == 0 or v.numel() == 0:
        return _empty_outputs(q, k, v, g, beta, N, output_final_state, initial_state, state_v_first)
    fwd = _ops.gdn_fwd if torch.compiler.is_compiling() else _ops.forward_impl
    with torch.no_grad():
        o, ht = fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first, False,
                    split_mode, split_chunks, batch_invariant, _host_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu))
    return o, (ht if output_final_state else None)


def chunk_gated_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    split: Optional[bool] = None,
    split_chunks: Optional[int] = None,
    batch_invariant: bool = False,
):
    """Low-level backward: given the forward inputs, do (the gradient of o) and dht (the
    gradient of the final state, or None), returns (dq, dk, dv, dg, dbeta, dh0).

    dq and dk are summed over each value-head group (GVA); dg and dbeta have the dtypes
    of g and beta; dh0 is fp32 in the state layout (the gradient of initial_state,
    which is zero-initialised when initial_state is None). split, split_chunks, batch_invariant:
    the CUDA backward's sequence splitting and batch invariance, as chunk_gated_delta_rule's
    (split=True or batch_invariant=True take the fused backward, which splits; None: automatic).
    cu_seqlens_cpu: the host copy of cu_seqlens, as chunk_gated_delta_rule's: the CUDA backward
    then plans its pieces from the true lengths.
    """
    split_mode, split_chunks = _split_args(split, split_chunks)
    batch_invariant = _check_bool("batch_invariant", batch_invariant)
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    _check_tensor("do", do, 4, (q.dtype,))
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do: expected shape {_fmt_shape(v)} (the shape of o), got {_fmt_shape(do)}")
    if do.device != q.device:
        raise ValueError(f"do: expected a tensor on {q.device}, got one on {do.device}")
    K = q.shape[-1]
    state_shape = _ops.state_shape(q, v, N, state_v_first)
    if dht is not None:
        _check_tensor("dht", dht, 4, (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,))
        if tuple(dht.shape) != state_shape:
            raise ValueError(f"dht: expected shape {list(state_shape)}, got {_fmt_shape(dht)}")
        if dht.device != q.device:
            raise ValueError(f"dht: expected a tensor on {q.device}, got one on {dht.device}")
    scale = _resolve_scale(scale, K)
    if q.numel() == 0 or v.numel() == 0:
        sdt = _ops.state_dtype(q)
        dh0 = dht.to(sdt, copy=True) if dht is not None else q.new_zeros(state_shape, dtype=sdt)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0)
    bwd = _ops.gdn_bwd if torch.compiler.is_compiling() else _ops.backward_impl  # (the op only where traced)
    return bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do.contiguous(),
               None if dht is None else dht.contiguous(), state_v_first, split_mode, split_chunks, batch_invariant,
               _host_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu))


def _cp_call(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens, split_mode,
             split_chunks, batch_invariant, ctx):
    """chunk_gated_delta_rule with a cp_context (qla/cp.py), after the preprocessing."""
    from . import cp
    if not isinstance(ctx, cp.CPContext):
        raise TypeError(f"cp_context: expected a qla.CPContext (qla.build_cp_context), got {type(ctx).__name__}")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: expected None with cp_context (the context holds this rank's boundaries)")
    if split_mode != _ops.SPLIT_AUTO or split_chunks or batch_invariant:
        raise ValueError("split, split_chunks, batch_invariant: expected the defaults with cp_context")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] != ctx.tokens_per_rank:
        raise ValueError(f"q: expected this rank's slice of {ctx.tokens_per_rank} tokens (cp_context), "
                         f"got {q.shape[1]}")
    cu = ctx.cu_seqlens if q.device.type == "cpu" else ctx.cu_seqlens.to(q.device)
    _check_inputs(q, k, v, g, beta, initial_state, cu, state_v_first, ctx.cu_seqlens)
    o, ht = cp.cp_forward(q, k, v, g, beta, _resolve_scale(scale, q.shape[-1]), initial_state, state_v_first, ctx)
    return o, (ht if output_final_state else None)


def _pool_no_tokens(v, N, pool, init_idx, final_idx, output_final_state, q, k, g, beta, state_v_first):
    """A pool call without tokens: each written slot takes the state its sequence starts from. The
    indices are read on the host (a device synchronisation for CUDA indices, in this rare call
    alone) and checked as the core checks them."""
    S = pool.shape[0]
    reads = None if init_idx is None else init_idx.tolist()
    writes = None if final_idx is None else final_idx.tolist()
    for name, vals, slots_name in (("initial_state_indices", reads, "initial_state_slots"),
                                   ("final_state_indices", writes, "final_state_slots")):
        for i, x in enumerate(vals or []):
            if x >= S:
                raise ValueError(f"{name}: expected entries below {slots_name}={S} (negative: no state), got {x} "
                                 f"at index {i}")
    if writes is not None:
        writer = {}
        for i, x in enumerate(writes):
            if x >= 0 and writer.setdefault(x, i) != i:
                raise ValueError(f"final_state_indices: expected distinct slots, got {x} at indices {writer[x]} and {i}")
        for i, x in enumerate(reads or []):
            if x >= 0 and writer.get(x, i) != i:
                raise ValueError(f"initial_state_indices: slot {x} (read by sequence {i}) is written by another "
                                 f"sequence (sequence {writer[x]}) in the same pool; expected a sequence to read only "
                                 f"slots no other sequence writes")
    start = torch.zeros((N,) + tuple(pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    for i, x in enumerate(reads or []):
        if x >= 0:
            start[i] = pool[x]
    for i, x in enumerate(writes or []):
        if x >= 0:
            pool[x] = start[i]
    ht = start.to(_ops.state_dtype(q)) if output_final_state and final_idx is None else None
    return _empty_outputs(q, k, v, g, beta, N, False, None, state_v_first)[0], ht


def _pool_call(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens, split_mode,
               split_chunks, batch_invariant, cu_seqlens_cpu, qk_normalized, pool, init_idx, final_idx):
    """chunk_gated_delta_rule with a state pool (inference), after the preprocessing."""
    if pool is None:
        raise ValueError("state_pool: expected the pool that initial_state_indices / final_state_indices index, "
                         "got None")
    if init_idx is None and final_idx is None:
        raise ValueError("state_pool: expected initial_state_indices and/or final_state_indices with it, got neither")
    if initial_state is not None:
        raise ValueError("initial_state: expected None with state_pool (initial_state_indices reads the pool)")
    N = _check_inputs(q, k, v, g, beta, None, cu_seqlens, state_v_first, cu_seqlens_cpu)
    # An engine's state cache may be 16-bit: read once, the arithmetic in fp32, the written states
    # rounded to nearest (the cpu backend for now; the CUDA one refuses such a pool by name).
    _check_tensor("state_pool", pool, 4, (torch.float32, torch.float64) if q.dtype == torch.float64 else
                  (torch.float32, torch.bfloat16, torch.float16))
    want = _ops.state_shape(q, v, pool.shape[0], state_v_first)
    if tuple(pool.shape) != want:
        raise ValueError(f"state_pool: expected shape [S, {', '.join(str(x) for x in want[1:])}] (S slots), got "
                         f"{_fmt_shape(pool)}")
    if pool.device != q.device:
        raise ValueError(f"state_pool: expected a tensor on {q.device} (the device of q), got one on {pool.device}")
    if pool.numel() > 0 and pool.stride(-1) != 1:
        raise ValueError(f"state_pool: expected a contiguous last dimension (stride 1), got stride {pool.stride(-1)}")
    for name, t in (("initial_state_indices", init_idx), ("final_state_indices", final_idx)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype not in _INDEX_DTYPES or t.shape[0] != N:
            raise ValueError(f"{name}: expected a 1-D int32 or int64 tensor of N={N} entries (one per sequence), got "
                             f"{t.dim()}-D {t.dtype} of shape {_fmt_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (the device of q), got one on {t.device}")
        if N > 1 and t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous tensor")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, pool)):
        raise ValueError("state_pool: the pool is read and written in place, for inference; expected no tensor that "
                         "requires grad (call under torch.no_grad(), or pass initial_state for training)")
    scale = _resolve_scale(scale, q.shape[-1])
    if q.numel() == 0 or v.numel() == 0:
        return _pool_no_tokens(v, N, pool, init_idx, final_idx, output_final_state, q, k, g, beta, state_v_first)
    host_cu = _host_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu)
    if torch.compiler.is_compiling():  # the op that declares the pool's mutation
        o, ht = _ops.gdn_fwd_pool(q, k, v, g, beta, scale, pool, init_idx, final_idx, cu_seqlens, output_final_state,
                                  state_v_first, bool(qk_normalized), split_mode, split_chunks, batch_invariant, host_cu)
    else:
        o, ht = _ops.forward_impl(q, k, v, g, beta, scale, None, cu_seqlens, output_final_state, state_v_first,
                                  bool(qk_normalized), split_mode, split_chunks, batch_invariant, host_cu, pool,
                                  init_idx, final_idx)
    return o, (ht if output_final_state and final_idx is None else None)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, computed in fp32 (fp64 for fp64)."""
    xf = x if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    split: Optional[bool] = None,
    split_chunks: Optional[int] = None,
    batch_invariant: bool = False,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    cp_context=None,
    state_pool: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    final_state_indices: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet, chunked prefill (FLA-compatible; differentiable).

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V] with HV a multiple of H (GVA).
        g: [B, T, HV] log-decay (<= 0), or the raw gate input when use_gate_in_kernel.
        beta: [B, T, HV] write strength, or its logits when use_beta_sigmoid_in_kernel.
        scale: multiplies the read; default K ** -0.5.
        initial_state: [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first).
        output_final_state: also return the final state (fp32, same layout).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first.
        use_beta_sigmoid_in_kernel: beta = sigmoid(beta) first.
        allow_neg_eigval: with use_beta_sigmoid_in_kernel, beta = 2 * sigmoid(beta) (range [0, 2)).
        cu_seqlens: [N + 1] int32/int64 boundaries of packed sequences (requires B == 1).
        use_gate_in_kernel: g = -exp(A_log) * softplus(g + dt_bias), A_log and dt_bias [HV].
        split: the CUDA forward's sequence splitting: None (default) splits long sequences
            when a cost model of the kernels says it pays, True always, False never. Each
            piece's entering state is exact (transfer maps and a scan), or, for a (sequence,
            head) whose gates decay by e^-16 within 8 chunks before every piece boundary, those
            chunks rerun from zero; heads with g = 0 always take the exact path. CPU calls
            ignore it.
        split_chunks: with split (implied), pieces of at most this many chunks of 64 tokens
            (ceil(chunks / split_chunks) equal pieces per sequence, at most 64).
        batch_invariant: the CUDA forward gives each sequence bitwise the same o and final
            state whatever else the call holds (other sequences; other heads, as a
            tensor-parallel shard against the full head set): its path and pieces then depend
            on its own length and gates only (pieces of up to split_chunks, default 64 chunks,
            unless split=False). Slower for many-sequence calls.
        cu_seqlens_cpu: a host copy of cu_seqlens (as in FLA). CUDA calls then validate the
            boundaries without a device synchronisation, and the CUDA forward plans its path,
            pieces and V tile from the true lengths (without it, from the bound T).
        cp_context: context parallelism (qla.build_cp_context): q, k, v, g, beta are this
            rank's equal slice of the packed tokens, cu_seqlens None (the context holds the
            local boundaries), initial_state and the final state per local sequence (qla/cp.py
            says which rows are read and what they hold). Exact, forward and backward.
        state_pool: a pool of states, [S, HV, K, V] fp32 ([S, HV, V, K] with state_v_first),
            read and written in place through the two index tensors below (as an inference
            engine keeps one state slot per request). Inference only: no autograd, no
            initial_state, no cp_context. On the CPU the pool may also be bf16 or fp16 (an
            engine's 16-bit state cache: read exactly, the arithmetic in fp32, the written states
            rounded to nearest); the CUDA forward refuses 16-bit pools for now.
        initial_state_indices: [N] int32/int64 on q's device: sequence n starts from
            state_pool[initial_state_indices[n]], from zeros where the index is negative.
        final_state_indices: [N] int32/int64 on q's device: sequence n's final state is written
            into state_pool[final_state_indices[n]], nowhere where the index is negative; the
            returned final state is then None. A slot may be written by one sequence only and
            read by no other. CPU calls check every index (ValueError); CUDA calls do not
            synchronise: an index >= S gives NaN in o and in the final slots in range.
        transpose_state_layout: FLA's former name of state_v_first (deprecated).
        chunk_indices, chunk_size: accepted for FLA compatibility.

    Returns:
        (o [B, T, HV, V] in q's dtype, final_state or None)
    """
    split_mode, split_chunks = _split_args(split, split_chunks)
    batch_invariant = _check_bool("batch_invariant", batch_invariant)
    kwargs.pop("chunk_indices", None)
    chunk_size = kwargs.pop("chunk_size", None)
    if chunk_size not in (None, 16, 32, 64):  # the result does not depend on it; kernels use their own
        raise ValueError(f"chunk_size: expected 16, 32 or 64 (or None), got {chunk_size}")
    if kwargs.pop("head_first", False):
        raise ValueError("head_first: expected False; pass tensors as [B, T, H, D]")
    if "transpose_state_layout" in kwargs:  # FLA's former name of state_v_first
        if state_v_first:
            raise ValueError("transpose_state_layout: pass state_v_first only (transpose_state_layout is its old name)")
        warnings.warn("transpose_state_layout is deprecated; use state_v_first", DeprecationWarning, stacklevel=2)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if kwargs:
        raise TypeError(f"chunk_gated_delta_rule: unexpected keyword arguments {sorted(kwargs)}")
    # FLA's flags take any truthy value, as there; bool() keeps the core's arguments typed.
    use_qk_l2norm_in_kernel = bool(use_qk_l2norm_in_kernel)
    use_beta_sigmoid_in_kernel = bool(use_beta_sigmoid_in_kernel)
    allow_neg_eigval, use_gate_in_kernel = bool(allow_neg_eigval), bool(use_gate_in_kernel)
    state_v_first = bool(state_v_first)
    if use_gate_in_kernel or use_beta_sigmoid_in_kernel or use_qk_l2norm_in_kernel:
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):  # before the preprocessing uses them
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: expected use_beta_sigmoid_in_kernel=True (beta becomes 2 * sigmoid(beta))")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: expected a [HV] tensor when use_gate_in_kernel=True, got None")
        HV = v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else None
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.numel() != HV):
                got = _fmt_shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a tensor with HV={HV} elements, got {got}")
            if t is not None and t.device != g.device:
                raise ValueError(f"{name}: expected a tensor on {g.device} (the device of g), got one on {t.device}")
        gate_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        gx = g.to(gate_dtype)
        if dt_bias is not None:
            gx = gx + dt_bias.to(gate_dtype).reshape(-1)
        g = -torch.exp(A_log.to(gate_dtype).reshape(-1)) * F.softplus(gx)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta if beta.dtype == torch.float64 else beta.float())
    if allow_neg_eigval:
        beta = beta * 2.0
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if cp_context is not None:
        if state_pool is not None or initial_state_indices is not None or final_state_indices is not None:
            raise ValueError("state_pool: expected None with cp_context (state pools are for inference calls)")
        return _cp_call(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                        split_mode, split_chunks, batch_invariant, cp_context)
    if state_pool is not None or initial_state_indices is not None or final_state_indices is not None:
        return _pool_call(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                          split_mode, split_chunks, batch_invariant, cu_seqlens_cpu, use_qk_l2norm_in_kernel,
                          state_pool, initial_state_indices, final_state_indices)
    N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, cu_seqlens_cpu)
    scale = _resolve_scale(scale, q.shape[-1])
    if q.numel() == 0 or v.numel() == 0:
        return _empty_outputs(q, k, v, g, beta, N, output_final_state, initial_state, state_v_first)
    fwd = _ops.gdn_fwd if _ops.needs_dispatch(q, k, v, g, beta, initial_state) else _ops.forward_impl
    o, ht = fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, state_v_first,
                use_qk_l2norm_in_kernel, split_mode, split_chunks, batch_invariant,
                _host_cu_seqlens(q, cu_seqlens, cu_seqlens_cpu))
    return o, (ht if output_final_state else None)
