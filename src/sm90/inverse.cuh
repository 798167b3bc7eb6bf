// The fused forward's kernel 1 of 2 (docs/fused.md v2, step 1): the chunk-parallel inverse.
// Per (chunk, value head) region it stores what the fused recurrence needs besides q, k, v:
// Tu = (I + L)^-1 diag(beta) as an fp16 image and the chunk's gates. 9 KiB per region against
// the two-pass prep's 65 KiB. The fused recurrence (fused_chunks.cuh) reads it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "prep.cuh"

namespace qla {
namespace sm90 {
namespace {

// Inverse region (bytes from the region start; regions of kInvRegionBytes, (chunk, value head)
// order like the prep's):
//   kInvImg   Tu fp16, Lay<half_t>::TokTok_K image (the swizzled offsets of img_off), 8 KiB;
//             columns past the sequence end are 0 (beta = 0 there)
//   kInvGam   gamma_i = g_0 + .. + g_i, fp32 x 64 (padding tokens repeat the last value)
//   kInvEg    e^gamma_i, fp32 x 64 (0 on padding)
//   kInvEgk   e^(Gamma - gamma_i), fp32 x 64 (0 on padding)
//   kInvEG    e^Gamma, fp32
//   kInvTuExp et, int32, and kInvKn, fp32 (below)
//   kInvKexp  ek_i, int8 x 64: 2^ek_i |k_i| in [2^-1/2, 2^1/2) (0 for a zero key and on padding)
//   kInvQexp  eq_i, int8 x 64: the same for q_i (within a few percent: bf16 sums)
// Keys far from unit norm (use_qk_l2norm_in_kernel=False) would leave fp16's range or
// precision in the fused recurrence, so its operands are scaled by exact powers of two per
// token: K' = diag(2^ek) K, and the image holds Tu' = 2^et diag(2^-ek) Tu, with et chosen so
// that max_i |beta_i| 2^(et - ek_i) (the diagonal's largest entry) lies in [1/2, 1); kn =
// max(1, max_i 2^-ek_i) bounds the chunk's key norms (the recurrence's fp16 window). For
// l2-normalised keys ek = 0, kn = 1 and et = 0 (while some beta >= 1/2).
constexpr uint32_t kInvImg = 0;
constexpr uint32_t kInvGam = kImgTokTok * 2;
constexpr uint32_t kInvEg = kInvGam + kC * 4;
constexpr uint32_t kInvEgk = kInvEg + kC * 4;
constexpr uint32_t kInvEG = kInvEgk + kC * 4;
constexpr uint32_t kInvTuExp = kInvEG + 4, kInvKn = kInvEG + 8, kInvKexp = kInvEG + 16, kInvQexp = kInvKexp + kC;
constexpr uint32_t kInvRegionTail = kInvQexp + kC;  // the last byte K2 copies, plus one
constexpr size_t kInvRegionBytes = 9216;
static_assert(kInvRegionTail <= kInvRegionBytes && kInvRegionBytes <= 16384, "inverse region over its 16 KiB budget");

// Shared memory of one warpgroup (byte offsets from its 1 KiB aligned slice): the item's K tile
// (TMA; the next item's tile is loaded into it as soon as this item's K K^T has retired, so it
// lands while the item's regions are inverted); L and Tm fp32 [64][kLd] (phase 2's scratch in
// L's upper blocks; once the inverse is done, L's bytes take the region's Tu image for its bulk
// store, whose read the next region waits for before it writes L); gamma, beta; the TMA
// mbarrier; the key and query exponents (int32 x 64 each) and two warps' reductions. One K
// stage instead of two, and the image in L, fit four warpgroups per SM instead of three: each
// region is a chain of barriers, substitution and block products, and a third more of them in
// flight made the kernel 5-19% faster (fused-17 in docs/design.md).
constexpr uint32_t kInvK = 0, kInvL = 16384;
constexpr uint32_t kInvT = kInvL + kC * kLd * 4;
constexpr uint32_t kInvMisc = kInvT + kC * kLd * 4;
constexpr uint32_t kInvSKexp = kInvMisc + 2 * kC * 4 + 16, kInvSQexp = kInvSKexp + kC * 4;
constexpr uint32_t kInvRed = kInvSQexp + kC * 4;
constexpr uint32_t kInvWGBytes = (kInvRed + 16 + 1023) & ~1023u;
constexpr int kInvWarpgroups = 4;  // per CTA, independent (own slice, named barrier, mbarrier)
constexpr size_t kInvSmem = 1024 + kInvWarpgroups * size_t(kInvWGBytes);
static_assert(kInvSmem <= 232448, "inverse smem over the 227 KiB limit");
static_assert(kInvL % 1024 == 0 && kImgTokTok * 2 <= kC * kLd * 4, "the Tu image (128-byte swizzle) lives in L's bytes");

// A region's place, found when its loads are issued and kept for its compute: the chunk's
// tokens, and this thread's token's g and beta (tid < 64), whose loads are then in flight
// during the previous region's inverse.
struct InvRegion {
  int64_t b, t0;
  int len, ci, hv;
  float g, beta;
};

// The warpgroups' work items are (chunk, key head, group of inv_group of its value heads): one
// K tile and one K K^T serve the group's value heads (regions), taken one after the other.
// inverse_place: region gi of an item, without loads; inverse_gates: with its gates, whose loads
// are then in flight during the previous region's inverse.
__device__ __forceinline__ InvRegion inverse_place(const PrepParams& p, int item, int gi) {
  InvRegion q;
  const int groups = p.HV / p.H / p.inv_group;  // per key head
  q.ci = item / (p.H * groups);
  const int r = item % (p.H * groups);
  q.hv = (r / groups) * (p.HV / p.H) + (r % groups) * p.inv_group + gi;
  region_tokens(p, q.ci, q.b, q.t0, q.len);
  q.g = q.beta = 0.f;
  return q;
}
__device__ __forceinline__ InvRegion inverse_gates(const PrepParams& p, int tid, int item, int gi) {
  InvRegion q = inverse_place(p, item, gi);
  if (tid < kC) load_gates(p, tid, q.len, q.b, q.t0, q.hv, q.g, q.beta);
  return q;
}
// The item's K tile: two 64-column boxes (rows past the sequence end: finite, beta = 0).
__device__ __forceinline__ void inverse_load_k(const PrepParams& p, uint8_t* sK, uint64_t* bar, int tid, const InvRegion& q) {
  if (tid == 0) {
    const int hq = q.hv / (p.HV / p.H);
    mbar_expect_tx(bar, kQKBytes);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      tma_load_4d(sK + h * kQKBytes / 2, &p.tmk, h * 64, hq, static_cast<int>(q.t0), static_cast<int>(q.b), bar);
  }
}

// One region, its K tile loaded earlier into sK / bar. first: the item's first value head, which
// waits for K, computes K K^T into kk (kept for the item's other value heads) and, once every
// warp's product has retired, loads next_item's tile (with load_next) into the same bytes.
template <class T, class Acc>
__device__ __forceinline__ void inverse_region(const PrepParams& p, uint8_t* sm, uint8_t* sKb, int tid, int barid,
                                               uint64_t* bar, uint32_t phase, const InvRegion& q, bool first, Acc& kk,
                                               bool load_next, const InvRegion& next_item) {
  using L = Lay<T>;
  using H = Lay<cutlass::half_t>;
  T* sK = reinterpret_cast<T*>(sKb);
  float* sL = reinterpret_cast<float*>(sm + kInvL);
  float* sT = reinterpret_cast<float*>(sm + kInvT);
  float* sGam = reinterpret_cast<float*>(sm + kInvMisc);
  float* sBeta = sGam + kC;
  const int warp = tid >> 5, lane = tid & 31;
  const int len = q.len;

  int* sKexp = reinterpret_cast<int*>(sm + kInvSKexp);
  int* sQexp = reinterpret_cast<int*>(sm + kInvSQexp);
  if (first && !p.q) {
    if (tid < kC) sQexp[tid] = 0;  // the caller's q rows have unit norm
  } else if (first) {
    // eq_i = -round(log2 |q_i|) (one per key head: its value heads reuse it). Squares summed
    // as T pairs (bf16 sums: a few percent, enough to pick the power of two), then over the
    // row's 16 lanes. q's rows are read here, 16 bytes (8 dims) per thread and row: held from
    // the previous region on, they would take 32 registers that four warpgroups per SM lack.
    uint4 qv[8];
    {
      const int hq = q.hv / (p.HV / p.H);
      const uint8_t* qb = static_cast<const uint8_t*>(p.q) + 2 * (q.b * p.sq[0] + q.t0 * p.sq[1] + hq * p.sq[2]) + 16 * (tid & 15);
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        const int row = (tid >> 4) + 8 * j;
        qv[j] = row < len ? __ldg(reinterpret_cast<const uint4*>(qb + 2 * row * p.sq[1])) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    float x[8];
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {
      const uint32_t* pu = &qv[j].x;
      if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
        uint32_t acc = 0u;
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) asm("fma.rn.bf16x2 %0, %1, %1, %0;" : "+r"(acc) : "r"(pu[e]));
        const float2 f = unpack2<T>(acc);
        x[j] = f.x + f.y;
      } else {
        x[j] = 0.f;
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) {
          const float2 f = unpack2<T>(pu[e]);
          x[j] = fmaf(f.x, f.x, fmaf(f.y, f.y, x[j]));
        }
      }
    }
    CUTE_UNROLL
    for (int m = 1; m < 16; m <<= 1)
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) x[j] += __shfl_xor_sync(0xffffffffu, x[j], m);
    if ((tid & 15) == 0)
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j)
        sQexp[(tid >> 4) + 8 * j] = x[j] > 0.f ? max(-30, min(30, -(float_exponent(2.f * x[j]) >> 1))) : 0;
  }
  uint32_t* sRed = reinterpret_cast<uint32_t*>(sm + kInvRed);
  if (tid == 0) bulk_wait_read();  // the previous region's image store has read L's bytes (ordered by the barrier below)
  if (tid < kC) {
    sGam[tid] = warp_inclusive_sum(q.g);
    sBeta[tid] = q.beta;
  }
  wg_bar(barid);
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  wg_bar(barid);
  const float gam_last = sGam[len - 1];

  uint8_t* regb = static_cast<uint8_t*>(p.regions) + (static_cast<size_t>(q.ci) * p.HV + q.hv) * kInvRegionBytes;
  if (tid < kC) {  // the gates, fp32 (coalesced)
    const bool ok = tid < len;
    reinterpret_cast<float*>(regb + kInvGam)[tid] = sGam[tid];
    reinterpret_cast<float*>(regb + kInvEg)[tid] = ok ? expf(sGam[tid]) : 0.f;
    reinterpret_cast<float*>(regb + kInvEgk)[tid] = ok ? expf(gam_last - sGam[tid]) : 0.f;
  } else if (tid == kC) {
    reinterpret_cast<float*>(regb + kInvEG)[0] = expf(gam_last);
  }

  auto mma = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
  auto thr = mma.get_thread_slice(tid);
  if (first) {
    Tensor tK = make_tensor(make_smem_ptr(sK), typename L::TokD_K{});
    mbar_wait(bar, phase);
    if (!(p.skip & 4)) {
      Tensor rKa = thr.partition_fragment_A(tK);
      Tensor rKb = thr.partition_fragment_B(tK);
      warpgroup_fence_operand(kk);
      warpgroup_arrive();
      gemm_k(mma, rKa, rKb, kk, GMMA::ScaleOut::Zero);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(kk);
    }
  }
  if (!(p.skip & 4)) {
    // L_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (i > j), the gate as a clamped difference.
    // Warp w holds rows 16 w .. 16 w + 15, and accumulator element e lies in column block e / 8
    // (the accumulator's column groups of 8 are e / 4): the blocks left of the diagonal need no
    // mask, the diagonal block is masked and holds |k_r|^2, and the blocks right of it are not
    // written at all (nothing reads L's upper blocks before phase 2 writes its scratch there).
    // The branches are uniform per warp.
    Tensor cc = thr.partition_C(make_identity_tensor(Shape<_64, _64>{}));
    CUTE_UNROLL
    for (int cb = 0; cb < 4; ++cb) {
      if (cb > warp) continue;
      CUTE_UNROLL
      for (int i = 8 * cb; i < 8 * cb + 8; i += 2) {
        const int r = get<0>(cc(i)), c = get<1>(cc(i));
        const float gr = sGam[r], br = sBeta[r];
        const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
        const float x0 = exp2_approx(fminf(gr - gc.x, 0.f) * kLog2e), x1 = exp2_approx(fminf(gr - gc.y, 0.f) * kLog2e);
        float2 l = make_float2(br * x0 * kk(i), br * x1 * kk(i + 1));
        if (cb == warp) {
          l.x = r > c ? l.x : 0.f;
          l.y = r > c + 1 ? l.y : 0.f;
          // The diagonal's |k_r|^2: ek_r = -round(log2 |k_r|) = -floor(E / 2), E = the exponent of 2 |k_r|^2.
          if (r == c || r == c + 1) {
            const float k2 = r == c ? kk(i) : kk(i + 1);
            sKexp[r] = r < len && k2 > 0.f ? max(-30, min(30, -(float_exponent(2.f * k2) >> 1))) : 0;
          }
        }
        *reinterpret_cast<float2*>(sL + r * kLd + c) = l;
      }
    }
  } else if (tid < kC) {
    sKexp[tid] = 0;
  }
  wg_bar(barid);  // L complete; every warp's K K^T has retired (kk holds it), so K's bytes are free
  if (load_next) inverse_load_k(p, sKb, bar, tid, next_item);
  if (tid < kC) {
    // The image's exponent et and the norm bound kn: max over tokens of |beta_i| 2^-ek_i and of
    // -ek_i (two warps, read after the barriers below).
    const int e = sKexp[tid];
    const uint32_t bm = __reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(sBeta[tid]) * pow2i(-e)));  // ints: same order
    const int emin = __reduce_min_sync(0xffffffffu, e);
    if (lane == 0) {
      sRed[warp] = bm;
      sRed[2 + warp] = static_cast<uint32_t>(emin + 64);
    }
  }
  if (!(p.skip & 2)) {
    invert_diagonal_blocks(sL, sT, warp, lane);
    wg_bar(barid);  // phase 2 reads every warp's diagonal inverse
    if (!(p.skip & 1)) invert_block_columns_tc(sL, sT, warp, lane, barid);
  }
  wg_bar(barid);
  if (p.skip & 8) {
    if (tid == 0) bulk_wait_read();
    return;
  }

  // Tu' = 2^et diag(2^-ek) Tm diag(beta) as the fp16 image, into L's bytes (dead after the
  // inverse): each thread 4 runs of 8 columns.
  const float beta_max = __uint_as_float(max(sRed[0], sRed[1]));
  const int tu_exp = beta_max > 0.f ? max(-30, min(30, -1 - float_exponent(beta_max))) : 0;
  const int ek_min = static_cast<int>(min(sRed[2], sRed[3])) - 64;
  const float tu_scale = pow2i(tu_exp);
  cutlass::half_t* sImg = reinterpret_cast<cutlass::half_t*>(sL);
  Tensor tImg = make_tensor(make_smem_ptr(sImg), typename H::TokTok_K{});
  CUTE_UNROLL
  for (int it = 0; it < 4; ++it) {
    const int run = tid + 128 * it, i = run >> 3, j8 = (run & 7) * 8;
    float t[8];
    tm_run(sT, i, j8, t);
    const float rf = tu_scale * pow2i(-sKexp[i]);
    uint4 u;
    uint32_t* pu = &u.x;
    CUTE_UNROLL
    for (int e = 0; e < 8; e += 2)
      pu[e / 2] = pack2<cutlass::half_t>(t[e] * (sBeta[j8 + e] * rf), t[e + 1] * (sBeta[j8 + e + 1] * rf));
    sts128(smem_u32(sImg + static_cast<int>(&tImg(i, j8) - sImg)), u);
  }
  if (tid < kC) {
    regb[kInvKexp + tid] = static_cast<uint8_t>(static_cast<int8_t>(sKexp[tid]));
    regb[kInvQexp + tid] = static_cast<uint8_t>(static_cast<int8_t>(sQexp[tid]));
  } else if (tid == kC) {
    reinterpret_cast<int*>(regb + kInvTuExp)[0] = tu_exp;
    reinterpret_cast<float*>(regb + kInvKn)[0] = pow2i(max(0, -ek_min));
  }
  fence_async_smem();
  wg_bar(barid);
  if (tid == 0) {
    bulk_s2g(regb + kInvImg, sImg, kImgTokTok * 2);
    bulk_commit();
    if (p.ready) {  // a dependent kernel polls the flag: the image must be in global memory first
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
      st_release(p.ready + static_cast<size_t>(q.ci) * p.HV + q.hv, 1);
    }
  }
}

// Persistent like gdn_prep: kInvWarpgroups independent warpgroups per CTA walk the items
// chunk-major, each taking the item's value heads in turn (one K tile and one K K^T for all of
// them), the next item's K tile loaded during the item's first region and the next region's
// gates before it computes the current one.
template <class T>
__global__ void __launch_bounds__(128 * kInvWarpgroups, 1) gdn_fwd_inverse(const __grid_constant__ PrepParams p) {
  allow_dependent_launch();  // the fused recurrence may start its CTAs on the SMs this grid leaves
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* sm = base + wg * kInvWGBytes;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + kInvMisc + 2 * kC * 4);  // the K tile's
  if (tid == 0) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  wg_bar(1 + wg);
  wait_for_previous_kernels();  // the chunk table
  const int G = p.inv_group, nitems = p.chunk_off[p.N] * (p.HV / G);
  const int stride = gridDim.x * kInvWarpgroups;
  int it = blockIdx.x * kInvWarpgroups + wg;
  auto mma = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
  Tensor kk = partition_fragment_C(mma, Shape<_64, _64>{});  // the item's K K^T
  InvRegion cur{};
  if (it < nitems) {
    cur = inverse_gates(p, tid, it, 0);
    inverse_load_k(p, sm + kInvK, bar, tid, cur);
  }
  for (int k = 0; it < nitems; it += stride, ++k) {
    const bool more = it + stride < nitems;
    // The next item's first region: its K tile goes into the stage during this item's first
    // region (a single region per item: its gates too, one region ahead as below).
    InvRegion next_item{};
    if (more) next_item = G == 1 ? inverse_gates(p, tid, it + stride, 0) : inverse_place(p, it + stride, 0);
    for (int gi = 0; gi < G; ++gi) {
      // Loads ahead: the next value head's gates, or the next item's first gates.
      InvRegion next{};
      if (gi + 1 < G) next = inverse_gates(p, tid, it, gi + 1);
      else if (more) next = G == 1 ? next_item : inverse_gates(p, tid, it + stride, 0);
      inverse_region<T>(p, sm, sm + kInvK, tid, 1 + wg, bar, k & 1, cur, gi == 0, kk,
                        gi == 0 && more, next_item);
      cur = next;
    }
  }
  if (tid == 0) bulk_wait_read();  // the last image store has read shared memory
}

// Host side: the value heads per item and the grid. A whole key head's group shares its K tile
// and K K^T, but its regions run one after another in one warpgroup; when the regions are few
// the rounds of items, not the total work, set the kernel's time (2/8 at 1x2048: 64 items of 4
// regions on 396 warpgroups, three per SM then), so the group is split while that shortens them (256 items of 1
// region). The saving per region that reuses K K^T: 0.1 (fused-10's K1 figure) split groups
// whose rounds came out equal, and those rows ran 1-4% slower (8/32 at 1x8192, 8192x4, 1024x8;
// the full grid of 2026-12-01, runs A and B), so 0.2.
constexpr double kInvShareSaving = 0.2;  // of a region's time, per region that reuses K K^T
inline int inverse_group(int64_t nregions, int G, int sms) {
  const int64_t slots = static_cast<int64_t>(sms) * kInvWarpgroups;
  auto cost = [&](int gs) {
    const int64_t rounds = (nregions + gs * slots - 1) / (gs * slots);
    return static_cast<double>(rounds) * gs * (1.0 - kInvShareSaving * (1.0 - 1.0 / gs));
  };
  int best = G;
  for (int gs = G - 1; gs >= 1; --gs)
    if (G % gs == 0 && cost(gs) < cost(best)) best = gs;
  return best;
}
inline unsigned inverse_grid(int64_t nregions, int group, int sms) {
  const int64_t items = (nregions + group - 1) / group;
  return static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(sms, (items + kInvWarpgroups - 1) / kInvWarpgroups)));
}

}  // namespace
}  // namespace sm90
}  // namespace qla
