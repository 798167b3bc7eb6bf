"""sm90 forward on the GPU (skipped without a CUDA device of compute capability 9.x).

Accuracy is relative L2 against the fp64 reference on the benchmark input distribution
(bf16 q/k/v), plus the strongly decaying and g = 0 cases; outputs are poisoned first
(NaN left in the caching allocator) so an unwritten element fails the NaN check.
"""
import pytest
import torch
import torch.nn.functional as F

import qla
from conftest import capture_cuda_graph, reference, rel_err

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
    reason="needs a Hopper (sm90) GPU",
)

TOL = 3e-3


def _inputs(lens, H, HV, gate, dtype=torch.bfloat16, seed=0, K=128, V=128, state=True, zero_heads=False):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    x = torch.randn(1, T, HV, generator=gen)
    g = {"mild": F.logsigmoid(x) / 16, "strong": F.logsigmoid(x), "zero": torch.zeros_like(x)}[gate]
    if zero_heads:
        g[:, :, torch.randperm(HV, generator=gen)[: max(1, HV // 4)]] = 0
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    h0 = torch.randn(len(lens), HV, K, V, generator=gen) if state else None
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    dev = "cuda"
    return dict(q=q.to(dtype).to(dev), k=k.to(dtype).to(dev), v=v.to(dtype).to(dev), g=g.to(dev),
                beta=beta.to(dev), initial_state=None if h0 is None else h0.to(dev), cu_seqlens=cu.to(dev))


def _poison_allocator(*shapes_dtypes):
    """Leaves NaN-filled blocks of these sizes in torch's caching allocator for reuse."""
    blocks = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del blocks


def _check(x, state_v_first=False, scale=None, **opts):
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    N, HV, K, V = cu.numel() - 1, v.shape[2], q.shape[3], v.shape[3]
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    _poison_allocator((v.shape, v.dtype), ((N, HV, K, V), torch.float32))
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, state_v_first=state_v_first, **opts)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), "o has NaN or unwritten elements"
    assert not torch.isnan(ht).any(), "final state has NaN or unwritten elements"
    h0_ref = None if x["initial_state"] is None else x["initial_state"].cpu()
    ro, rht = reference(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=scale, initial_state=h0_ref,
                        cu_seqlens=cu.cpu())
    if state_v_first:
        ht = ht.transpose(-1, -2)
    return rel_err(o, ro), rel_err(ht, rht)


@pytest.mark.parametrize("gate", ["mild", "strong", "zero"])
def test_accuracy_bf16_benchmark_distribution(gate):
    e_o, e_h = _check(_inputs([300], 2, 4, gate, zero_heads=(gate == "mild")))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_varlen_with_zero_lengths_and_ragged_tails():
    e_o, e_h = _check(_inputs([0, 1, 63, 64, 65, 200, 0, 130], 1, 2, "mild", seed=1))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4), (1, 4)])
def test_gva_ratios(H, HV):
    e_o, e_h = _check(_inputs([129, 70], H, HV, "mild", seed=2))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def _mixed_lengths(n, seed, longest):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, longest + 1, (n,), generator=gen).tolist()
    lens[::7] = [0] * len(lens[::7])  # empty sequences among them
    return lens


def test_many_sequences_of_mixed_lengths_over_several_waves():
    # 70 sequences (more than one warp of the chunk table's longest-first sort, repeated and
    # empty lengths): the recurrence's CTAs run longest first over several waves, and every
    # sequence must still land in its own rows and final state.
    e_o, e_h = _check(_inputs(_mixed_lengths(70, 20, 300), 2, 4, "mild", seed=20))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_two_identical_calls_give_identical_bits():
    # Bitwise deterministic: no floating-point atomics, a fixed reduction order. Both forwards
    # and all their tiles: two-pass (16 pairs: V tile 32), fused at V tile 64 (two sequences,
    # 64 pairs) and at V tile 128 (640 pairs, several waves).
    for lens, H, HV in (([3000, 700], 2, 8), ([3000, 700], 8, 32), (_mixed_lengths(40, 22, 600), 4, 16)):
        x = _inputs(lens, H, HV, "mild", seed=22, zero_heads=True)
        run = lambda: qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                 initial_state=x["initial_state"], output_final_state=True,
                                                 cu_seqlens=x["cu_seqlens"])
        (o1, h1), (o2, h2) = run(), run()
        torch.cuda.synchronize()
        assert torch.equal(o1, o2) and torch.equal(h1, h2), lens


def test_two_uneven_sequences_many_heads():
    # The fused forward at V tile 64 (two sequences, 96 pairs: more CTAs than SMs): the long
    # sequence's CTAs go first.
    e_o, e_h = _check(_inputs([130, 700], 16, 48, "mild", seed=21))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def _many_short_sequences():
    # More sequences than one grid dimension holds (65535): the sequential passes' grid puts the
    # ranks past it in blockIdx.z. All but three have one token; the three longer ones are last
    # in index order and first in the launch order.
    return [1] * 65600 + [300, 130, 64]


def test_more_sequences_than_a_grid_dimension():
    x = _inputs(_many_short_sequences(), 1, 1, "mild", seed=22, state=False)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = qla.chunk_gated_delta_rule(*args, output_final_state=True, cu_seqlens=x["cu_seqlens"])
    ro, rht = qla.chunk_gated_delta_rule(*(a.cpu() for a in args), output_final_state=True,
                                         cu_seqlens=x["cu_seqlens"].cpu())  # the exact CPU backend
    assert rel_err(o, ro) < TOL
    for part in (slice(0, 300), slice(65400, None)):  # both sides of the 65535 boundary
        assert rel_err(ht[part], rht[part]) < TOL, part


def test_state_v_first_no_initial_state_fp16_and_scale():
    e_o, e_h = _check(_inputs([100, 50], 1, 2, "mild", seed=3), state_v_first=True)
    assert e_o < TOL and e_h < TOL
    e_o, e_h = _check(_inputs([150], 1, 2, "mild", seed=4, state=False))
    assert e_o < TOL and e_h < TOL
    e_o, e_h = _check(_inputs([150], 1, 2, "mild", seed=5, dtype=torch.float16), scale=0.3)
    assert e_o < 1e-3 and e_h < 1e-3


def _spread_norms(x, lo=-8.0, hi=8.0, seed=11):
    """q, k rows rescaled to norms 2^U(lo, hi) per token (use_qk_l2norm_in_kernel=False inputs),
    beta divided by max(1, |k|^2) so that the recurrence stays stable."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(x)
    for name in ("q", "k"):
        t = x[name].float().cpu()
        f = torch.exp2(torch.empty(t.shape[:-1] + (1,)).uniform_(lo, hi, generator=gen))
        out[name] = (t * f).to(x[name].dtype).to("cuda")
    k2 = out["k"].float().pow(2).sum(-1)  # [1, T, H]
    HV, H = x["v"].shape[2], x["k"].shape[2]
    out["beta"] = x["beta"] / k2.repeat_interleave(HV // H, dim=2).clamp(min=1.0)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens,H,HV", [([700, 300], 4, 16), ([300], 1, 2)])
def test_queries_and_keys_far_from_unit_norm(dtype, lens, H, HV):
    # 20 pairs and more take the fused forward (per-token power-of-two scales of q and k); 2 pairs
    # the two-pass one in bf16, the fused one in fp16 (its fp16 images would overflow).
    e_o, e_h = _check(_spread_norms(_inputs(lens, H, HV, "mild", dtype=dtype, seed=21)))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_next_sequence_keys_beyond_fp16_range():
    # A sequence ending inside a chunk: the chunk's last rows are the next sequence's tokens,
    # which the fused forward multiplies by zeros. Their bf16 keys of norm ~2^17 (elements past
    # fp16's 65504) must be scaled like any key, or 0 x Inf makes the first sequence's state and
    # last o rows NaN. 24 pairs (the fused forward); beta scaled down so the state stays bounded.
    x = _inputs([10, 118, 40], 2, 24, "mild", seed=23)
    k = x["k"].float()
    k[:, 10:74] *= 2.0 ** 17
    x["k"] = k.to(torch.bfloat16)
    k2 = x["k"].float().pow(2).sum(-1).repeat_interleave(12, dim=2)
    x["beta"] = x["beta"] / k2.clamp(min=1.0)
    e_o, e_h = _check(x)
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


POISONS = (2.0 ** 26, float("inf"), float("nan"))


def poison(t, value):
    """t scaled by value (far beyond the others, Inf or NaN), in t's dtype."""
    return (value * torch.randn_like(t, dtype=torch.float32)).to(t.dtype)


def poisoned_sequences(x):
    """(bad, value, y) for sequences 1 and 2 of x and each of POISONS: y is x with sequence bad's
    q, k, v, g and beta replaced by poison values."""
    cu = x["cu_seqlens"].tolist()
    for bad in (1, 2):
        t = slice(cu[bad], cu[bad + 1])
        for value in POISONS:
            y = {n: (a.clone() if isinstance(a, torch.Tensor) else a) for n, a in x.items()}
            for n in ("q", "k", "v"):
                y[n][:, t] = poison(y[n][:, t], value)
            for n in ("g", "beta"):
                y[n][:, t] = value
            yield bad, value, y


@pytest.mark.parametrize("lens,H,HV,split_chunks", [([10, 118, 40], 2, 24, None), ([200, 300, 150], 2, 24, 1),
                                                     ([10, 118, 40], 1, 2, None), ([65, 63, 40], 2, 24, None),
                                                     ([65, 63, 40], 1, 2, None)])  # (last chunks of 1 and 63 rows)
def test_a_sequence_s_bits_do_not_depend_on_the_next_sequence_s_tokens(lens, H, HV, split_chunks):
    # A sequence ending inside a chunk shares the chunk's tiles with the next sequence's first
    # tokens. Whatever those hold (finite values far beyond the others, Inf, NaN; in q, k, v, g
    # and beta), the other sequences' o and final states keep their bits. The fused forward
    # (24 value heads: 72 pairs), whole and split into pieces of one chunk, and the two-pass
    # forward (6 pairs of short sequences).
    x = _inputs(lens, H, HV, "mild", seed=31)
    cu = x["cu_seqlens"].tolist()

    def run(y):
        o, ht = qla.chunk_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["initial_state"],
                                           output_final_state=True, cu_seqlens=y["cu_seqlens"],
                                           split=None if split_chunks is None else True, split_chunks=split_chunks)
        torch.cuda.synchronize()
        return o, ht

    o_ref, h_ref = run(x)
    assert not torch.isnan(o_ref).any() and not torch.isnan(h_ref).any()
    for bad, value, y in poisoned_sequences(x):
        o, ht = run(y)
        for n in range(len(lens)):
            if n == bad:
                continue
            s = slice(cu[n], cu[n + 1])
            assert torch.equal(o[:, s], o_ref[:, s]), f"sequence {n}'s o changed with sequence {bad} at {value}"
            assert torch.equal(ht[n], h_ref[n]), f"sequence {n}'s state changed with sequence {bad} at {value}"


@pytest.mark.parametrize("scale", [7e4, 1e-5])
def test_scale_far_from_the_usual_in_the_fused_forward(scale):
    # scale multiplies o alone. Folded into the fused forward's fp16 scores A it overflowed them
    # (7e4 with q = k: Inf, o NaN) or sent them into subnormals (1e-5: o 5.5e-2 in the host
    # model). 48 pairs: the fused forward.
    x = _inputs([300, 200], 2, 24, "mild", seed=37)
    x["q"] = x["k"].clone()
    e_o, e_h = _check(x, scale=scale)
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


@pytest.mark.parametrize("scale,magnitude", [(7e4, 1e-3), (1e-5, 1e3)])
def test_fp16_scale_far_from_the_usual_with_few_pairs(scale, magnitude):
    # fp16 with unit-norm rows declared (use_qk_l2norm_in_kernel) and few short pairs: the two-pass
    # forward's fp16 score images would overflow (7e4 x q.k with q = k) or lose their entries to
    # subnormals (1e-5), so such scales take the fused forward (path_rule in gdn_fwd_sm90.cu). v
    # and h0 are scaled so that o itself stays in fp16's normal range (o ~ scale x v).
    x = _inputs([300, 200], 1, 2, "mild", dtype=torch.float16, seed=38)
    x["q"] = x["k"].clone()
    x["v"] = x["v"] * magnitude
    x["initial_state"] = x["initial_state"] * magnitude
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    qn, kn = qla.l2norm(q), qla.l2norm(k)
    ro, rht = reference(qn.cpu(), kn.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=scale, initial_state=h0.cpu(),
                        cu_seqlens=cu.cpu())
    assert rel_err(o, ro) < TOL and rel_err(ht, rht) < TOL, (rel_err(o, ro), rel_err(ht, rht))


def test_qk_l2norm_in_kernel_hint_path():
    # use_qk_l2norm_in_kernel=True normalises q, k and tells the core they are unit rows.
    x = _spread_norms(_inputs([1000, 24], 4, 16, "mild", seed=22), lo=-3.0, hi=3.0)
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
    qn, kn = qla.l2norm(q), qla.l2norm(k)
    ro, rht = reference(qn.cpu(), kn.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=h0.cpu(), cu_seqlens=cu.cpu())
    assert rel_err(o, ro) < TOL and rel_err(ht, rht) < TOL, (rel_err(o, ro), rel_err(ht, rht))


@pytest.mark.parametrize("gate,zero_heads", [("mild", True), ("strong", False), ("zero", False)])
@pytest.mark.parametrize("split_chunks,state_v_first", [(1, False), (5, True)])
def test_split_sequences_match_the_unsplit_reference(gate, zero_heads, split_chunks, state_v_first):
    # Sequence splitting forced on, pieces of 1 or 5 chunks: the exact path (transfer maps and
    # their scan) for g = 0 heads and mild gates near the sequence start, the warm-up path for
    # strongly decaying heads and mild ones with 8 chunks before a boundary; ragged and empty
    # sequences, h0 in both layouts, against the unsplit fp64 reference.
    x = _inputs([1500, 0, 700, 64, 1], 2, 4, gate, seed=30, zero_heads=zero_heads)
    e_o, e_h = _check(x, state_v_first=state_v_first, split=True, split_chunks=split_chunks)
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_host_lengths_plan_the_forward():
    # cu_seqlens_cpu reaches the CUDA forward's plan. Two 4096-token sequences at 2/8 (16 pairs)
    # are short by their host lengths (64 chunks: the two-pass forward) and long without them
    # (the bound T, 128 chunks: the fused forward, split), so the workspace differs. Calls with
    # host lengths are exact: those two, and 12288 + 4096 tokens, where the pieces follow the
    # true longest sequence instead of T (given as a tensor and as a list).
    from qla import _ops
    x = _inputs([4096, 4096], 2, 8, "mild", seed=35, zero_heads=True)
    q, v, g, cu = x["q"], x["v"], x["g"], x["cu_seqlens"]
    host = cu.cpu().to(torch.int64)
    descs = (_ops._desc(q), _ops._desc(q), _ops._desc(v), _ops._desc(g), _ops._desc(g), _ops._desc(None),
             _ops._cu_desc(cu), 2, _ops._desc(v), _ops._desc(None))
    size = lambda ptr: _ops._C.forward_workspace_size((1, 8192, 2, 8, 128, 128), *descs, 128 ** -0.5, 0, 1, False,
                                                      _ops.SPLIT_AUTO, 0, False, ptr, _ops._NO_POOLS)
    assert size(host.data_ptr()) != size(0)
    e_o, e_h = _check(x, cu_seqlens_cpu=host)
    assert e_o < TOL and e_h < TOL, (e_o, e_h)
    x = _inputs([12288, 4096], 2, 8, "mild", seed=36, zero_heads=True)
    for cpu_copy in (x["cu_seqlens"].cpu(), x["cu_seqlens"].cpu().tolist()):
        e_o, e_h = _check(x, cu_seqlens_cpu=cpu_copy)
        assert e_o < TOL and e_h < TOL, (e_o, e_h)


def _static_call(x):
    """Copies of the inputs, and the forward on them (for graph capture: fixed addresses)."""
    static = {n: t.clone() for n, t in x.items()}
    run = lambda: qla.chunk_gated_delta_rule(static["q"], static["k"], static["v"], static["g"], static["beta"],
                                             initial_state=static["initial_state"], output_final_state=True,
                                             cu_seqlens=static["cu_seqlens"])
    return static, run


def _graph_replay_errors(static, run, fresh):
    """Captures run, replays it on `fresh` inputs copied into its buffers: (o, state) errors."""
    graph, (o, ht) = capture_cuda_graph(run)
    for n in ("q", "k", "v", "g", "beta", "initial_state"):
        static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()
    ro, rht = reference(*(fresh[n].cpu() for n in ("q", "k", "v", "g", "beta")),
                        initial_state=fresh["initial_state"].cpu(), cu_seqlens=fresh["cu_seqlens"].cpu())
    return rel_err(o, ro), rel_err(ht, rht)


def test_split_long_sequence_by_default_deterministic_and_graph_capturable():
    # One 16384-token sequence on 2 value heads (one with g = 0): the default plan splits it.
    # Two identical calls give identical bits; a captured graph replays on fresh inputs.
    x = _inputs([16384], 1, 2, "mild", seed=31, zero_heads=True)
    e_o, e_h = _check(x)
    assert e_o < TOL and e_h < TOL, (e_o, e_h)
    static, run = _static_call(x)
    (o1, h1), (o2, h2) = run(), run()
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    e_o, e_h = _graph_replay_errors(static, run, _inputs([16384], 1, 2, "strong", seed=32))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_batch_invariant_bits_do_not_depend_on_the_batch_or_the_head_count():
    # batch_invariant=True: two sequences (5000 tokens: split into pieces; 700) give bitwise the
    # same o and final state alone (V tile 64), inside a call with 40 more sequences (V tile
    # 128, several waves), and as a tensor-parallel shard (key head 1 and value heads 4-7 of 8).
    H, HV, lens = 2, 8, [5000, 700]
    x = _inputs(lens + _mixed_lengths(40, 23, 900), H, HV, "mild", seed=33, zero_heads=True)
    T2 = sum(lens)
    cu2 = torch.tensor([0, 5000, T2], dtype=torch.int32, device="cuda")

    def run(q, k, v, g, beta, h0, cu):
        o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu, batch_invariant=True)
        return o[:, :T2], ht[:2]

    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    o_all, h_all = run(q, k, v, g, beta, h0, cu)
    o_two, h_two = run(q[:, :T2], k[:, :T2], v[:, :T2], g[:, :T2], beta[:, :T2], h0[:2], cu2)
    hs = slice(4, 8)
    o_tp, h_tp = run(*(t[:, :T2, 1:2].contiguous() for t in (q, k)), v[:, :T2, hs].contiguous(),
                     g[:, :T2, hs].contiguous(), beta[:, :T2, hs].contiguous(), h0[:2, hs].contiguous(), cu2)
    torch.cuda.synchronize()
    assert torch.equal(o_two, o_all) and torch.equal(h_two, h_all), "a sequence's bits changed with the batch"
    assert torch.equal(o_tp, o_all[:, :, hs]) and torch.equal(h_tp, h_all[:, hs]), "bits changed with the head count"
    ro, rht = reference(*(t[:, :T2].cpu() for t in (q, k, v, g, beta)), initial_state=h0[:2].cpu(), cu_seqlens=cu2.cpu())
    assert rel_err(o_two, ro) < TOL and rel_err(h_two, rht) < TOL, (rel_err(o_two, ro), rel_err(h_two, rht))


def test_batch_invariant_workspace_with_many_short_sequences():
    # batch_invariant fixes pieces of up to 64 chunks for every sequence; the transfer maps are
    # sized by the tokens (fewer than T / 4096 pieces have one), not by the sequence count: 4000
    # sequences of 100 tokens need none, and the bound adds ~50 MB here, not gigabytes.
    from qla import _ops
    N, L, H, HV, D = 4000, 100, 1, 2, 128
    T = N * L
    q = torch.empty(1, T, H, D, dtype=torch.bfloat16, device="cuda")
    v = torch.empty(1, T, HV, D, dtype=torch.bfloat16, device="cuda")
    g = torch.empty(1, T, HV, device="cuda")
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    descs = (_ops._desc(q), _ops._desc(q), _ops._desc(v), _ops._desc(g), _ops._desc(g), _ops._desc(None),
             _ops._cu_desc(cu), N, _ops._desc(v), _ops._desc(None))
    size = lambda inv: _ops._C.forward_workspace_size((1, T, H, HV, D, D), *descs, D ** -0.5, 0, 1, False,
                                                      _ops.SPLIT_AUTO, 0, inv, 0, _ops._NO_POOLS)
    extra = size(True) - size(False)
    assert 0 <= extra <= T // 4096 * HV * D * 2 * D * 4 + 4 * 3 * N + 16384, extra
    k = F.normalize(torch.randn(1, T, H, D, device="cuda"), dim=-1).to(torch.bfloat16)
    o, _ = qla.chunk_gated_delta_rule(k, k, v.normal_(), g.fill_(-0.05), torch.full_like(g, 0.5), cu_seqlens=cu,
                                      batch_invariant=True)  # and the call runs in that workspace
    assert not torch.isnan(o).any()


def test_fp16_unit_norm_hint_with_few_pairs():
    # fp16 with use_qk_l2norm_in_kernel=True on 2 pairs takes the two-pass forward: the binding's
    # workspace query must see the hint (without it, it sized the fused forward's workspace).
    x = _inputs([300, 77], 1, 1, "mild", dtype=torch.float16, seed=34)
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    o, ht = qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
    ro, rht = reference(qla.l2norm(q).cpu(), qla.l2norm(k).cpu(), v.cpu(), g.cpu(), beta.cpu(),
                        initial_state=h0.cpu(), cu_seqlens=cu.cpu())
    assert rel_err(o, ro) < TOL and rel_err(ht, rht) < TOL, (rel_err(o, ro), rel_err(ht, rht))


def test_batched_without_cu_seqlens_matches_varlen():
    x = _inputs([200, 200], 2, 4, "mild", seed=6)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o1, h1 = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                        cu_seqlens=x["cu_seqlens"])
    o2, h2 = qla.chunk_gated_delta_rule(*(a.reshape(2, 200, *a.shape[2:]) for a in args),
                                        initial_state=x["initial_state"], output_final_state=True)
    assert rel_err(o2.reshape(o1.shape), o1) < 1e-6 and rel_err(h2, h1) < 1e-6


def test_one_row_with_and_without_cu_seqlens_after_each_other():
    # B = 1 and T a multiple of 64: the same shapes and sequence count with and without
    # cu_seqlens, whose workspaces differ (T / 64 chunks against T / 64 + N); the cached size of
    # the first call must not serve the second (forward and backward, both orders).
    x = _inputs([4096], 2, 4, "mild", seed=9)
    args = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    outs = []
    for cu in (None, x["cu_seqlens"], None):
        o, ht = qla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                           cu_seqlens=cu)
        grads = torch.autograd.grad(o.float().square().sum() + ht.sum(), args)
        outs.append((o, ht) + grads)
    for a, b, c in zip(*outs):
        assert not torch.isnan(b).any()
        assert torch.equal(a, c)  # the first call again: the same bits
        assert rel_err(b, a) < 2 * TOL  # each within the bounds of the fp64 result (o 3e-3, gradients 4e-3)


def test_cuda_graph_capture_and_replay_on_new_inputs():
    static, run = _static_call(_inputs([256, 100], 2, 4, "mild", seed=7))
    e_o, e_h = _graph_replay_errors(static, run, _inputs([256, 100], 2, 4, "strong", seed=8))
    assert e_o < TOL and e_h < TOL, (e_o, e_h)


def test_inputs_not_modified_and_unsupported_head_dim_is_a_clear_error():
    x = _inputs([100], 1, 1, "mild", seed=9)
    before = {n: t.clone() for n, t in x.items()}
    qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, cu_seqlens=x["cu_seqlens"])
    for n, t in x.items():
        assert torch.equal(t, before[n]), n
    y = _inputs([10], 1, 1, "mild", K=64, V=64)
    with pytest.raises(ValueError, match=r"128"):
        qla.chunk_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"])


@pytest.mark.parametrize("bad", [[0, 300, 200, 500], [0, 100, 300], [5, 200, 500]])
def test_malformed_device_cu_seqlens_give_nan_not_a_crash(bad):
    # Device cu_seqlens are not read on the host (no synchronisation). Malformed values (here: a
    # decreasing step, a last entry short of T, a first entry not 0) must neither fault nor give a
    # plausible answer: the op writes NaN to every element of o and of the final state.
    x = _inputs([250, 250], 2, 4, "mild")
    x["cu_seqlens"] = torch.tensor(bad, dtype=torch.int32, device="cuda")
    x["initial_state"] = torch.randn(len(bad) - 1, 4, 128, 128, device="cuda")
    o, ht = qla.chunk_gated_delta_rule(**x, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.isnan(o).all() and torch.isnan(ht).all()
    # A well-formed call afterwards is unaffected.
    y = _inputs([250, 250], 2, 4, "mild")
    o2, _ = qla.chunk_gated_delta_rule(**y, output_final_state=True)
    torch.cuda.synchronize()
    assert not torch.isnan(o2).any()
