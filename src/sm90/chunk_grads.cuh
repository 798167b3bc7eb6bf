// The fused backward's gradients kernel (docs/backward.md section 10, build step 3, "revised"):
// chunk-parallel, one CTA per (chunk, q/k head), walking the HV / H value heads of the group in
// order. It reads what the sequential passes left per (chunk, value head) region: the inverse
// kernel's region (the Tu' image, gates, exponents: inverse.cuh) and the chunk operands in
// fragment order (fused_chunks.cuh's kFrag*: S' from the states pass, dSn' and dU' from the
// reverse chain), and forms the chunk's gradients.
//
// Every gradient of the chunk, tested against an fp64 token-by-token reference
// (tests/cuda/sm90_forward_test.cu --grads); one synchronous step after another (the pipeline
// comes once every gradient is right). Two math warpgroups. Operands are fp16 in shared memory,
// each with a power-of-two unit: per token (q's and k's exponents eq, ek from the region), per
// row of v (the fragments' esc_v, folded into one common unit before a product contracts over
// v), or per tile (a CTA max reduction: unit_for). Per value head of the group:
//   1. loads: V and dO tiles (TMA), the region's Tu' image and gates, the T' image, this
//      warpgroup's fragment blocks (64 rows of v) of S', dSn' and dU' into registers;
//   2. [rows v] dV^T = 2^-et R_v^-1 dU' Tu'; U recomputed as the forward's lean step
//      (Y' = S' K'^T, Z = R_v V^T - Y' diag(e^gamma 2^-ek), U' = Z Tu'^T); S, U, dU and dSn to
//      shared memory in common units;
//   3. [rows tokens; the warpgroups split the columns] the equations (B16)-(B33) of
//      docs/backward.md, with Tm = diag(2^ek) T' diag(2^-ek):
//        dP = dO U^T, dA = scale causal(E o dP), dQ = scale diag(e^gamma) dO S^T + dA K,
//        dK_P = dA^T Q, dK_d = diag(e^(Gamma - gamma)) U dSn^T, dW = -dU S^T,
//        dVb = Tm^T dU, dKb = Tm^T dW, dK_b = diag(beta e^gamma) dKb,
//        dL = strict(-(dVb Uv^T + dKb W^T)) with Uv = Tu V and W = Tu diag(e^gamma) K,
//        dM = E o dL, dK_L = diag(beta) dM K + dM^T diag(beta) K,
//        dbeta, and dg from the row dots and R = strict(dP o P) + dL o L (B29-B33);
//   dq and dk summed over the group's value heads in registers, in order (deterministic).
#pragma once

#include "fused_chunks.cuh"

namespace qla {
namespace sm90 {
namespace {

struct ChunkGradParams {
  CUtensorMap tmq, tmk, tmv, tmdo;  // q, k, v, dO as (d, head, token, batch), box (64, 1, 64, 1), 128-byte swizzle
  SeqDesc sd;
  const int* chunk_off;  // the chunk table (gdn_chunk_table)
  const void* regions;   // the inverse kernel's regions
  const void* tm;        // the inverse kernel's T' images (8 KiB per region)
  const void* frags;     // the chunk operands (kFragRegionBytes per region)
  const void* beta;
  int64_t sb[2];
  int b_dt;
  int N, H, HV;
  float scale;
  void *dq, *dk;  // (b, t, q/k head, d), the dtype of q
  int64_t sdq[3], sdk[3];
  void* dv;  // (b, t, value head, v), the dtype of v
  int64_t sdv[3];
  void *dg, *dbeta;  // (b, t, value head)
  int64_t sdg[2], sdb[2];
  int dg_dt, db_dt;
};

// Shared memory (byte offsets from the 1 KiB aligned base), reused as the contents die:
constexpr uint32_t kGrK = 0;                         // K' = 2^ek K (fp16, Lay::TokD_K), the CTA's
constexpr uint32_t kGrQ = kGrK + kQKBytes;           // Q' = 2^eq Q, the CTA's
constexpr uint32_t kGrV = kGrQ + kQKBytes;           // V (TMA), then Vs = 2^ev V
constexpr uint32_t kGrO = kGrV + kQKBytes;           // dO (TMA), dO' = 2^edo dO; then dWs
constexpr uint32_t kGrTu = kGrO + kQKBytes;          // the region's Tu' image
constexpr uint32_t kGrTm = kGrTu + kImgTokTok * 2;   // the region's T' image
constexpr uint32_t kGrS = kGrTm + kImgTokTok * 2;    // Ss (v, d) QK_K; then dVbs | dKbs (TokD_K each)
constexpr uint32_t kGrU = kGrS + 2 * kQKBytes;       // Us (v, tok) TW_K; then Kw (TokD_K)
constexpr uint32_t kGrA = kGrU + kQKBytes;           // dA'' (i, j) TokTok_K; then dM''
constexpr uint32_t kGrDU = kGrA + kImgTokTok * 2;    // dUs (v, tok) TW_K; then Ws (TokD_K)
constexpr uint32_t kGrD = kGrDU + kQKBytes;          // Ds (v, d) QK_K; then Uvs | BK' (TokD_K each)
constexpr uint32_t kGrMisc = kGrD + 2 * kQKBytes;
// Misc floats: gamma, e^gamma, e^gamma 2^-ek, e^(Gamma - gamma), beta (x 64 each); 24 reduction
// slots; per warpgroup the row partials a, x, dbeta (x 64 each); per warp the column sums of R.
constexpr int kGrMiscFloats = 5 * kC + 24 + 2 * 3 * kC + 8 * kC;
constexpr int kGradThreads = 256;  // two math warpgroups
constexpr size_t kGradSmemBytes = 1024 + kGrMisc + kGrMiscFloats * 4 + 2 * 8;
static_assert(kGradSmemBytes <= 232448, "gradients smem over the 227 KiB limit");

using GrTW_MN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<cutlass::half_t>{}, Shape<_64, _128>{},
                                       Step<_2, _1>{}));  // (tok, v): TW_K's bytes


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

// CTA-wide max of x >= 0 and min of e0, e1 (every thread gets them), through slots red[0..23].
__device__ __forceinline__ void cta_reduce(float& x, int& e0, int& e1, float* red, int tid) {
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    e0 = min(e0, __shfl_xor_sync(0xffffffffu, e0, o));
    e1 = min(e1, __shfl_xor_sync(0xffffffffu, e1, o));
  }
  int* ired = reinterpret_cast<int*>(red);
  __syncthreads();  // the slots' previous readers are done
  if ((tid & 31) == 0) {
    red[tid >> 5] = x;
    ired[8 + (tid >> 5)] = e0;
    ired[16 + (tid >> 5)] = e1;
  }
  __syncthreads();
  x = red[0];
  e0 = ired[8];
  e1 = ired[16];
  CUTE_UNROLL
  for (int w = 1; w < kGradThreads / 32; ++w) {
    x = fmaxf(x, red[w]);
    e0 = min(e0, ired[8 + w]);
    e1 = min(e1, ired[16 + w]);
  }
}
// The CTA-wide max of x >= 0.
__device__ __forceinline__ float cta_max(float x, float* red, int tid) {
  int a = 0, b = 0;
  cta_reduce(x, a, b, red, tid);
  return x;
}

// The exponent that brings a largest magnitude m into [2^13, 2^14) (0 for m = 0).
__device__ __forceinline__ int unit_for(float m) { return m > 0.f ? 13 - float_exponent(m) : 0; }

// One synchronous wgmma batch acc (+)= A B, both from shared memory (16-bit, majors from the views).
template <int N, GMMA::Major kA, GMMA::Major kB, class TA, class TB, class Acc>
__device__ __forceinline__ void grad_ss(int wt, const TA& sA, const TB& sB, Acc& acc, GMMA::ScaleOut first) {
  auto mma = make_tiled_mma(GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float, Shape<_64, Int<N>, _16>, kA, kB>());
  auto thr = mma.get_thread_slice(wt);
  gemm_sync(mma, thr.partition_fragment_A(sA), thr.partition_fragment_B(sB), acc, first);
}

// As above with a register A operand (fp16, accumulator order).
template <class MMA, class RA, class TB, class Acc>
__device__ __forceinline__ void grad_rs(MMA& mma, int wt, RA& rA, const TB& sB, Acc& acc, GMMA::ScaleOut first) {
  product_sync(mma, rA, mma.get_thread_slice(wt).partition_fragment_B(sB), acc, first);
}

// A 64 x 128 TokD_K tile of 16-bit T in place to fp16 times 2^e[row] (rows past len zeroed).
template <class T>
__device__ __forceinline__ void tile_to_fp16(uint8_t* tile, const int8_t* e, int len, int tid) {
#pragma unroll 1  // (rolled: the kernel's code must stay small, docs/design.md bwd-18)
  for (int u = tid; u < kQKBytes / 16; u += kGradThreads) {
    const int r = (u & 511) >> 3;  // a 16-byte run lies in one row: row (u % 512) / 8
    const uint32_t a = smem_u32(tile) + 16u * u;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (r < len) {
      x = lds_u128(a);
      uint32_t* px = &x.x;
      const float sc = pow2i(e[r]);
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(px[i]);
        px[i] = pack2<cutlass::half_t>(f.x * sc, f.y * sc);
      }
    }
    sts128(a, x);
  }
}

// A 64 x 128 TokD_K tile of 16-bit T in place to fp16 in one unit (its largest |value| near 2^13;
// rows past len zeroed); returns the unit's exponent. e0, e1: CTA-wide minimums taken in the same
// reduction.
template <class T>
__device__ __forceinline__ int tile_to_fp16_unit(uint8_t* tile, int len, int tid, float* red, int& e0, int& e1) {
  float m = 0.f;
#pragma unroll 1  // (two rolled passes, the second reading the tile again: less code than one unrolled)
  for (int u = tid; u < kQKBytes / 16; u += kGradThreads) {
    if (((u & 511) >> 3) >= len) continue;
    const uint4 x = lds_u128(smem_u32(tile) + 16u * u);
    const uint32_t* px = &x.x;
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float2 f = unpack2<T>(px[i]);
      m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  cta_reduce(m, e0, e1, red, tid);  // (its barriers also order the reads before the writes)
  const int e = unit_for(m);
  const float sc = pow2i(e);
#pragma unroll 1
  for (int u = tid; u < kQKBytes / 16; u += kGradThreads) {
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (((u & 511) >> 3) < len) {
      x = lds_u128(smem_u32(tile) + 16u * u);
      uint32_t* px = &x.x;
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(px[i]);
        px[i] = pack2<cutlass::half_t>(f.x * sc, f.y * sc);
      }
    }
    sts128(smem_u32(tile) + 16u * u, x);
  }
  return e;
}

// dst = diag(f) src for a 64 x 128 fp16 TokD_K tile (dst in the same layout), f(row) a factor.
template <class F>
__device__ __forceinline__ void scale_rows_fp16(const uint8_t* src, uint8_t* dst, int tid, F f) {
#pragma unroll 1
  for (int u = tid; u < kQKBytes / 16; u += kGradThreads) {
    const int r = (u & 511) >> 3;
    uint4 x = lds_u128(smem_u32(src) + 16u * u);
    uint32_t* px = &x.x;
    const float sc = f(r);
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<cutlass::half_t>(px[i]);
      px[i] = pack2<cutlass::half_t>(v.x * sc, v.y * sc);
    }
    sts128(smem_u32(dst) + 16u * u, x);
  }
}

// Malformed device cu_seqlens: instead of a silent wrong answer every element of dq, dk, dv,
// dg and dbeta becomes NaN (varlen, so one batch row of sd.T tokens; grid-stride over the grid;
// the reverse chain does d(initial state)).
template <class T>
__device__ void fill_nan_grads(const ChunkGradParams& p) {
  const int64_t nthreads = grid_blocks() * blockDim.x, first = flat_block() * blockDim.x + threadIdx.x;
  const float nan = __int_as_float(0x7fc00000);
  for (int64_t i = first; i < p.sd.T * p.H * kDK; i += nthreads) {
    const int64_t d = i % kDK, h = (i / kDK) % p.H, t = i / (kDK * p.H);
    static_cast<T*>(p.dq)[t * p.sdq[1] + h * p.sdq[2] + d] = T(nan);
    static_cast<T*>(p.dk)[t * p.sdk[1] + h * p.sdk[2] + d] = T(nan);
  }
  for (int64_t i = first; i < p.sd.T * p.HV * kDV; i += nthreads) {
    const int64_t v = i % kDV, h = (i / kDV) % p.HV, t = i / (kDV * p.HV);
    static_cast<T*>(p.dv)[t * p.sdv[1] + h * p.sdv[2] + v] = T(nan);
  }
  for (int64_t i = first; i < p.sd.T * p.HV; i += nthreads) {
    const int64_t h = i % p.HV, t = i / p.HV;
    store_f(p.dg, p.dg_dt, t * p.sdg[1] + h, nan);
    store_f(p.dbeta, p.db_dt, t * p.sdb[1] + h, nan);
  }
}

template <class T>
__global__ void __launch_bounds__(kGradThreads, 1) gdn_bwd_chunk_grads(const __grid_constant__ ChunkGradParams p) {
  using H = cutlass::half_t;
  using LH = Lay<H>;
  using MK = GMMA::Major;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  float* sGam = reinterpret_cast<float*>(sm + kGrMisc);
  float* sEg = sGam + kC;
  float* sEgZ = sEg + kC;  // e^gamma 2^-ek
  float* sEgk = sEgZ + kC;  // e^(Gamma - gamma)
  float* sBeta = sEgk + kC;
  float* sRed = sBeta + kC;
  float* sPart = sRed + 24;       // [2 warpgroups][a, x, dbeta][64]
  float* sColR = sPart + 6 * kC;  // [8 warps][64]: column sums of R
  uint64_t* bar = reinterpret_cast<uint64_t*>(sColR + 8 * kC);  // [0]: Q, K; [1]: V, dO
  const int tid = threadIdx.x, mw = tid >> 7, wt = tid & 127, warp = tid >> 5, lane = tid & 31;
  const int ci = blockIdx.x, hq = blockIdx.y;
  wait_for_previous_kernels();  // the regions and the chunk operands
  if (p.chunk_off[p.N + 1]) {  // malformed device cu_seqlens (flagged by gdn_chunk_table)
    fill_nan_grads<T>(p);
    return;
  }
  if (ci >= p.chunk_off[p.N]) return;
  int64_t b, t0;
  int len;
  region_tokens(p, ci, b, t0, len);  // the chunk's batch row, first token and length
  const int group = p.HV / p.H;
  const int tok = static_cast<int>(t0), bb = static_cast<int>(b);
  // k's and q's exponents (any value head's region of the chunk has them: the group's first).
  const uint8_t* reg0 = static_cast<const uint8_t*>(p.regions) + (static_cast<size_t>(ci) * p.HV + hq * group) * kInvRegionBytes;
  const int8_t* kexp = reinterpret_cast<const int8_t*>(reg0 + kInvKexp);
  const int8_t* qexp = reinterpret_cast<const int8_t*>(reg0 + kInvQexp);
  if (tid == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(&bar[0], 2 * kQKBytes);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      tma_load_4d(sm + kGrK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, bb, &bar[0]);
      tma_load_4d(sm + kGrQ + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, bb, &bar[0]);
    }
  }

  auto hp = [&](uint32_t off) { return reinterpret_cast<H*>(sm + off); };
  auto tokd = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), typename LH::TokD_K{}); };    // (tok, d|v)
  auto dtok = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), typename LH::DTok_MN{}); };   // (d|v, tok)
  auto tt = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), typename LH::TokTok_K{}); };    // (i, j)
  auto ttT = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), typename LH::TokTok_MN{}); };  // (j, i)
  auto vd = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), QK_K{}); };     // (v, d)
  auto dv_ = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), QK_MN{}); };   // (d, v)
  auto vt = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), TW_K{}); };     // (v, tok)
  auto tv = [&](uint32_t off) { return make_tensor(make_smem_ptr(hp(off)), GrTW_MN{}); };  // (tok, v)
  // This warpgroup's column half of a B operand (N = 64 of 128, or 32 of 64).
  auto h64 = [&](auto t) { return local_tile(t, make_shape(Int<64>{}, size<1>(t)), make_coord(mw, 0)); };
  auto h32 = [&](auto t) { return local_tile(t, make_shape(Int<32>{}, size<1>(t)), make_coord(mw, 0)); };

  const int row0 = 16 * (wt >> 5) + (lane >> 2);  // this thread's accumulator rows: row0, row0 + 8
  const int c64 = 64 * mw, c32 = 32 * mw;          // this warpgroup's first column
  Tensor cc = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, MK::K, MK::K>())
                  .get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));
  Tensor c32t = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _32, _16>, MK::K, MK::K>())
                    .get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _32>{}));
  using Acc64 = decltype(partition_fragment_C(make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, MK::K, MK::K>()), Shape<_64, _64>{}));
  using Acc32 = decltype(partition_fragment_C(make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _32, _16>, MK::K, MK::K>()), Shape<_64, _32>{}));
  Acc64 dqAcc, dkAcc;  // dq, dk (tok, d) of this warpgroup's 64 columns, summed over the group
  clear(dqAcc);
  clear(dkAcc);
  // Row partials of this thread's two rows (quad-reduced), and their sum over the warpgroups.
  auto put_rows = [&](int q, float2 v) {
    if ((lane & 3) == 0) {
      sPart[(mw * 3 + q) * kC + row0] = v.x;
      sPart[(mw * 3 + q) * kC + row0 + 8] = v.y;
    }
  };
  auto quad2 = [&](float2 v) {
    CUTE_UNROLL
    for (int o = 1; o < 4; o <<= 1) {
      v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
    }
    return v;
  };
  auto fac2 = [&](const float* x) { return make_float2(x[row0], x[row0 + 8]); };
  // A 64 x 32 part of R (this warpgroup's columns c32 ..): its row sums into rsum, its column
  // sums into this warp's slot (fixed order: no atomics).
  auto add_r = [&](const auto& r, float2& rsum) {
    CUTE_UNROLL
    for (int i = 0; i < size(r); i += 2) {
      if (acc_half(i)) rsum.y += r(i) + r(i + 1);
      else rsum.x += r(i) + r(i + 1);
    }
    add_col_sums(r, c32t, sColR + warp * kC, c32, lane);
  };

  QLA_PHASES(10);
  for (int gi = 0; gi < group; ++gi) {
    const int hv = hq * group + gi;
    const size_t region = static_cast<size_t>(ci) * p.HV + hv;
    const uint8_t* regb = static_cast<const uint8_t*>(p.regions) + region * kInvRegionBytes;
    const uint8_t* fb = static_cast<const uint8_t*>(p.frags) + region * kFragRegionBytes + mw * kFragBlockBytes;
    __syncthreads();  // every read of the previous value head's shared memory is done
    if (tid == 0) {
      fence_async_smem();
      mbar_expect_tx(&bar[1], 2 * kQKBytes);
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        tma_load_4d(sm + kGrV + h * kQKBytes / 2, &p.tmv, h * 64, hv, tok, bb, &bar[1]);
        tma_load_4d(sm + kGrO + h * kQKBytes / 2, &p.tmdo, h * 64, hv, tok, bb, &bar[1]);
      }
    }
    // This warpgroup's chunk operands toward L2 now (read from the rows-v block on), the Tu' and
    // T' images into shared memory without a register round trip (waited for before the barrier
    // ahead of their first product).
    for (int k = wt; k < kFragBlockBytes / 128; k += 128) prefetch_l2(fb + 128u * k);
    const uint8_t* tmb = static_cast<const uint8_t*>(p.tm) + region * (kImgTokTok * 2);
#pragma unroll 1
    for (int k = tid; k < kImgTokTok * 2 / 16; k += kGradThreads) {
      cp_async16(smem_u32(sm + kGrTu) + 16u * k, regb + kInvImg + 16u * k);
      cp_async16(smem_u32(sm + kGrTm) + 16u * k, tmb + 16u * k);
    }
    if (tid < kC) {
      sGam[tid] = reinterpret_cast<const float*>(regb + kInvGam)[tid];
      const float eg = reinterpret_cast<const float*>(regb + kInvEg)[tid];
      sEg[tid] = eg;
      sEgZ[tid] = eg * pow2i(-kexp[tid]);
      sEgk[tid] = reinterpret_cast<const float*>(regb + kInvEgk)[tid];
      sBeta[tid] = tid < len ? bits_value(load_bits(p.beta, p.b_dt, b * p.sb[0] + (t0 + tid) * p.sb[1] + hv), p.b_dt) : 0.f;
    }
    for (int i = tid; i < 8 * kC; i += kGradThreads) sColR[i] = 0.f;
    const int et = *reinterpret_cast<const int*>(regb + kInvTuExp);
    const float eGamma = *reinterpret_cast<const float*>(regb + kInvEG);
    const int* escSp = reinterpret_cast<const int*>(fb + kFragEscS);
    const int* escUp = reinterpret_cast<const int*>(fb + kFragEsc);
    const int escS[2] = {escSp[row0], escSp[row0 + 8]}, escU[2] = {escUp[row0], escUp[row0 + 8]};
    if (gi == 0) {  // K', Q' in fp16 in place, rows past the end zeroed (once per CTA)
      mbar_wait(&bar[0], 0);
      tile_to_fp16<T>(sm + kGrK, kexp, len, tid);
      tile_to_fp16<T>(sm + kGrQ, qexp, len, tid);
    }
    mbar_wait(&bar[1], gi & 1);
#pragma unroll 1
    for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(sm + kGrV + h * kQKBytes / 2), len, tid, kGradThreads);
    // dO's unit, and the common units of the rows of S (cS) and of dU, dSn (cU).
    int cS = min(escS[0], escS[1]), cU = min(escU[0], escU[1]);
    QLA_PHASE(0);
    const int edo = tile_to_fp16_unit<T>(sm + kGrO, len, tid, sRed, cS, cU);
    cp_async_wait_all();
    fence_async_smem();
    __syncthreads();  // K', Q', dO', Tu', T', the gates and the zeroed V rows
    QLA_PHASE(1);

    // ---- rows v (this warpgroup's fragment block): dV^T, U; S, U, dU, dSn to shared memory ----
    {
      Tensor rS16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});  // S' (v, d), then dSn'
      Tensor rU16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // dU' (v, tok)
      load_fragments(rU16, fb + kFragDU, wt);
      auto mmaV = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<MK::K, MK::MN>{});  // B = Tu' as (j, i)
      auto mmaL = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<MK::K, MK::K>{});   // B = K' (j, d), Tu' (i, j)
      Tensor acc = partition_fragment_C(mmaV, Shape<_64, _64>{});
      Tensor cV = mmaV.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (v, tok)
      // dV^T = 2^-et R_v^-1 dU' Tu'.
      grad_rs(mmaV, wt, rU16, ttT(kGrTu), acc, GMMA::ScaleOut::Zero);
      {
        const float uf[2] = {pow2i(-et - escU[0]), pow2i(-et - escU[1])};
        // Element 4 k + 2 h + e is (v, t) = (row0 + 8 h, 8 k + tq + e): one pointer walks the
        // column blocks (cheap addressing keeps the code small).
        const int tq = 2 * (lane & 3);
        const int64_t s1 = p.sdv[1];
        T* pk = static_cast<T*>(p.dv) + b * p.sdv[0] + static_cast<int64_t>(hv) * p.sdv[2] + c64 + row0 + (t0 + tq) * s1;
        CUTE_UNROLL
        for (int k = 0; k < size(acc) / 4; ++k, pk += 8 * s1) {
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            if (8 * k + tq + e < len) {
              pk[e * s1] = T(acc(4 * k + e) * uf[0]);
              pk[e * s1 + 8] = T(acc(4 * k + 2 + e) * uf[1]);
            }
          }
        }
      }
      const float uu[2] = {pow2i(cU - escU[0]), pow2i(cU - escU[1])};
      auto rows = [&](auto t) { return local_tile(t, make_shape(Int<64>{}, size<1>(t)), make_coord(mw, 0)); };
      Tensor tdU = rows(vt(kGrDU));
      stmatrix_rows<64>(tdU, wt, [&](int i) { return static_cast<float>(rU16(i)) * uu[acc_half(i)]; });
      load_fragments(rS16, fb + kFragS, wt);
      const float su[2] = {pow2i(cS - escS[0]), pow2i(cS - escS[1])};
      Tensor tS = rows(vd(kGrS));
      stmatrix_rows<128>(tS, wt, [&](int i) { return static_cast<float>(rS16(i)) * su[acc_half(i)]; });
      // Y' = S' K'^T, Z = R_v V^T - Y' diag(e^gamma 2^-ek), U' = Z Tu'^T.
      grad_rs(mmaL, wt, rS16, tokd(kGrK), acc, GMMA::ScaleOut::Zero);
      uint32_t vp[16];
      load_vt_pairs(reinterpret_cast<const T*>(sm + kGrV) + mw * kC * 64, wt, vp);
      Tensor rZ16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});
      const float rs[2] = {pow2i(escS[0]), pow2i(escS[1])};
      form_z<T>(acc, cV, vp, sEgZ, rs, rZ16);
      grad_rs(mmaL, wt, rZ16, tt(kGrTu), acc, GMMA::ScaleOut::Zero);
      Tensor tU = rows(vt(kGrU));
      stmatrix_rows<64>(tU, wt, [&](int i) { return acc(i) * su[acc_half(i)]; });
      load_fragments(rS16, fb + kFragDSn, wt);  // dSn'
      Tensor tD = rows(vd(kGrD));
      stmatrix_rows<128>(tD, wt, [&](int i) { return static_cast<float>(rS16(i)) * uu[acc_half(i)]; });
    }
    fence_async_smem();
    __syncthreads();  // Ss, Us, dUs, Ds
    QLA_PHASE(2);

    // ---- rows tokens: this warpgroup's columns c64 .. of d or v, c32 .. of j ----
    float2 aR = make_float2(0.f, 0.f), xR = aR, dbR = aR, rR = aR;  // a, x, dbeta, R's row sums
    const float2 ekr = make_float2(pow2i(kexp[row0]), pow2i(kexp[row0 + 8]));     // 2^ek of my rows
    const float2 ekri = make_float2(pow2i(-kexp[row0]), pow2i(-kexp[row0 + 8]));  // 2^-ek
    const float2 eqr = make_float2(pow2i(qexp[row0]), pow2i(qexp[row0 + 8]));
    const float2 eqri = make_float2(pow2i(-qexp[row0]), pow2i(-qexp[row0 + 8]));
    auto rh = [](float2 v, int i) { return acc_half(i) ? v.y : v.x; };
    Acc64 acc;
    Acc32 a32, b32;
    // dq1 = scale e^gamma_i 2^-(edo + cS) dO' Ss^T; a_i += <dq1_i, Q_i>.
    grad_ss<64, MK::K, MK::MN>(wt, tokd(kGrO), h64(dv_(kGrS)), acc, GMMA::ScaleOut::Zero);
    {
      const float f = p.scale * pow2i(-edo - cS);
      const float2 eg = fac2(sEg);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) *= f * rh(eg, i);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dqAcc(i) += acc(i);
      const float2 d = row_dot<H, typename LH::TokD_K>(acc, cc, hp(kGrQ), c64);
      aR.x += d.x * eqri.x;
      aR.y += d.y * eqri.y;
    }
    // P = scale causal(E o Q K^T) and dP = dO U^T (this warpgroup's 32 columns j);
    // R1 = strict(dP o P); dA'' = 2^cA 2^-eq_i dA 2^-ek_j, dA = scale causal(E o dP).
    grad_ss<32, MK::K, MK::K>(wt, tokd(kGrQ), h32(tokd(kGrK)), a32, GMMA::ScaleOut::Zero);
    grad_ss<32, MK::K, MK::MN>(wt, tokd(kGrO), h32(tv(kGrU)), b32, GMMA::ScaleOut::Zero);
    float ma = 0.f;
    {
      const float fp = pow2i(-edo - et - cS);
      Acc32 rr;
      CUTE_UNROLL
      for (int i = 0; i < size(b32); ++i) {
        const int r = get<0>(c32t(i)), j = get<1>(c32t(i)) + c32;
        const bool causal = r < len && r >= j;
        const float E = causal ? exp2f(fminf(sGam[r] - sGam[j], 0.f) * kLog2e) : 0.f;
        const float ekj = pow2i(kexp[j]);
        const float dp = b32(i) * fp * ekj;  // dP
        const float pv = p.scale * E * a32(i) * rh(eqri, i) * pow2i(-kexp[j]);  // P
        rr(i) = causal && r > j ? dp * pv : 0.f;
        b32(i) = p.scale * E * dp * rh(eqri, i) * pow2i(-kexp[j]);  // 2^-eq_i dA 2^-ek_j
        ma = fmaxf(ma, fabsf(b32(i)));
      }
      add_r(rr, rR);
    }
    const int cA = unit_for(cta_max(ma, sRed, tid));
    {
      const float af = pow2i(cA);
      Tensor tA = local_tile(tt(kGrA), Shape<_64, _32>{}, make_coord(0, mw));
      stmatrix_rows<32>(tA, wt, [&](int i) { return b32(i) * af; });
    }
    fence_async_smem();
    __syncthreads();  // dA''; dO' is dead: dWs takes its bytes
    QLA_PHASE(3);
    // dq += 2^(eq_i - cA) dA'' K'.
    grad_ss<64, MK::K, MK::MN>(wt, tt(kGrA), h64(dtok(kGrK)), acc, GMMA::ScaleOut::Zero);
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) dqAcc(i) += acc(i) * rh(eqr, i) * pow2i(-cA);
    // dk += 2^(ek_j - cA) dA''^T Q'.
    grad_ss<64, MK::MN, MK::MN>(wt, ttT(kGrA), h64(dtok(kGrQ)), acc, GMMA::ScaleOut::Zero);
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) dkAcc(i) += acc(i) * rh(ekr, i) * pow2i(-cA);
    // dK_d = e^(Gamma - gamma_j) 2^ek_j 2^-(et + cS + cU) Us^T Ds; x_j = <dK_d_j, K_j>.
    grad_ss<64, MK::MN, MK::MN>(wt, tv(kGrU), h64(dv_(kGrD)), acc, GMMA::ScaleOut::Zero);
    {
      const float f = pow2i(-et - cS - cU);
      const float2 egk = fac2(sEgk);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) *= f * rh(egk, i) * rh(ekr, i);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dkAcc(i) += acc(i);
      const float2 d = row_dot<H, typename LH::TokD_K>(acc, cc, hp(kGrK), c64);
      xR.x += d.x * ekri.x;
      xR.y += d.y * ekri.y;
    }
    // <dSn, S> (e^Gamma times it joins dg): Ss and Ds share their layout.
    float sdot = 0.f;
#pragma unroll 1
    for (int u = tid; u < 2 * kQKBytes / 16; u += kGradThreads) {
      const uint4 x = lds_u128(smem_u32(sm + kGrS) + 16u * u), y = lds_u128(smem_u32(sm + kGrD) + 16u * u);
      const uint32_t* px = &x.x;
      const uint32_t* py = &y.x;
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const float2 a = unpack2<H>(px[e]), c = unpack2<H>(py[e]);
        sdot += a.x * c.x + a.y * c.y;
      }
    }
    QLA_PHASE(4);
    // dW = -2^-(cU + cS) 2^-ek_j dUs^T Ss: dWs = 2^cw (-acc) = 2^(cw + cU + cS) diag(2^ek) dW.
    grad_ss<64, MK::MN, MK::MN>(wt, tv(kGrDU), h64(dv_(kGrS)), acc, GMMA::ScaleOut::Zero);
    float mdw = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) mdw = fmaxf(mdw, fabsf(acc(i)));
    const int cw = unit_for(cta_max(mdw, sRed, tid));  // (after it every warp's dO' reads are done)
    {
      const float f = -pow2i(cw);
      Tensor tW = local_tile(tokd(kGrO), Shape<_64, _64>{}, make_coord(0, mw));
      stmatrix_rows<64>(tW, wt, [&](int i) { return acc(i) * f; });
    }
    // dVb = 2^-cU 2^-ek_i T'^T dUs (columns v); dbeta_i += <dVb_i, V_i> (raw V).
    grad_ss<64, MK::MN, MK::K>(wt, ttT(kGrTm), h64(vt(kGrDU)), acc, GMMA::ScaleOut::Zero);
    {
      const float2 d = row_dot<T, typename Lay<T>::TokD_K>(acc, cc, reinterpret_cast<const T*>(sm + kGrV), c64);
      const float f = pow2i(-cU);
      dbR.x += d.x * f * ekri.x;
      dbR.y += d.y * f * ekri.y;
    }
    float mvb = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) mvb = fmaxf(mvb, fabsf(acc(i)));
    const int cvb = unit_for(cta_max(mvb, sRed, tid));  // (after it: every read of Ss by dW, of dUs by dVb)
    {
      const float f = pow2i(cvb);
      Tensor tVb = local_tile(tokd(kGrS), Shape<_64, _64>{}, make_coord(0, mw));
      stmatrix_rows<64>(tVb, wt, [&](int i) { return acc(i) * f; });  // dVbs = 2^(cvb + cU) diag(2^ek) dVb
    }
    fence_async_smem();
    __syncthreads();  // dWs, dVbs
    QLA_PHASE(5);
    // dKb = 2^-(cw + cU + cS) 2^-ek_i T'^T dWs; dK_b = beta e^gamma dKb; dbeta, a.
    grad_ss<64, MK::MN, MK::MN>(wt, ttT(kGrTm), h64(dtok(kGrO)), acc, GMMA::ScaleOut::Zero);
    {
      const float f = pow2i(-cw - cU - cS);
      const float2 d = row_dot<H, typename LH::TokD_K>(acc, cc, hp(kGrK), c64);  // <acc_i, K'_i>
      const float2 eg = fac2(sEg), bt = fac2(sBeta);
      const float kx = d.x * f * ekri.x * ekri.x, ky = d.y * f * ekri.y * ekri.y;  // <dKb_i, K_i>
      dbR.x += eg.x * kx;
      dbR.y += eg.y * ky;
      aR.x += bt.x * eg.x * kx;
      aR.y += bt.y * eg.y * ky;
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dkAcc(i) += acc(i) * f * rh(ekri, i) * rh(bt, i) * rh(eg, i);
    }
    float mkb = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) mkb = fmaxf(mkb, fabsf(acc(i)));
    const int ckb = unit_for(cta_max(mkb, sRed, tid));
    {
      const float f = pow2i(ckb);
      Tensor tKb = local_tile(tokd(kGrS + kQKBytes), Shape<_64, _64>{}, make_coord(0, mw));
      stmatrix_rows<64>(tKb, wt, [&](int i) { return acc(i) * f; });  // dKbs = 2^(ckb + cw + cU + cS) diag(2^ek) dKb
    }
    // Kw = 2^ckw e^gamma_j 2^-ek_j K'_j (= 2^ckw e^gamma K) over Us (dead since dK_d).
    float mz = 0.f;
    if (tid < kC) mz = sEgZ[tid];
    const int ckw = unit_for(cta_max(mz, sRed, tid)) - 1;  // (K' rows: |entries| < 2^1/2)
    scale_rows_fp16(sm + kGrK, sm + kGrU, tid, [&](int r) { return sEgZ[r] * pow2i(ckw); });
    // Vs = 2^ev V in place (the dbeta row dot has read the raw V).
    int no0 = 0, no1 = 0;
    const int ev = tile_to_fp16_unit<T>(sm + kGrV, len, tid, sRed, no0, no1);
    fence_async_smem();
    __syncthreads();  // dKbs, Kw, Vs
    QLA_PHASE(6);
    // Uv: 2^(et + ev) 2^-ek_i Uv = Tu' Vs -> Uvs (unit cuv); W: 2^(et + ckw) 2^-ek_i W = Tu' Kw -> Ws (cws).
    grad_ss<64, MK::K, MK::MN>(wt, tt(kGrTu), h64(dtok(kGrV)), acc, GMMA::ScaleOut::Zero);
    float muv = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) muv = fmaxf(muv, fabsf(acc(i)));
    Acc64 acc2;
    grad_ss<64, MK::K, MK::MN>(wt, tt(kGrTu), h64(dtok(kGrU)), acc2, GMMA::ScaleOut::Zero);
    float mws = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < size(acc2); ++i) mws = fmaxf(mws, fabsf(acc2(i)));
    const int cuv = unit_for(cta_max(muv, sRed, tid));
    const int cws = unit_for(cta_max(mws, sRed, tid));
    {  // Ds and dUs are dead (dK_d, dVb, <dSn, S> done): Uvs over Ds, Ws over dUs
      const float f = pow2i(cuv), g = pow2i(cws);
      Tensor tUv = local_tile(tokd(kGrD), Shape<_64, _64>{}, make_coord(0, mw));
      stmatrix_rows<64>(tUv, wt, [&](int i) { return acc(i) * f; });
      Tensor tWs = local_tile(tokd(kGrDU), Shape<_64, _64>{}, make_coord(0, mw));
      stmatrix_rows<64>(tWs, wt, [&](int i) { return acc2(i) * g; });
    }
    // BK' = beta_i 2^(et - ek_i) K'_i over Ds's second half.
    scale_rows_fp16(sm + kGrK, sm + kGrD + kQKBytes, tid, [&](int r) { return sBeta[r] * pow2i(et - kexp[r]); });
    fence_async_smem();
    __syncthreads();  // Uvs, Ws, BK'
    QLA_PHASE(7);
    // dL = strict(-(dVb Uv^T + dKb W^T)) (this warpgroup's 32 columns j), L = strict(diag(beta) E o K K^T),
    // R2 = dL o L, dM'' = 2^cm dM diag(2^-ek), dM = E o dL.
    grad_ss<32, MK::K, MK::K>(wt, tokd(kGrS), h32(tokd(kGrD)), a32, GMMA::ScaleOut::Zero);
    grad_ss<32, MK::K, MK::K>(wt, tokd(kGrS + kQKBytes), h32(tokd(kGrDU)), b32, GMMA::ScaleOut::Zero);
    float mm = 0.f;
    {
      Acc32 kk;
      grad_ss<32, MK::K, MK::K>(wt, tokd(kGrK), h32(tokd(kGrK)), kk, GMMA::ScaleOut::Zero);
      const float f1 = pow2i(-cvb - cU - cuv - ev - et), f2 = pow2i(-ckb - cw - cU - cS - cws - et - ckw);
      const float2 bt = fac2(sBeta);
      CUTE_UNROLL
      for (int i = 0; i < size(a32); ++i) {
        const int r = get<0>(c32t(i)), j = get<1>(c32t(i)) + c32;
        const bool strict = r < len && r > j;
        const float E = strict ? exp2f(fminf(sGam[r] - sGam[j], 0.f) * kLog2e) : 0.f;
        const float fj = pow2i(kexp[j]) * rh(ekri, i);  // 2^(ek_j - ek_i)
        const float dl = strict ? -(a32(i) * f1 + b32(i) * f2) * fj : 0.f;
        const float l = rh(bt, i) * E * kk(i) * rh(ekri, i) * pow2i(-kexp[j]);
        kk(i) = dl * l;  // R2
        a32(i) = E * dl * pow2i(-kexp[j]);  // dM diag(2^-ek)
        mm = fmaxf(mm, fabsf(a32(i)));
      }
      add_r(kk, rR);
    }
    const int cm = unit_for(cta_max(mm, sRed, tid));  // (after it: every read of dA'' is done)
    {
      const float f = pow2i(cm);
      Tensor tM = local_tile(tt(kGrA), Shape<_64, _32>{}, make_coord(0, mw));
      stmatrix_rows<32>(tM, wt, [&](int i) { return a32(i) * f; });
    }
    fence_async_smem();
    __syncthreads();  // dM''
    QLA_PHASE(8);
    // dM K = 2^-cm dM'' K': dk += beta_i dM K; dbeta_i += <(dM K)_i, K_i>.
    grad_ss<64, MK::K, MK::MN>(wt, tt(kGrA), h64(dtok(kGrK)), acc, GMMA::ScaleOut::Zero);
    {
      const float f = pow2i(-cm);
      const float2 bt = fac2(sBeta);
      const float2 d = row_dot<H, typename LH::TokD_K>(acc, cc, hp(kGrK), c64);
      dbR.x += d.x * f * ekri.x;
      dbR.y += d.y * f * ekri.y;
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dkAcc(i) += acc(i) * f * rh(bt, i);
    }
    // dM^T diag(beta) K = 2^(ek_j - cm - et) dM''^T BK'.
    grad_ss<64, MK::MN, MK::MN>(wt, ttT(kGrA), h64(dtok(kGrD + kQKBytes)), acc, GMMA::ScaleOut::Zero);
    {
      const float f = pow2i(-cm - et);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) dkAcc(i) += acc(i) * f * rh(ekr, i);
    }
    // dbeta and dg (B33): dg_t = sum_{i >= t} a_i + sum_{i < t} x_i + e^Gamma <dSn, S>, a_i with
    // R's row sums minus its column sums; both warpgroups' halves summed in order.
    rR = quad2(rR);
    put_rows(0, make_float2(aR.x + rR.x, aR.y + rR.y));
    put_rows(1, xR);
    put_rows(2, dbR);
    (void)cta_max(0.f, sRed, tid);  // (its barriers: the row partials and column sums are complete)
    {
      // <dSn, S>: the threads' partials through the reduction slots (a sum, in warp order).
      float v = sdot;
      CUTE_UNROLL
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) sRed[warp] = v;
    }
    __syncthreads();
    if (tid < kC) {
      const int r = tid;
      float col = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < 8; ++w) col += sColR[w * kC + r];
      const float a = sPart[0 * kC + r] + sPart[3 * kC + r] - col;
      const float x = sPart[1 * kC + r] + sPart[4 * kC + r];
      const float db = sPart[2 * kC + r] + sPart[5 * kC + r];
      sColR[r] = a;       // (warp 0's column slot, read above by this thread only)
      sColR[kC + r] = x;  // (warp 1's)
      if (r < len) store_f(p.dbeta, p.db_dt, b * p.sdb[0] + (t0 + r) * p.sdb[1] + hv, db);
    }
    __syncthreads();
    if (tid < len) {
      float sdS = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < 8; ++w) sdS += sRed[w];
      float s_ = eGamma * sdS * pow2i(-cS - cU);
      for (int i = tid; i < kC; ++i) s_ += sColR[i];
      for (int i = 0; i < tid; ++i) s_ += sColR[kC + i];
      store_f(p.dg, p.dg_dt, b * p.sdg[0] + (t0 + tid) * p.sdg[1] + hv, s_);
    }
    QLA_PHASE(9);
  }
  QLA_PHASES_PRINT("gradients (loads, dO' and units + barrier, rows v: dv, U, stores, dq1 + P + dP + dA'', dq2 + dK_P + dK_d, "
                   "dW + dVb, dKb + Kw + Vs, Uv + W + BK', dL + KK + dM'', dM K + dM^T BK + dg)", 10, group);
  // dq, dk of the group, once.
  {
    // Element 4 k + 2 h + e is (t, d) = (row0 + 8 h, 8 k + tq + e).
    const int tq = 2 * (lane & 3);
    T* dqg = static_cast<T*>(p.dq) + b * p.sdq[0] + static_cast<int64_t>(hq) * p.sdq[2] + c64 + tq + (t0 + row0) * p.sdq[1];
    T* dkg = static_cast<T*>(p.dk) + b * p.sdk[0] + static_cast<int64_t>(hq) * p.sdk[2] + c64 + tq + (t0 + row0) * p.sdk[1];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      if (row0 + 8 * h < len) {
        T* q = dqg + 8 * h * p.sdq[1];
        T* k = dkg + 8 * h * p.sdk[1];
        CUTE_UNROLL
        for (int i = 0; i < size(dqAcc) / 4; ++i) {
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            q[8 * i + e] = T(dqAcc(4 * i + 2 * h + e));
            k[8 * i + e] = T(dkAcc(4 * i + 2 * h + e));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
