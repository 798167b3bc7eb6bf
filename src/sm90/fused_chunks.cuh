// The fused forward's kernel 2 of 2 (docs/fused.md): the recurrence with its output. It reads
// q, k, v directly (TMA) and the inverse kernel's regions (Tu image and gates, inverse.cuh);
// nothing per chunk goes back to global memory but o.
//
// One CTA per (sequence, value head, V tile of 64 kMathWGs), chunks in order, 2 + kMathWGs
// warpgroups:
//   WG0 warp 0, producer (one thread): TMA of K and Q (stacked, 128 x 128), the V tile and bulk
//       copies of the chunk's region (Tu image, gates) into a kStages ring (`full` / `empty`).
//   WG0 warps 1-3, output store: copy each chunk's O tile (transposed by the math warpgroups
//       into a staging buffer, `oready` / `ofree`) to o.
//   WG1 aux, running ahead of the chain: scales K and Q rows by powers of two (exponents from
//       the inverse kernel, row norms near 1) and converts them to fp16 in place;
//       A = e^(gamma_i - gamma_j) Q K^T (i >= j), then W = A Tu as an fp16 image under Tu;
//       then arrives on `aready`.
//   WG2.. math, 64 v rows each: the state held transposed, S^T (v, d), in fp32 wgmma
//       accumulators; every product takes its left operand from registers (RS wgmma, fp16),
//       all with N = 128:
//         [Y^T | P^T] = S^T [K; Q]^T                                        (64 x 128 x 128)
//         Z^T = V^T - Y^T diag(e^gamma)
//         [U^T | O^T] = [0 | P^T diag(e^gamma)] + Z^T [Tu; W]^T               (64 x 128 x 64)
//           (U^T A^T = Z^T Tu^T A^T = Z^T W^T; o = scale O)
//         S^T = e^Gamma S^T + X^T K, X^T = U^T diag(e^(Gamma - gamma))        (64 x 128 x 64)
//       O leaves by stmatrix.trans while S^T updates.
// fp16 range: every value-side quantity (S, Z, U, X, O) is linear in (v, h0), and each v row of
// S^T is independent of the others, so row v is carried in units of 2^esc_v (an exact power of
// two, changed when the row's max |S| or |V| leaves [2^6, 2^10)); the fp16 copies are then far
// from overflow for any input scale, and o and the final state are scaled back on the way out.
// The same for q and k (use_qk_l2norm_in_kernel=False): per token, K' = diag(2^ek) K and
// Q' = diag(2^eq) Q (exponents from the inverse kernel) have row norms near 1, and the inverse
// kernel's image is Tu' = 2^et diag(2^-ek) Tu; the exact powers of two cancel in S's update and
// leave O in per-token units 2^(eq + et), undone on the way out; the window also bounds
// |S| max|k|. Keys and queries of any norm keep fp16's precision and range.
#pragma once

#include "inverse.cuh"
#include "recurrence.cuh"
#include "split.cuh"

namespace qla {
namespace sm90 {
namespace {

// kMathWGs math warpgroups of 64 v rows each: V tile 64 (one) or 128 (two, sharing every load,
// the aux's work and the producer).
template <int kMathWGs_>
struct FusedCfg {
  static constexpr int kMathWGs = kMathWGs_;
  static constexpr int kStages = 3;
  static constexpr int kVT = 64 * kMathWGs;  // V columns per CTA
  static constexpr int kThreads = 128 * (2 + kMathWGs);
  // Stage (1 KiB aligned parts):
  //   K|Q  one 128-row operand (QK_K): rows 0-63 the chunk's K, 64-127 its Q (TMA; converted to
  //        fp16 in place), so that [Y^T | P^T] = S^T [K; Q]^T is one N = 128 product;
  //   V    the V tile (TMA, one 64-column box per math warpgroup);
  //   Tu|W one 128-row operand (TW_K): rows 0-63 Tu (the region's image), 64-127 W = A Tu (the
  //        aux), so that [U^T | (A U)^T] = Z^T [Tu; W]^T is one N = 128 product;
  //   the region's gates and key exponents (inverse.cuh), then the aux's per-token factors for
  //   the math warpgroups (fp32 x 64 each): Z's e^gamma 2^-ek, P's e^gamma 2^et and O's
  //   way back scale 2^-(eq + et) (see the aux).
  static constexpr uint32_t kQK = 0, kV = 2 * kQKBytes, kTW = kV + kC * kVT * 2, kTu = kTW;
  static constexpr uint32_t kGates = kTW + 2 * kImgTokTok * 2;
  static constexpr uint32_t kGateCopy = kInvGateCopy;
  static constexpr uint32_t kEgZ = kGates + 1024, kEgP = kEgZ + kC * 4, kInvTok = kEgP + kC * 4;
  static constexpr uint32_t kStageBytes = kGates + 2048;
  static constexpr uint32_t kTx = 2 * kQKBytes + kC * kVT * 2 + kImgTokTok * 2 + kGateCopy;
  // O staging, kOBufs buffers of [64 tok][kOPitch] elements (padded rows; one buffer at V tile
  // 128, for the smem limit), then the mbarriers.
  static constexpr int kOPitch = kVT + 8;
  static constexpr int kOBufs = kMathWGs == 1 ? 2 : 1;
  static constexpr uint32_t kO = kStages * kStageBytes;
  static constexpr uint32_t kBar = kO + kOBufs * kC * kOPitch * 2;
  static constexpr uint32_t kFlags = kBar + (3 * kStages + 4) * 8;  // the piece's path (split.cuh)
  static constexpr size_t kSmem = 1024 + kFlags + 16;
  static_assert(kSmem <= 232448, "fused recurrence smem over the 227 KiB limit");
  static_assert(kGateCopy <= 1024 && kInvTok + kC * 4 <= kStageBytes, "stage parts overlap");
};

// The stacked operands of a stage (see FusedCfg), fp16.
using QK_K = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<_128, _128>{}));  // (row, d)
using QK_MN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::half_t>{}, Shape<_128, _128>{},
                                     Step<_2, _1>{}));  // (d, row): the same bytes
using TW_K = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::half_t>{}, Shape<_128, _64>{}));  // (row, j)

// Named barriers (0 is __syncthreads).
constexpr int kBarAux = 2;

// The V^T (v, tok) pairs of math thread wt (warp w rows 16 w .. 16 w + 15), one per even
// accumulator element of a 64 x 64 tile: ldmatrix.trans of the TMA-loaded V tile (tok, v), whose
// 8 x 8 blocks it reads by rows of 16 bytes. vp[2 tb + q] holds elements 4 tb + 2 q, + 1.
template <class T>
__device__ __forceinline__ void load_vt_pairs(const T* sV, int wt, uint32_t (&vp)[16]) {
  Tensor tV = make_tensor(make_smem_ptr(sV), typename Lay<T>::TokTok_K{});
  const int lane = wt & 31, w = wt >> 5, mtx = lane >> 3;
  CUTE_UNROLL
  for (int tb = 0; tb < 8; tb += 2) {
    // Lane l addresses row l % 8 of block l / 8 = (v half mtx & 1, token block tb + mtx / 2).
    const uint32_t a = smem_u32(&tV(8 * (tb + (mtx >> 1)) + (lane & 7), 16 * w + 8 * (mtx & 1)));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(vp[2 * tb]), "=r"(vp[2 * tb + 1]), "=r"(vp[2 * tb + 2]), "=r"(vp[2 * tb + 3])
                 : "r"(a));
  }
}

// Four 8 x 8 blocks of 16-bit pairs stored transposed (rows of the memory image = columns of the
// fragment): the O^T (v, tok) accumulator pairs become rows of o's (tok, v) layout.
__device__ __forceinline__ void stmatrix_t4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// The fused recurrence's roles and steps, one function each. Cfg
// names a stage's parts: kQK (K | Q, stacked), kV (the V tile's 64-column boxes), kTu (the
// region's Tu image), kGates (its gates and key exponents, kGateCopy bytes), then the aux's
// per-token factors kEgZ, kEgP, kInvTok; kTx is the bytes a stage receives.
// ---------------------------------------------------------------------------------------------

// The producer's loads of one chunk (first token tok of batch row bb; its region, (chunk, value
// head) index `region`) into stage dst, completing on `full`. The lean kernel (kLean) reads no
// Q (it forms no scores and no o): the Q rows of the stacked operand keep stale bytes, which
// neither the aux (aux_convert_qk<.., true>) nor any product touches.
template <class Cfg, bool kLean>
__device__ __forceinline__ void produce_chunk(const RecParams& p, uint8_t* dst, uint64_t* full, size_t region, int hq,
                                              int hv, int vcol, int tok, int bb) {
  const uint8_t* reg = static_cast<const uint8_t*>(p.regions) + region * kInvRegionBytes;
#ifdef QLA_SM90_TEST_HOOKS
  if (p.skip) {  // timing variant (test builds): leave some loads out, the stage keeps stale bytes
    uint32_t tx = 0;
    if (!(p.skip & 1)) tx += 2 * kQKBytes;
    if (!(p.skip & 2)) tx += kC * 64 * 2 * Cfg::kMathWGs;
    if (!(p.skip & 4)) tx += kImgTokTok * 2 + Cfg::kGateCopy;
    mbar_expect_tx(full, tx);
    if (!(p.skip & 1))
      for (int h = 0; h < 2; ++h) {
        tma_load_4d(dst + Cfg::kQK + h * kQKBytes, &p.tmk, h * 64, hq, tok, bb, full);
        tma_load_4d(dst + Cfg::kQK + h * kQKBytes + kQKBytes / 2, &p.tmq, h * 64, hq, tok, bb, full);
      }
    if (!(p.skip & 2))
      for (int h = 0; h < Cfg::kMathWGs; ++h) tma_load_4d(dst + Cfg::kV + h * kC * 64 * 2, &p.tmv, vcol + 64 * h, hv, tok, bb, full);
    if (!(p.skip & 4)) {
      bulk_g2s(dst + Cfg::kTu, reg + kInvImg, kImgTokTok * 2, full);
      bulk_g2s(dst + Cfg::kGates, reg + kInvGam, Cfg::kGateCopy, full);
    }
    return;
  }
#endif
  mbar_expect_tx(full, kLean ? Cfg::kTx - kQKBytes : Cfg::kTx);
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    // d-block h of the stacked operand: K's 64 rows, then Q's.
    tma_load_4d(dst + Cfg::kQK + h * kQKBytes, &p.tmk, h * 64, hq, tok, bb, full);
    if constexpr (!kLean) tma_load_4d(dst + Cfg::kQK + h * kQKBytes + kQKBytes / 2, &p.tmq, h * 64, hq, tok, bb, full);
  }
  CUTE_UNROLL
  for (int h = 0; h < Cfg::kMathWGs; ++h)  // one 64-column box per math warpgroup; past V (the transfer
    // map's columns, split.cuh) the box lies outside v's tensor map and arrives as zeros
    tma_load_4d(dst + Cfg::kV + h * kC * 64 * 2, &p.tmv, vcol + 64 * h, hv, tok, bb, full);
#ifdef QLA_SM90_TEST_HOOKS
  if (p.ready) {  // overlapped variant: the region is written by the inverse kernel running beside
    const int* f = p.ready + region;
    while (ld_acquire(f) == 0) __nanosleep(100);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk copies below read it
  }
#endif
  bulk_g2s(dst + Cfg::kTu, reg + kInvImg, kImgTokTok * 2, full);
  bulk_g2s(dst + Cfg::kGates, reg + kInvGam, Cfg::kGateCopy, full);
}

// The output store threads' copy of one chunk's rows (WG0 warps 1-3, thread st_t of 96): from
// the staging buffer sO, whose element (j, e) lies at at(j, e) (e even; a multiple of 8 for the
// 16-byte copies), to oc (row stride so1). 16-byte stores when every row start is 16-byte
// aligned (vec), else 4-byte ones.
// The loops stay rolled: unrolled they were 390 instructions of the schedulers' shared
// instruction cache for no gain (these warps wait on the math's O, not on their issue).
constexpr int kFusedStoreThreads = 96;
template <class T, int VT, class At>
__device__ __forceinline__ void copy_o_rows(const T* sO, At at, T* oc, int64_t so1, int rows, int st_t, bool vec) {
  if (vec) {
#pragma unroll 1
    for (int q = st_t; q < rows * (VT / 8); q += kFusedStoreThreads) {
      const int j = q / (VT / 8), v8 = q % (VT / 8);
      *reinterpret_cast<uint4*>(oc + j * so1 + 8 * v8) = *reinterpret_cast<const uint4*>(sO + at(j, 8 * v8));
    }
  } else {
#pragma unroll 1
    for (int q = st_t; q < rows * (VT / 2); q += kFusedStoreThreads) {
      const int j = q / (VT / 2), v2 = q % (VT / 2);
      *reinterpret_cast<uint32_t*>(oc + j * so1 + 2 * v2) = *reinterpret_cast<const uint32_t*>(sO + at(j, 2 * v2));
    }
  }
}

// The region's image exponent et (inverse.cuh).
template <class Cfg>
__device__ __forceinline__ int tu_exp_of(const uint8_t* stb) {
  return *reinterpret_cast<const int*>(stb + Cfg::kGates + (kInvTuExp - kInvGam));
}

// The aux warpgroup's first step on a stage: K' = diag(2^ek) K and Q' = diag(2^eq) Q in fp16 in
// place, rows past the sequence end zeroed (K, Q and the V slot's boxes). kKOnly (the lean
// kernel, which loads no Q): K's rows alone. The caller fences and meets the aux's barrier
// before any wgmma reads them.
template <class T, class Cfg, bool kKOnly>
__device__ __forceinline__ void aux_convert_qk(uint8_t* stb, int len, int wt QLA_PHASE_ARGS) {
  using H = cutlass::half_t;
  // Per-token scales (powers of two, exact, from the inverse kernel): K' = diag(2^ek) K and
  // Q' = diag(2^eq) Q, each row's norm brought near 1, so that fp16 holds them, and A, W and
  // Y below stay in range, whatever the inputs' norms (ek = eq = 0 for l2-normalised q, k).
  // Thread wt holds runs wt + 128 it: row wt / 8 + 16 (it & 3) of d-block it / 8, K rows for
  // it & 7 < 4, Q rows after.
  const int8_t* kexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvKexp - kInvGam));
  const int8_t* qexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvQexp - kInvGam));
  const int r0 = wt >> 3;
  const uint32_t base = smem_u32(stb + Cfg::kQK) + 16u * wt;
  auto run_addr = [&](int it) { return base + 16u * 128u * it; };
  int ex[8];  // it & 7 -> the row's exponent
  bool unit = true;
  CUTE_UNROLL
  for (int r = 0; r < 4; ++r) {
    ex[r] = kexp[r0 + 16 * r];
    ex[4 + r] = qexp[r0 + 16 * r];
    unit = unit && ex[r] == 0 && (kKOnly || ex[4 + r] == 0);
  }
  constexpr int kRuns = kKOnly ? 4 : 8;  // runs a half: K's 4, then Q's 4
  const bool scaled = !__all_sync(0xffffffffu, unit);
  QLA_PHASE(1);
  // In place to fp16 (bf16 inputs always, fp16 ones when a scale is not 1), eight runs'
  // loads issued together. Scaling by 2^e is exact: bf16x2 multiplies (bf16 has fp32's
  // range), fp32 ones for fp16 inputs. Two copies of the loop: the unscaled one (unit-norm
  // q and k) issues no multiplies at all.
  auto convert_all = [&](auto with_scale) {
    [[maybe_unused]] constexpr bool kScale = decltype(with_scale)::value;
    uint32_t sc2[8];  // 2^e per row, as bf16x2
    CUTE_UNROLL
    for (int r = 0; r < 8; ++r) {
      const uint32_t b = static_cast<uint32_t>(ex[r] + 127) << 7;
      sc2[r] = b | (b << 16);
    }
    // Not unrolled: the two halves run one body, which keeps the aux's hot code (with the
    // math's and the store warps' on each scheduler) inside the instruction cache.
#pragma unroll 1
    for (int hb = 0; hb < 2; ++hb) {
      uint4 u[8];
      CUTE_UNROLL
      for (int r = 0; r < kRuns; ++r)
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(u[r].x), "=r"(u[r].y), "=r"(u[r].z), "=r"(u[r].w) : "r"(run_addr(8 * hb + r)));
      CUTE_UNROLL
      for (int r = 0; r < kRuns; ++r) {
        uint32_t* pu = &u[r].x;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
            if constexpr (kScale) asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(pu[i]) : "r"(sc2[r]));
            const float2 f = unpack2<T>(pu[i]);
            pu[i] = pack2<H>(f.x, f.y);
          } else {
            const float2 f = unpack2<T>(pu[i]);
            const float sc = pow2i(ex[r]);
            pu[i] = pack2<H>(f.x * sc, f.y * sc);
          }
        }
        sts128(run_addr(8 * hb + r), u[r]);
      }
    }
  };
  if (scaled) convert_all(std::true_type{});
  else if constexpr (!std::is_same_v<T, H>) convert_all(std::false_type{});
  if (len < kC) {
    // The sequence's last chunk: its rows past the end (the next sequence's first tokens) zeroed
    // in K|Q (this thread's runs: token (16 (it & 7) + r0) & 63) and in the math warpgroups' V
    // boxes, so that nothing there reaches this sequence's products or its units (chunk_units
    // takes max |V| over the tile's rows).
    CUTE_UNROLL
    for (int it = 0; it < 16; ++it)
      if ((!kKOnly || (it & 7) < 4) && ((16 * (it & 7) + r0) & (kC - 1)) >= len) sts128(run_addr(it), make_uint4(0u, 0u, 0u, 0u));
    CUTE_UNROLL
    for (int h = 0; h < Cfg::kMathWGs; ++h) zero_box_rows(smem_u32(stb + Cfg::kV + h * kC * 64 * 2), len, wt, 128);
  }
}

// The forward's per-token factors for the math warpgroups (after aux_convert_qk).
template <class Cfg>
__device__ __forceinline__ void aux_forward_factors(const RecParams& p, uint8_t* stb, int wt) {
  const int8_t* kexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvKexp - kInvGam));
  const int8_t* qexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvQexp - kInvGam));
  const int et = tu_exp_of<Cfg>(stb);
  // Y' = S K'^T holds 2^ek Y: Z's gate is e^gamma 2^-ek. U' = Z Tu'^T holds 2^(et - ek) U, and
  // X' K' (X' = U' e^(Gamma - gamma) 2^-et) is S's update. O holds 2^(eq + et) O / scale: W' = A' Tu' with A' = diag(2^eq) A
  // diag(2^ek) / scale (from Q', K'), so P (2^eq P) takes e^gamma 2^et, and O's way back
  // carries scale. scale stays out of the fp16 scores A', which it would push out of fp16's
  // range (|scale| >~ 3e4: Inf) or into its subnormals (|scale| <~ 1e-4), and into the fp32
  // factor of the output alone.
  if (wt < kC) {
    reinterpret_cast<float*>(stb + Cfg::kInvTok)[wt] = p.scale * pow2i(-(qexp[wt] + et));
    float* g = reinterpret_cast<float*>(stb + Cfg::kGates);
    const float eg = g[(kInvEg - kInvGam) / 4 + wt];
    reinterpret_cast<float*>(stb + Cfg::kEgZ)[wt] = eg * pow2i(-kexp[wt]);
    reinterpret_cast<float*>(stb + Cfg::kEgP)[wt] = eg * pow2i(et);
    g[(kInvEgk - kInvGam) / 4 + wt] *= pow2i(-et);
  }
}

// The aux's Q K^T (SS wgmma) and W = A Tu (RS wgmma, A from registers), 64 x 64 each.
using AuxMma = decltype(make_tiled_mma(
    GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>()));
using AuxAcc = decltype(partition_fragment_C(AuxMma{}, Shape<_64, _64>{}));

// acc = Q K^T from the stacked K|Q operand sQK (the fp16 copies K', Q'), issued as one wgmma
// batch and committed, not waited for.
__device__ __forceinline__ void aux_issue_qk(const cutlass::half_t* sQK, int wt, AuxAcc& acc) {
  auto mma = AuxMma{};
  auto thr = mma.get_thread_slice(wt);
  Tensor tQK = make_tensor(make_smem_ptr(sQK), QK_K{});
  Tensor rQ = thr.partition_fragment_A(local_tile(tQK, Shape<_64, _128>{}, make_coord(1, 0)));
  Tensor rK = thr.partition_fragment_B(local_tile(tQK, Shape<_64, _128>{}, make_coord(0, 0)));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mma, rQ, rK, acc, GMMA::ScaleOut::Zero);
  warpgroup_commit_batch();
}

// The gated scores from acc = Q K^T (waited for): A_ij = e^(gamma_i - gamma_j) acc_ij for
// j <= i < len, else 0, into rA16 (fp16: a register A operand of K = 64, or a 64 x 64
// accumulator's elements for stmatrix_tokd). The gate as a clamped difference (no overflow).
using AuxA16 = decltype(make_tensor<cutlass::half_t>(Shape<Shape<_2, _2, _2>, _1, _4>{}));
__device__ __forceinline__ void aux_gate_scores(const float* sGam, int len, int wt, const AuxAcc& acc, AuxA16& rA16) {
  using H = cutlass::half_t;
  Tensor cc = AuxMma{}.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (i, j)
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(cc(i)), j = get<1>(cc(i));
    const float gr = sGam[r];
    const float2 gc = *reinterpret_cast<const float2*>(sGam + j);
    const float x0 = fminf(gr - gc.x, 0.f) * kLog2e, x1 = fminf(gr - gc.y, 0.f) * kLog2e;
    rA16(i) = H(r < len && r >= j ? exp2_approx(x0) * acc(i) : 0.f);
    rA16(i + 1) = H(r < len && r >= j + 1 ? exp2_approx(x1) * acc(i + 1) : 0.f);
  }
}

// A_ij = e^(gamma_i - gamma_j) q_i.k_j for j <= i < len, else 0 (scale is O's factor), from
// Q' K'^T (the K|Q operand sQK, fp16) into acc, then as fp16 into rA16.
__device__ __forceinline__ void aux_gated_scores(const cutlass::half_t* sQK, const float* sGam, int len, int wt, AuxAcc& acc,
                                                 AuxA16& rA16 QLA_PHASE_ARGS) {
  aux_issue_qk(sQK, wt, acc);
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  QLA_PHASE(4);
  aux_gate_scores(sGam, len, wt, acc, rA16);
}

// The gated scores A (aux_gated_scores), then acc = W = A Tu (sTu: the Tu image, read as
// (j, j'), MN-major).
__device__ __forceinline__ void aux_scores_w(const cutlass::half_t* sQK, const cutlass::half_t* sTu, const float* sGam,
                                             int len, int wt, AuxAcc& acc QLA_PHASE_ARGS) {
  using H = cutlass::half_t;
  AuxA16 rA16;
  aux_gated_scores(sQK, sGam, len, wt, acc, rA16 QLA_PHASE_PASS);
  auto mmaW = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = Tu (j, j')
  auto thrW = mmaW.get_thread_slice(wt);
  Tensor rTu = thrW.partition_fragment_B(make_tensor(make_smem_ptr(sTu), typename Lay<H>::TokTok_MN{}));
  warpgroup_fence_operand(rA16);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mmaW, rA16, rTu, acc, GMMA::ScaleOut::Zero);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

// One wgmma product acc (+)= A B with a register A operand (fp16, accumulator order), as its own
// batch, waited for.
template <class MMA, class RA, class RB, class Acc>
__device__ __forceinline__ void product_sync(MMA& mma, RA& rA, const RB& rB, Acc& acc, GMMA::ScaleOut first) {
  warpgroup_fence_operand(rA);
  gemm_sync(mma, rA, rB, acc, first);
}

// A warpgroup's 64 x N fp32 accumulator rows as E (fp16 unless named) into the K-major 16-bit
// tile at shared address tile (tokd_byte's bytes, 64-column boxes of kBox bytes), by stmatrix:
// element i of the accumulator becomes value(i). TokdLane's addresses: one add a store, where
// CuTe's coordinate tensors cost ~35 address instructions (the step's hot code, design.md bwd-59).
template <int N, class E = cutlass::half_t, uint32_t kBox = 8192u, class Value>
__device__ __forceinline__ void stmatrix_tokd(uint32_t tile, int wt, Value value) {
  const TokdLane ln(tile, wt);
  CUTE_UNROLL
  for (int tb = 0; tb < N / 8; tb += 2) {  // columns 8 tb .. 8 tb + 15: accumulators 4 tb .. 4 tb + 7
    uint32_t rr[4];
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) rr[q] = pack2<E>(value(4 * tb + 2 * q), value(4 * tb + 2 * q + 1));
    stmatrix4(ln.at<kBox>(tb), rr[0], rr[1], rr[2], rr[3]);
  }
}

// The math warpgroups' accumulator elements: element i of a 64 x N fragment lies in row half
// acc_half(i) (rows 16 w + lane / 4 and + 8).
__device__ __forceinline__ int acc_half(int i) { return (i >> 1) & 1; }

// The state entering a CTA's chunks (S^T (v, d) as accS, columns v0 .. v0 + 63 of [V | K]):
// h0 (its pool slot, or the scan's copy h0c when non-null), the scan's state (maps), zero, or
// the identity's columns (the transfer map; split.cuh).
template <class AccS, class CS>
__device__ __forceinline__ void load_entering_state(const RecParams& p, int init, int n, int hv, int v0, const float* maps,
                                                    const float* h0c, AccS& accS, const CS& cS) {
  // One strided read for every stored source: element (d, v) at src[d * sd + v * sv].
  const float* src = nullptr;
  int64_t sd = 0, sv = 1;
  if (init == kInitH0 && h0c) {
    src = h0c, sd = kDV;
  } else if (init == kInitH0 && p.h0) {
    const int64_t slot = pool_slot(p.h0_pool, n);  // negative: no state (zeros)
    if (slot >= 0) {
      src = p.h0 + slot * p.sh0[0] + static_cast<int64_t>(hv) * p.sh0[1];
      sd = p.vk ? 1 : p.sh0[2], sv = p.vk ? p.sh0[2] : 1;
    }
  } else if (init == kInitMaps) {
    src = maps, sd = kMapCols;
  }
  if (src) {
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) accS(i) = src[get<1>(cS(i)) * sd + (v0 + get<0>(cS(i))) * sv];
  } else {  // zero, or the identity's columns (the transfer map)
    const bool id = init == kInitIdentity;
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) accS(i) = id && v0 + get<0>(cS(i)) - kDV == get<1>(cS(i)) ? 1.f : 0.f;
  }
}

// The state leaving a CTA's chunks (row v in units 2^esc): the final state or the piece's maps
// (written only by split calls' pass 0, the lean kernel: kLean; the maps' tf32 rounding compiled
// into the other kernels too cost the V tile 128 one 4-12 more bytes of spill stores and loads).
template <bool kLean, class AccS, class CS>
__device__ __forceinline__ void store_leaving_state(const RecParams& p, int end, int n, int hv, int v0, float* maps,
                                                    const AccS& accS, const CS& cS, const int (&esc)[2]) {
  const float inv[2] = {pow2i(-esc[0]), pow2i(-esc[1])};
  const int64_t slot = end == kEndFinal && p.hT ? pool_slot(p.hT_pool, n) : -1;  // negative: not written
  if (slot >= 0) {
    const int64_t fb = slot * p.shT[0] + static_cast<int64_t>(hv) * p.shT[1];
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) {
      const int v = v0 + get<0>(cS(i)), d = get<1>(cS(i));
      p.hT[fb + (p.vk ? v * p.shT[2] + d : d * p.shT[2] + v)] = accS(i) * inv[acc_half(i)];
    }
  } else if (end == kEndMaps) {
    // M's columns (v0 >= kDV) are read only by the scan, whose tensor cores take them as tf32:
    // rounded here, once, instead of in every scan CTA's every step.
    const bool m_cols = kLean && v0 >= kDV;
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) {
      const float x = accS(i) * inv[acc_half(i)];
      maps[get<1>(cS(i)) * kMapCols + v0 + get<0>(cS(i))] = m_cols ? __uint_as_float(tf32_round(x)) : x;
    }
  }
}

// The largest |element| of each of a thread's two accumulator rows (row halves), over the whole
// row of a 64 x N fragment (the quad's four threads then share it: quad_row_units).
template <class Acc>
__device__ __forceinline__ void row_abs_max(const Acc& acc, float (&m)[2]) {
  float m4[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // four chains per row: shorter latency
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) m4[acc_half(i)][(i & 1) | ((i >> 1) & 2)] = fmaxf(m4[acc_half(i)][(i & 1) | ((i >> 1) & 2)], fabsf(acc(i)));
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) m[h] = fmaxf(fmaxf(m4[h][0], m4[h][1]), fmaxf(m4[h][2], m4[h][3]));
}

// A row's units 2^esc from mm, this thread's part of the row's measure in the current units: the
// quad's maximum kept in [2^lo, 2^(lo + 4)), else put back at 2^(lo + 2) (a zero row keeps its
// units). Leaves f = new / old units and sc = the new units.
__device__ __forceinline__ void quad_row_units(float mm, int lo, int& esc, float& f, float& sc) {
  mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 1));
  mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, 2));
  const int ex = float_exponent(mm);
  const int de = mm > 0.f && (ex < lo || ex >= lo + 4) ? max(-126, min(127, lo + 2 - ex)) : 0;
  const int ne = max(-120, min(120, esc + de));
  f = pow2i(ne - esc);
  esc = ne;
  sc = pow2i(ne);
}

// Row v's units for a chunk (see the top of this file), from max |S| (current units) and max |V|
// (raw, this thread's V^T pairs vp) over the four threads of a quad (they share rows); kn bounds
// the chunk's key norms. max(|S| kn 2^wsh, |V|) is kept in [2^(6 + wsh), 2^(10 + wsh)): S's
// bound as with wsh = 0, V's up to 2^wsh higher (the caller raises wsh in chunks of small beta,
// where S ~ beta V, with no h0, would otherwise fall to fp16 subnormals). Leaves rS16 =
// the fp16 copy of S^T in the new units, f = new / old units and sc = the new units per row
// half, esc updated.
template <class T, class AccS, class S16>
__device__ __forceinline__ void chunk_units(const AccS& accS, S16& rS16, const uint32_t (&vp)[16], float kn, int (&esc)[2],
                                            float (&f)[2], float (&sc)[2], int wsh) {
  using H = cutlass::half_t;
  float m[2];
  row_abs_max(accS, m);
  float mv[2] = {0.f, 0.f};
  CUTE_UNROLL
  for (int k = 0; k < 16; ++k) {  // pair k: elements 2 k, 2 k + 1, row half k & 1
    const float2 a = unpack2<T>(vp[k]);
    mv[k & 1] = fmaxf(mv[k & 1], fmaxf(fabsf(a.x), fabsf(a.y)));
  }
  // The fp16 copy of S in the current units, issued before the units are checked: they
  // change only when a row's max leaves [2^6, 2^10) (then it is put back in [2^8, 2^9)), so
  // in the common case nothing waits for the quad reduction below.
  CUTE_UNROLL
  for (int i = 0; i < size(accS); ++i) rS16(i) = H(accS(i));
  // The window keeps fp16 far from overflow: |Y| <= |k| |S row| <= sqrt(2) kn sqrt(128) |S|max
  // < sqrt(2) sqrt(128) 2^10, |V| < 2^10.
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) quad_row_units(fmaxf(m[h] * (kn * pow2i(wsh)), mv[h] * pow2i(esc[h])), 6 + wsh, esc[h], f[h], sc[h]);
  if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) {  // new units in this warp: redo the copy
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) rS16(i) = H(accS(i) * f[acc_half(i)]);
  }
}

// X^T = U^T diag(e^(Gamma - gamma)) as the S update's fp16 operand (U^T: elements 0 .. 31 of
// acc, their tokens from cAcc; the aux folded 2^-(2 ek + et) into the factors sEgk), and S^T
// times the chunk's decay e^Gamma and its change of units f.
template <class Acc, class CAcc, class X16, class AccS>
__device__ __forceinline__ void x_and_decay(const Acc& acc, const CAcc& cAcc, const float* sEgk, X16& rX16, AccS& accS,
                                            const float (&f)[2], float eG) {
  using H = cutlass::half_t;
  CUTE_UNROLL
  for (int i = 0; i < 32; i += 2) {
    const float2 ek = *reinterpret_cast<const float2*>(sEgk + get<1>(cAcc(i)));
    rX16(i) = H(acc(i) * ek.x);
    rX16(i + 1) = H(acc(i + 1) * ek.y);
  }
  CUTE_UNROLL
  for (int i = 0; i < size(accS); ++i) accS(i) *= f[acc_half(i)] * eG;
}

// The piece's path (split.cuh), from the gates of the chunks next to its boundaries, by warp 1
// into sflags: [0] the warm-up path, [1] its warm-up chunks.
__device__ __forceinline__ void piece_path_flags(const RecParams& p, const PieceCta& tile, int* sflags, int tid) {
  if (tid >= 32 && tid < 64) {
    const int nch = static_cast<int>((tile.slen + kC - 1) / kC);
    const bool warm = tile.sp.np > 1 && warm_path(p, tile.ci0, tile.hv, tile.sp, nch, tid - 32);
    if (tid == 32) {
      sflags[0] = warm;
      sflags[1] = warm && tile.j > 0 ? warm_chunks(p, tile.ci0, tile.hv, tile.j * tile.sp.len) : 0;
    }
  }
}

// A math warpgroup's O^T (v, tok) block, accumulator elements kBase .. kBase + 31 (a 64 x 64
// block's order), to a (tok, v) staging buffer by stmatrix.trans in true units: row v / 2^esc,
// token by its factor inv_tok (this thread's 8 token pairs). addr(tok, v): the byte address of
// the buffer's row tok at the warpgroup's column v (a multiple of 8).
template <class T, int kBase, class Acc, class Addr>
__device__ __forceinline__ void stage_o_trans(const Acc& acc, const int (&esc)[2], const float2 (&inv_tok)[8], int wt, Addr addr) {
  const float inv[2] = {pow2i(-esc[0]), pow2i(-esc[1])};
  const int lane = wt & 31, w = wt >> 5, mtx = lane >> 3;
  CUTE_UNROLL
  for (int tb = 0; tb < 8; tb += 2) {  // tokens 8 tb .. 8 tb + 15: accumulators kBase + 4 tb .. + 7
    uint32_t r[4];
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      const int i = kBase + 4 * tb + 2 * q;
      const float2 it = inv_tok[(i - kBase) >> 2];  // per token: elements 4 k .. 4 k + 3 share a pair
      r[q] = pack2<T>(acc(i) * (inv[acc_half(i)] * it.x), acc(i + 1) * (inv[acc_half(i)] * it.y));
    }
    // Lane l addresses row l % 8 of block l / 8 = (v half mtx & 1, token block tb + mtx / 2).
    const int tok = 8 * (tb + (mtx >> 1)) + (lane & 7), v = 16 * w + 8 * (mtx & 1);
    stmatrix_t4(addr(tok, v), r[0], r[1], r[2], r[3]);
  }
}

// The lean step's Z^T = diag(sc) V^T - Y'^T diag(egz) in fp16 (the A operand of U^T = Z^T Tu^T):
// accL holds Y'^T (v, tok) with coordinates cL, vp this thread's V^T pairs (load_vt_pairs), egz
// the per-token factors (e^gamma 2^-ek), sc the row units of this thread's two rows.
template <class T, class Acc, class Coord, class Z16>
__device__ __forceinline__ void form_z(const Acc& accL, const Coord& cL, const uint32_t (&vp)[16], const float* egz,
                                       const float (&sc)[2], Z16& rZ16) {
  using H = cutlass::half_t;
  CUTE_UNROLL
  for (int k = 0; k < 16; ++k) {
    const int i = 2 * k;
    const float2 vv = unpack2<T>(vp[k]);
    const float2 eg = *reinterpret_cast<const float2*>(egz + get<1>(cL(i)));
    const float s_ = sc[acc_half(i)];
    rZ16(i) = H(vv.x * s_ - eg.x * accL(i));
    rZ16(i + 1) = H(vv.y * s_ - eg.y * accL(i + 1));
  }
}

// RecParams::grad_simg is set: per (chunk, value head) region, the state entering the chunk as
// S^T (v, d) in the input type, laid out as the reverse step's shared-memory tile (QK_K: two
// 64-column boxes of 128 rows of 128 bytes, the 128-byte swizzle moving 16-byte runs within a row
// by row % 8) so that one bulk copy brings it in; no unit goes with it. Written from the states
// role's fp16 copy in row units (rS16), unscaled. The accumulator's
// element pair (2e, 2e + 1) of n8 block j = e / 2 sits at rows r0, r0 + 8 (acc_half), columns
// 8 j + 2 (lane % 4) + {0, 1}.
constexpr uint32_t kSImgBytes = kDV * kDK * 2;
template <class T, class R16>
__device__ __forceinline__ void store_state_image(const R16& r16, uint8_t* img, int v0, int wt, const int (&esc)[2]) {
  static_assert(decltype(size(r16))::value == 64, "a 64 x 128 accumulator's fragments");
  const int v = v0 + 16 * (wt >> 5) + ((wt & 31) >> 2);  // row r0 (r0 + 8: the same row % 8)
  const float sc[2] = {pow2i(-esc[0]), pow2i(-esc[1])};
  uint8_t* row = img + 128 * v + 4 * (wt & 3);
  CUTE_UNROLL
  for (int e = 0; e < 64; e += 2) {
    const int j = e >> 2, h = acc_half(e);
    const uint32_t off = 16384u * (j >> 3) + 1024u * h + 16u * ((j & 7) ^ (v & 7));
    *reinterpret_cast<uint32_t*>(row + off) =
        pack2<T>(static_cast<float>(r16(e)) * sc[h], static_cast<float>(r16(e + 1)) * sc[h]);
  }
}

// Nothing to do for this CTA: padding past the last piece or sequence, or malformed device
// cu_seqlens (then pass 0 fills the outputs with NaN).
template <class T>
__device__ __forceinline__ bool fused_cta_idle(const RecParams& p, const PieceCta& tile) {
  if (p.chunk_off[p.N + 1]) {
    if (p.pass == 0) fill_nan_outputs<T>(p);
    return true;
  }
  return !tile.live;
}

// The producer thread's loop: each chunk's loads into stage c % kStages once the math
// warpgroups have released it (`empty`).
template <class Cfg, bool kLean>
__device__ __forceinline__ void run_producer(const RecParams& p, const PieceCta& tile, const PieceRole& role, uint8_t* sm,
                                             uint64_t* full, uint64_t* empty) {
  const int hq = tile.hv / (p.HV / p.H);
  for (int c = 0; c < role.nch; ++c) {
    const int st = c % Cfg::kStages;
    // Rows past the sequence end are the next sequence's tokens (zeros past the tensor end): the
    // aux zeroes their K, Q and V once they land (aux_convert_qk); their O rows are not stored.
    const int tok = static_cast<int>(tile.t0) + (role.c0 + c) * kC, bb = static_cast<int>(tile.b);
    const size_t region = static_cast<size_t>(tile.ci0 + role.c0 + c) * p.HV + tile.hv;
    mbar_wait(&empty[st], ((c / Cfg::kStages) & 1) ^ 1);
    produce_chunk<Cfg, kLean>(p, sm + st * Cfg::kStageBytes, &full[st], region, hq, tile.hv, tile.vt * Cfg::kVT, tok, bb);
  }
}

// kLean: the lean kernel of a split call's pass 0 (split.cuh) and of the backward's states pass
// (at V tile 64, or 128 where 64 would take a second wave), whose CTAs write no o: the chunk
// step runs [Y] and [U] at N = 64 (no P, no W, no O staging) and the store warps and the aux's
// scores stay idle. A template argument, not a runtime one: the lean step's code beside the full
// one cost the full kernel registers and 1-7% of its time (split-8 in docs/design.md).
template <class T, int kMathWGs, bool kLean>
__global__ void __launch_bounds__(FusedCfg<kMathWGs>::kThreads, 1) gdn_fwd_chunks(const __grid_constant__ RecParams p) {
  using Cfg = FusedCfg<kMathWGs>;
  using H = cutlass::half_t;
  using LH = Lay<H>;
  constexpr int kStages = Cfg::kStages, VT = Cfg::kVT;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBar);
  uint64_t* aready = full + kStages;
  uint64_t* empty = aready + kStages;
  uint64_t* oready = empty + kStages;  // [kOBufs]: the staging buffer holds chunk c's O
  uint64_t* ofree = oready + 2;        // [kOBufs]: the store threads have copied it out

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
#ifdef QLA_SM90_TEST_HOOKS
  // Test builds, overlapped variant (p.ready): beside the inverse kernel, each region's flag
  // waited for by the producer instead of the whole kernel here.
  if (!p.ready) wait_for_previous_kernels();
#else
  wait_for_previous_kernels();  // the chunk table and the inverse kernel's regions
#endif
  const PieceCta tile = piece_cta(p);
  const int vt = tile.vt, n = tile.n, hv = tile.hv;
  const int64_t b = tile.b, t0 = tile.t0, slen = tile.slen;
  if (fused_cta_idle<T>(p, tile)) return;
  // The piece's path (split.cuh), from the gates of the chunks next to its boundaries: warp 1.
  int* sflags = reinterpret_cast<int*>(sm + Cfg::kFlags);
  piece_path_flags(p, tile, sflags, tid);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&aready[s], 128);
      mbar_init(&empty[s], 128 * kMathWGs);
    }
    for (int s = 0; s < Cfg::kOBufs; ++s) {
      mbar_init(&oready[s], 128 * kMathWGs);
      mbar_init(&ofree[s], kFusedStoreThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const PieceRole role = piece_role(p, tile, kDV / VT, sflags[0] != 0, sflags[1]);
  if (!role.run) return;
  // Chunks c = 0 .. nch - 1 of the loops are chunks c0 + c of the sequence; the first nwarm of
  // them (a warm-up) leave no output.
  const int nch = role.nch, c0 = role.c0, nwarm = role.nwarm;
  auto stage = [&](int c) { return sm + (c % kStages) * Cfg::kStageBytes; };
  auto parity = [&](int c) { return static_cast<uint32_t>((c / kStages) & 1); };

  if (wg == 0) {
    // ---------------- producer ----------------
    // Register budgets (per thread): 40 / 160 / 232 with one math warpgroup, 24 / 88 / 200
    // with two (the 64 Ki registers of the SM).
    if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
    if (wt >= 32) {
      // ---------------- output store (warps 1-3) ----------------
      if constexpr (kLean) return;
      const int st_t = wt - 32;
      T* ob = static_cast<T*>(p.o) + b * p.so[0] + static_cast<int64_t>(hv) * p.so[2] + vt * VT;
      // 16-byte stores when every row start is 16-byte aligned, else 4-byte ones.
      const bool vec = (reinterpret_cast<uintptr_t>(ob) & 15) == 0 && (p.so[1] & 7) == 0;
      for (int c = 0; c < nch; ++c) {
        const int ob_i = c % Cfg::kOBufs;
        const T* sO = reinterpret_cast<const T*>(sm + Cfg::kO) + ob_i * kC * Cfg::kOPitch;
        const int64_t cs = static_cast<int64_t>(c0 + c) * kC;  // within the sequence
        const int rows = role.out && c >= nwarm ? static_cast<int>(min<int64_t>(kC, slen - cs)) : 0;
        T* oc = ob + (t0 + cs) * p.so[1];
        mbar_wait(&oready[ob_i], (c / Cfg::kOBufs) & 1);
#ifdef QLA_SM90_TEST_HOOKS
        if (p.skip & 8) {
          // (timing variant: no store)
        } else
#endif
        copy_o_rows<T, VT>(sO, [](int j, int e) { return j * Cfg::kOPitch + e; }, oc, p.so[1], rows, st_t, vec);
        mbar_arrive(&ofree[ob_i]);
      }
      return;
    }
    if (wt == 0) run_producer<Cfg, kLean>(p, tile, role, sm, full, empty);
    return;
  }

  if (wg == 1) {
    // ---------------- aux: fp16 Q and K, W = A Tu ----------------
    if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 160;" ::: "memory");
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 88;" ::: "memory");
    AuxAcc acc;  // W = A Tu (i, j')
    QLA_PHASES(6);  // wait, exponents, conversion, factors, Q K^T, A and W
    for (int c = 0; c < nch; ++c) {
      uint8_t* stb = stage(c);
      H* sQK = reinterpret_cast<H*>(stb + Cfg::kQK);
      H* sTW = reinterpret_cast<H*>(stb + Cfg::kTW);
      const float* sGam = reinterpret_cast<const float*>(stb + Cfg::kGates);
      mbar_wait(&full[c % kStages], parity(c));
      QLA_PHASE(0);
      const int len = static_cast<int>(min<int64_t>(kC, slen - static_cast<int64_t>(c0 + c) * kC));
      aux_convert_qk<T, Cfg, kLean>(stb, len, wt QLA_PHASE_PASS);
      QLA_PHASE(2);
      aux_forward_factors<Cfg>(p, stb, wt);
      fence_async_smem();  // the generic stores before the async proxy's reads (wgmma) and refill (TMA)
      wg_bar(kBarAux);     // every thread's conversions done, before the wgmma reads them
      if constexpr (!kLean) {  // (the lean step's [U] = Z Tu^T alone needs no scores)
        QLA_PHASE(3);
        aux_scores_w(sQK, sTW, sGam, len, wt, acc QLA_PHASE_PASS);
        // W as fp16 into rows 64-127 of the Tu|W operand.
        stmatrix_tokd<64>(smem_u32(sTW) + 8192u, wt, [&](int i) { return acc(i); });  // (TW_K: one 16 KiB box of 128 rows; rows 64-127 start 8 KiB in)
        fence_async_smem();
      }
      mbar_arrive(&aready[c % kStages]);
      QLA_PHASE(5);
    }
    QLA_PHASES_PRINT("aux (wait, exponents, convert, factors, QK^T, A and W)", 6, nch);
    return;
  }

  // ---------------- math: the chain ----------------
  if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  else asm volatile("setmaxnreg.inc.sync.aligned.u32 200;" ::: "memory");
  const int mw = wg - 2;  // this math warpgroup's 64 v rows of the tile
  auto mmaN = make_tiled_mma(SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});   // B = K|Q or Tu|W
  auto mmaS = make_tiled_mma(SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = K as (d, tok)
  auto thrN = mmaN.get_thread_slice(wt);
  auto thrS = mmaS.get_thread_slice(wt);
  Tensor accS = partition_fragment_C(mmaS, Shape<_64, _128>{});  // S^T (v, d), row v in units 2^esc_v
  // [Y^T | P^T], then [U^T | O^T]: elements 0-31 are the left 64 columns, 32-63 the right ones,
  // with the same (v, tok) for i and i + 32.
  Tensor accT = partition_fragment_C(mmaN, Shape<_64, _128>{});
  Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  Tensor cT = thrN.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  constexpr int kHalf = 32;
  // Register A operands (fp16). The accumulator of a 64 x N product and the A fragment of a
  // K = N product list a thread's elements in the same order (CLayout_64xN, ALayout_64x16), so
  // element i of the one becomes element i of the other.
  Tensor rS16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});
  Tensor rZ16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // Z^T
  Tensor rX16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});
  static_assert(size(decltype(accS){}) == size(decltype(rS16){}) && size(decltype(accT){}) == 2 * size(decltype(rZ16){}),
                "A operands are the accumulators' elements");

  const int v0 = vt * VT + 64 * mw;  // the first of this warpgroup's columns of [V | K]
  // The piece's maps (split.cuh): its own, or the previous piece's R, which the scan made the
  // state entering this one.
  float* maps = p.maps ? map_at(p, tile.map - (role.init == kInitMaps), hv) : nullptr;
  // Piece 0 of a split sequence in pass 1 reads the scan's copy of h0 where the final state
  // shares its memory (the sequence's last piece writes it in this launch).
  const float* h0c = p.h0_copy && p.pass == 1 && tile.sp.np > 1 ? h0_copy_at(p, tile.map, hv) : nullptr;
  load_entering_state(p, role.init, n, hv, v0, maps, h0c, accS, cS);
  int esc[2] = {0, 0};  // row v's units: 2^esc
  QLA_PHASES(8);

  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    uint8_t* stb = stage(c);
    H* sQK = reinterpret_cast<H*>(stb + Cfg::kQK);
    H* sTW = reinterpret_cast<H*>(stb + Cfg::kTW);
    const float* sG = reinterpret_cast<const float*>(stb + Cfg::kGates);
    const float* sEgZ = reinterpret_cast<const float*>(stb + Cfg::kEgZ);  // the aux's factors
    const float* sEgP = reinterpret_cast<const float*>(stb + Cfg::kEgP);
    const float* sInvTok = reinterpret_cast<const float*>(stb + Cfg::kInvTok);
    const float* sEgk = sG + (kInvEgk - kInvGam) / 4;
    const T* sV = reinterpret_cast<const T*>(stb + Cfg::kV) + mw * kC * 64;
    mbar_wait(&full[st], parity(c));
    mbar_wait(&aready[st], parity(c));
    QLA_PHASE(0);
    const float eG = sG[(kInvEG - kInvGam) / 4];
    const float kn = sG[(kInvKn - kInvGam) / 4];  // bounds the chunk's key norms (>= 1)

    // This thread's V^T pairs (ldmatrix.trans of the TMA tile; Z below uses them).
    uint32_t vp[16];
    load_vt_pairs(sV, wt, vp);
    float f[2], sc[2];  // this chunk's change of units, and its units
    chunk_units<T>(accS, rS16, vp, kn, esc, f, sc, max(0, min(4, tu_exp_of<Cfg>(stb) - 1)));
    QLA_PHASE(1);
    if constexpr (kLean) {
      // The backward's states pass (RecParams::grad_simg): the state entering each chunk that
      // has o, S' = rS16 in its row units, before the first product reads the registers.
      if (p.grad_simg && role.out && c >= nwarm && v0 < kDV) {
        const size_t region = static_cast<size_t>(tile.ci0 + c0 + c) * p.HV + hv;
        store_state_image<T>(rS16, static_cast<uint8_t*>(p.grad_simg) + region * kSImgBytes, v0, wt, esc);
      }
      // Y^T = S^T K^T, Z^T = V^T - Y^T diag(e^gamma), U^T = Z^T Tu^T (N = 64 each: K's and Tu's
      // rows of the stacked operands), X^T = U^T diag(e^(Gamma - gamma)), S^T = e^Gamma S^T + X^T K.
      auto mmaL = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});
      auto thrL = mmaL.get_thread_slice(wt);
      Tensor accL = partition_fragment_C(mmaL, Shape<_64, _64>{});
      Tensor cL = thrL.partition_C(make_identity_tensor(Shape<_64, _64>{}));
      Tensor tQK = make_tensor(make_smem_ptr(sQK), QK_K{});
      product_sync(mmaL, rS16, thrL.partition_fragment_B(local_tile(tQK, Shape<_64, _128>{}, make_coord(0, 0))), accL,
              GMMA::ScaleOut::Zero);
      form_z<T>(accL, cL, vp, sEgZ, sc, rZ16);
      Tensor tTW = make_tensor(make_smem_ptr(sTW), TW_K{});
      product_sync(mmaL, rZ16, thrL.partition_fragment_B(local_tile(tTW, Shape<_64, _64>{}, make_coord(0, 0))), accL,
              GMMA::ScaleOut::Zero);
      x_and_decay(accL, cL, sEgk, rX16, accS, f, eG);
      Tensor tK = make_tensor(make_smem_ptr(sQK), QK_MN{});
      product_sync(mmaS, rX16, thrS.partition_fragment_B(local_tile(tK, Shape<_128, _64>{}, make_coord(0, 0))), accS,
              GMMA::ScaleOut::One);
      mbar_arrive(&empty[st]);  // every read of the stage is done
      continue;
    }

    // [Y^T | P^T] = S^T [K; Q]^T.
    Tensor rKQ = thrN.partition_fragment_B(make_tensor(make_smem_ptr(sQK), QK_K{}));
    warpgroup_fence_operand(rS16);
    warpgroup_fence_operand(accT);
    warpgroup_arrive();
    gemm_k(mmaN, rS16, rKQ, accT, GMMA::ScaleOut::Zero);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accT);
    QLA_PHASE(2);

    // Z^T = V^T - Y^T diag(e^gamma), in the row units (Y' = 2^ek Y: the aux's e^gamma 2^-ek);
    // then the left half becomes 0 and the right one P^T diag(e^gamma) (in O's per-token
    // units, the aux's factor), which the next product adds to.
    CUTE_UNROLL
    for (int k = 0; k < 16; ++k) {
      const int i = 2 * k;
      const float2 vv = unpack2<T>(vp[k]);
      const float2 eg = *reinterpret_cast<const float2*>(sEgZ + get<1>(cT(i)));
      const float2 ep = *reinterpret_cast<const float2*>(sEgP + get<1>(cT(i)));
      const float s_ = sc[acc_half(i)];
      rZ16(i) = H(vv.x * s_ - eg.x * accT(i));
      rZ16(i + 1) = H(vv.y * s_ - eg.y * accT(i + 1));
      accT(i) *= 0.f;  // not a constant: the accumulator keeps its own registers (Y^T is finite)
      accT(i + 1) *= 0.f;
      accT(kHalf + i) *= ep.x;
      accT(kHalf + i + 1) *= ep.y;
    }
    QLA_PHASE(3);
    // [U^T | O^T] = [0 | P^T diag(e^gamma)] + Z^T [Tu; W]^T, W = A Tu (the aux): U^T A^T = Z^T W^T.
    Tensor rTW = thrN.partition_fragment_B(make_tensor(make_smem_ptr(sTW), TW_K{}));
    warpgroup_fence_operand(rZ16);
    warpgroup_fence_operand(accT);
    warpgroup_arrive();
    gemm_k(mmaN, rZ16, rTW, accT, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    // O's per-token factors (this thread's 8 token pairs), loaded while the product runs.
    float2 inv_tok[8];
    CUTE_UNROLL
    for (int k = 0; k < 8; ++k) inv_tok[k] = *reinterpret_cast<const float2*>(sInvTok + get<1>(cT(4 * k)));
    warpgroup_wait<0>();
    warpgroup_fence_operand(accT);
    QLA_PHASE(4);

    // X^T = U^T diag(e^(Gamma - gamma)); S^T = e^Gamma S^T + X^T K in the new units (the aux
    // folded 2^-(2 ek + et) into e^(Gamma - gamma): X'^T K' is then S's update in units 2^esc).
    x_and_decay(accT, cT, sEgk, rX16, accS, f, eG);
    QLA_PHASE(5);
    Tensor rKs = thrS.partition_fragment_B(local_tile(make_tensor(make_smem_ptr(sQK), QK_MN{}), Shape<_128, _64>{}, make_coord(0, 0)));
    warpgroup_fence_operand(rX16);
    warpgroup_fence_operand(accS);
    warpgroup_arrive();
    gemm_k(mmaS, rX16, rKs, accS, GMMA::ScaleOut::One);
    warpgroup_commit_batch();

    // While S^T updates: O = O^T in true units into staging buffer c % kOBufs by
    // stmatrix.trans (rows = tokens, this warpgroup's 64 columns), once the store threads have
    // copied out its previous chunk.
    const int ob_i = c % Cfg::kOBufs, ob_use = c / Cfg::kOBufs;
    if (ob_use >= 1) mbar_wait(&ofree[ob_i], (ob_use - 1) & 1);
    {
      const uint32_t sO = smem_u32(sm + Cfg::kO) + (ob_i * kC * Cfg::kOPitch + 64 * mw) * 2;
      stage_o_trans<T, kHalf>(accT, esc, inv_tok, wt, [&](int tok, int v) { return sO + (tok * Cfg::kOPitch + v) * 2; });
    }
    mbar_arrive(&oready[ob_i]);
    QLA_PHASE(6);
    warpgroup_wait<0>();
    warpgroup_fence_operand(accS);
    mbar_arrive(&empty[st]);  // every read of the stage is done
    QLA_PHASE(7);
  }
  QLA_PHASES_PRINT("math (wait, units + S16, [Y|P], Z, [U|O], X + scale, O out, S^T)", 8, nch);

  store_leaving_state<kLean>(p, role.end, n, hv, v0, maps, accS, cS, esc);
}

}  // namespace
}  // namespace sm90
}  // namespace qla
