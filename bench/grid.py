"""The benchmark grid of shared/docs/benchmarks.md, its inputs, the floor of gdn.md section 4,
the ceilings it is measured against, and a CUDA-event timing helper.

Importable without CUDA (and without any peer installed): only torch is needed at import.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

D = 128  # K = V = 128 everywhere in the grid
CHUNK = 64
L2_BYTES = 60 * 10**6  # H200 L2 (60 MB)

# --------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------

# (label, h_qk, h_v)
HEAD_CONFIGS: List[Tuple[str, int, int]] = [
    ("397B/122B TP8", 2, 8),
    ("397B/122B TP4", 4, 16),
    ("397B/122B TP2", 8, 32),
    ("397B/122B TP1", 16, 64),
    ("35B/9B/4B TP1", 16, 32),
    ("27B TP2", 8, 24),
    ("27B TP1", 16, 48),
    ("2B/0.8B TP1", 16, 16),
    ("Sym h32", 32, 32),
]


def _rep(n: int, length: int) -> Tuple[int, ...]:
    return (length,) * n


FWD_LAYOUTS: List[Tuple[int, ...]] = [
    (32768,), (16384,), (8192,), (4096,), (2048,),
    (28672, 4096), (24576, 8192), (16384, 16384), (8192, 24576), (4096, 28672),
    (12288, 4096), (6144, 2048), (4096, 4096), (2048, 6144), (1024, 7168),
    _rep(4, 8192), _rep(8, 4096), _rep(4, 2048), _rep(8, 1024),
]

BWD_HEADS: List[Tuple[int, int]] = [(16, 32), (8, 16), (4, 8), (2, 4)]
BWD_TOTALS: Tuple[int, ...] = (8192, 32768)
BWD_SPLITS: Tuple[int, ...] = (1, 2, 4, 8)
BWD_SEED = 42


def layout_label(lengths: Sequence[int]) -> str:
    """1x32768, 28672+4096, 8192x4 (as benchmarks.md writes them); random cuts joined by '+'."""
    lengths = tuple(int(x) for x in lengths)
    if len(lengths) == 1:
        return f"1x{lengths[0]}"
    if len(set(lengths)) == 1 and len(lengths) > 2:
        return f"{lengths[0]}x{len(lengths)}"
    return "+".join(str(x) for x in lengths)


def random_cut_lengths(total: int, n: int, seed: int = BWD_SEED) -> Tuple[int, ...]:
    """Cut `total` tokens into `n` sequences at random points:
    cuts = sort(randperm(total - 1)[:n - 1]) + 1 from a torch.Generator seeded with `seed`.
    A fresh generator is seeded for every (total, n), so each layout is reproducible alone."""
    if n <= 1:
        return (total,)
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(total - 1, generator=gen)[: n - 1]).values + 1
    bounds = [0] + cuts.tolist() + [total]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Row:
    kind: str                 # "fwd", "bwd" or "step" (one training step: forward + backward)
    label: str                # head-config label
    h: int                    # q/k heads
    hv: int                   # value heads
    lengths: Tuple[int, ...]  # sequence lengths, packed into one B = 1 batch

    @property
    def T(self) -> int:
        return sum(self.lengths)

    @property
    def N(self) -> int:
        return len(self.lengths)

    @property
    def layout(self) -> str:
        return layout_label(self.lengths)

    @property
    def name(self) -> str:
        heads = f"{self.h}/{self.hv}"
        label = heads if self.label == heads else f"{self.label} {heads}"
        return f"{self.kind} {label} {self.layout}"


def fwd_rows() -> List[Row]:
    return [Row("fwd", label, h, hv, lay) for (label, h, hv) in HEAD_CONFIGS for lay in FWD_LAYOUTS]


def bwd_rows(kind: str = "bwd") -> List[Row]:
    """The backward grid's rows; kind "step" gives the same rows as training steps."""
    rows = []
    for h, hv in BWD_HEADS:
        for total in BWD_TOTALS:
            for n in BWD_SPLITS:
                rows.append(Row(kind, f"{h}/{hv}", h, hv, random_cut_lengths(total, n)))
    return rows


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """One input set in QLA's (FLA's) conventions: B = 1, packed with cu_seqlens."""
    q: torch.Tensor             # [1, T, H, D] bf16, l2-normalised
    k: torch.Tensor             # [1, T, H, D] bf16, l2-normalised
    v: torch.Tensor             # [1, T, HV, D] bf16
    g: torch.Tensor             # [1, T, HV] fp32 natural-log decay (<= 0)
    beta: torch.Tensor          # [1, T, HV] fp32
    h0: torch.Tensor            # [N, HV, D, D] fp32, [K, V] layout
    cu_seqlens: torch.Tensor    # [N + 1] int32 or int64
    cu_seqlens_cpu: torch.Tensor  # same values on the host (int64)
    lengths: Tuple[int, ...]
    do: Optional[torch.Tensor] = None   # [1, T, HV, D] bf16 (backward rows)
    dht: Optional[torch.Tensor] = None  # [N, HV, D, D] fp32 (backward rows)
    extra: Dict[str, object] = field(default_factory=dict)

    def nbytes(self) -> int:
        ts = [self.q, self.k, self.v, self.g, self.beta, self.h0, self.do, self.dht]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def make_inputs(
    lengths: Sequence[int],
    h: int,
    hv: int,
    *,
    device="cuda",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    gate: str = "standard",
    cu_dtype: torch.dtype = torch.int32,
    with_grads: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Inputs:
    """Inputs with the distribution of benchmarks.md.

    gate: "standard"  g = logsigmoid(randn) / 16, and g = 0 on a random 25% of value heads
          "strong"    g = logsigmoid(randn) (strong decay)
          "none"      g = 0 on every head
    cu_seqlens: pass one shared tensor for all input sets of a row, so that peers that cache
    host-side metadata by tensor identity (FLA, FlashQLA) hit their cache.
    """
    lengths = tuple(int(x) for x in lengths)
    T, N = sum(lengths), len(lengths)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)

    q = F.normalize(randn(1, T, h, D), p=2, dim=-1).to(dtype)
    k = F.normalize(randn(1, T, h, D), p=2, dim=-1).to(dtype)
    v = randn(1, T, hv, D).to(dtype)
    if gate == "none":
        g = torch.zeros(1, T, hv, device=dev, dtype=torch.float32)
    else:
        g = F.logsigmoid(randn(1, T, hv))
        if gate == "standard":
            g = g / 16
            n_flat = hv // 4
            if n_flat > 0:
                heads = torch.randperm(hv, generator=gen, device=dev)[:n_flat]
                g[:, :, heads] = 0.0
        elif gate != "strong":
            raise ValueError(f"gate: expected 'standard', 'strong' or 'none', got {gate!r}")
    beta = torch.sigmoid(randn(1, T, hv))
    h0 = randn(N, hv, D, D)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu_cpu = torch.tensor(offsets, dtype=torch.int64)
    if cu_seqlens is None:
        cu_seqlens = cu_cpu.to(device=dev, dtype=cu_dtype)
    do = dht = None
    if with_grads:
        do = randn(1, T, hv, D).to(dtype)
        dht = randn(N, hv, D, D) / 8
    return Inputs(q, k, v, g, beta, h0, cu_seqlens, cu_cpu, lengths, do, dht)


def n_rotating_sets(set_bytes: int, l2_bytes: int = L2_BYTES, max_sets: int = 8) -> int:
    """How many input sets to cycle through so consecutive launches do not find their
    inputs in L2: enough sets to span twice the L2 when one set is smaller than ~L2."""
    if set_bytes >= l2_bytes:
        return 1
    return max(2, min(max_sets, math.ceil(2 * l2_bytes / max(set_bytes, 1))))


def estimate_set_bytes(lengths: Sequence[int], h: int, hv: int, with_grads: bool = False) -> int:
    T, N = sum(lengths), len(lengths)
    b = 2 * T * h * D * 2 + T * hv * D * 2 + 2 * T * hv * 4 + N * hv * D * D * 4
    if with_grads:
        b += T * hv * D * 2 + N * hv * D * D * 4
    return b


# --------------------------------------------------------------------------------------
# Floor (gdn.md section 4)
# --------------------------------------------------------------------------------------

FWD_FLOPS_PER_TOKEN_HEAD = 8 * CHUNK * D + 6 * D * D                    # 163,840 at d = 128
BWD_FLOPS_PER_TOKEN_HEAD = 22 * CHUNK * D + 12 * D * D + 4 * CHUNK * CHUNK  # 393,216 at d = 128
assert FWD_FLOPS_PER_TOKEN_HEAD == 163_840 and BWD_FLOPS_PER_TOKEN_HEAD == 393_216


def work_flops(kind: str, T: int, hv: int) -> float:
    if kind == "step":  # a training step: the forward's work and the backward's
        return work_flops("fwd", T, hv) + work_flops("bwd", T, hv)
    per = FWD_FLOPS_PER_TOKEN_HEAD if kind == "fwd" else BWD_FLOPS_PER_TOKEN_HEAD
    return float(T) * hv * per


def work_bytes(kind: str, T: int, N: int, h: int, hv: int) -> float:
    """Forward (gdn.md section 4): q, k 2*H*d bytes per token each; v, o 2*HV*d each;
    g, beta 4*HV each; per sequence the fp32 state in and out (4*HV*d^2 each).
    Backward (our extension of the same rule, not in gdn.md): reads q, k, v, do, g, beta,
    h0, dht and writes dq, dk (H heads), dv, dg, dbeta, dh0 (no recomputed intermediates).
    A training step ("step"): both."""
    if kind == "step":
        return work_bytes("fwd", T, N, h, hv) + work_bytes("bwd", T, N, h, hv)
    if kind == "fwd":
        per_tok = 2 * (2 * h * D) + 2 * (2 * hv * D) + 2 * (4 * hv)
        per_seq = 2 * (4 * hv * D * D)
    else:
        per_tok = 4 * (2 * h * D) + 3 * (2 * hv * D) + 4 * (4 * hv)
        per_seq = 3 * (4 * hv * D * D)
    return float(T) * per_tok + float(N) * per_seq


def floor_ms(kind: str, T: int, N: int, h: int, hv: int, peak_tflops: float, peak_tbs: float) -> float:
    """max(FLOPs / peak bf16, bytes / peak bandwidth) in milliseconds; ceilings in
    TFLOP/s and TB/s (10^12). A training step's floor is the sum of its two."""
    if kind == "step":
        return (floor_ms("fwd", T, N, h, hv, peak_tflops, peak_tbs) +
                floor_ms("bwd", T, N, h, hv, peak_tflops, peak_tbs))
    t_flops = work_flops(kind, T, hv) / (peak_tflops * 1e12)
    t_bytes = work_bytes(kind, T, N, h, hv) / (peak_tbs * 1e12)
    return 1e3 * max(t_flops, t_bytes)


def row_floor_ms(row: Row, ceilings: Dict[str, float]) -> float:
    return floor_ms(row.kind, row.T, row.N, row.h, row.hv, ceilings["tflops"], ceilings["tbs"])


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------

@dataclass
class Timing:
    median_ms: float
    min_ms: float
    iters: int
    sets: int


def time_cuda(
    fns: Sequence[Callable[[], object]],
    *,
    warmup: int = 3,
    iters: Optional[int] = None,
    target_ms: float = 400.0,
    min_iters: int = 10,
    max_iters: int = 200,
) -> Timing:
    """Median of per-launch CUDA-event times. `fns` holds one zero-arg callable per input
    set; launches cycle through them so each finds its inputs out of L2 (see
    n_rotating_sets). The first call of each callable is the warm-up that absorbs JIT
    compilation and autotuning; then `warmup` more rounds. Without `iters`, enough
    launches to fill about `target_ms` of GPU time."""
    fns = list(fns)
    if not fns:
        raise ValueError("time_cuda: no callables")
    for fn in fns:  # compile / autotune
        fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    if iters is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for fn in fns:
            fn()
        e.record()
        e.synchronize()
        est = max(s.elapsed_time(e) / len(fns), 1e-3)
        iters = int(min(max_iters, max(min_iters, target_ms / est)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        fn = fns[i % len(fns)]
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), min(times), iters, len(fns))


class GraphCaptureError(RuntimeError):
    """A backend's call cannot be captured in a CUDA graph (a host synchronisation or another
    operation that stream capture refuses); the message says what the capture reported."""


def time_graph(
    fns: Sequence[Callable[[], object]],
    *,
    per_call_ms: float,
    graph_ms: float = 20.0,
    max_calls: int = 64,
    target_ms: float = 300.0,
    min_replays: int = 5,
) -> Timing:
    """Device time per call from CUDA-graph replay: one graph captures `calls` back-to-back
    calls (cycling through the input sets, about `graph_ms` of GPU time from the eager
    estimate `per_call_ms`), replayed after two warm-up replays; each replay is timed with
    events and divided by `calls`; the median over replays. Launch gaps and host work are not
    in it. The callables must have run eagerly first (compilation and autotuning happen
    outside the capture). Raises GraphCaptureError when the capture fails."""
    fns = list(fns)
    n = len(fns)
    calls = max(n, min(max_calls, math.ceil(graph_ms / max(per_call_ms, 1e-3))))
    calls = n * math.ceil(calls / n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream (lazy per-stream state)
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            for i in range(calls):
                out = fns[i % n]()
                del out  # the graph's pool reuses the memory of the next call
    except Exception as e:
        torch.cuda.synchronize()
        raise GraphCaptureError(f"{type(e).__name__}: {e}"[:300]) from e
    torch.cuda.synchronize()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    replays = int(min(200, max(min_replays, target_ms / (calls * max(per_call_ms, 1e-3)))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for i in range(replays):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) / calls for s, e in zip(starts, ends)]
    del graph
    return Timing(statistics.median(per_call), min(per_call), replays * calls, n)


# --------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------

def measure_ceilings(device="cuda", n: int = 8192, copy_bytes: int = 2 * 1024**3, reps: int = 10) -> Dict[str, float]:
    """bf16 n^3 matmul TFLOP/s (random data) and device-to-device copy TB/s, counting the
    bytes read and written; each the median of `reps` timed runs after 3 warm-ups."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(1)
    a = torch.randn(n, n, generator=gen, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    t = time_cuda([lambda: torch.matmul(a, b, out=c)], warmup=3, iters=reps)
    tflops = 2.0 * n**3 / (t.median_ms * 1e-3) / 1e12
    del a, b, c
    numel = copy_bytes // 4
    src = torch.empty(numel, device=dev, dtype=torch.float32).uniform_(generator=gen)
    dst = torch.empty_like(src)
    t = time_cuda([lambda: dst.copy_(src)], warmup=3, iters=reps)
    tbs = 2.0 * numel * 4 / (t.median_ms * 1e-3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return {"tflops": tflops, "tbs": tbs}


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not xs:
        return float("nan")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))
