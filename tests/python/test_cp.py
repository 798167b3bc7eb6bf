"""Context parallelism (qla.build_cp_context): 2 and 4 processes with the gloo backend, each
holding an equal slice of the packed tokens, against the single-process result in fp64
(outputs, every local final state, and the gradients of every input). On the CPU backend in
fp64 (exact); on a Hopper GPU, two processes sharing it, in bf16 at the accuracy bounds."""
import datetime
import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qla

TOL = 1e-10
CUDA_TOL, CUDA_GRAD_TOL = 3e-3, 1e-2  # bf16 inputs against fp64 (the CUDA forward and backward suites' bounds)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _inputs(lens, world, H=1, HV=2, K=8, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    d = torch.float64
    x = dict(q=torch.randn(1, T, H, K, generator=gen, dtype=d), k=torch.randn(1, T, H, K, generator=gen, dtype=d),
             v=torch.randn(1, T, HV, V, generator=gen, dtype=d),
             g=torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen, dtype=d)) / 4,
             beta=torch.randn(1, T, HV, generator=gen, dtype=d),  # logits: sigmoid in the call
             h0=torch.randn(len(lens), HV, K, V, generator=gen, dtype=d))
    x["g"][:, :, 0] = 0  # one head that never decays
    w = dict(o=torch.randn(1, T, HV, V, generator=gen, dtype=d), h=torch.randn(len(lens), HV, K, V, generator=gen, dtype=d),
             mid=torch.randn(world, len(lens), HV, K, V, generator=gen, dtype=d))
    return x, w


def _call(x, cu, h0, state_v_first, l2norm=True, **kw):
    return qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                      use_beta_sigmoid_in_kernel=True, state_v_first=state_v_first, cu_seqlens=cu, **kw)


def _in_group(rank, world, store, check, *args):
    """Runs check(rank, world, *args) in a gloo group of `world` processes."""
    torch.set_num_threads(1)
    # A timeout, so that a rank that failed before a collective makes the others fail, not hang.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        check(rank, world, *args)
    except BaseException:
        # A failed rank leaves at once: waiting in a barrier while another rank waits in a
        # collective of the call would hang both until the group's timeout.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()  # every rank done before any tears its connections down
    dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, in which torch's gloo threads aborted
    # about one process in six ("terminate called without an active exception", after the
    # checks had passed).
    os._exit(0)


def _worker(rank, world, store, lens, state_v_first, device, h0_fp32):
    _in_group(rank, world, store, _check_rank, lens, state_v_first, device, h0_fp32)


def _check_rank(rank, world, lens, state_v_first, device="cpu", h0_fp32=False):
    cuda = device == "cuda"
    x, w = _inputs(lens, world, K=128 if cuda else 8, V=128 if cuda else 8)
    tol, gtol = (CUDA_TOL, CUDA_GRAD_TOL) if cuda else (TOL, TOL)
    h0_tol = gtol
    if h0_fp32:  # fp64 inputs with an fp32 initial state (the documented state dtype): the same
        # values in the reference, and every result as exact but dh0, which comes back in fp32
        x["h0"] = x["h0"].float().double()
        h0_tol = 1e-6
    if cuda:
        # The reference takes the values the GPU sees: q, k, v rounded to bf16, q and k unit rows
        # before the rounding and no l2norm in the call (normalising bf16 rows on the GPU rounds
        # them again, which an fp64 reference of the same call does not: o 3.3e-3 against fp64
        # from that alone, also without context parallelism).
        for n in ("q", "k"):
            x[n] = torch.nn.functional.normalize(x[n], dim=-1)
        for n in ("q", "k", "v"):
            x[n] = x[n].to(torch.bfloat16).double()
    T = sum(lens)
    L = T // world
    lo, hi = rank * L, (rank + 1) * L
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    tr = (lambda s: s.transpose(-1, -2).contiguous()) if state_v_first else (lambda s: s)

    # Single process: the whole batch, plus the state of each sequence at every rank's end that
    # it goes on past (its prefix run alone), all in one loss: the sum of the ranks' losses.
    xs = {n: t.clone().requires_grad_() for n, t in x.items()}
    cu = torch.tensor(bounds, dtype=torch.int32)
    o, ht = _call(xs, cu, tr(xs["h0"]), state_v_first, l2norm=not cuda)
    loss = (o * w["o"]).sum() + (tr(ht) * w["h"]).sum()
    mids = {}
    for j in range(world):
        end = (j + 1) * L
        for n in range(len(lens)):
            s, e = bounds[n], bounds[n + 1]
            if s < end < e:  # goes on past rank j
                part = {m: t[:, s:end] for m, t in xs.items() if m != "h0"}
                _, hm = _call(part, torch.tensor([0, end - s], dtype=torch.int32), tr(xs["h0"][n:n + 1]),
                              state_v_first, l2norm=not cuda)
                mids[j, n] = tr(hm[0]).detach()
                loss = loss + (tr(hm[0]) * w["mid"][j, n]).sum()
    loss.backward()

    # This rank's slice with the context.
    ctx = qla.build_cp_context(bounds)
    gi = list(ctx.global_index)
    def dev(t, n):
        if not cuda:
            return t.float() if n == "h0" and h0_fp32 else t
        return t.to("cuda", torch.bfloat16 if n in ("q", "k", "v") else torch.float32)
    xl = {n: dev(t[:, lo:hi], n).clone().requires_grad_() for n, t in x.items() if n != "h0"}
    h0l = dev(tr(x["h0"][gi]), "h0").clone().requires_grad_()
    w = {n: dev(t, n) for n, t in w.items()}
    ol, htl = _call(xl, None, h0l, state_v_first, l2norm=not cuda, cp_context=ctx)
    htl = tr(htl)
    rel = lambda a, b: _rel(a.double().cpu(), b)
    loss_l = (ol.to(w["o"].dtype) * w["o"][:, lo:hi]).sum()
    for i, n in enumerate(gi):
        if bounds[n + 1] <= hi:  # ends here: its final state
            assert rel(htl[i], tr(ht)[n].detach()) < tol, (rank, n, "final state")
            loss_l = loss_l + (htl[i] * w["h"][n]).sum()
        else:  # goes on: its state after this rank's tokens
            assert rel(htl[i], mids[rank, n]) < tol, (rank, n, "state at the slice end")
            loss_l = loss_l + (htl[i] * w["mid"][rank, n]).sum()
    assert rel(ol, o[:, lo:hi].detach()) < tol, (rank, "o", rel(ol, o[:, lo:hi].detach()))
    loss_l.backward()
    for n in ("q", "k", "v", "g", "beta"):
        e = rel(xl[n].grad, xs[n].grad[:, lo:hi])
        assert e < gtol, (rank, "d" + n, e)
    dh0 = tr(h0l.grad)
    for i, n in enumerate(gi):
        if bounds[n] < lo:  # started on an earlier rank: its initial state row is not read
            assert torch.count_nonzero(dh0[i]) == 0, (rank, n)
        else:
            assert rel(dh0[i], xs["h0"].grad[n]) < h0_tol, (rank, n, "dh0")


def _run(world, lens, state_v_first=False, device="cpu", h0_fp32=False):
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), lens, state_v_first, device, h0_fp32), nprocs=world,
                 join=True)


# With L tokens per rank: a sequence over every rank (crossed whole by the middle ones), and a
# layout with a sequence that ends exactly at a boundary, an empty sequence right there, and
# sequences that cross one boundary each.
@pytest.mark.parametrize("world", [2, 4])
def test_one_sequence_over_every_rank(world):
    L = 48
    _run(world, [world * L - 5, 5])


@pytest.mark.parametrize("world,lens", [(2, [48, 0, 30, 18]), (4, [48, 0, 70, 50, 24])])
def test_boundaries_empty_and_crossing_sequences(world, lens):
    _run(world, lens, state_v_first=world == 4)


def test_fp32_initial_state_with_fp64_inputs():
    # The states the ranks exchange stay fp64 (an fp32 h0 rounded them: o 4e-9, gradients 1e-8).
    _run(2, [85, 5], h0_fp32=True)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs a Hopper (sm90) GPU")
@pytest.mark.parametrize("lens", [[507, 5], [256, 0, 150, 106]])
def test_cuda_ranks_sharing_one_gpu(lens):
    # The CUDA path (bf16, K = V = 128) with two processes on one GPU, the states gathered
    # through the host by gloo: a sequence over both ranks, and one ending at the boundary.
    _run(2, lens, device="cuda")


def _check_errors(rank, world):
    with pytest.raises(ValueError, match=r"cu_seqlens: expected the total length to be a positive multiple of "
                                         r"the group size 2 \(equal slices per rank\), got T=7"):
        qla.build_cp_context([0, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens: expected non-decreasing boundaries from 0"):
        qla.build_cp_context([0, 9, 8])
    ctx = qla.build_cp_context(torch.tensor([0, 5, 8]))
    assert ctx.tokens_per_rank == 4 and ctx.num_local_seqs == (2 if rank == 1 else 1)
    x, _ = _inputs([8], 2)
    args = [x[n][:, :4] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=r"cu_seqlens: expected None with cp_context"):
        qla.chunk_gated_delta_rule(*args, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    with pytest.raises(ValueError, match=r"split, split_chunks, batch_invariant: expected the defaults"):
        qla.chunk_gated_delta_rule(*args, split=True, cp_context=ctx)
    with pytest.raises(ValueError, match=r"q: expected this rank's slice of 4 tokens \(cp_context\), got 3"):
        qla.chunk_gated_delta_rule(*(t[:, :3] for t in args), cp_context=ctx)


def _errors_worker(rank, world, store):
    _in_group(rank, world, store, _check_errors)


def test_context_errors():
    with pytest.raises(ValueError, match="cp_context: expected an initialised torch.distributed process group"):
        qla.build_cp_context([0, 8])
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_errors_worker, args=(2, os.path.join(d, "store")), nprocs=2, join=True)
