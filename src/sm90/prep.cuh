// sm90 forward kernels 1 and 2: the chunk table (device offsets, cu_seqlens check) and the
// chunk-parallel prep (persistent, two warpgroups per CTA). See README.md in this folder.
#pragma once

#include "common.cuh"
#include "split_plan.cuh"

namespace qla {
namespace sm90 {
// Anonymous: these headers are included by gdn_fwd_sm90.cu alone (internal linkage).
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// 1. Chunk table: off[n] = sum_{m<n} ceil(len_m / 64), off[N] = total chunks, and the sequences
//    longest first (layout: chunk_table_ints in common.cuh). One block. Also clears the ready
//    flags of the overlapped mode.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ int seq_chunks(const SeqDesc& sd, int n) {
  int64_t b, t0, len;
  seq_bounds(sd, n, b, t0, len);
  return static_cast<int>((len + kC - 1) / kC);
}

// order[0..N): the sequences by descending bucket, equal buckets in index order (a stable
// counting sort, so the launch order is deterministic). All 1024 threads call it.
__device__ void longest_first_order(const SeqDesc& sd, int N, int* order) {
  __shared__ int cursor[kOrderBuckets];             // next free slot of each bucket
  __shared__ int below[32][kOrderBuckets];           // per batch: earlier warps' count per bucket
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < kOrderBuckets) cursor[tid] = 0;
  __syncthreads();
  for (int n = tid; n < N; n += 1024) atomicAdd(&cursor[order_bucket(seq_chunks(sd, n))], 1);
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the counts from the top bucket down (4 buckets a lane)
    int c[4], sum = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) sum += (c[i] = cursor[kOrderBuckets - 1 - (4 * lane + i)]);
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    int start = incl - sum;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cursor[kOrderBuckets - 1 - (4 * lane + i)] = start;
      start += c[i];
    }
  }
  __syncthreads();
  for (int base = 0; base < N; base += 1024) {  // batches of 1024 sequences, in index order
    const int n = base + tid;
    const int key = n < N ? order_bucket(seq_chunks(sd, n)) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const int in_warp = __popc(peers & ((1u << lane) - 1u));
#pragma unroll
    for (int i = 0; i < kOrderBuckets / 32; ++i) below[warp][lane + 32 * i] = 0;
    __syncwarp();
    if (key >= 0 && in_warp == 0) below[warp][key] = __popc(peers);
    __syncthreads();
    int batch_count = 0;  // per bucket: exclusive scan over the warps
    if (tid < kOrderBuckets) {
      for (int w = 0; w < 32; ++w) {
        const int c = below[w][tid];
        below[w][tid] = batch_count;
        batch_count += c;
      }
    }
    __syncthreads();
    if (key >= 0) order[cursor[key] + below[warp][key] + in_warp] = n;
    __syncthreads();
    if (tid < kOrderBuckets) cursor[tid] += batch_count;
    __syncthreads();
  }
}

// out[i + 1] = count(0) + .. + count(i) for i < M, out[0] = 0: one block of 1024 threads, in
// batches of 1024 (warp scans, then a scan of the warp sums).
template <class Count>
__device__ void block_prefix_sum(int M, Count count, int* out) {
  __shared__ int warp_sum[32];
  __shared__ int carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < M; base += 1024) {
    const int i = base + tid;
    int x = i < M ? count(i) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sum[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sum[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      warp_sum[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int incl = x + (warp > 0 ? warp_sum[warp - 1] : 0) + carry;
    if (i < M) out[i + 1] = incl;
    __syncthreads();
    if (tid == 1023) carry = incl;
    __syncthreads();
  }
  if (tid == 0) out[0] = 0;
}

// Each chunk's place (the fused forward's inverse kernel; inverse_place unpacks it): x = its
// first token, y = batch row << 7 | tokens (<= 64), so batch rows below kMaxPlaceBatch
// (check_supported refuses more). A thread writes the chunks of its sequences of at most
// kPlaceThreadChunks chunks; longer ones its warp writes together, lanes striding the chunks
// (one sequence of 8192 chunks: 256 rounds of one warp).
constexpr int64_t kMaxPlaceBatch = int64_t(1) << 24;
constexpr int kPlaceThreadChunks = 4;
__device__ __forceinline__ void write_chunk_places(const SeqDesc& sd, int N, const int* off, int2* places) {
  const int lane = threadIdx.x & 31;
  for (int n0 = threadIdx.x - lane; n0 < N; n0 += 1024) {
    const int n = n0 + lane;
    int64_t b = 0, t0 = 0, len = 0;
    if (n < N) seq_bounds(sd, n, b, t0, len);
    const int first = n < N ? off[n] : 0, nch = n < N ? off[n + 1] - first : 0;
    auto place = [&](int j, int64_t tb, int64_t tt, int64_t tl) {
      const int64_t cs = static_cast<int64_t>(j) * kC;
      return make_int2(static_cast<int>(tt + cs), static_cast<int>(tb << 7 | (tl - cs < kC ? tl - cs : kC)));
    };
    if (nch <= kPlaceThreadChunks)
      for (int j = 0; j < nch; ++j) places[first + j] = place(j, b, t0, len);
    unsigned longs = __ballot_sync(0xffffffffu, nch > kPlaceThreadChunks);
    while (longs) {
      const int src = __ffs(longs) - 1;
      longs &= longs - 1;
      const int f = __shfl_sync(0xffffffffu, first, src), c = __shfl_sync(0xffffffffu, nch, src);
      const int64_t tb = __shfl_sync(0xffffffffu, b, src), tt = __shfl_sync(0xffffffffu, t0, src),
                    tl = __shfl_sync(0xffffffffu, len, src);
      for (int j = lane; j < c; j += 32) places[f + j] = place(j, tb, tt, tl);
    }
  }
}

// off[N + 1] is set to 1 when the device cu_seqlens are malformed (first entry not 0, a
// decreasing step, or last entry not T) or a state-pool index is at or past its pool's slots
// (h0_pool, hT_pool; the forward's): every offset is then 0 (no chunk is read or written),
// the order is the identity, and the kernels fill their outputs with NaN instead (see
// fill_nan_outputs).
// With a piece table (split forward, pieces != nullptr; layout piece_table_ints in common.cuh):
// the pieces of the sequences in launch order (piece_split), their offsets by rank and each
// piece's rank. With places (the fused forward): each chunk's place (write_chunk_places).
// With a device plan (dp.out, device-only lengths): the piece plan refined from the true
// lengths (refine_plan in split_plan.cuh) before the piece table, and written to dp.out for the
// passes and the scan.
struct DevicePlan {
  int* out = nullptr;  // [piece_chunks, max_pieces]; null: the host's plan is final
  int hv = 0, sms = 0;
  bool pass1_v128 = false;
  bool fill = false;  // the fused backward's rule (fill_piece_chunks, from the bound's piece length), not the cost model
};
// The refined plan by warp 0: lane l weighs np = l + 1 and l + 33 (refine_candidate), then the
// least cost, ties to the fewest pieces, as refine_plan orders them (its host reference).
__device__ __forceinline__ PiecePlan refine_plan_warp(const PiecePlan& bound, int longest, double pairs,
                                                      const DevicePlan& dp) {
  const int lane = threadIdx.x & 31;
  double best = INFINITY;
  int best_np = 1;
  PiecePlan cand;
  for (int np = lane + 1; np <= kMaxPiecesPerSeq; np += 32) {
    if (!refine_candidate(bound, longest, np, cand)) continue;
    const double c = refine_cost(longest, pairs, dp.sms, dp.pass1_v128, np);
    if (c < best) best = c, best_np = np;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const double c = __shfl_xor_sync(0xffffffffu, best, o);
    const int n = __shfl_xor_sync(0xffffffffu, best_np, o);
    if (c < best || (c == best && n < best_np)) best = c, best_np = n;
  }
  const double unsplit = refine_cost(longest, pairs, dp.sms, dp.pass1_v128, 1);
  if (best_np == 1 || !(best < kSplitMinGain * unsplit)) return PiecePlan{};
  refine_candidate(bound, longest, best_np, cand);
  return cand;
}
__global__ void __launch_bounds__(1024) gdn_chunk_table(SeqDesc sd, int N, int* off, int* ready, int64_t nready,
                                                        PiecePlan plan = {}, int* pieces = nullptr,
                                                        int2* places = nullptr, DevicePlan dp = {},
                                                        PoolIndex h0_pool = {}, PoolIndex hT_pool = {}) {
  allow_dependent_launch();  // the fused forward's inverse kernel waits for this one's end itself
  for (int64_t i = threadIdx.x; i < nready; i += 1024) ready[i] = 0;  // overlapped mode's flags
  const int tid = threadIdx.x;
  int* order = off + N + 2;
  int bad = 0;
  if (sd.cu) {
    for (int n = tid; n < N; n += 1024) bad |= cu_at(sd, n + 1) < cu_at(sd, n);
    if (tid == 0) bad |= cu_at(sd, 0) != 0 || cu_at(sd, N) != sd.T;
  }
  // A state-pool index at or past its pool's slots (negative ones: no state).
  if (h0_pool.idx)
    for (int n = tid; n < N; n += 1024) bad |= pool_slot(h0_pool, n) >= h0_pool.slots;
  if (hT_pool.idx)
    for (int n = tid; n < N; n += 1024) bad |= pool_slot(hT_pool, n) >= hT_pool.slots;
  if (__syncthreads_or(bad)) {
    for (int n = tid; n <= N; n += 1024) off[n] = 0;
    for (int n = tid; n < N; n += 1024) order[n] = n;
    if (tid == 0) off[N + 1] = 1;
    if (pieces)  // one empty piece per sequence (the kernels only fill NaN)
      for (int n = tid; n <= N; n += 1024) {
        pieces[n] = n;
        if (n < N) pieces[N + 1 + n] = n;
      }
    if (dp.out && tid == 0) dp.out[0] = 0, dp.out[1] = 1;
    return;
  }
  if (tid == 0) off[N + 1] = 0;
  block_prefix_sum(N, [&](int n) { return seq_chunks(sd, n); }, off);
  if (places) {
    __syncthreads();  // every offset written
    write_chunk_places(sd, N, off, places);
  }
  if (N == 1) {
    if (tid == 0) order[0] = 0;
  } else {
    longest_first_order(sd, N, order);
  }
  if (!pieces) return;
  __syncthreads();
  if (dp.out) {
    __shared__ int s_longest;
    __shared__ PiecePlan s_plan;
    if (tid == 0) s_longest = 0;
    __syncthreads();
    int mx = 0;
    for (int n = tid; n < N; n += 1024) mx = max(mx, off[n + 1] - off[n]);
    mx = __reduce_max_sync(0xffffffffu, mx);
    if ((tid & 31) == 0 && mx > 0) atomicMax(&s_longest, mx);
    __syncthreads();
    if (tid < 32) {
      const int longest = s_longest;
      PiecePlan r{};
      if (dp.fill) {
        // The fused backward: the shortest pieces whose CTAs fit the SMs, each candidate's pieces
        // counted by the warp's lanes (sequences lane-strided; integer sums, so every lane agrees).
        auto ctas = [&](int pc) {
          const PiecePlan pl{pc, kMaxPiecesPerSeq};
          int c = 0;
          for (int n = tid; n < N; n += 32) c += piece_split(off[n + 1] - off[n], pl).np;
          return static_cast<int64_t>(__reduce_add_sync(0xffffffffu, c)) * dp.hv;
        };
        const int pc = longest > 0 ? fill_piece_chunks(plan.piece_chunks, longest, dp.sms, ctas) : 0;
        if (pc < longest) r = PiecePlan{pc, kMaxPiecesPerSeq};
      } else if (longest > 0) {
        // The pairs as forward_choice counts them: each sequence by its share of the longest chain.
        const double pairs = static_cast<double>(off[N]) / longest * dp.hv;
        r = refine_plan_warp(plan, longest, pairs, dp);
      }
      if (tid == 0) {
        s_plan = r;
        dp.out[0] = r.piece_chunks, dp.out[1] = r.max_pieces;
      }
    }
    __syncthreads();
    plan = s_plan;
  }
  auto split_of = [&](int r) { const int n = order[r]; return piece_split(off[n + 1] - off[n], plan); };
  block_prefix_sum(N, [&](int r) { return split_of(r).np; }, pieces);
  __syncthreads();
  int* rank_of = pieces + N + 1;
  for (int r = tid; r < N; r += 1024) {
    const int first = pieces[r], np = split_of(r).np;
    for (int j = 0; j < np; ++j) rank_of[first + j] = r;
  }
}

// ---------------------------------------------------------------------------------------------
// Prep parameters and shared-memory plan.
// ---------------------------------------------------------------------------------------------
struct PrepParams {
  CUtensorMap tmq, tmk, tmv;  // q, k, v as (d, head, token, batch), box (64, 1, 64, 1), 128-byte swizzle
  const void *g, *beta;
  int64_t sg[2], sb[2];
  int g_dt, b_dt;
  SeqDesc sd;
  int N, H, HV;
  const int* chunk_off;
  const int2* places;  // the inverse kernel: each chunk's place (write_chunk_places)
  void* regions;  // kRegionBytes per (chunk, value head)
  int* ready;     // overlapped mode: per (chunk, value head) flag set once its region is written; else null
  void* tm;       // backward: the prep's Tm = (I + L)^-1 hi|lo images (TokTok_K, 2 x 8 KiB) per region; the
                  // inverse kernel's T' (fp16 TokTok_K, 8 KiB per region: Tm = diag(2^ek) T' diag(2^-ek)); else null
  float scale;
  int skip;       // the inverse kernel's test hook only (0 otherwise): stages left out, to time the others
  const void* q;  // the inverse kernel: q's row norms (16-byte loads; element strides B, T, H)
  int64_t sq[3];
  int inv_group;  // the inverse kernel: value heads per work item, a divisor of HV / H (inverse_group)
  // The inverse kernel's item and head arithmetic as multiply-shifts (set_inverse_items): a
  // division by a runtime value is ~20 SASS instructions, and K1's loop must stay in the
  // instruction cache (docs/design.md, fused-35).
  cutlass::FastDivmod items_per_chunk;  // item -> (chunk, item in the chunk): H * groups
  cutlass::FastDivmod groups_per_key;   // item in the chunk -> (key head, group): HV / H / inv_group
  cutlass::FastDivmod values_per_key;   // value head -> key head: HV / H
};
// The inverse kernel's items: group value heads of one key head each (a divisor of HV / H).
inline void set_inverse_items(PrepParams& pp, int group) {
  const int per_key = pp.HV / pp.H, groups = per_key / group;
  pp.inv_group = group;
  pp.items_per_chunk = cutlass::FastDivmod(pp.H * groups);
  pp.groups_per_key = cutlass::FastDivmod(groups);
  pp.values_per_key = cutlass::FastDivmod(per_key);
}

// Host side: the sequences of a call, and what the chunk-parallel kernels (prep, inverse) take
// from it (gates, sequences, heads, scale); the caller adds tensor maps and output pointers.
// P: GdnForwardParams or GdnBackwardParams.
template <class P>
SeqDesc seq_desc(const P& p) {
  SeqDesc sd;
  sd.cu = p.cu_seqlens.data;
  sd.cu64 = p.cu_seqlens.dtype == DType::kInt64;
  sd.T = p.shape.seqlen;
  return sd;
}
template <class P>
PrepParams chunk_params(const P& p, const SeqDesc& sd, int N, const int* table) {
  PrepParams pp{};
  pp.g = p.g.data;
  pp.beta = p.beta.data;
  for (int i = 0; i < 2; ++i) { pp.sg[i] = p.g.stride[i]; pp.sb[i] = p.beta.stride[i]; }
  pp.g_dt = static_cast<int>(p.g.dtype);
  pp.b_dt = static_cast<int>(p.beta.dtype);
  pp.sd = sd;
  pp.N = N;
  pp.H = static_cast<int>(p.shape.num_qk_heads);
  pp.HV = static_cast<int>(p.shape.num_v_heads);
  pp.chunk_off = table;
  pp.scale = static_cast<float>(p.scale);
  pp.q = p.q.data;
  for (int i = 0; i < 3; ++i) pp.sq[i] = p.q.stride[i];
  set_inverse_items(pp, pp.HV / pp.H);
  return pp;
}

// Shared memory of one gdn_prep warpgroup (byte offsets from the 1 KiB aligned base). Buffers are reused once
// their contents are dead; the phases are separated by CTA barriers.
//   Q tile (TMA)   -> A hi|lo staging (bulk-stored) -> Tu = Tm diag(beta) hi|lo images
//   K tile (TMA)   -> w_hi staging
//   V tile (TMA)   \_ u fp32 staging (32 KiB, after the last wgmma)
//   L fp32 [64][kLd] -> Tw = Tm diag(beta e^gamma) hi|lo images
//   Tm fp32 [64][kLd], per-warp 16 x 16 product scratch, gamma, beta, the TMA mbarrier.
constexpr int kLd = 68;  // fp32 row pitch of L and Tm (16-byte rows; 4-bank stagger between rows)
constexpr int kPd = 20;  // fp32 row pitch of the per-warp scratch
constexpr uint32_t kPrepQ = 0, kPrepK = 16384, kPrepV = 32768, kPrepL = 49152;
constexpr uint32_t kPrepT = kPrepL + kC * kLd * 4;
constexpr uint32_t kPrepP = kPrepT + kC * kLd * 4;
constexpr uint32_t kPrepMisc = kPrepP + 4 * 16 * kPd * 4;
constexpr uint32_t kPrepWGBytes = (kPrepMisc + 3 * kC * 4 + 16 + 1023) & ~1023u;  // one warpgroup's slice
constexpr size_t kPrepSmem = 1024 + 2 * size_t(kPrepWGBytes);                      // two warpgroups per CTA
static_assert(kPrepSmem <= 232448, "prep smem over the 227 KiB limit");
static_assert(kPrepV + 32768 <= kPrepT, "u staging overlaps Tm");
static_assert(kPrepL + 16384 <= kPrepT, "Tw images overlap Tm");

// ---------------------------------------------------------------------------------------------
// 2. Chunk-parallel prep, one warpgroup per (chunk, value head) region.
//    TMA loads of Q, K, V -> wgmma K K^T, Q K^T -> L (fp32) and A (hi/lo image, bulk-stored)
//    -> Tm = (I + L)^-1 blockwise on all four warps -> Tu, Tw images -> wgmma w = Tw K,
//    u = Tu V -> w_hi image and u staged in shared memory and bulk-stored.
// ---------------------------------------------------------------------------------------------
// Chunk ci (global index over all sequences' chunks): its batch row b, first token t0 and valid
// tokens len (<= 64). The sequence is the largest n with off[n] <= ci (skips empty ones).
template <class Params>
__device__ __forceinline__ void region_tokens(const Params& p, int ci, int64_t& b, int64_t& t0, int& len) {
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.chunk_off[mid] <= ci) lo = mid; else hi = mid - 1;
  }
  const int n = lo;
  int64_t slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int64_t cstart = static_cast<int64_t>(ci - p.chunk_off[n]) * kC;  // within the sequence
  t0 += cstart;
  len = static_cast<int>(min<int64_t>(kC, slen - cstart));
}

// (I + L)^-1 of one strictly lower N x N block L (fp32, row pitch ld; zeros above the diagonal
// need not be there) into D (row pitch ld; exact zeros above the diagonal), in one warp: this
// lane solves column c by forward substitution and writes it if `store` (lanes that repeat a
// column: the rows' broadcast loads cost the same). D may be L itself.
template <int N>
__device__ __forceinline__ void invert_diag(const float* L, float* D, int ld, int c, bool store) {
  float x[N];
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) {
    float a0 = (i == c) ? 1.f : 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    const uint32_t Lr = smem_u32(L + i * ld);
    CUTE_UNROLL
    for (int j4 = 0; j4 < i / 4; ++j4) {
      const float4 l = lds128(Lr + 16 * j4);
      a0 -= l.x * x[4 * j4 + 0];
      a1 -= l.y * x[4 * j4 + 1];
      a2 -= l.z * x[4 * j4 + 2];
      a3 -= l.w * x[4 * j4 + 3];
    }
    CUTE_UNROLL
    for (int j = 4 * (i / 4); j < i; ++j) a0 -= L[i * ld + j] * x[j];
    x[i] = (a0 + a1) + (a2 + a3);
  }
  __syncwarp();  // every lane has read L (D may be L)
  if (store) {
    CUTE_UNROLL
    for (int i = 0; i < N; ++i) D[i * ld + c] = x[i];
  }
  __syncwarp();
}
// Tm = (I + L)^-1 of a strictly lower triangular fp32 L ([64][kLd] in shared memory) into sT, in
// 16 x 16 blocks on the four warps of a warpgroup. Phase 1: warp w inverts its diagonal block
// D_w = I + L_ww by forward substitution (lane c: column c; L rows are broadcasts). Phase 2: warp
// w walks down its block column, Tm_aw = -D_a^-1 sum_{m=w}^{a-1} L_am Tm_mw, with fp32 FMA
// products (lane: one row, 8 columns; 16-byte shared loads), synchronising only within the warp.
// sP: the warp's 16 x kPd scratch. Ends with the warps' own blocks written (no barrier after).
__device__ __forceinline__ void invert_diagonal_blocks(const float* sL, float* sT, int warp, int lane) {
  invert_diag<16>(sL + 16 * warp * kLd + 16 * warp, sT + 16 * warp * kLd + 16 * warp, kLd, lane & 15, lane < 16);
}
__device__ __forceinline__ void invert_block_columns(const float* sL, float* sT, float* sP, int warp, int lane) {
  {
    const int w = warp, r = lane >> 1, hc = (lane & 1) * 8;
    for (int a = w + 1; a < 4; ++a) {
      float acc[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      for (int m = w; m < a; ++m) {
        const uint32_t Lr = smem_u32(sL + (16 * a + r) * kLd + 16 * m);
        const uint32_t Tc = smem_u32(sT + (16 * m) * kLd + 16 * w + hc);
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) {
          const float4 l = lds128(Lr + 16 * k4);
          const float lk[4] = {l.x, l.y, l.z, l.w};
          CUTE_UNROLL
          for (int kk = 0; kk < 4; ++kk) {
            const uint32_t row = Tc + (4 * k4 + kk) * kLd * 4;
            const float4 t0 = lds128(row), t1 = lds128(row + 16);
            acc[0] += lk[kk] * t0.x; acc[1] += lk[kk] * t0.y; acc[2] += lk[kk] * t0.z; acc[3] += lk[kk] * t0.w;
            acc[4] += lk[kk] * t1.x; acc[5] += lk[kk] * t1.y; acc[6] += lk[kk] * t1.z; acc[7] += lk[kk] * t1.w;
          }
        }
      }
      const uint32_t Pw = smem_u32(sP + r * kPd + hc);
      sts128f(Pw, acc[0], acc[1], acc[2], acc[3]);
      sts128f(Pw + 16, acc[4], acc[5], acc[6], acc[7]);
      __syncwarp();
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      const uint32_t Dr = smem_u32(sT + (16 * a + r) * kLd + 16 * a);
      const uint32_t Pc = smem_u32(sP + hc);
      CUTE_UNROLL
      for (int k4 = 0; k4 < 4; ++k4) {
        const float4 d = lds128(Dr + 16 * k4);
        const float dk[4] = {d.x, d.y, d.z, d.w};
        CUTE_UNROLL
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t row = Pc + (4 * k4 + kk) * kPd * 4;
          const float4 t0 = lds128(row), t1 = lds128(row + 16);
          acc[0] -= dk[kk] * t0.x; acc[1] -= dk[kk] * t0.y; acc[2] -= dk[kk] * t0.z; acc[3] -= dk[kk] * t0.w;
          acc[4] -= dk[kk] * t1.x; acc[5] -= dk[kk] * t1.y; acc[6] -= dk[kk] * t1.z; acc[7] -= dk[kk] * t1.w;
        }
      }
      const uint32_t Tw = smem_u32(sT + (16 * a + r) * kLd + 16 * w + hc);
      sts128f(Tw, acc[0], acc[1], acc[2], acc[3]);
      sts128f(Tw + 16, acc[4], acc[5], acc[6], acc[7]);
      __syncwarp();  // the next block of the column reads this one; the scratch is rewritten
    }
  }
}
__device__ __forceinline__ void invert_unit_lower(const float* sL, float* sT, float* sP, int warp, int lane,
                                                  int barid) {
  invert_diagonal_blocks(sL, sT, warp, lane);
  wg_bar(barid);  // phase 2 reads every warp's diagonal inverse
  invert_block_columns(sL, sT, sP, warp, lane);
}

// Columns j8 .. j8 + 7 of row i of Tm (fp32 [64][kLd]); zero above the diagonal blocks (Tm is
// lower triangular, and its diagonal blocks hold exact zeros above the diagonal).
__device__ __forceinline__ void tm_run(const float* sT, int i, int j8, float (&t)[8]) {
  if ((i >> 4) >= (j8 >> 4)) {
    const float4 t0 = lds128(smem_u32(sT + i * kLd + j8)), t1 = lds128(smem_u32(sT + i * kLd + j8 + 4));
    t[0] = t0.x; t[1] = t0.y; t[2] = t0.z; t[3] = t0.w; t[4] = t1.x; t[5] = t1.y; t[6] = t1.z; t[7] = t1.w;
  } else {
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) t[e] = 0.f;
  }
}

// One region. sm: the warpgroup's shared-memory slice; tid: 0..127; bar: the slice's TMA
// mbarrier (initialised), used once per region with parity `phase`.
template <class T>
__device__ __forceinline__ void prep_region(const PrepParams& p, uint8_t* sm, int tid, int barid, uint64_t* bar,
                                            uint32_t phase, int ci, int hv) {
  using L = Lay<T>;
  T* sQ = reinterpret_cast<T*>(sm + kPrepQ);
  T* sK = reinterpret_cast<T*>(sm + kPrepK);
  T* sV = reinterpret_cast<T*>(sm + kPrepV);
  float* sL = reinterpret_cast<float*>(sm + kPrepL);
  float* sT = reinterpret_cast<float*>(sm + kPrepT);
  float* sGam = reinterpret_cast<float*>(sm + kPrepMisc);
  float* sBeta = sGam + kC;
  float* sBw = sBeta + kC;  // beta e^gamma (column scale of Tw)

  const int warp = tid >> 5, lane = tid & 31;
  int64_t b, t0;
  int len;
  region_tokens(p, ci, b, t0, len);
  const int hq = hv / (p.HV / p.H);

  // Q, K, V tiles by TMA (two 64-column boxes each = the two K-blocks of the GMMA tile). Rows
  // past the sequence end are the next sequence's tokens (zeros past the tensor end): zeroed
  // once they land, so that whatever they hold (Inf x 0 is NaN) reaches none of this chunk's
  // products.
  if (tid == 0) {
    mbar_expect_tx(bar, 3 * kQKBytes);
    const int tok = static_cast<int>(t0), bb = static_cast<int>(b);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      tma_load_4d(sm + kPrepQ + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, bb, bar);
      tma_load_4d(sm + kPrepK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, bb, bar);
      tma_load_4d(sm + kPrepV + h * kQKBytes / 2, &p.tmv, h * 64, hv, tok, bb, bar);
    }
  }

  // gamma = inclusive cumsum of g over the valid tokens (padding: g = 0, beta = 0).
  if (tid < kC) load_gates_scan(p, tid, len, b, t0, hv, sGam[tid], sBeta[tid]);
  wg_bar(barid);
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  wg_bar(barid);
  const float gam_last = sGam[len - 1];

  uint8_t* regb = static_cast<uint8_t*>(p.regions) + (static_cast<size_t>(ci) * p.HV + hv) * kRegionBytes;
  float* regf = reinterpret_cast<float*>(regb + kF32Off);
  if (tid < kC) {  // row gates of the recurrence, fp32 (coalesced)
    sBw[tid] = sBeta[tid] * expf(sGam[tid]);
    regf[kFGq + tid] = tid < len ? p.scale * expf(sGam[tid]) : 0.f;  // 0 on padding: the backward's dO rows there are foreign
    regf[kFGk + tid] = tid < len ? expf(gam_last - sGam[tid]) : 0.f;
  } else if (tid == kC) {
    regf[kFEG] = expf(gam_last);
  }

  Tensor tQ = make_tensor(make_smem_ptr(sQ), typename L::TokD_K{});
  Tensor tK = make_tensor(make_smem_ptr(sK), typename L::TokD_K{});
  Tensor tVmn = make_tensor(make_smem_ptr(sV), typename L::DTok_MN{});  // (v, tok)
  mbar_wait(bar, phase);
  if (len < kC) {  // the sequence's last chunk
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      zero_box_rows(smem_u32(sm + kPrepQ + h * kQKBytes / 2), len, tid, 128);
      zero_box_rows(smem_u32(sm + kPrepK + h * kQKBytes / 2), len, tid, 128);
      zero_box_rows(smem_u32(sm + kPrepV + h * kQKBytes / 2), len, tid, 128);
    }
    fence_async_smem();  // the generic stores before the wgmma's reads
    wg_bar(barid);
  }

  // K K^T and Q K^T (64 x 64 x 128).
  auto mma1 = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
  auto thr1 = mma1.get_thread_slice(tid);
  Tensor rQa = thr1.partition_fragment_A(tQ);
  Tensor rKa = thr1.partition_fragment_A(tK);
  Tensor rKb = thr1.partition_fragment_B(tK);
  Tensor accKK = partition_fragment_C(mma1, Shape<_64, _64>{});
  Tensor accQK = partition_fragment_C(mma1, Shape<_64, _64>{});
  warpgroup_fence_operand(accKK);
  warpgroup_fence_operand(accQK);
  warpgroup_arrive();
  gemm_k(mma1, rKa, rKb, accKK, GMMA::ScaleOut::Zero);
  gemm_k(mma1, rQa, rKb, accQK, GMMA::ScaleOut::Zero);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(accKK);
  warpgroup_fence_operand(accQK);
  wg_bar(barid);  // Q is dead: its bytes take the A image

  // L_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (i > j) to fp32 smem, and the causal gated score
  // image A_ij = scale e^(gamma_i - gamma_j) q_i.k_j (i >= j) as hi/lo into Q's bytes.
  // Gates as differences (<= 0): no overflow. Elements i, i+1 are columns c, c+1 of one row.
  {
    T* sAh = sQ;
    Tensor tAimg = make_tensor(make_smem_ptr(sAh), typename L::TokTok_K{});
    Tensor cc1 = thr1.partition_C(make_identity_tensor(Shape<_64, _64>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(accKK); i += 2) {
      const int r = get<0>(cc1(i)), c = get<1>(cc1(i));
      const float gr = sGam[r], br = sBeta[r];
      const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
      // Branch-free: the exponent is clamped to <= 0 and the mask applied after.
      const float x0 = exp2_approx(fminf(gr - gc.x, 0.f) * kLog2e), x1 = exp2_approx(fminf(gr - gc.y, 0.f) * kLog2e);
      const float e0 = r >= c ? x0 : 0.f, e1 = r >= c + 1 ? x1 : 0.f;
      *reinterpret_cast<float2*>(sL + r * kLd + c) =
          make_float2(r > c ? br * e0 * accKK(i) : 0.f, r > c + 1 ? br * e1 * accKK(i + 1) : 0.f);
      // Rows past the sequence end are zero (the forward never stores them; the backward's
      // P^T dO must not see them).
      uint32_t ah, al;
      const float sr = r < len ? p.scale : 0.f;
      split_pair<T>(sr * e0 * accQK(i), sr * e1 * accQK(i + 1), ah, al);
      const int off = static_cast<int>(&tAimg(r, c) - sAh);
      *reinterpret_cast<uint32_t*>(sAh + off) = ah;
      *reinterpret_cast<uint32_t*>(sAh + kImgTokTok + off) = al;
    }
  }
  fence_async_smem();
  wg_bar(barid);
  if (tid == 0) {
    bulk_s2g(regb + kOffAh * sizeof(T), sQ, 2 * kImgTokTok * sizeof(T));
    bulk_commit();
  }

  // Tm = (I + L)^-1 (blockwise, all four warps).
  invert_unit_lower(sL, sT, reinterpret_cast<float*>(sm + kPrepP) + warp * 16 * kPd, warp, lane, barid);
  if (tid == 0) bulk_wait_read();  // the A image has left Q's bytes: they take the Tu images
  wg_bar(barid);

  // Images of Tu = Tm diag(beta) (into Q's bytes) and Tw = Tm diag(beta e^gamma) (into L's
  // bytes), hi/lo, K-major (i, j). Each thread: 4 runs of 8 columns; blocks above the diagonal
  // are zero (Tm is lower triangular; the diagonal blocks hold exact zeros above the diagonal).
  T* sTuh = sQ;
  T* sTwh = reinterpret_cast<T*>(sm + kPrepL);
  {
    Tensor tImg = make_tensor(make_smem_ptr(sTuh), typename L::TokTok_K{});  // offsets only
    CUTE_UNROLL
    for (int it = 0; it < 4; ++it) {
      const int q = tid + 128 * it, i = q >> 3, j8 = (q & 7) * 8;
      float t[8];
      tm_run(sT, i, j8, t);
      uint4 uh, ul, wh, wl;
      uint32_t* puh = &uh.x; uint32_t* pul = &ul.x; uint32_t* pwh = &wh.x; uint32_t* pwl = &wl.x;
      CUTE_UNROLL
      for (int e = 0; e < 8; e += 2) {
        const float b0 = sBeta[j8 + e], b1 = sBeta[j8 + e + 1];
        const float w0 = sBw[j8 + e], w1 = sBw[j8 + e + 1];
        split_pair<T>(t[e] * b0, t[e + 1] * b1, puh[e / 2], pul[e / 2]);
        split_pair<T>(t[e] * w0, t[e + 1] * w1, pwh[e / 2], pwl[e / 2]);
      }
      const int off = static_cast<int>(&tImg(i, j8) - sTuh);
      if (p.tm) {  // backward: Tm itself, hi/lo, in the same image layout
        uint4 th, tl;
        uint32_t* pth = &th.x; uint32_t* ptl = &tl.x;
        CUTE_UNROLL
        for (int e = 0; e < 8; e += 2) split_pair<T>(t[e], t[e + 1], pth[e / 2], ptl[e / 2]);
        T* tmg = static_cast<T*>(p.tm) + (static_cast<size_t>(ci) * p.HV + hv) * (2 * kImgTokTok);
        *reinterpret_cast<uint4*>(tmg + off) = th;
        *reinterpret_cast<uint4*>(tmg + kImgTokTok + off) = tl;
      }
      sts128(smem_u32(sTuh + off), uh);
      sts128(smem_u32(sTuh + kImgTokTok + off), ul);
      sts128(smem_u32(sTwh + off), wh);
      sts128(smem_u32(sTwh + kImgTokTok + off), wl);
    }
  }
  fence_async_smem();
  wg_bar(barid);

  // w = Tw K, u = Tu V (64 x 128 x 64), Tm as hi + lo.
  auto mma2 = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto thr2 = mma2.get_thread_slice(tid);
  Tensor rAwh = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sTwh), typename L::TokTok_K{}));
  Tensor rAwl = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sTwh + kImgTokTok), typename L::TokTok_K{}));
  Tensor rAuh = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sTuh), typename L::TokTok_K{}));
  Tensor rAul = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sTuh + kImgTokTok), typename L::TokTok_K{}));
  Tensor rKb2 = thr2.partition_fragment_B(make_tensor(make_smem_ptr(sK), typename L::DTok_MN{}));
  Tensor rVb2 = thr2.partition_fragment_B(tVmn);
  Tensor accW = partition_fragment_C(mma2, Shape<_64, _128>{});
  Tensor accU = partition_fragment_C(mma2, Shape<_64, _128>{});
  warpgroup_fence_operand(accW);
  warpgroup_fence_operand(accU);
  warpgroup_arrive();
  gemm_k(mma2, rAwh, rKb2, accW, GMMA::ScaleOut::Zero);
  gemm_k(mma2, rAwl, rKb2, accW, GMMA::ScaleOut::One);
  gemm_k(mma2, rAuh, rVb2, accU, GMMA::ScaleOut::Zero);
  gemm_k(mma2, rAul, rVb2, accU, GMMA::ScaleOut::One);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(accW);
  warpgroup_fence_operand(accU);
  wg_bar(barid);  // K, V and the images are dead: w and u are staged in their bytes

  // w_hi as a 16-bit (tok, d) K-major image (K's bytes); u fp32 [V/32][tok][32] (V's and L's
  // bytes). Padding rows -> 0. Accumulator elements 2i, 2i+1 are columns c, c+1 of one row.
  float* sU = reinterpret_cast<float*>(sm + kPrepV);
  Tensor cc2 = thr2.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  CUTE_UNROLL
  for (int i = 0; i < size(accW); i += 2) {
    const int r = get<0>(cc2(i)), c = get<1>(cc2(i));
    const bool ok = r < len;
    const int off = static_cast<int>(&tK(r, c) - sK);
    *reinterpret_cast<uint32_t*>(sK + off) = pack2<T>(ok ? accW(i) : 0.f, ok ? accW(i + 1) : 0.f);
    *reinterpret_cast<float2*>(sU + (c / kUT) * (kC * kUT) + u_index(r, c % kUT)) =
        make_float2(ok ? accU(i) : 0.f, ok ? accU(i + 1) : 0.f);
  }
  fence_async_smem();
  wg_bar(barid);
  if (tid == 0) {
    bulk_s2g(regb + kOffWh * sizeof(T), sK, kImgTokD * sizeof(T));
    bulk_s2g(regb + kF32Off + kFU * 4, sU, kC * kDV * 4);
    bulk_commit();
    if (p.ready) {  // overlapped mode: the region must be complete in global memory, then flagged
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
      st_release(p.ready + static_cast<size_t>(ci) * p.HV + hv, 1);
    } else {
      bulk_wait_read();  // the next region's TMA loads overwrite these bytes
    }
  }
}

// Persistent: each CTA runs two independent warpgroups (own shared-memory slice, named barrier
// and TMA mbarrier), and each warpgroup walks the regions chunk-major (all heads of chunk 0
// first), so an overlapped recurrence finds its early chunks ready first; with several
// sequences then in level order (level_order_chunk: chunk c of every sequence before chunk
// c + 1 of any), so that no sequence's recurrence waits for another's chunks.
template <class T>
__global__ void __launch_bounds__(256, 1) gdn_prep(const __grid_constant__ PrepParams p) {
  // Let a programmatically dependent recurrence launch now (overlapped mode; see launch()).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* sm = base + wg * kPrepWGBytes;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + kPrepMisc + 3 * kC * 4);
  if (tid == 0) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  wg_bar(1 + wg);
  const int nreg = p.chunk_off[p.N] * p.HV;
  uint32_t phase = 0;
  const bool levels = p.ready && p.N > 1 && p.N <= kLevelOrderMaxSeqs;
  for (int r = blockIdx.x * 2 + wg; r < nreg; r += gridDim.x * 2, phase ^= 1) {
    const int i = r / p.HV;
    prep_region<T>(p, sm, tid, 1 + wg, bar, phase, levels ? level_order_chunk(p.chunk_off, p.N, i) : i, r % p.HV);
  }
}


}  // namespace
}  // namespace sm90
}  // namespace qla
