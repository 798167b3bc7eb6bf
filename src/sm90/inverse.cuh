// The fused forward's kernel 1 of 2 (docs/fused.md v2, step 1): the chunk-parallel inverse.
// Per (chunk, value head) region it stores what the fused recurrence needs besides q, k, v:
// Tu = (I + L)^-1 diag(beta) as an fp16 image and the chunk's gates. 9 KiB per region against
// the prep's 65 KiB. Not yet used by the forward's launch path (the fused recurrence, step 2,
// reads it); reached through a test hook.
#pragma once

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
constexpr uint32_t kInvImg = 0;
constexpr uint32_t kInvGam = kImgTokTok * 2;
constexpr uint32_t kInvEg = kInvGam + kC * 4;
constexpr uint32_t kInvEgk = kInvEg + kC * 4;
constexpr uint32_t kInvEG = kInvEgk + kC * 4;
constexpr size_t kInvRegionBytes = 9216;
static_assert(kInvEG + 16 <= kInvRegionBytes && kInvRegionBytes <= 16384, "inverse region over its 16 KiB budget");

// Shared memory of one warpgroup (byte offsets from its 1 KiB aligned slice): two K stages
// (TMA; the next region's tile lands while this one is inverted; a stage's bytes then take its
// Tu image); L and Tm fp32 [64][kLd] (phase 2's scratch in L's upper blocks); gamma, beta;
// one TMA mbarrier per stage.
constexpr uint32_t kInvK = 0, kInvL = 2 * 16384;
constexpr uint32_t kInvT = kInvL + kC * kLd * 4;
constexpr uint32_t kInvMisc = kInvT + kC * kLd * 4;
constexpr uint32_t kInvWGBytes = (kInvMisc + 2 * kC * 4 + 16 + 1023) & ~1023u;
constexpr int kInvWarpgroups = 3;  // per CTA, independent (own slice, named barrier, mbarriers)
constexpr size_t kInvSmem = 1024 + kInvWarpgroups * size_t(kInvWGBytes);
static_assert(kInvSmem <= 232448, "inverse smem over the 227 KiB limit");

// A region's place, found when its loads are issued and kept for its compute: the chunk's
// tokens, and this thread's token's g and beta (tid < 64), whose loads are then in flight
// during the previous region's inverse.
struct InvRegion {
  int64_t b, t0;
  int len, ci, hv;
  float g, beta;
};

// The warpgroups' work items are (chunk, key head): one K tile and one K K^T serve the key
// head's HV / H value heads (regions), taken one after the other.
__device__ __forceinline__ InvRegion inverse_gates(const PrepParams& p, int tid, int item, int gi) {
  InvRegion q;
  q.ci = item / p.H;
  q.hv = (item % p.H) * (p.HV / p.H) + gi;
  region_tokens(p, q.ci, q.b, q.t0, q.len);
  q.g = q.beta = 0.f;
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

// One region, its loads issued earlier into the stage sK / bar. first: the item's first value
// head, which waits for K and computes K K^T into kk (kept for the item's other value heads).
template <class T, class Acc>
__device__ __forceinline__ void inverse_region(const PrepParams& p, uint8_t* sm, uint8_t* sKb, int tid, int barid,
                                               uint64_t* bar, uint32_t phase, const InvRegion& q, bool first, Acc& kk) {
  using L = Lay<T>;
  using H = Lay<cutlass::half_t>;
  T* sK = reinterpret_cast<T*>(sKb);
  float* sL = reinterpret_cast<float*>(sm + kInvL);
  float* sT = reinterpret_cast<float*>(sm + kInvT);
  float* sGam = reinterpret_cast<float*>(sm + kInvMisc);
  float* sBeta = sGam + kC;
  const int warp = tid >> 5, lane = tid & 31;
  const int len = q.len;

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
    Tensor cc = thr.partition_C(make_identity_tensor(Shape<_64, _64>{}));
    CUTE_UNROLL
    for (int i = 0; i < size(kk); i += 2) {
      const int r = get<0>(cc(i)), c = get<1>(cc(i));
      const float gr = sGam[r], br = sBeta[r];
      const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
      const float x0 = exp2_approx(fminf(gr - gc.x, 0.f) * kLog2e), x1 = exp2_approx(fminf(gr - gc.y, 0.f) * kLog2e);
      *reinterpret_cast<float2*>(sL + r * kLd + c) =
          make_float2(r > c ? br * x0 * kk(i) : 0.f, r > c + 1 ? br * x1 * kk(i + 1) : 0.f);
    }
  }
  wg_bar(barid);  // L complete; every warp's K K^T has retired (kk holds it), so K's bytes are free
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

  // Tu = Tm diag(beta) as the fp16 image, into K's bytes: each thread 4 runs of 8 columns.
  cutlass::half_t* sImg = reinterpret_cast<cutlass::half_t*>(sK);
  Tensor tImg = make_tensor(make_smem_ptr(sImg), typename H::TokTok_K{});
  CUTE_UNROLL
  for (int it = 0; it < 4; ++it) {
    const int run = tid + 128 * it, i = run >> 3, j8 = (run & 7) * 8;
    float t[8];
    tm_run(sT, i, j8, t);
    uint4 u;
    uint32_t* pu = &u.x;
    CUTE_UNROLL
    for (int e = 0; e < 8; e += 2) pu[e / 2] = pack2<cutlass::half_t>(t[e] * sBeta[j8 + e], t[e + 1] * sBeta[j8 + e + 1]);
    sts128(smem_u32(sImg + static_cast<int>(&tImg(i, j8) - sImg)), u);
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
    } else {
      bulk_wait_read();  // the stage takes the tile of the region after next
    }
  }
}

// Persistent like gdn_prep: kInvWarpgroups independent warpgroups per CTA walk the (chunk, key
// head) items chunk-major, each taking the item's value heads in turn (one K tile and one K K^T
// for all of them) and issuing the next loads before it computes the current region.
template <class T>
__global__ void __launch_bounds__(128 * kInvWarpgroups, 1) gdn_fwd_inverse(const __grid_constant__ PrepParams p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* sm = base + wg * kInvWGBytes;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sm + kInvMisc + 2 * kC * 4);  // bar[0], bar[1]: the stages
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_init(bar + 1, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  wg_bar(1 + wg);
  const int nitems = p.chunk_off[p.N] * p.H, G = p.HV / p.H;
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
    const int s = k & 1;
    const bool more = it + stride < nitems;
    for (int gi = 0; gi < G; ++gi) {
      // Loads ahead: the next value head's gates, or the next item's K tile (into stage s ^ 1,
      // whose last image store has been read: inverse_region's end) and its first gates.
      InvRegion next{};
      if (gi + 1 < G) {
        next = inverse_gates(p, tid, it, gi + 1);
      } else if (more) {
        next = inverse_gates(p, tid, it + stride, 0);
        inverse_load_k(p, sm + kInvK + (s ^ 1) * 16384, bar + (s ^ 1), tid, next);
      }
      inverse_region<T>(p, sm, sm + kInvK + s * 16384, tid, 1 + wg, bar + s, (k >> 1) & 1, cur, gi == 0, kk);
      cur = next;
    }
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
