// The fused backward's gradients kernel (docs/backward.md section 10, build step 3, "revised"):
// chunk-parallel, one CTA per (chunk, q/k head), walking the HV / H value heads of the group in
// order. It reads what the sequential passes left per (chunk, value head) region: the inverse
// kernel's region (the Tu' image, gates, exponents: inverse.cuh) and the chunk operands in
// fragment order (fused_chunks.cuh's kFrag*: S' from the states pass, dSn' and dU' from the
// reverse chain), and forms the chunk's gradients.
//
// Built gradient by gradient, each tested against the fp64 reference as it lands
// (tests/cuda/sm90_forward_test.cu --grads). Now dv and dq; one synchronous step after another
// (the pipeline comes once every gradient is right). Two math warpgroups; per value head:
//   1. loads: V and dO tiles (TMA), the region's Tu' image and gates, this warpgroup's fragment
//      block (64 rows of v) of S' and dU' straight into registers (they are A operands as they are);
//   2. units: the tile's dO' = 2^edo dO (largest |dO| near 2^13) and one unit 2^cS for every row of
//      S and U (cS = the smallest row unit esc_v: the products below contract over v, so rows
//      must share a unit; a row far below the largest only loses bits it would not add);
//   3. [rows v] dV^T = 2^-et R_v^-1 dU' Tu'; U recomputed as the forward's lean step:
//      Y' = S' K'^T, Z = R_v V^T - Y' diag(e^gamma 2^-ek), U' = Z Tu'^T (= 2^et R_v U^T diag(2^-ek));
//      S and U to shared memory in the common unit (Ss (v, d), Us (v, tok));
//   4. [rows tokens, columns split between the warpgroups]
//      dQ  = scale diag(e^gamma) dO S^T + dA K, with dP = dO U^T and dA = scale causal(E o dP)
//      (dA' = dA diag(2^-ek), in a unit 2^cA, against K' = diag(2^ek) K);
//   dq summed over the group's value heads in registers, in order (deterministic), stored once.
#pragma once

#include "fused_chunks.cuh"

namespace qla {
namespace sm90 {
namespace {

struct ChunkGradParams {
  CUtensorMap tmk, tmv, tmdo;  // k, v, dO as (d, head, token, batch), box (64, 1, 64, 1), 128-byte swizzle
  SeqDesc sd;
  const int* chunk_off;  // the chunk table (gdn_chunk_table)
  const void* regions;   // the inverse kernel's regions
  const void* frags;     // the chunk operands (kFragRegionBytes per region)
  int N, H, HV;
  float scale;
  void* dv;  // (b, t, value head, v), the dtype of v
  int64_t sdv[3];
  void* dq;  // (b, t, q/k head, d), the dtype of q
  int64_t sdq[3];
};

// Shared memory (byte offsets from the 1 KiB aligned base).
constexpr uint32_t kGrK = 0;                    // K tile (TMA, Lay::TokD_K), then K' = 2^ek K in fp16
constexpr uint32_t kGrV = kGrK + kQKBytes;      // V tile (TMA, two 64-column boxes)
constexpr uint32_t kGrO = kGrV + kQKBytes;      // dO tile (TMA), then dO' = 2^edo dO in fp16
constexpr uint32_t kGrTu = kGrO + kQKBytes;     // the region's Tu' image (TokTok_K)
constexpr uint32_t kGrS = kGrTu + kImgTokTok * 2;  // Ss (v, d) fp16, QK_K: 2^cS S^T
constexpr uint32_t kGrU = kGrS + 2 * kQKBytes;  // Us (v, tok) fp16, TW_K: 2^(et + cS) U^T diag(2^-ek)
constexpr uint32_t kGrA = kGrU + kQKBytes;      // dA' (i, j) fp16, TokTok_K: 2^cA dA diag(2^-ek)
constexpr uint32_t kGrMisc = kGrA + kImgTokTok * 2;  // gamma, e^gamma, e^gamma 2^-ek (fp32 x 64 each),
                                                     // 16 reduction slots, 2 mbarriers
constexpr int kGradThreads = 256;  // two math warpgroups
constexpr size_t kGradSmemBytes = 1024 + kGrMisc + 3 * kC * 4 + 16 * 4 + 2 * 8;
static_assert(kGradSmemBytes <= 232448, "gradients smem over the 227 KiB limit");

using GrTW_MN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::half_t>{}, Shape<_64, _128>{},
                                       Step<_2, _1>{}));  // (tok, v): TW_K's bytes

__device__ __forceinline__ uint4 lds_u128(uint32_t a) {
  uint4 u;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "r"(a));
  return u;
}

// The inverse of store_fragments: this thread's fragments of an accumulator-ordered fp16 tensor.
template <class R16>
__device__ __forceinline__ void load_fragments(R16& r16, const uint8_t* src, int wt) {
  CUTE_UNROLL
  for (int i = 0; i < size(r16) / 8; ++i) {
    const uint4 u = *reinterpret_cast<const uint4*>(src + 2048u * i + 16u * wt);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      r16(8 * i + 2 * j) = cutlass::half_t::bitcast(static_cast<uint16_t>(w[j] & 0xffffu));
      r16(8 * i + 2 * j + 1) = cutlass::half_t::bitcast(static_cast<uint16_t>(w[j] >> 16));
    }
  }
}

// CTA-wide max of x >= 0 and min of e (every thread gets both), through slots red[0..15].
__device__ __forceinline__ void cta_max_min(float& x, int& e, float* red, int tid) {
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    e = min(e, __shfl_xor_sync(0xffffffffu, e, o));
  }
  __syncthreads();  // the slots' previous readers are done
  if ((tid & 31) == 0) {
    red[tid >> 5] = x;
    reinterpret_cast<int*>(red)[8 + (tid >> 5)] = e;
  }
  __syncthreads();
  x = red[0];
  e = reinterpret_cast<const int*>(red)[8];
  CUTE_UNROLL
  for (int w = 1; w < kGradThreads / 32; ++w) {
    x = fmaxf(x, red[w]);
    e = min(e, reinterpret_cast<const int*>(red)[8 + w]);
  }
}

// The exponent that brings a largest magnitude m into [2^13, 2^14) (0 for m = 0).
__device__ __forceinline__ int unit_for(float m) { return m > 0.f ? 13 - float_exponent(m) : 0; }

// One synchronous wgmma batch acc (+)= A B, both from shared memory.
template <class MMA, class TA, class TB, class Acc>
__device__ __forceinline__ void grad_mma_ss(MMA& mma, int wt, const TA& sA, const TB& sB, Acc& acc, GMMA::ScaleOut first) {
  auto thr = mma.get_thread_slice(wt);
  Tensor rA = thr.partition_fragment_A(sA);
  Tensor rB = thr.partition_fragment_B(sB);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mma, rA, rB, acc, first);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

// As above with a register A operand (fp16, accumulator order).
template <class MMA, class RA, class TB, class Acc>
__device__ __forceinline__ void grad_mma_rs(MMA& mma, int wt, RA& rA, const TB& sB, Acc& acc, GMMA::ScaleOut first) {
  auto thr = mma.get_thread_slice(wt);
  Tensor rB = thr.partition_fragment_B(sB);
  warpgroup_fence_operand(rA);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mma, rA, rB, acc, first);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

template <class T>
__global__ void __launch_bounds__(kGradThreads, 1) gdn_bwd_chunk_grads(const __grid_constant__ ChunkGradParams p) {
  using H = cutlass::half_t;
  using LH = Lay<H>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  float* sGam = reinterpret_cast<float*>(sm + kGrMisc);
  float* sEg = sGam + kC;
  float* sEgZ = sEg + kC;  // e^gamma 2^-ek
  float* sRed = sEgZ + kC;
  uint64_t* bar = reinterpret_cast<uint64_t*>(sRed + 16);  // [0]: K, [1]: V and dO
  const int tid = threadIdx.x, mw = tid >> 7, wt = tid & 127;
  const int ci = blockIdx.x, hq = blockIdx.y;
  wait_for_previous_kernels();  // the regions and the chunk operands
  if (p.chunk_off[p.N + 1] || ci >= p.chunk_off[p.N]) return;
  int64_t b, t0;
  int len;
  region_tokens(p, ci, b, t0, len);  // the chunk's batch row, first token and length
  const int group = p.HV / p.H;
  const int tok = static_cast<int>(t0), bb = static_cast<int>(b);
  // k's exponents (any value head's region of the chunk has them: the group's first).
  const int8_t* kexp = reinterpret_cast<const int8_t*>(static_cast<const uint8_t*>(p.regions) +
                                                       (static_cast<size_t>(ci) * p.HV + hq * group) * kInvRegionBytes + kInvKexp);
  if (tid == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(&bar[0], kQKBytes);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) tma_load_4d(sm + kGrK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, bb, &bar[0]);
  }

  auto tTokD = [&](uint32_t off) { return make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + off)), typename LH::TokD_K{}); };
  // Each 16-byte run of a 64 x 128 TokD_K tile lies within one row: row (u % 512) / 8 of run u.
  auto run_row = [](int u) { return (u & 511) >> 3; };
  const int row0 = 16 * (wt >> 5) + ((wt & 31) >> 2);  // this thread's accumulator rows: row0, row0 + 8
  Tensor dqAcc = partition_fragment_C(
      make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::MN>()),
      Shape<_64, _64>{});  // dq (tok, d) of this warpgroup's 64 columns
  clear(dqAcc);

  for (int gi = 0; gi < group; ++gi) {
    const int hv = hq * group + gi;
    const size_t region = static_cast<size_t>(ci) * p.HV + hv;
    const uint8_t* regb = static_cast<const uint8_t*>(p.regions) + region * kInvRegionBytes;
    const uint8_t* fb = static_cast<const uint8_t*>(p.frags) + region * kFragRegionBytes + mw * kFragBlockBytes;
    __syncthreads();  // every read of the previous value head's tiles is done
    if (tid == 0) {
      fence_async_smem();
      mbar_expect_tx(&bar[1], 2 * kQKBytes);
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        tma_load_4d(sm + kGrV + h * kQKBytes / 2, &p.tmv, h * 64, hv, tok, bb, &bar[1]);
        tma_load_4d(sm + kGrO + h * kQKBytes / 2, &p.tmdo, h * 64, hv, tok, bb, &bar[1]);
      }
    }
    for (int k = tid; k < kImgTokTok * 2 / 16; k += kGradThreads)
      reinterpret_cast<uint4*>(sm + kGrTu)[k] = reinterpret_cast<const uint4*>(regb + kInvImg)[k];
    if (tid < kC) {
      sGam[tid] = reinterpret_cast<const float*>(regb + kInvGam)[tid];
      const float eg = reinterpret_cast<const float*>(regb + kInvEg)[tid];
      sEg[tid] = eg;
      sEgZ[tid] = eg * pow2i(-kexp[tid]);
    }
    const int et = *reinterpret_cast<const int*>(regb + kInvTuExp);
    Tensor rS16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});  // S' (v, d)
    Tensor rU16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // dU' (v, tok)
    load_fragments(rS16, fb + kFragS, wt);
    load_fragments(rU16, fb + kFragDU, wt);
    const int escS[2] = {reinterpret_cast<const int*>(fb + kFragEscS)[row0], reinterpret_cast<const int*>(fb + kFragEscS)[row0 + 8]};
    const int escU[2] = {reinterpret_cast<const int*>(fb + kFragEsc)[row0], reinterpret_cast<const int*>(fb + kFragEsc)[row0 + 8]};

    if (gi == 0) {  // K' = 2^ek K in fp16 in place, rows past the end zeroed (once per CTA)
      mbar_wait(&bar[0], 0);
      for (int u = tid; u < kQKBytes / 16; u += kGradThreads) {
        const int r = run_row(u);
        const uint32_t a = smem_u32(sm + kGrK) + 16u * u;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r < len) {
          x = lds_u128(a);
          uint32_t* px = &x.x;
          const float sc = pow2i(kexp[r]);
          CUTE_UNROLL
          for (int i = 0; i < 4; ++i) {
            const float2 f = unpack2<T>(px[i]);
            px[i] = pack2<H>(f.x * sc, f.y * sc);
          }
        }
        sts128(a, x);
      }
    }
    // dO's unit and the common unit of S and U rows (one reduction); rows past the end zeroed.
    mbar_wait(&bar[1], gi & 1);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(sm + kGrV + h * kQKBytes / 2), len, tid, kGradThreads);
    uint4 od[kQKBytes / 16 / kGradThreads];
    float m = 0.f;
    CUTE_UNROLL
    for (int k = 0; k < kQKBytes / 16 / kGradThreads; ++k) {
      const int u = tid + kGradThreads * k;
      od[k] = run_row(u) < len ? lds_u128(smem_u32(sm + kGrO) + 16u * u) : make_uint4(0u, 0u, 0u, 0u);
      const uint32_t* px = &od[k].x;
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(px[i]);
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
    int cS = min(escS[0], escS[1]);
    cta_max_min(m, cS, sRed, tid);
    const int edo = unit_for(m);
    {
      const float sc = pow2i(edo);
      CUTE_UNROLL
      for (int k = 0; k < kQKBytes / 16 / kGradThreads; ++k) {
        uint32_t* px = &od[k].x;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
          const float2 f = unpack2<T>(px[i]);
          px[i] = pack2<H>(f.x * sc, f.y * sc);
        }
        sts128(smem_u32(sm + kGrO) + 16u * (tid + kGradThreads * k), od[k]);
      }
    }
    fence_async_smem();
    __syncthreads();  // K', dO', Tu', the gates and the zeroed V rows, before any product reads them

    // ---- rows v: dV^T, then U recomputed; S and U to shared memory in the unit 2^cS ----
    {
      auto mmaV = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = Tu' as (j, i)
      auto mmaL = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});   // B = K' (j, d), Tu' (i, j)
      Tensor acc = partition_fragment_C(mmaV, Shape<_64, _64>{});
      Tensor cA = mmaV.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));
      Tensor tTu = make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrTu)), typename LH::TokTok_K{});
      Tensor tTuT = make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrTu)), typename LH::TokTok_MN{});
      // dV^T = 2^-et R_v^-1 dU' Tu'.
      grad_mma_rs(mmaV, wt, rU16, tTuT, acc, GMMA::ScaleOut::Zero);
      {
        const float uf[2] = {pow2i(-et - escU[0]), pow2i(-et - escU[1])};
        T* dvg = static_cast<T*>(p.dv) + b * p.sdv[0] + static_cast<int64_t>(hv) * p.sdv[2] + 64 * mw;
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          const int v = get<0>(cA(i)), t = get<1>(cA(i));
          if (t < len) dvg[(t0 + t) * p.sdv[1] + v] = T(acc(i) * uf[acc_half(i)]);
        }
      }
      // Ss = 2^(cS - escS_v) S' (rows 64 mw ..).
      const float su[2] = {pow2i(cS - escS[0]), pow2i(cS - escS[1])};
      Tensor tS = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrS)), QK_K{}), Shape<_64, _128>{},
                             make_coord(mw, 0));
      stmatrix_rows<128>(tS, wt, [&](int i) { return static_cast<float>(rS16(i)) * su[acc_half(i)]; });
      // Y' = S' K'^T, Z = R_v V^T - Y' diag(e^gamma 2^-ek), U' = Z Tu'^T.
      grad_mma_rs(mmaL, wt, rS16, tTokD(kGrK), acc, GMMA::ScaleOut::Zero);
      uint32_t vp[16];
      load_vt_pairs(reinterpret_cast<const T*>(sm + kGrV) + mw * kC * 64, wt, vp);
      Tensor rZ16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});
      const float rs[2] = {pow2i(escS[0]), pow2i(escS[1])};
      form_z<T>(acc, cA, vp, sEgZ, rs, rZ16);
      grad_mma_rs(mmaL, wt, rZ16, tTu, acc, GMMA::ScaleOut::Zero);
      Tensor tU = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrU)), TW_K{}), Shape<_64, _64>{},
                             make_coord(mw, 0));
      stmatrix_rows<64>(tU, wt, [&](int i) { return acc(i) * su[acc_half(i)]; });
    }
    fence_async_smem();
    __syncthreads();  // Ss and Us complete

    // ---- rows tokens: dq; warpgroup mw takes columns 64 mw .. of d (32 mw .. of dP's j) ----
    {
      auto mmaQ = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::MN>());
      auto mmaP = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _32, _16>, GMMA::Major::K, GMMA::Major::MN>());
      Tensor acc = partition_fragment_C(mmaQ, Shape<_64, _64>{});
      Tensor cQ = mmaQ.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));
      // dq += scale e^gamma_i 2^-(edo + cS) dO' Ss^T.
      Tensor tSd = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrS)), QK_MN{}), Shape<_64, _128>{},
                              make_coord(mw, 0));  // (d, v)
      grad_mma_ss(mmaQ, wt, tTokD(kGrO), tSd, acc, GMMA::ScaleOut::Zero);
      const float qf = p.scale * pow2i(-edo - cS);
      const float eq[2] = {sEg[row0] * qf, sEg[row0 + 8] * qf};
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dqAcc(i) += eq[acc_half(i)] * acc(i);
      // dP = 2^-(edo + et + cS) diag(2^ek) dO' Us^T ... as dA' = scale causal(E o dP) diag(2^-ek).
      Tensor accP = partition_fragment_C(mmaP, Shape<_64, _32>{});
      Tensor cP = mmaP.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _32>{}));
      Tensor tUj = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrU)), GrTW_MN{}), Shape<_32, _128>{},
                              make_coord(mw, 0));  // (j, v)
      grad_mma_ss(mmaP, wt, tTokD(kGrO), tUj, accP, GMMA::ScaleOut::Zero);
      const float pf = p.scale * pow2i(-edo - et - cS);
      float ma = 0.f;
      CUTE_UNROLL
      for (int i = 0; i < size(accP); ++i) {
        const int r = get<0>(cP(i)), j = get<1>(cP(i)) + 32 * mw;
        const bool causal = r < len && r >= j;
        accP(i) = causal ? pf * exp2f(fminf(sGam[r] - sGam[j], 0.f) * kLog2e) * accP(i) : 0.f;
        ma = fmaxf(ma, fabsf(accP(i)));
      }
      int unused = 0;
      cta_max_min(ma, unused, sRed, tid);
      const int cA = unit_for(ma);
      const float af = pow2i(cA);
      Tensor tA = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrA)), typename LH::TokTok_K{}),
                             Shape<_64, _32>{}, make_coord(0, mw));
      stmatrix_rows<32>(tA, wt, [&](int i) { return accP(i) * af; });
      fence_async_smem();
      __syncthreads();  // dA' complete
      // dq += 2^-cA dA' K'.
      Tensor tKd = local_tile(make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrK)), typename LH::DTok_MN{}),
                              Shape<_64, _64>{}, make_coord(mw, 0));  // (d, j)
      Tensor tAij = make_tensor(make_smem_ptr(reinterpret_cast<H*>(sm + kGrA)), typename LH::TokTok_K{});
      grad_mma_ss(mmaQ, wt, tAij, tKd, acc, GMMA::ScaleOut::Zero);
      const float kf = pow2i(-cA);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dqAcc(i) += kf * acc(i);
      (void)cQ;
    }
  }
  // dq of the group, once.
  {
    Tensor cQ = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::MN>())
                    .get_thread_slice(wt)
                    .partition_C(make_identity_tensor(Shape<_64, _64>{}));
    T* dqg = static_cast<T*>(p.dq) + b * p.sdq[0] + static_cast<int64_t>(hq) * p.sdq[2] + 64 * mw;
    CUTE_UNROLL
    for (int i = 0; i < size(dqAcc); ++i) {
      const int t = get<0>(cQ(i)), d = get<1>(cQ(i));
      if (t < len) dqg[(t0 + t) * p.sdq[1] + d] = T(dqAcc(i));
    }
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
