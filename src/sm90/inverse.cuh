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
//   kInvKexp  ek_i, int8 x 64: 2^ek_i |k_i| in [2^-1/2, 2^1/2) (0 for a zero key; rows past the
//             chunk's end, the next sequence's keys, have theirs too, so their fp16 copies stay finite)
//   kInvQexp  eq_i, int8 x 64: the same for q_i (within a few percent: bf16 sums)
// Keys far from unit norm (use_qk_l2norm_in_kernel=False) would leave fp16's range or
// precision in the fused recurrence, so its operands are scaled by exact powers of two per
// token: K' = diag(2^ek) K, and the image holds Tu' = 2^et diag(2^-ek) Tu, with et chosen so
// that max_i |beta_i| 2^(et - ek_i) (the diagonal's largest entry) lies in [1/2, 1); kn =
// max(1, max_i 2^-ek_i) over the chunk's own tokens bounds their key norms (the recurrence's
// fp16 window). For l2-normalised keys ek = 0, kn = 1 and et = 0 (while some beta >= 1/2).
constexpr uint32_t kInvImg = 0;
constexpr uint32_t kInvGam = kImgTokTok * 2;
constexpr uint32_t kInvEg = kInvGam + kC * 4;
constexpr uint32_t kInvEgk = kInvEg + kC * 4;
constexpr uint32_t kInvEG = kInvEgk + kC * 4;
constexpr uint32_t kInvTuExp = kInvEG + 4, kInvKn = kInvEG + 8, kInvKexp = kInvEG + 16, kInvQexp = kInvKexp + kC;
constexpr uint32_t kInvRegionTail = kInvQexp + kC;  // the last byte K2 copies, plus one
constexpr uint32_t kInvGateCopy = (kInvRegionTail - kInvGam + 15) & ~15u;  // the bytes from kInvGam a stage copies
constexpr size_t kInvRegionBytes = 9216;
static_assert(kInvRegionTail <= kInvRegionBytes && kInvRegionBytes <= 16384, "inverse region over its 16 KiB budget");

// Shared memory of one warpgroup (byte offsets from its 1 KiB aligned slice): the item's K tile
// (TMA; the next item's tile is loaded into it as soon as this item's K K^T has retired, so it
// lands while the item's regions are inverted); the region's Tu image (staging for its bulk
// store, whose read the next region waits for before it writes the image); the inverse's fp16
// blocks (row-major [64][kInvTh]: the diagonal inverses D_a, T_10, and the products P_20, P_21
// in the unused blocks (0, 2), (0, 3)); each warp's fp32 16 x 16 diagonal block (L'_aa in, D_a
// out, row pitch kInvDp); gamma, beta, the TMA mbarrier; the key and query exponents (int32 x
// 64 each), two warps' reductions and the image's column factors beta_j 2^-ek_j.
constexpr int kInvTh = 72;  // fp16 row pitch: 144-byte rows, so that ldmatrix / stmatrix rows hit distinct banks
constexpr int kInvDp = 20;  // fp32 row pitch of a diagonal block (16-byte rows for the substitution's loads)
constexpr uint32_t kInvK = 0, kInvImgS = 16384;
constexpr uint32_t kInvTb = kInvImgS + kImgTokTok * 2;
constexpr uint32_t kInvD = kInvTb + kC * kInvTh * 2;
constexpr uint32_t kInvMisc = kInvD + 4 * 16 * kInvDp * 4;
constexpr uint32_t kInvSKexp = kInvMisc + 2 * kC * 4 + 16, kInvSQexp = kInvSKexp + kC * 4;
constexpr uint32_t kInvRed = kInvSQexp + kC * 4, kInvBc = kInvRed + 16;
constexpr uint32_t kInvWGBytes = (kInvBc + kC * 4 + 1023) & ~1023u;
constexpr int kInvWarpgroups = 4;  // per CTA, independent (own slice, named barriers, mbarrier)
constexpr size_t kInvSmem = 1024 + kInvWarpgroups * size_t(kInvWGBytes);
// The backward's instantiation (gdn_fwd_inverse<T, true>, PrepParams::tm set) also stages each
// warpgroup's T' image (8 KiB) after the slices.
constexpr size_t kInvSmemTm = kInvSmem + kInvWarpgroups * size_t(kImgTokTok * 2);
static_assert(kInvSmemTm <= 232448, "inverse smem over the 227 KiB limit");
static_assert(kInvImgS % 1024 == 0, "the Tu image (128-byte swizzle) needs 1 KiB alignment");

// A region's place, found when its loads are issued and kept for its compute: the chunk's
// tokens, and this thread's token's g and beta (tid < 64), whose loads are then in flight
// during the previous region's inverse.
struct InvRegion {
  int b, t0;  // batch row and first token (TMA coordinates: 32-bit)
  int len, ci, hv;
  uint32_t g, beta;  // this thread's token's gates as loaded (load_bits; 0 past the sequence end)
};

// The warpgroups' work items are (chunk, key head, group of inv_group of its value heads): one
// K tile and one K K^T serve the group's value heads (regions), taken one after the other.
// inverse_place: the first region of an item, from the chunk's place that the chunk table
// kernel wrote (one load; a cursor over the sequences took 2-3 dependent rounds of loads
// whenever the item's chunk lay in another sequence, and its registers spilled: the region's
// start at 16/16 1024x8 2.9 K -> 2.3 K cycles); with_gates: a region with its gates, whose
// loads are then in flight during the previous region's inverse.
__device__ __forceinline__ InvRegion inverse_place(const PrepParams& p, int item) {
  InvRegion q;
  int r, hq, gi;
  p.items_per_chunk(q.ci, r, item);
  p.groups_per_key(hq, gi, r);
  q.hv = hq * p.values_per_key.divisor + gi * p.inv_group;
  const int2 pl = p.places[q.ci];
  q.t0 = pl.x;
  q.b = pl.y >> 7;
  q.len = pl.y & 127;
  q.g = q.beta = 0u;
  return q;
}
__device__ __forceinline__ InvRegion with_gates(const PrepParams& p, int tid, InvRegion q, int hv) {
  q.hv = hv;
  q.g = q.beta = 0u;
  if (tid < q.len) {
    const int64_t t = q.t0 + tid;
    q.g = load_bits(p.g, p.g_dt, q.b * p.sg[0] + t * p.sg[1] + q.hv);
    q.beta = load_bits(p.beta, p.b_dt, q.b * p.sb[0] + t * p.sb[1] + q.hv);
  }
  return q;
}
// The item's K tile: two 64-column boxes (rows past the sequence end: zeroed once they land).
__device__ __forceinline__ void inverse_load_k(const PrepParams& p, uint8_t* sK, uint64_t* bar, int tid, const InvRegion& q) {
  if (tid == 0) {
    const int hq = p.values_per_key.div(q.hv);
    mbar_expect_tx(bar, kQKBytes);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      tma_load_4d(sK + h * kQKBytes / 2, &p.tmk, h * 64, hq, q.t0, q.b, bar);
  }
}

// One region, its K tile loaded earlier into sK / bar. first: the item's first value head, which
// waits for K, computes K K^T into kk (kept for the item's other value heads) and, once every
// warp's product has retired, loads next_item's tile (with load_next) into the same bytes.
// kTm (the backward's instantiation, p.tm set): also the region's T' image, staged in sTm. A
// template argument: at run time its code cost the forward's instantiation registers (a spill).
template <class T, bool kTm, class Acc>
__device__ __forceinline__ void inverse_region(const PrepParams& p, uint8_t* sm, uint8_t* sKb, int tid, int barid,
                                               uint64_t* bar, uint32_t phase, const InvRegion& q, bool first, Acc& kk,
                                               bool load_next, const InvRegion& next_item, cutlass::half_t* sTm QLA_PHASE_ARGS) {
  using L = Lay<T>;
  using H = Lay<cutlass::half_t>;
  T* sK = reinterpret_cast<T*>(sKb);
  float* sGam = reinterpret_cast<float*>(sm + kInvMisc);
  float* sBeta = sGam + kC;
  const int warp = tid >> 5, lane = tid & 31;
  const int len = q.len;

  int* sKexp = reinterpret_cast<int*>(sm + kInvSKexp);
  int* sQexp = reinterpret_cast<int*>(sm + kInvSQexp);
  if (first && !p.q) {
    if (tid < kC) sQexp[tid] = 0;  // the caller's q rows have unit norm
  } else if (first) {
    // eq_i = -round(log2 |q_i|) (one per key head: its value heads reuse it). Two threads per
    // row, each 64 of its dims in 8 loads of 16 bytes (the pair's 32 bytes adjacent: whole
    // sectors), and one shuffle adds the halves: a thread per 8 dims of 8 rows took 32 shuffles
    // and 8 exponents per thread. Squares summed as T pairs per load (bf16 sums: a few percent,
    // enough to pick the power of two), then in fp32. q is read here, not held from the
    // previous region on: 32 registers that four warpgroups per SM lack.
    const int row = tid >> 1;
    float x = 0.f;
    if (row < len) {
      const int hq = p.values_per_key.div(q.hv);
      const uint8_t* qb = static_cast<const uint8_t*>(p.q) +
                          2 * (int64_t(q.b) * p.sq[0] + int64_t(q.t0 + row) * p.sq[1] + hq * p.sq[2]) + 16 * (tid & 1);
      uint4 qv[8];
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) qv[j] = __ldg(reinterpret_cast<const uint4*>(qb + 32 * j));
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        const uint32_t* pu = &qv[j].x;
        if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
          uint32_t acc = 0u;
          CUTE_UNROLL
          for (int e = 0; e < 4; ++e) asm("fma.rn.bf16x2 %0, %1, %1, %0;" : "+r"(acc) : "r"(pu[e]));
          const float2 f = unpack2<T>(acc);
          x += f.x + f.y;
        } else {
          CUTE_UNROLL
          for (int e = 0; e < 4; ++e) {
            const float2 f = unpack2<T>(pu[e]);
            x = fmaf(f.x, f.x, fmaf(f.y, f.y, x));
          }
        }
      }
    }
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    if ((tid & 1) == 0) sQexp[row] = x > 0.f ? max(-30, min(30, -(float_exponent(2.f * x) >> 1))) : 0;
  }
  QLA_PHASE(0);  // q's exponents (the item's first region, without the unit-norm hint)
  uint32_t* sRed = reinterpret_cast<uint32_t*>(sm + kInvRed);
  float* sBc = reinterpret_cast<float*>(sm + kInvBc);
  if (tid < kC) {
    sGam[tid] = warp_inclusive_sum(bits_value(q.g, p.g_dt));
    sBeta[tid] = bits_value(q.beta, p.b_dt);
  }
  wg_bar(barid);
  QLA_PHASE(1);  // the gate scan and its first barrier
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  wg_bar(barid);
  const float gam_last = sGam[len - 1];
  QLA_PHASE(2);  // the scan's second barrier

  uint8_t* regb = static_cast<uint8_t*>(p.regions) + (static_cast<size_t>(q.ci) * p.HV + q.hv) * kInvRegionBytes;
  if (tid < kC) {  // the gates, fp32 (coalesced)
    const bool ok = tid < len;
    reinterpret_cast<float*>(regb + kInvGam)[tid] = sGam[tid];
    reinterpret_cast<float*>(regb + kInvEg)[tid] = ok ? expf(sGam[tid]) : 0.f;
    reinterpret_cast<float*>(regb + kInvEgk)[tid] = ok ? expf(gam_last - sGam[tid]) : 0.f;
  } else if (tid == kC) {
    reinterpret_cast<float*>(regb + kInvEG)[0] = expf(gam_last);
  }

  // Thread (warp, g, t) holds, in a 64 x 64 wgmma accumulator, rows 16 warp + g and + 8 of
  // columns 16 b + 2t, + 1, + 8, + 9 at elements 8 b .. 8 b + 7: the order of a 16 x 16
  // mma.sync block (block_mma_f16).
  const int g8 = lane >> 2, t4 = lane & 3;
  const int r0 = 16 * warp + g8, r1 = r0 + 8;
  if (first) {
    mbar_wait(bar, phase);
    if (len < kC) {  // the sequence's last chunk: the rows past its end zeroed before K K^T
      for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(sKb + h * kQKBytes / 2), len, tid, 128);
      fence_async_smem();  // the generic stores before the wgmma's reads
      wg_bar(barid);
    }
    if (!(p.skip & 4)) {
      auto mma = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
      auto thr = mma.get_thread_slice(tid);
      Tensor tK = make_tensor(make_smem_ptr(sK), typename L::TokD_K{});
      Tensor rKa = thr.partition_fragment_A(tK);
      Tensor rKb = thr.partition_fragment_B(tK);
      warpgroup_fence_operand(kk);
      warpgroup_arrive();
      gemm_k(mma, rKa, rKb, kk, GMMA::ScaleOut::Zero);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(kk);
      // ek_r = -round(log2 |k_r|) = -floor(E / 2), E the exponent of 2 |k_r|^2, from the diagonal
      // (r, r): element 8 warp + (g % 2) of thread t = g / 2 for row r0, + 6 for row r1.
      if (t4 == (g8 >> 1)) {
        float k0 = 0.f, k1 = 0.f;  // (selects: a register array takes constant indices only)
        CUTE_UNROLL
        for (int b = 0; b < 4; ++b) {
          k0 = b == warp ? ((g8 & 1) ? kk(8 * b + 1) : kk(8 * b)) : k0;
          k1 = b == warp ? ((g8 & 1) ? kk(8 * b + 7) : kk(8 * b + 6)) : k1;
        }
        // Rows past the chunk's end get one too (0: their keys are zeroed here and in the fused
        // recurrence's aux before any product reads them); kn excludes them.
        sKexp[r0] = k0 > 0.f ? max(-30, min(30, -(float_exponent(2.f * k0) >> 1))) : 0;
        sKexp[r1] = k1 > 0.f ? max(-30, min(30, -(float_exponent(2.f * k1) >> 1))) : 0;
      }
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(kk); ++i) kk(i) = 0.f;
      if (tid < kC) sKexp[tid] = 0;
    }
    wg_bar(barid);  // the key exponents complete; every warp's K K^T has retired, so K's bytes are free
    if (load_next) inverse_load_k(p, sKb, bar, tid, next_item);
  }
  QLA_PHASE(3);  // the gates' stores, K K^T and the key exponents

  // L' = diag(2^-ek) L diag(2^ek), L_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (i > j): since
  // 2^-ek_i ~ |k_i|, L'_ij ~ beta_i |k_i|^2 (k_i.k_j / |k_i| |k_j|) e^(gamma_i - gamma_j), as
  // L for unit keys, so fp16 holds it and the inverse's blocks for any key norm:
  // T' = (I + L')^-1 = diag(2^-ek) (I + L)^-1 diag(2^ek). Per element one ex2 of a row term
  // plus a column term, L'_ij = (beta_i 2^-ek_i) 2^(log2e gamma_i + (ek_j - log2e gamma_j)) k_i.k_j:
  // with g <= 0 (gdn.md) the gate part is <= 0 on and below the diagonal; above it (the diagonal
  // block's upper triangle, which the selects below drop) ex2 may overflow. The warp's blocks left of
  // its diagonal become fp16 A operands (la), the diagonal block goes to its fp32 scratch for
  // the substitution, the blocks right of it are not needed.
  float* sD = reinterpret_cast<float*>(sm + kInvD) + warp * 16 * kInvDp;
  uint32_t la[3][4];
  {
    const float gl0 = sGam[r0] * kLog2e, gl1 = sGam[r1] * kLog2e;
    const float br0 = sBeta[r0] * pow2i(-sKexp[r0]), br1 = sBeta[r1] * pow2i(-sKexp[r1]);
    CUTE_UNROLL
    for (int b = 0; b < 4; ++b) {
      if (b > warp) continue;
      float l[8];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {  // columns 16 b + 8 h + 2 t, + 1
        const int c = 16 * b + 8 * h + 2 * t4;
        const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
        const int2 ec = *reinterpret_cast<const int2*>(sKexp + c);
        const float cj[2] = {fmaf(gc.x, -kLog2e, static_cast<float>(ec.x)), fmaf(gc.y, -kLog2e, static_cast<float>(ec.y))};
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
          l[4 * h + e] = br0 * exp2_approx(gl0 + cj[e]) * kk(8 * b + 4 * h + e);
          l[4 * h + 2 + e] = br1 * exp2_approx(gl1 + cj[e]) * kk(8 * b + 4 * h + 2 + e);
        }
      }
      if (b < warp) {
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) la[b < 3 ? b : 0][e] = pack2<cutlass::half_t>(l[2 * e], l[2 * e + 1]);
      } else {  // the diagonal block: strictly lower part
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int c = 8 * h + 2 * t4;
          *reinterpret_cast<float2*>(sD + g8 * kInvDp + c) =
              make_float2(g8 > c ? l[4 * h] : 0.f, g8 > c + 1 ? l[4 * h + 1] : 0.f);
          *reinterpret_cast<float2*>(sD + (g8 + 8) * kInvDp + c) =
              make_float2(g8 + 8 > c ? l[4 * h + 2] : 0.f, g8 + 8 > c + 1 ? l[4 * h + 3] : 0.f);
        }
      }
    }
  }
  if (tid < kC) {
    // The image's exponent et and the norm bound kn: max over tokens of |beta_i| 2^-ek_i and of
    // -ek_i (two warps, read after the barrier below); the image's column factors beta_j 2^-ek_j.
    const int e = sKexp[tid];
    const uint32_t bm = __reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(sBeta[tid]) * pow2i(-e)));  // ints: same order
    const int emin = __reduce_min_sync(0xffffffffu, tid < len ? e : 0);
    if (lane == 0) {
      sRed[warp] = bm;
      sRed[2 + warp] = static_cast<uint32_t>(emin + 64);
    }
    sBc[tid] = sBeta[tid] * pow2i(-e);
  }

  QLA_PHASE(4);  // L' and the reductions

  // The warp's diagonal inverse D_a = (I + L'_aa)^-1 (fp32 substitution on its 8 x 8 diagonal
  // blocks, 8 steps instead of 16: -7% of the kernel on the wide rows), as an fp32 block (dc, for
  // the image), an fp16 A operand (da) and an fp16 block of Tb (for the others).
  cutlass::half_t* sTb = reinterpret_cast<cutlass::half_t*>(sm + kInvTb);
  auto tb_addr = [&](int a, int b) { return block_lane_addr(smem_u32(sTb + 16 * a * kInvTh + 16 * b), kInvTh * 2, lane); };
  float dc[8];
  uint32_t da[4];
  __syncwarp();
  {
    // E0, E1 = the inverses of its two 8 x 8 diagonal blocks (lanes 0-7 and 8-15, in place),
    // then D_a = Dd - Dd Loff Dd with Dd = diag(E0, E1) and Loff its lower-left quarter ((Loff Dd)^2 = 0).
    const int sb = (lane >> 3) & 1;
    if (!(p.skip & 2)) invert_diag<8>(sD + 8 * sb * (kInvDp + 1), sD + 8 * sb * (kInvDp + 1), kInvDp, lane & 7, lane < 16);
    const float2 e0 = *reinterpret_cast<const float2*>(sD + g8 * kInvDp + 2 * t4);
    const float2 lo = *reinterpret_cast<const float2*>(sD + (g8 + 8) * kInvDp + 2 * t4);
    const float2 e1 = *reinterpret_cast<const float2*>(sD + (g8 + 8) * kInvDp + 8 + 2 * t4);
    const uint32_t pe0 = pack2<cutlass::half_t>(e0.x, e0.y), pe1 = pack2<cutlass::half_t>(e1.x, e1.y);
    const uint32_t aoff[4] = {0u, pack2<cutlass::half_t>(lo.x, lo.y), 0u, 0u};
    const uint32_t bdd[4] = {movmatrix_t(pe0), 0u, 0u, movmatrix_t(pe1)};
    float y[8] = {}, z[8] = {};
    block_mma_f16(y, aoff, bdd);  // Y = Loff Dd: its lower-left quarter only
    const uint32_t add[4] = {pe0, 0u, 0u, pe1};
    const uint32_t by[4] = {0u, movmatrix_t(pack2<cutlass::half_t>(y[2], y[3])), 0u, 0u};
    block_mma_f16(z, add, by);  // Dd Y: its lower-left quarter only
    dc[0] = e0.x; dc[1] = e0.y; dc[2] = -z[2]; dc[3] = -z[3];
    dc[4] = 0.f; dc[5] = 0.f; dc[6] = e1.x; dc[7] = e1.y;
  }
  CUTE_UNROLL
  for (int e = 0; e < 4; ++e) da[e] = pack2<cutlass::half_t>(dc[2 * e], dc[2 * e + 1]);
  stmatrix4(tb_addr(warp, warp), da[0], da[1], da[2], da[3]);
  if (tid == 0) bulk_wait_read();  // the previous region's image store has read the staging bytes
  QLA_PHASE(5);  // the diagonal blocks
  wg_bar(barid);  // B1: every D_a in Tb; the reductions and column factors complete

  // Block products (docs/fused.md section 8), each warp finishing its own row block of
  // T' = (I + L')^-1 in registers. With the 32 x 32 halves [D0 0; T10 D1] and [D2 0; T32 D3]:
  //   warp 1: T10 = -D1 (L10 D0);   warp 3: T32 = -D3 (L32 D2);
  //   warps 2, 3: P_a1 = L_a1 D1, P_a0 = L_a0 D0 + L_a1 T10 (after T10, barrier B2);
  //   warp 2: T2b = -D2 P2b;         warp 3: T3b = -(T32 P2b + D3 P3b) (after P2, barrier B3).
  // Left operands come from the warp's registers (its L' blocks, D_a, T32), right ones from Tb
  // (ldmatrix.trans) or, for the warp's own products, from its accumulators (movmatrix).
  const int bar_t10 = barid + kInvWarpgroups, bar_p2 = barid + 2 * kInvWarpgroups;
  float tc[3][8];  // the row block's off-diagonal blocks T'_{warp, b}, b < warp
  const bool products = !(p.skip & 3);
  auto zero8 = [](float (&x)[8]) {
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) x[e] = 0.f;
  };
  auto as_b = [](const float (&x)[8], uint32_t (&bf)[4]) {  // the block's transpose as a B operand
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) bf[e] = movmatrix_t(pack2<cutlass::half_t>(x[2 * e], x[2 * e + 1]));
  };
  auto neg8 = [](float (&x)[8]) {
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) x[e] = -x[e];
  };
  CUTE_UNROLL
  for (int b = 0; b < 3; ++b) zero8(tc[b]);
  if (warp == 1 || warp == 3) {
    // T_{a, a-1} = -D_a (L_{a, a-1} D_{a-1}).
    // (Register arrays indexed by constants only: the warp picks by selects, not by index.)
    float x[8], y[8];
    uint32_t bf[4], lx[4];
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) lx[e] = warp == 1 ? la[0][e] : la[2][e];
    zero8(x);
    zero8(y);
    ldsm_x4_trans(tb_addr(warp - 1, warp - 1), bf);
    if (products) block_mma_f16(x, lx, bf);
    as_b(x, bf);
    if (products) block_mma_f16(y, da, bf);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      tc[0][e] = warp == 1 ? -y[e] : 0.f;
      tc[2][e] = warp == 3 ? -y[e] : 0.f;
    }
    if (warp == 1) {
      uint32_t r[4];
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) r[e] = pack2<cutlass::half_t>(tc[0][2 * e], tc[0][2 * e + 1]);
      stmatrix4(tb_addr(1, 0), r[0], r[1], r[2], r[3]);
      asm volatile("bar.arrive %0, 96;" ::"r"(bar_t10) : "memory");  // B2: T10 in Tb
    }
  }
  if (warp >= 2) {
    float pb[2][8];  // P_{a0}, P_{a1}
    uint32_t bf[4];
    zero8(pb[0]);
    zero8(pb[1]);
    ldsm_x4_trans(tb_addr(1, 1), bf);
    if (products) block_mma_f16(pb[1], la[1], bf);
    ldsm_x4_trans(tb_addr(0, 0), bf);
    if (products) block_mma_f16(pb[0], la[0], bf);
    asm volatile("bar.sync %0, 96;" ::"r"(bar_t10) : "memory");  // B2: T10
    ldsm_x4_trans(tb_addr(1, 0), bf);
    if (products) block_mma_f16(pb[0], la[1], bf);
    if (warp == 2) {
      // P2 into Tb's blocks (0, 2), (0, 3) for warp 3, then T2b = -D2 P2b.
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        uint32_t r[4];
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) r[e] = pack2<cutlass::half_t>(pb[j][2 * e], pb[j][2 * e + 1]);
        stmatrix4(tb_addr(0, 2 + j), r[0], r[1], r[2], r[3]);
      }
      asm volatile("bar.arrive %0, 64;" ::"r"(bar_p2) : "memory");  // B3: P2 in Tb
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        as_b(pb[j], bf);
        if (products) block_mma_f16(tc[j], da, bf);
        neg8(tc[j]);
      }
    } else {
      uint32_t a32[4];
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) a32[e] = pack2<cutlass::half_t>(tc[2][2 * e], tc[2][2 * e + 1]);
      asm volatile("bar.sync %0, 64;" ::"r"(bar_p2) : "memory");  // B3: P2
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        ldsm_x4_trans(tb_addr(0, 2 + j), bf);
        if (products) block_mma_f16(tc[j], a32, bf);
        as_b(pb[j], bf);
        if (products) block_mma_f16(tc[j], da, bf);
        neg8(tc[j]);
      }
    }
  }
  QLA_PHASE(6);  // waiting at B1, the block products
  if (p.skip & 8) {
    wg_bar(barid);
    return;
  }

  // Tu' = 2^et diag(2^-ek) Tm diag(beta) as the fp16 image, Tm = diag(2^ek) T' diag(2^-ek), so
  // Tu' = 2^et T' diag(beta 2^-ek): column factors only; each warp its 16 rows (stmatrix into
  // the swizzled image, zeros right of the diagonal block).
  const float beta_max = __uint_as_float(max(sRed[0], sRed[1]));
  const int tu_exp = beta_max > 0.f ? max(-30, min(30, -1 - float_exponent(beta_max))) : 0;
  const int ek_min = static_cast<int>(min(sRed[2], sRed[3])) - 64;
  const float rf = pow2i(tu_exp);
  cutlass::half_t* sImg = reinterpret_cast<cutlass::half_t*>(sm + kInvImgS);
  Tensor tImg = make_tensor(make_smem_ptr(sImg), typename H::TokTok_K{});
  const int mtx = lane >> 3;
  CUTE_UNROLL
  for (int b = 0; b < 4; ++b) {
    uint32_t r[4] = {0u, 0u, 0u, 0u}, r2[4] = {0u, 0u, 0u, 0u};  // r2: the backward's T' block
    if (b <= warp) {
      float x[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) x[e] = b == warp ? dc[e] : tc[b < 3 ? b : 0][e];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const float2 bc = *reinterpret_cast<const float2*>(sBc + 16 * b + 8 * h + 2 * t4);
        r[2 * h] = pack2<cutlass::half_t>(x[4 * h] * (rf * bc.x), x[4 * h + 1] * (rf * bc.y));
        r[2 * h + 1] = pack2<cutlass::half_t>(x[4 * h + 2] * (rf * bc.x), x[4 * h + 3] * (rf * bc.y));
      }
      if constexpr (kTm) {
        CUTE_UNROLL
        for (int h = 0; h < 4; ++h) r2[h] = pack2<cutlass::half_t>(x[2 * h], x[2 * h + 1]);
      }
    }
    const int row = 16 * warp + 8 * (mtx & 1) + (lane & 7), col = 16 * b + 8 * (mtx >> 1);
    stmatrix4(smem_u32(&tImg(row, col)), r[0], r[1], r[2], r[3]);
    if constexpr (kTm) {  // the backward's T' image (the same block without the column factors)
      Tensor tTm = make_tensor(make_smem_ptr(sTm), typename H::TokTok_K{});
      stmatrix4(smem_u32(&tTm(row, col)), r2[0], r2[1], r2[2], r2[3]);
    }
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
  QLA_PHASE(7);  // the image and the last barrier
  if (tid == 0) {
    bulk_s2g(regb + kInvImg, sImg, kImgTokTok * 2);
    if constexpr (kTm) bulk_s2g(static_cast<uint8_t*>(p.tm) + (static_cast<size_t>(q.ci) * p.HV + q.hv) * (kImgTokTok * 2), sTm, kImgTokTok * 2);
    bulk_commit();
    if (p.ready) {  // a dependent kernel polls the flag: the image must be in global memory first
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      asm volatile("fence.proxy.async.global;" ::: "memory");
      st_release(p.ready + static_cast<size_t>(q.ci) * p.HV + q.hv, 1);
    }
  }
  QLA_PHASE(8);  // the image's bulk store issued
}

// Persistent like gdn_prep: kInvWarpgroups independent warpgroups per CTA walk the items
// chunk-major, each taking the item's value heads in turn (one K tile and one K K^T for all of
// them), the next item's K tile loaded during the item's first region and the next region's
// gates before it computes the current one.
template <class T, bool kTm = false>
__global__ void __launch_bounds__(128 * kInvWarpgroups, 1) gdn_fwd_inverse(const __grid_constant__ PrepParams p) {
  allow_dependent_launch();  // the fused recurrence may start its CTAs on the SMs this grid leaves
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  uint8_t* sm = base + wg * kInvWGBytes;
  cutlass::half_t* sTm = kTm ? reinterpret_cast<cutlass::half_t*>(base + kInvWarpgroups * kInvWGBytes + wg * (kImgTokTok * 2))
                             : nullptr;
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
  int nreg = 0;  // regions done (phase timers)
  QLA_PHASES(10);
  if (it < nitems) {
    cur = inverse_place(p, it);
    cur = with_gates(p, tid, cur, cur.hv);
    inverse_load_k(p, sm + kInvK, bar, tid, cur);
  }
  for (int k = 0; it < nitems; it += stride, ++k) {
    const bool more = it + stride < nitems;
    // The next item's first region: its K tile goes into the stage during this item's first
    // region, its gates are loaded during this item's last region.
    const InvRegion next_item = more ? inverse_place(p, it + stride) : InvRegion{};
    for (int gi = 0; gi < G; ++gi) {
      // Loads ahead: the next value head's gates (the same place), or the next item's first gates.
      InvRegion next{};
      if (gi + 1 < G) next = with_gates(p, tid, cur, cur.hv + 1);
      else if (more) next = with_gates(p, tid, next_item, next_item.hv);
      QLA_PHASE(9);  // the next item's place (an item's first region) and the next region's gate loads
      inverse_region<T, kTm>(p, sm, sm + kInvK, tid, 1 + wg, bar, k & 1, cur, gi == 0, kk,
                             gi == 0 && more, next_item, sTm QLA_PHASE_PASS);
      ++nreg;
      cur = next;
    }
  }
  if (tid == 0) bulk_wait_read();  // the last image store has read shared memory
  QLA_PHASES_PRINT("inverse (q, scan + barrier, barrier, gate stores + K K^T, L', diagonal, B1 + products, image, image issue, next place + gates)", 10, nreg);
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
