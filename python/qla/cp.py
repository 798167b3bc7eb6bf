"""Context parallelism: one packed batch of sequences sharded over the ranks of a
torch.distributed process group, each rank holding an equal contiguous slice of the tokens.

    ctx = qla.build_cp_context(cu_seqlens, group)      # the global boundaries, on the host
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=ctx, ...)

q, k, v, g and beta are the rank's slice ([1, T / world, ...]). The rank's tokens hold pieces of
the global sequences: its local sequences (`ctx.cu_seqlens`, `ctx.global_index`). Only the
first may have started on an earlier rank and only the last may go on to a later one.

Forward (docs/gdn.md section 5): S_end = M S_in + S0 for a piece, M the piece's transfer map
(the forward run from the identity with v = 0) and S0 its end state run from zero.
1. The rank's last local sequence, when it goes on: (S0, M), or its complete end state when it
   also started here (M = 0).
2. One all_gather of those [HV, K, V + K] blocks (gloo for CPU tensors, NCCL for CUDA ones).
3. The first local sequence, when it continues: its entering state by the fold
   S <- M_j S + S0_j over the ranks from the one where it started.
4. The local forward with that entering state: o and every local final state exact.

Backward mirrors it for the state gradient: the first local sequence's gradient with respect to
its entering state (its part from this rank's outputs, and M for a rank it crosses whole), one
all_gather, the fold dS <- M_j^T dS + dS_j from the rank where the last local sequence ends,
then the local backward with that gradient added to the last sequence's d(final state).
Both are exact: no warm-up shortcut.

Local initial_state / final state rows are per local sequence ([N_local, HV, K, V]): the final
state row of a sequence that goes on to a later rank is its state after this rank's tokens;
the initial_state row of a sequence that started on an earlier rank is not read (its entering
state comes from those ranks; its gradient is sent back to them, and that row's is zero).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class CPContext:
    """What a rank needs to know of the sharding, made by build_cp_context (host values only;
    no communication)."""
    group: object
    rank: int
    world: int
    tokens_per_rank: int                 # T / world
    cu_seqlens: torch.Tensor             # int32 [N_local + 1], the rank's local boundaries (CPU)
    global_index: Tuple[int, ...]        # global sequence of each local one
    # per rank j (all ranks, so that every rank can fold without asking):
    first_continues: Tuple[bool, ...]    # j's first local sequence started on an earlier rank
    last_continues: Tuple[bool, ...]     # j's last local sequence goes on to a later rank
    single: Tuple[bool, ...]             # j's first and last local sequences are the same one

    @property
    def num_local_seqs(self) -> int:
        return len(self.global_index)


def _local_sequences(bounds: Sequence[int], lo: int, hi: int) -> Tuple[List[int], List[int]]:
    """The pieces of the global sequences in tokens [lo, hi): local boundaries (relative to lo)
    and the global index of each. A zero-length sequence belongs to the rank holding its start
    (the last rank when it starts at T)."""
    cu, idx = [0], []
    T = bounds[-1]
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        if s == e:
            if lo <= s < hi or (s == T and hi == T):
                idx.append(n)
                cu.append(cu[-1])
            continue
        a, b = max(s, lo), min(e, hi)
        if a < b:
            idx.append(n)
            cu.append(cu[-1] + b - a)
    return cu, idx


def build_cp_context(cu_seqlens, group=None) -> CPContext:
    """The sharding of one packed batch over `group` (default: the world group).

    cu_seqlens: the global boundaries [N + 1] (a CPU tensor or a list, the same on every rank);
    the last entry T must be a multiple of the group size, each rank holding T / world tokens
    in rank order."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("cp_context: expected an initialised torch.distributed process group, got none")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError(f"cu_seqlens: expected the global boundaries on the host (a CPU tensor or a list), "
                             f"got a tensor on {cu_seqlens.device}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = [int(x) for x in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing boundaries from 0 with at least one sequence, "
                         f"got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: expected a process group that holds this process, got one without it")
    T = bounds[-1]
    if T == 0 or T % world != 0:
        raise ValueError(f"cu_seqlens: expected the total length to be a positive multiple of the group size "
                         f"{world} (equal slices per rank), got T={T}")
    L = T // world
    first_c, last_c, single = [], [], []
    mine = None
    for j in range(world):
        cu, idx = _local_sequences(bounds, j * L, (j + 1) * L)
        first_c.append(bounds[idx[0]] < j * L)
        last_c.append(bounds[idx[-1] + 1] > (j + 1) * L)
        single.append(len(idx) == 1)
        if j == rank:
            mine = (cu, idx)
    return CPContext(group=group, rank=rank, world=world, tokens_per_rank=L,
                     cu_seqlens=torch.tensor(mine[0], dtype=torch.int32), global_index=tuple(mine[1]),
                     first_continues=tuple(first_c), last_continues=tuple(last_c), single=tuple(single))


def _all_gather(x: torch.Tensor, ctx: CPContext) -> List[torch.Tensor]:
    """Every rank's block. A gloo group gathers CUDA blocks through host copies (a few hundred
    KiB: several processes sharing one GPU, or a CPU group beside CUDA tensors)."""
    import torch.distributed as dist
    via_host = x.is_cuda and dist.get_backend(ctx.group) == "gloo"
    y = x.cpu() if via_host else x.contiguous()
    parts = [torch.empty_like(y) for _ in range(ctx.world)]
    dist.all_gather(parts, y, group=ctx.group)
    return [p.to(x.device) for p in parts] if via_host else parts


def _entering_state(parts: List[torch.Tensor], ctx: CPContext, V: int) -> torch.Tensor:
    """The state entering this rank's first local sequence: S <- M_j S + S0_j from the rank
    where it started (whose block is its complete end state) to the rank before this one."""
    j = ctx.rank - 1
    while ctx.first_continues[j] and ctx.single[j]:  # rank j is crossed whole: look further back
        j -= 1
    S = parts[j][..., :V]
    for i in range(j + 1, ctx.rank):
        S = parts[i][..., V:] @ S + parts[i][..., :V]
    return S


def _exit_gradient(parts: List[torch.Tensor], ctx: CPContext, V: int) -> torch.Tensor:
    """The gradient reaching this rank's last local sequence's end state from the later ranks:
    dS <- M_j^T dS + dS_j from the rank where it ends back to the one after this."""
    j = ctx.rank + 1
    while ctx.last_continues[j] and ctx.single[j]:  # crossed whole
        j += 1
    dS = parts[j][..., :V]
    for i in range(j - 1, ctx.rank, -1):
        dS = parts[i][..., V:].transpose(-1, -2) @ dS + parts[i][..., :V]
    return dS


def _slice_seq(x: torch.Tensor, cu: List[int], i: int) -> torch.Tensor:
    return x[:, cu[i]:cu[i + 1]]


class _CPFunction(torch.autograd.Function):
    """The CP forward and backward over the core inputs (states in the [K, V] layout)."""

    @staticmethod
    def forward(fctx, q, k, v, g, beta, h0, scale, ctx):
        from .api import chunk_gated_delta_rule_fwd
        K, V, HV = q.shape[-1], v.shape[-1], v.shape[2]
        cu_list = ctx.cu_seqlens.tolist()
        cu = ctx.cu_seqlens.to(q.device)
        n_loc, r = ctx.num_local_seqs, ctx.rank
        sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        h0_given = h0 is not None
        h0 = h0 if h0_given else q.new_zeros((n_loc, HV, K, V), dtype=sdt)

        def run(i, init, vv):  # local sequence i alone: its final state
            seg = torch.tensor([0, cu_list[i + 1] - cu_list[i]], dtype=torch.int32)
            _, ht = chunk_gated_delta_rule_fwd(*(_slice_seq(t, cu_list, i) for t in (q, k, vv, g, beta)), scale=scale,
                                               initial_state=init, output_final_state=True,
                                               cu_seqlens=seg.to(q.device), cu_seqlens_cpu=seg)
            return ht[0]

        block = q.new_zeros((HV, K, V + K), dtype=sdt)
        last = n_loc - 1
        if ctx.last_continues[r]:
            if ctx.first_continues[r] and ctx.single[r]:  # crossed whole: S0 and the transfer map M
                block[..., :V] = run(last, None, v)
                eye = torch.eye(K, dtype=sdt, device=q.device).expand(1, HV, K, K).contiguous()
                block[..., V:] = run(last, eye, v.new_zeros(v.shape[:-1] + (K,)))
            else:  # started here: its end state is complete
                block[..., :V] = run(last, h0[last:last + 1], v)
        parts = _all_gather(block, ctx)
        h0_used = h0
        if ctx.first_continues[r]:
            h0_used = h0.clone()
            h0_used[0] = _entering_state(parts, ctx, V)
        o, ht = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=scale, initial_state=h0_used,
                                           output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=ctx.cu_seqlens)
        fctx.save_for_backward(q, k, v, g, beta, h0_used, block[..., V:].clone())
        fctx.scale, fctx.ctx, fctx.had_h0 = scale, ctx, h0_given
        return o, ht

    @staticmethod
    def backward(fctx, do, dht):
        from .api import chunk_gated_delta_rule_bwd
        q, k, v, g, beta, h0_used, M = fctx.saved_tensors
        scale, ctx = fctx.scale, fctx.ctx
        V, r = v.shape[-1], ctx.rank
        cu_list = ctx.cu_seqlens.tolist()
        cu = ctx.cu_seqlens.to(q.device)
        do = v.new_zeros(v.shape) if do is None else do.contiguous()
        dht = torch.zeros_like(h0_used) if dht is None else dht.contiguous()
        block = h0_used.new_zeros(h0_used.shape[1:-1] + (V + h0_used.shape[-2],))
        if ctx.first_continues[r]:
            # The gradient with respect to its entering state from this rank's outputs (and its
            # end state's own d(final state)); for a rank crossed whole, also M for the fold.
            n = cu_list[1]
            one = torch.tensor([0, n], dtype=torch.int32, device=q.device)
            *_, dh0 = chunk_gated_delta_rule_bwd(*(t[:, :n] for t in (q, k, v, g, beta)), do[:, :n], dht[:1],
                                                 scale=scale, initial_state=h0_used[:1], cu_seqlens=one)
            block[..., :V] = dh0[0]
            if ctx.last_continues[r] and ctx.single[r]:
                block[..., V:] = M
        parts = _all_gather(block, ctx)
        if ctx.last_continues[r]:
            dht = dht.clone()
            dht[-1] += _exit_gradient(parts, ctx, V)
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, do, dht, scale=scale,
                                                                initial_state=h0_used, cu_seqlens=cu)
        if not fctx.had_h0:
            dh0 = None
        elif ctx.first_continues[r]:
            dh0 = dh0.clone()
            dh0[0] = 0  # that row was not read: its gradient went to the earlier ranks
        return dq, dk, dv, dg, dbeta, dh0, None, None


def cp_forward(q, k, v, g, beta, scale, initial_state, state_v_first, ctx: CPContext):
    """chunk_gated_delta_rule's CP path on checked, preprocessed inputs: (o, final states)."""
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    if h0 is not None and q.dtype == torch.float64:
        # The states the ranks exchange and fold in are fp64 with fp64 inputs: an fp32 h0 would
        # round them (autograd casts its gradient back to fp32).
        h0 = h0.to(torch.float64)
    o, ht = _CPFunction.apply(q, k, v, g, beta, h0, scale, ctx)
    if state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht
