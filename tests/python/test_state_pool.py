"""State pools: chunk_gated_delta_rule reading and writing states in place through per-sequence
slot indices (state_pool, initial_state_indices, final_state_indices), as inference engines
keep them. Each call is compared with the same call on gathered states (initial_state =
pool[slots]) and its final states scattered back: the same arithmetic, so the same bits."""
import pytest
import torch

import qla
from conftest import make_inputs

CUDA = torch.cuda.is_available() and qla._C.cuda_compiled() and torch.cuda.get_device_capability()[0] == 9


def _varlen(lens, H, HV, K, V, dtype, device, seed=0):
    x = make_inputs(1, sum(lens), H, HV, K, V, dtype=dtype, device=device, seed=seed)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    return x, cu


def _expected(x, cu, pool, reads, writes, state_v_first=False, **kw):
    """o and the pool after the call, from a call on gathered states and a scatter."""
    N = len(reads)
    h0 = torch.zeros((N,) + tuple(pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    for n, s in enumerate(reads):
        if s >= 0:
            h0[n] = pool[s]
    o, ht = qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu, state_v_first=state_v_first, **kw)
    after = pool.clone()
    for n, s in enumerate(writes):
        if s >= 0:
            after[s] = ht[n]
    return o, after


def _pool_call(x, cu, pool, reads, writes, index_dtype=torch.int32, **kw):
    dev = pool.device
    ri = None if reads is None else torch.tensor(reads, dtype=index_dtype, device=dev)
    wi = None if writes is None else torch.tensor(writes, dtype=index_dtype, device=dev)
    return qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, state_pool=pool,
                                      initial_state_indices=ri, final_state_indices=wi, **kw)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_pool_read_and_written_in_place_equals_gathered_states(index_dtype, state_v_first):
    lens = [37, 0, 70, 5]
    x, cu = _varlen(lens, 2, 4, 16, 8, torch.float64, "cpu")
    shape = (7, 4, 8, 16) if state_v_first else (7, 4, 16, 8)
    pool = torch.randn(shape, dtype=torch.float64)
    reads, writes = [3, 5, -1, 3], [3, -1, 6, 0]  # slot 3 read by sequences 0 and 3, written by 0
    # (sequence 3 reads slot 3, which sequence 0 writes: refused below; here 3 reads 1 instead)
    reads[3] = 1
    want_o, want_pool = _expected(x, cu, pool, reads, writes, state_v_first=state_v_first)
    o, ht = _pool_call(x, cu, pool, reads, writes, index_dtype, state_v_first=state_v_first)
    assert ht is None
    assert torch.equal(o, want_o)
    assert torch.equal(pool, want_pool)  # written slots hold the final states, the others unchanged


def test_pool_read_only_returns_the_final_state():
    x, cu = _varlen([20, 33], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    before = pool.clone()
    want_o, want_pool = _expected(x, cu, pool, [2, -1], [0, 1])
    o, ht = _pool_call(x, cu, pool, [2, -1], None, output_final_state=True)
    assert torch.equal(pool, before)
    assert torch.equal(o, want_o)
    assert torch.equal(ht[0], want_pool[0]) and torch.equal(ht[1], want_pool[1])


def test_pool_write_only_starts_from_zeros():
    x, cu = _varlen([20, 33], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    want_o, want_pool = _expected(x, cu, pool, [-1, -1], [2, 0])
    o, _ = _pool_call(x, cu, pool, None, [2, 0])
    assert torch.equal(o, want_o) and torch.equal(pool, want_pool)


def test_pool_with_no_tokens_copies_each_start_into_its_slot():
    x, cu = _varlen([0, 0], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    before = pool.clone()
    o, _ = _pool_call(x, cu, pool, [2, -1], [1, 0])
    assert o.numel() == 0
    assert torch.equal(pool[1], before[2]) and torch.equal(pool[0], torch.zeros_like(pool[0]))
    assert torch.equal(pool[2], before[2])


def test_pool_errors_name_the_argument():
    x, cu = _varlen([10, 12], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.zeros(3, 2, 8, 8, dtype=torch.float64)
    idx = lambda *v: torch.tensor(v, dtype=torch.int32)
    call = lambda **kw: qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match="initial_state_indices: expected entries below initial_state_slots=3"):
        call(state_pool=pool, initial_state_indices=idx(0, 3))
    with pytest.raises(ValueError, match="final_state_indices: expected distinct slots"):
        call(state_pool=pool, final_state_indices=idx(1, 1))
    with pytest.raises(ValueError, match="initial_state_indices: slot 1 .* written by another sequence"):
        call(state_pool=pool, initial_state_indices=idx(1, 2), final_state_indices=idx(0, 1))
    with pytest.raises(ValueError, match="initial_state: expected None with state_pool"):
        call(state_pool=pool, initial_state_indices=idx(0, 1), initial_state=x["initial_state"][:2])
    with pytest.raises(ValueError, match="state_pool: expected the pool"):
        call(initial_state_indices=idx(0, 1))
    with pytest.raises(ValueError, match="state_pool: expected initial_state_indices and/or final_state_indices"):
        call(state_pool=pool)
    with pytest.raises(ValueError, match=r"state_pool: expected shape \[S, 2, 8, 8\]"):
        call(state_pool=torch.zeros(3, 2, 8, 4, dtype=torch.float64), initial_state_indices=idx(0, 1))
    with pytest.raises(ValueError, match="final_state_indices: expected a 1-D int32 or int64 tensor of N=2"):
        call(state_pool=pool, final_state_indices=idx(0, 1, 2))
    with pytest.raises(ValueError, match="initial_state_indices: expected a 1-D int32 or int64"):
        call(state_pool=pool, initial_state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="final_state_indices: expected a torch.Tensor"):
        call(state_pool=pool, final_state_indices=[0, 1])
    q = x["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="state_pool: the pool is read and written in place, for inference"):
        qla.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, state_pool=pool,
                                   initial_state_indices=idx(0, 1))
    assert torch.equal(pool, torch.zeros_like(pool))  # nothing written by the refused calls


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_16bit_pool_reads_exactly_and_writes_rounded_to_nearest(pool_dtype, in_dtype):
    # An engine's 16-bit state cache: the call equals the one on an fp32 copy of the pool (every
    # 16-bit value is exact in fp32, the arithmetic is the same) with the written slots rounded to
    # nearest, bit for bit; the other slots keep their bits.
    x, cu = _varlen([37, 0, 70, 5], 2, 4, 16, 8, in_dtype, "cpu", seed=3)
    pool = (torch.randn(6, 4, 16, 8) * 4).to(pool_dtype)
    pool32 = pool.float()
    reads, writes = [3, 5, -1, 1], [3, -1, 4, 0]
    want_o, want32 = _pool_call(x, cu, pool32, reads, writes)[0], pool32
    before = pool.clone()
    o, ht = _pool_call(x, cu, pool, reads, writes)
    assert ht is None and torch.equal(o, want_o)
    assert torch.equal(pool, want32.to(pool_dtype))
    assert torch.equal(pool[[1, 2, 5]], before[[1, 2, 5]])
    assert not torch.equal(pool[3], before[3])  # (written: the test sees the write)
    # read only, the final states returned in fp32 as without a pool
    pool = before.clone()
    o2, ht2 = _pool_call(x, cu, pool, reads, None, output_final_state=True)
    _, want_ht = _pool_call(x, cu, before.float(), reads, None, output_final_state=True)
    assert torch.equal(pool, before) and ht2.dtype == torch.float32 and torch.equal(ht2, want_ht)
    # no tokens: each start copied into its slot (exact: 16-bit to 16-bit)
    xe, cue = _varlen([0, 0], 2, 4, 16, 8, in_dtype, "cpu")
    pool = before.clone()
    _pool_call(xe, cue, pool, [2, -1], [1, 0])
    assert torch.equal(pool[1], before[2]) and torch.equal(pool[0], torch.zeros_like(pool[0]))


def test_16bit_states_are_for_the_forward_of_16bit_or_fp32_inputs():
    x, cu = _varlen([10, 12], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.zeros(3, 2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"state_pool: expected dtype in \(float32, float64\), got bfloat16"):
        _pool_call(x, cu, pool, [0, 1], None)
    # without a pool, initial_state stays fp32 (the autograd path's states)
    y = make_inputs(2, 10, 1, 2, 8, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="initial_state: expected dtype float32"):
        qla.chunk_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"],
                                   initial_state=y["initial_state"].to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# CUDA (sm90): the same properties on the fused, split and two-pass forwards.
# ----------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not CUDA, reason="needs an sm90 GPU")


@cuda
@pytest.mark.parametrize("lens,split", [
    ([300, 4000, 130], False),          # fused (or two-pass) whole sequences
    ([8192, 700], True),                # split: the last piece writes the slot piece 0 reads
    ([64 * 40], True),
    ([120, 0], None),                   # 16 pairs of short sequences: the two-pass forward
])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_cuda_pool_in_place_equals_gathered_states(lens, split, state_v_first):
    H, HV = 2, 8
    x, cu = _varlen(lens, H, HV, 128, 128, torch.bfloat16, "cuda")
    N = len(lens)
    slots = 2 * N + 1
    shape = (slots, HV, 128, 128)
    pool = torch.randn(shape, dtype=torch.float32, device="cuda")
    reads = [2 * n + 1 for n in range(N)]
    reads[-1] = -1
    writes = [2 * n + 1 for n in range(N)]  # in place: each sequence writes the slot it read
    kw = dict(split=split, split_chunks=8 if split else None)
    want_o, want_pool = _expected(x, cu, pool, reads, writes, state_v_first=state_v_first, **kw)
    o, _ = _pool_call(x, cu, pool, reads, writes, state_v_first=state_v_first, **kw)
    torch.cuda.synchronize()
    assert torch.equal(o, want_o)
    assert torch.equal(pool, want_pool)


@cuda
def test_cuda_pool_index_past_the_pool_gives_nan():
    x, cu = _varlen([100, 200], 1, 2, 128, 128, torch.bfloat16, "cuda")
    pool = torch.zeros(2, 2, 128, 128, device="cuda")
    o, _ = _pool_call(x, cu, pool, [0, 2], [1, 0])  # 2 is past the pool's 2 slots: no sync, NaN
    torch.cuda.synchronize()
    assert torch.isnan(o).all()
    assert torch.isnan(pool).all()  # every final slot in range


@cuda
def test_cuda_pool_call_is_capturable_and_deterministic():
    from conftest import capture_cuda_graph
    x, cu = _varlen([3000, 900], 2, 8, 128, 128, torch.bfloat16, "cuda")
    start = torch.randn(4, 8, 128, 128, device="cuda")
    pool = start.clone()
    ri = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
    call = lambda: qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu,
                                              state_pool=pool, initial_state_indices=ri, final_state_indices=ri)
    graph, (o, _) = capture_cuda_graph(call)
    results = []
    for _ in range(2):
        pool.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        results.append((o.clone(), pool.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    pool.copy_(start)
    want_o, want_pool = _expected(x, cu, start, [1, 3], [1, 3])
    assert torch.equal(results[0][0], want_o) and torch.equal(results[0][1], want_pool)


def test_low_level_forward_takes_the_pool_too():
    x, cu = _varlen([25, 40], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    want_o, want_pool = _expected(x, cu, pool, [1, 2], [1, 2])
    ri = torch.tensor([1, 2])
    o, ht = qla.chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, state_pool=pool,
                                           initial_state_indices=ri, final_state_indices=ri)
    assert ht is None and torch.equal(o, want_o) and torch.equal(pool, want_pool)


def test_pool_refused_with_cp_context():
    x, cu = _varlen([25, 40], 1, 2, 8, 8, torch.float64, "cpu")
    with pytest.raises(ValueError, match="state_pool: expected None with cp_context"):
        qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cp_context=object(),
                                   state_pool=torch.zeros(3, 2, 8, 8, dtype=torch.float64),
                                   initial_state_indices=torch.tensor([0, 1]))


def test_pool_with_no_tokens_checks_its_indices():
    x, cu = _varlen([0, 0], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.zeros(3, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="initial_state_indices: expected entries below initial_state_slots=3"):
        _pool_call(x, cu, pool, [3, 0], None)
    with pytest.raises(ValueError, match="final_state_indices: expected distinct slots"):
        _pool_call(x, cu, pool, None, [1, 1])
    with pytest.raises(ValueError, match="written by another sequence"):
        _pool_call(x, cu, pool, [1, 2], [0, 1])


def test_overlapping_states_of_another_view_are_refused():
    # One pool is the same tensor; overlapping memory behind another view could be written before
    # it is read, so it is refused (the core's check, C++ and Python alike).
    x, cu = _varlen([10, 12], 1, 2, 8, 8, torch.float64, "cpu")
    pool = torch.zeros(4, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="final_state: expected memory apart from initial_state's"):
        qla._ops.forward_impl(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, pool[1:3], cu, False, False, False,
                              qla._ops.SPLIT_AUTO, 0, False, None, pool[0:3],
                              None, torch.tensor([0, 1]))


@cuda
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_cuda_16bit_pool_is_refused_by_name(pool_dtype):
    x, cu = _varlen([300, 130], 2, 4, 128, 128, torch.bfloat16, "cuda")
    pool = torch.randn(4, 4, 128, 128, device="cuda").to(pool_dtype)
    before = pool.clone()
    with pytest.raises(ValueError, match="initial_state: expected dtype float32 on this backend"):
        _pool_call(x, cu, pool, [0, 1], [2, 3])
    with pytest.raises(ValueError, match="final_state: expected dtype float32 on this backend"):
        _pool_call(x, cu, pool, None, [2, 3])
    assert torch.equal(pool, before)
