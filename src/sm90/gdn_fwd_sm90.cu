// sm90 (Hopper, sm_90a) forward backend of the Gated DeltaNet chunked prefill.
// Three launches on p.stream, no host synchronisation (graph-capturable):
//   1. gdn_chunk_table: per-sequence chunk offsets (prefix sum of ceil(len/64)), on device.
//   2. gdn_prep<T>:     chunk-parallel, one CTA per (chunk, value head): gamma, K K^T, Q K^T,
//                       Tm = (I+L)^-1, and the wgmma-ready operand images of the recurrence.
//   3. gdn_recur<T>:    sequential over chunks, one CTA per (sequence, value head, V tile of 64):
//                       U = u - w S, O = diag(scale e^gamma) Q S + A U,
//                       S = e^Gamma S + K^T diag(e^(Gamma-gamma)) U (all wgmma).
// Precision: the wgmma operands that are not exact inputs (Tm, A, S, U, X) are split into
// bf16/fp16 hi + lo parts (x = hi + lo to ~16 mantissa bits) except w (hi only); u and the gates
// stay fp32. Plain 16-bit rounding of all intermediates cost ~3.4e-3 relative L2 on bf16 inputs.
// See src/sm90/README.md for the design and budgets.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include "../backends.h"

namespace qla {
namespace sm90 {
namespace {

using namespace cute;

constexpr int kC = 64;    // chunk length
constexpr int kDK = 128;  // head dim of q/k
constexpr int kDV = 128;  // head dim of v
constexpr int kUT = 32;   // V columns per u tile of the workspace (recurrence V tiles: 32 or 64)

// Workspace region of one (chunk, value head). The 16-bit part holds the exact shared-memory
// bytes (swizzled GMMA layouts) that gdn_recur wants, so one plain bulk copy loads it:
//   w_hi (tok, d) | A_hi, A_lo (i, j)                                        (elements of T)
// followed by an fp32 part that the producer also bulk-copies (the math loop never touches
// global memory, whose latency would sit on the sequential path):
//   u [V/32][tok][32] (each recurrence CTA's V tile contiguous) | gq[64] = scale e^gamma |
//   gk[64] = e^(Gamma-gamma) (0 on padding) | e^Gamma | pad (528 bytes of gates in all)
// Q and K are not copied: the recurrence loads them from q, k with the tensor-memory
// accelerator (TMA), 128-byte swizzled. w_lo is not stored: its product moved the final state
// error from ~5e-6 to ~1e-3 only (see README "Precision"), for 16 KiB per region.
constexpr int kImgTokD = kC * kDK;   // 64 x 128
constexpr int kImgTokTok = kC * kC;  // 64 x 64
constexpr int kOffWh = 0;
constexpr int kOffAh = kImgTokD;
constexpr int kOffAl = kImgTokD + kImgTokTok;
constexpr int kImgElems = kImgTokD + 2 * kImgTokTok;  // 16384 elements = 32 KiB
constexpr size_t kF32Off = size_t(kImgElems) * 2;      // byte offset of the fp32 part
constexpr int kFU = 0, kFGq = kC * kDV, kFGk = kFGq + kC, kFEG = kFGk + kC;
constexpr uint32_t kImgBytes = kImgElems * 2;      // 16-bit image (32 KiB)
constexpr uint32_t kQKBytes = kImgTokD * 2;        // one Q or K tile (16 KiB, two TMA boxes)
constexpr uint32_t kGateBytes = (kFEG + 4 - kFGq) * 4;  // gq, gk, e^Gamma, pad (528 B, 16-B multiple)
constexpr size_t kRegionBytes = (kF32Off + (kFEG + 4) * 4 + 1023) & ~size_t(1023);  // 65 KiB
static_assert(kGateBytes % 16 == 0, "bulk copies move 16-byte multiples");

// Split x into hi + lo 16-bit parts (x - hi is exact in fp32).
template <class T>
__device__ __forceinline__ void split2(float x, T& hi, T& lo) {
  hi = T(x);
  lo = T(x - float(hi));
}

// Shared-memory layouts (GMMA canonical, 128-byte swizzle). A [token][d] tile with d contiguous
// is the same bytes as a K-major (token, d) tile and as an MN-major (d, token) tile when the
// MN atoms are tiled token-first (Step<_2,_1>); K and kg use both views.
template <class T>
struct Lay {
  using KAtom = GMMA::Layout_K_SW128_Atom<T>;
  using MNAtom = GMMA::Layout_MN_SW128_Atom<T>;
  using TokD_K = decltype(tile_to_shape(KAtom{}, Shape<_64, _128>{}));                    // (tok, d)
  using DTok_MN = decltype(tile_to_shape(MNAtom{}, Shape<_128, _64>{}, Step<_2, _1>{}));  // (d, tok)
  using TokTok_K = decltype(tile_to_shape(KAtom{}, Shape<_64, _64>{}));                   // (i, j)
};
// Recurrence operands with V tile VT (64: 128-byte swizzle; 32: 64-byte swizzle, MN-major atoms
// must not be wider than the tile).
template <class T, int VT>
struct RecLay {
  using MNAtom = std::conditional_t<VT == 64, GMMA::Layout_MN_SW128_Atom<T>, GMMA::Layout_MN_SW64_Atom<T>>;
  using VD_MN = decltype(tile_to_shape(MNAtom{}, Shape<Int<VT>, _128>{}));  // (v, d) state
  using VTok_MN = decltype(tile_to_shape(MNAtom{}, Shape<Int<VT>, _64>{}));  // (v, tok)
};

// ---------------------------------------------------------------------------------------------
// Small PTX helpers (mbarrier + bulk copy + proxy fence + named barrier).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// 4-d tiled TMA load (128-byte swizzle is encoded in the tensor map), completing on bar.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];" ::
          "r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// 16-byte shared load (a broadcast here). Written out because the compiler otherwise splits
// the substitution's row reads into four scalar LDS, four times the shared-memory instructions.
__device__ __forceinline__ float4 lds128(uint32_t addr) {
  float4 r;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(addr));
  return r;
}
// Generic-proxy smem writes must be made visible to wgmma (async proxy) before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Barrier 1 among the 128 math threads only (the producer warp never joins it).
__device__ __forceinline__ void math_bar() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

__device__ __forceinline__ float load_f(const void* p, int dt, int64_t i) {
  if (dt == static_cast<int>(DType::kFloat32)) return static_cast<const float*>(p)[i];
  if (dt == static_cast<int>(DType::kBFloat16))
    return float(static_cast<const cutlass::bfloat16_t*>(p)[i]);
  return float(static_cast<const cutlass::half_t*>(p)[i]);
}

// Sequences: varlen (cu_seqlens on device, B == 1) or B rows of length T.
struct SeqDesc {
  const void* cu = nullptr;
  int cu64 = 0;
  int64_t T = 0;
};
__device__ __forceinline__ int64_t cu_at(const SeqDesc& s, int64_t n) {
  return s.cu64 ? static_cast<const int64_t*>(s.cu)[n] : static_cast<const int32_t*>(s.cu)[n];
}
// b: batch row, t0: first token (within row b), len: tokens.
__device__ __forceinline__ void seq_bounds(const SeqDesc& s, int64_t n, int64_t& b, int64_t& t0, int64_t& len) {
  if (s.cu) {
    b = 0;
    t0 = cu_at(s, n);
    len = cu_at(s, n + 1) - t0;
  } else {
    b = n;
    t0 = 0;
    len = s.T;
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Chunk table: off[n] = sum_{m<n} ceil(len_m / 64), off[N] = total chunks. One block.
// ---------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(1024) gdn_chunk_table(SeqDesc sd, int N, int* off) {
  __shared__ int warp_sum[32];
  __shared__ int carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < N; base += 1024) {
    const int n = base + tid;
    int cnt = 0;
    if (n < N) {
      int64_t b, t0, len;
      seq_bounds(sd, n, b, t0, len);
      cnt = static_cast<int>((len + kC - 1) / kC);
    }
    int x = cnt;
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
    if (n < N) off[n + 1] = incl;
    __syncthreads();
    if (tid == 1023) carry = incl;
    __syncthreads();
  }
  if (tid == 0) off[0] = 0;
}

// ---------------------------------------------------------------------------------------------
// 2. Chunk-parallel prep. One CTA (one warpgroup) per (chunk, value head).
// ---------------------------------------------------------------------------------------------
struct PrepParams {
  const void *q, *k, *v, *g, *beta;
  int64_t sq[3], sk[3], sv[3], sg[2], sb[2];
  int g_dt, b_dt;
  SeqDesc sd;
  int N, H, HV;
  const int* chunk_off;
  void* regions;  // kRegionBytes per (chunk, value head)
  float scale;
};

constexpr int kLd = 68;  // fp32 row pitch of L (16-byte aligned rows)
constexpr size_t kPrepSmem = 1024 + 3 * kImgTokD * 2 + 4 * kImgTokTok * 2 + kC * kLd * 4 + 2 * kC * 4;

template <class T>
__global__ void __launch_bounds__(128) gdn_prep(PrepParams p) {
  using L = Lay<T>;
  extern __shared__ uint8_t smem_raw[];
  // 1 KiB aligned (128-byte swizzle atoms), as an offset from smem_raw so that the compiler keeps
  // the shared state space (LDS/STS, 32-bit addresses) and knows the alignment (vector accesses).
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  T* sQ = reinterpret_cast<T*>(sm);
  T* sK = sQ + kImgTokD;
  T* sV = sK + kImgTokD;
  T* sAuh = sV + kImgTokD;       // Tm diag(beta), hi/lo          (i, j), K-major
  T* sAul = sAuh + kImgTokTok;
  T* sAwh = sAul + kImgTokTok;   // Tm diag(beta e^gamma), hi/lo
  T* sAwl = sAwh + kImgTokTok;
  float* sL = reinterpret_cast<float*>(sAwl + kImgTokTok);
  float* sGam = sL + kC * kLd;
  float* sBeta = sGam + kC;

  const int tid = threadIdx.x;
  const int ci = blockIdx.x, hv = blockIdx.y;
  const int total = p.chunk_off[p.N];
  if (ci >= total) return;  // grid is an upper bound on the chunk count
  // Largest n with off[n] <= ci (skips zero-length sequences).
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.chunk_off[mid] <= ci) lo = mid; else hi = mid - 1;
  }
  const int n = lo;
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int64_t cstart = static_cast<int64_t>(ci - p.chunk_off[n]) * kC;  // within the sequence
  t0 += cstart;
  const int len = static_cast<int>(min<int64_t>(kC, slen - cstart));
  const int hq = hv / (p.HV / p.H);

  // gamma = inclusive cumsum of g over the valid tokens (padding: g = 0, beta = 0).
  if (tid < kC) {
    float gv = 0.f, bv = 0.f;
    if (tid < len) {
      const int64_t t = t0 + tid;
      gv = load_f(p.g, p.g_dt, b * p.sg[0] + t * p.sg[1] + hv);
      bv = load_f(p.beta, p.b_dt, b * p.sb[0] + t * p.sb[1] + hv);
    }
    const int lane = tid & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, gv, o);
      if (lane >= o) gv += y;
    }
    sGam[tid] = gv;
    sBeta[tid] = bv;
  }
  __syncthreads();
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  __syncthreads();
  const float gam_last = sGam[len - 1];

  uint8_t* regb = static_cast<uint8_t*>(p.regions) + (static_cast<size_t>(ci) * p.HV + hv) * kRegionBytes;
  T* reg = reinterpret_cast<T*>(regb);
  float* regf = reinterpret_cast<float*>(regb + kF32Off);
  if (tid < kC) {  // row gates of the recurrence, fp32
    regf[kFGq + tid] = p.scale * expf(sGam[tid]);
    regf[kFGk + tid] = tid < len ? expf(gam_last - sGam[tid]) : 0.f;
  }
  if (tid == 0) regf[kFEG] = expf(gam_last);

  Tensor tQ = make_tensor(make_smem_ptr(sQ), typename L::TokD_K{});
  Tensor tK = make_tensor(make_smem_ptr(sK), typename L::TokD_K{});
  Tensor tVmn = make_tensor(make_smem_ptr(sV), typename L::DTok_MN{});  // (v, tok)

  // Q, K, V -> smem (16-byte vectors; the swizzle keeps 8-element groups contiguous).
  // Padding rows are zero.
  const T* qb = static_cast<const T*>(p.q) + b * p.sq[0] + hq * p.sq[2];
  const T* kb = static_cast<const T*>(p.k) + b * p.sk[0] + hq * p.sk[2];
  const T* vb = static_cast<const T*>(p.v) + b * p.sv[0] + hv * p.sv[2];
  // All 24 loads are issued before any store: the workspace stores could alias q/k/v as far as
  // the compiler knows, so interleaving them would serialise one memory latency per row group.
  constexpr int kLdIt = (kC * kDK / 8) / 128;
  uint4 qv[kLdIt], kv[kLdIt], vv[kLdIt];
#pragma unroll
  for (int it = 0; it < kLdIt; ++it) {
    const int idx = tid + it * 128;
    const int row = idx >> 4, c8 = (idx & 15) * 8;
    qv[it] = kv[it] = vv[it] = make_uint4(0, 0, 0, 0);
    if (row < len) {
      const int64_t t = t0 + row;
      qv[it] = __ldg(reinterpret_cast<const uint4*>(qb + t * p.sq[1] + c8));
      kv[it] = __ldg(reinterpret_cast<const uint4*>(kb + t * p.sk[1] + c8));
      vv[it] = __ldg(reinterpret_cast<const uint4*>(vb + t * p.sv[1] + c8));
    }
  }
#pragma unroll
  for (int it = 0; it < kLdIt; ++it) {
    const int idx = tid + it * 128;
    const int row = idx >> 4, c8 = (idx & 15) * 8;
    const int off = static_cast<int>(&tQ(row, c8) - sQ);
    *reinterpret_cast<uint4*>(sQ + off) = qv[it];
    *reinterpret_cast<uint4*>(sK + off) = kv[it];
    *reinterpret_cast<uint4*>(&tVmn(c8, row)) = vv[it];
  }
  fence_async_smem();
  __syncthreads();

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
  mma1.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb2 = 0; kb2 < size<2>(rKa); ++kb2) {
    cute::gemm(mma1, rKa(_, _, kb2), rKb(_, _, kb2), accKK);
    mma1.accumulate_ = GMMA::ScaleOut::One;
  }
  mma1.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb2 = 0; kb2 < size<2>(rQa); ++kb2) {
    cute::gemm(mma1, rQa(_, _, kb2), rKb(_, _, kb2), accQK);
    mma1.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(accKK);
  warpgroup_fence_operand(accQK);

  // L_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j (i > j), and the causal gated score image
  // A_ij = scale e^(gamma_i - gamma_j) q_i.k_j (i >= j). Gates as differences (<= 0): no overflow.
  Tensor tAimg = make_tensor(make_smem_ptr(sAuh), typename L::TokTok_K{});  // offsets only
  Tensor cc1 = thr1.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  // Elements i, i+1 are columns c, c+1 of one row (adjacent in the K-major image): 4-byte stores.
  CUTE_UNROLL
  for (int i = 0; i < size(accKK); i += 2) {
    const int r = get<0>(cc1(i)), c = get<1>(cc1(i));
    __align__(4) T ah[2], al[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float e = r >= c + h ? expf(sGam[r] - sGam[c + h]) : 0.f;
      sL[r * kLd + c + h] = r > c + h ? sBeta[r] * e * accKK(i + h) : 0.f;
      split2(p.scale * e * accQK(i + h), ah[h], al[h]);
    }
    const int off = static_cast<int>(&tAimg(r, c) - sAuh);
    *reinterpret_cast<uint32_t*>(reg + kOffAh + off) = *reinterpret_cast<uint32_t*>(ah);
    *reinterpret_cast<uint32_t*>(reg + kOffAl + off) = *reinterpret_cast<uint32_t*>(al);
  }
  __syncthreads();

  // Tm = (I + L)^-1 by forward substitution, one column per thread (L reads are broadcasts).
  if (tid < kC) {
    const int c = tid;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float a0 = (i == c) ? 1.f : 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      const uint32_t Lr = smem_u32(sL + i * kLd);
#pragma unroll
      for (int j4 = 0; j4 < i / 4; ++j4) {
        const float4 l = lds128(Lr + 16 * j4);
        a0 -= l.x * x[4 * j4 + 0];
        a1 -= l.y * x[4 * j4 + 1];
        a2 -= l.z * x[4 * j4 + 2];
        a3 -= l.w * x[4 * j4 + 3];
      }
#pragma unroll
      for (int j = 4 * (i / 4); j < i; ++j) a0 -= sL[i * kLd + j] * x[j];
      x[i] = (a0 + a1) + (a2 + a3);
    }
    Tensor tAu = make_tensor(make_smem_ptr(sAuh), typename L::TokTok_K{});
    const float bu = sBeta[c];
    const float bw = bu * expf(sGam[c]);
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      const int off = static_cast<int>(&tAu(i, c) - sAuh);
      split2(x[i] * bu, sAuh[off], sAul[off]);
      split2(x[i] * bw, sAwh[off], sAwl[off]);
    }
  }
  fence_async_smem();
  __syncthreads();

  // w = Tm diag(beta e^gamma) K, u = Tm diag(beta) V (64 x 128 x 64), Tm as hi + lo.
  auto mma2 = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto thr2 = mma2.get_thread_slice(tid);
  Tensor rAwh = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sAwh), typename L::TokTok_K{}));
  Tensor rAwl = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sAwl), typename L::TokTok_K{}));
  Tensor rAuh = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sAuh), typename L::TokTok_K{}));
  Tensor rAul = thr2.partition_fragment_A(make_tensor(make_smem_ptr(sAul), typename L::TokTok_K{}));
  Tensor rKb2 = thr2.partition_fragment_B(make_tensor(make_smem_ptr(sK), typename L::DTok_MN{}));
  Tensor rVb2 = thr2.partition_fragment_B(tVmn);
  Tensor accW = partition_fragment_C(mma2, Shape<_64, _128>{});
  Tensor accU = partition_fragment_C(mma2, Shape<_64, _128>{});
  warpgroup_fence_operand(accW);
  warpgroup_fence_operand(accU);
  warpgroup_arrive();
  mma2.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rAwh); ++k) {
    cute::gemm(mma2, rAwh(_, _, k), rKb2(_, _, k), accW);
    mma2.accumulate_ = GMMA::ScaleOut::One;
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rAwl); ++k) cute::gemm(mma2, rAwl(_, _, k), rKb2(_, _, k), accW);
  mma2.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rAuh); ++k) {
    cute::gemm(mma2, rAuh(_, _, k), rVb2(_, _, k), accU);
    mma2.accumulate_ = GMMA::ScaleOut::One;
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rAul); ++k) cute::gemm(mma2, rAul(_, _, k), rVb2(_, _, k), accU);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(accW);
  warpgroup_fence_operand(accU);

  // w as a 16-bit (tok, d) K-major image; u fp32 [V/32][tok][32]. Padding rows -> 0.
  // Accumulator elements 2i, 2i+1 are columns c, c+1 of one row: stored as one pair.
  Tensor cc2 = thr2.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  CUTE_UNROLL
  for (int i = 0; i < size(accW); i += 2) {
    const int r = get<0>(cc2(i)), c = get<1>(cc2(i));
    const bool ok = r < len;
    __align__(4) T wh[2] = {T(ok ? accW(i) : 0.f), T(ok ? accW(i + 1) : 0.f)};
    const int off = static_cast<int>(&tQ(r, c) - sQ);
    *reinterpret_cast<uint32_t*>(reg + kOffWh + off) = *reinterpret_cast<uint32_t*>(wh);
    *reinterpret_cast<float2*>(regf + kFU + (c / kUT) * (kC * kUT) + r * kUT + c % kUT) =
        make_float2(ok ? accU(i) : 0.f, ok ? accU(i + 1) : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Recurrence. One CTA per (sequence, value head, V tile): warps 0-3 = math warpgroup,
//    warp 4 = producer (bulk copies of the chunk's 32 KiB image, its u tile and gates, and TMA
//    loads of its Q and K tiles, into a 2-stage mbarrier ring). The math loop reads only shared
//    memory and registers.
// ---------------------------------------------------------------------------------------------
// Precision bits: which hi/lo correction products the recurrence adds (the hi*hi product is
// always there). Every operand that is not an exact input is rounded to 16 bits otherwise.
// (Bit 1, w_lo S_hi, was dropped with the w_lo image; it is why bits 30 is "all".)
enum : int {
  kPrecSlo = 2,   // w_hi S_lo and Q S_lo
  kPrecAlo = 4,   // A_lo U_hi
  kPrecUlo = 8,   // A_hi U_lo
  kPrecXlo = 16,  // K^T X_lo
  kPrecAll = 30,
};
constexpr int kPrecDefault = kPrecAll;

struct RecParams {
  CUtensorMap tmq, tmk;  // q, k as (d, head, token, batch), box (64, 1, 64, 1), 128-byte swizzle
  SeqDesc sd;
  const int* chunk_off;
  const void* regions;
  const float* h0;
  int64_t sh0[3];
  float* hT;
  int64_t shT[3];
  int vk;  // StateLayout::kVK
  void* o;
  int64_t so[3];
  int H, HV;
  int prec;  // kPrec* bits
};

constexpr int kStages = 2;
// Stage: 16-bit image | Q | K | u tile (fp32, 64 x 64) | gates (528 B, padded to 1 KiB: keeps the
// next stage 1024-byte aligned for the 128-byte swizzle; the mbarriers live in stage 0's padding).
template <int VT>
struct RecCfg {
  static constexpr uint32_t kUBytes = kC * VT * 4;  // u of the CTA's V tile
  static constexpr uint32_t kStQ = kImgBytes, kStK = kStQ + kQKBytes, kStU = kStK + kQKBytes, kStG = kStU + kUBytes;
  static constexpr uint32_t kStageBytes = kStG + 1024;
  static constexpr uint32_t kBarOff = kStG + 768;
  static constexpr uint32_t kStageTx = kImgBytes + 2 * kQKBytes + kUBytes + kGateBytes;
  // S hi/lo (2 x 128 x VT) and U, X hi/lo (4 x 64 x VT) share one buffer (see below).
  static constexpr size_t kSmem = 1024 + kStages * size_t(kStageBytes) + 2 * kDK * VT * 2;
  static_assert(kSmem <= 232448, "recurrence smem over the 227 KiB limit");
};
// One 32 KiB buffer holds S hi/lo during batch 1 and U hi/lo, X hi/lo during batch 2: their
// lifetimes do not overlap (named barriers between them), and the smem limit is 227 KiB.
static_assert(kGateBytes <= 768, "gates overlap the mbarriers");

template <class T, int VT>
__global__ void __launch_bounds__(160, 1) gdn_recur(const __grid_constant__ RecParams p) {
  using L = Lay<T>;
  using RL = RecLay<T, VT>;
  using Cfg = RecCfg<VT>;
  constexpr uint32_t kStageBytes = Cfg::kStageBytes;
  extern __shared__ uint8_t smem_raw[];
  // 1 KiB aligned (128-byte swizzle atoms), as an offset from smem_raw so that the compiler keeps
  // the shared state space (LDS/STS, 32-bit addresses) and knows the alignment (vector accesses).
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  T* sSh = reinterpret_cast<T*>(sm + kStages * kStageBytes);  // state hi/lo (v, d)
  T* sSl = sSh + kDK * VT;
  T* sUh = sSh;              // U hi/lo (v, tok), same bytes as the state images
  T* sUl = sUh + kC * VT;
  T* sXh = sUl + kC * VT;   // diag(e^(Gamma-gamma)) U hi/lo (v, tok)
  T* sXl = sXh + kC * VT;
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBarOff);
  uint64_t* empty = full + kStages;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int n = blockIdx.x, hv = blockIdx.y, vt = blockIdx.z;
  const int HV = p.HV;
#ifdef QLA_SM90_TEST_HOOKS
  const int prec = p.prec;
#else
  const int prec = kPrecDefault;  // compile-time: no branches around the wgmma batches
#endif
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int nch = static_cast<int>((slen + kC - 1) / kC);
  const int ci0 = p.chunk_off[n];
  const uint8_t* regions = static_cast<const uint8_t*>(p.regions);

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4) {  // producer
    if ((tid & 31) == 0) {
      const int hq = hv / (HV / p.H);
      for (int c = 0; c < nch; ++c) {
        const int st = c % kStages;
        const uint8_t* src = regions + (static_cast<size_t>(ci0 + c) * HV + hv) * kRegionBytes;
        uint8_t* dst = sm + st * kStageBytes;
        // Rows past the sequence end are the next sequence's tokens (zeros past the tensor end):
        // finite, and harmless (their O rows are not stored, their X rows are zero).
        const int tok = static_cast<int>(t0) + c * kC;
        mbar_wait(&empty[st], ((c / kStages) & 1) ^ 1);
        mbar_expect_tx(&full[st], Cfg::kStageTx);
        bulk_g2s(dst, src, kImgBytes, &full[st]);
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {  // two 64-column boxes = the two K-blocks of the GMMA tile
          tma_load_4d(dst + Cfg::kStQ + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, static_cast<int>(b), &full[st]);
          tma_load_4d(dst + Cfg::kStK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, static_cast<int>(b), &full[st]);
        }
        // u tiles [V/32][tok][32] of this V tile are consecutive: one copy.
        bulk_g2s(dst + Cfg::kStU, src + kF32Off + size_t(vt) * Cfg::kUBytes, Cfg::kUBytes, &full[st]);
        bulk_g2s(dst + Cfg::kStG, src + kF32Off + kFGq * 4, kGateBytes, &full[st]);
      }
    }
    return;
  }

  // ---- math warpgroup ----
  auto mmaU = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto mmaS = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::MN, GMMA::Major::MN>());
  auto thrU = mmaU.get_thread_slice(tid);
  auto thrS = mmaS.get_thread_slice(tid);
  Tensor tSh = make_tensor(make_smem_ptr(sSh), typename RL::VD_MN{});    // (v, d)
  Tensor tUh = make_tensor(make_smem_ptr(sUh), typename RL::VTok_MN{});  // (v, tok)
  Tensor accS = partition_fragment_C(mmaS, Shape<_128, Int<VT>>{});      // (d, v) fp32 state
  Tensor accU = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});
  Tensor accO = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});
  Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_128, Int<VT>>{}));
  Tensor cU = thrU.partition_C(make_identity_tensor(Shape<_64, Int<VT>>{}));
  Tensor rSh = thrU.partition_fragment_B(tSh);
  Tensor rSl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sSl), typename RL::VD_MN{}));
  Tensor rUh = thrU.partition_fragment_B(tUh);
  Tensor rUl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sUl), typename RL::VTok_MN{}));
  Tensor rXh = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sXh), typename RL::VTok_MN{}));
  Tensor rXl = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sXl), typename RL::VTok_MN{}));

  // State tile -> hi/lo 16-bit copies. Elements 2i, 2i+1 are columns v, v+1 (adjacent in the
  // MN-major (v, .) layouts), so they are written as one 4-byte pair; hi/lo share offsets.
  auto store_state = [&]() {
    CUTE_UNROLL
    for (int i = 0; i < size(accS); i += 2) {
      __align__(4) T h[2], l[2];
      split2(accS(i), h[0], l[0]);
      split2(accS(i + 1), h[1], l[1]);
      const int off = static_cast<int>(&tSh(get<1>(cS(i)), get<0>(cS(i))) - sSh);
      *reinterpret_cast<uint32_t*>(sSh + off) = *reinterpret_cast<uint32_t*>(h);
      *reinterpret_cast<uint32_t*>(sSl + off) = *reinterpret_cast<uint32_t*>(l);
    }
    fence_async_smem();
    math_bar();
  };

  const int v0 = vt * VT;
  const int64_t hbase = static_cast<int64_t>(n) * p.sh0[0] + static_cast<int64_t>(hv) * p.sh0[1];
  CUTE_UNROLL
  for (int i = 0; i < size(accS); ++i) {
    const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
    accS(i) = p.h0 ? p.h0[hbase + (p.vk ? v * p.sh0[2] + d : d * p.sh0[2] + v)] : 0.f;
  }
  store_state();

  T* ob = static_cast<T*>(p.o) + b * p.so[0] + static_cast<int64_t>(hv) * p.so[2] + v0;
  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    uint8_t* stb = sm + st * kStageBytes;
    T* base = reinterpret_cast<T*>(stb);
    const float* sU = reinterpret_cast<const float*>(stb + Cfg::kStU);  // [V/32][tok][32]
    const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);  // gq | gk | e^Gamma
    mbar_wait(&full[st], (c / kStages) & 1);
    T* sQ = reinterpret_cast<T*>(stb + Cfg::kStQ);
    T* sK = reinterpret_cast<T*>(stb + Cfg::kStK);
    Tensor rWh = thrU.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffWh), typename L::TokD_K{}));
    Tensor rQ = thrU.partition_fragment_A(make_tensor(make_smem_ptr(sQ), typename L::TokD_K{}));
    Tensor rAh = thrU.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAh), typename L::TokTok_K{}));
    Tensor rAl = thrU.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAl), typename L::TokTok_K{}));
    Tensor rKt = thrS.partition_fragment_A(make_tensor(make_smem_ptr(sK), typename L::DTok_MN{}));

    // Batch 1: accU = w S (w_hi S_hi [+ w_hi S_lo]), accO = Q S_hi [+ Q S_lo].
    warpgroup_fence_operand(accU);
    warpgroup_fence_operand(accO);
    warpgroup_arrive();
    mmaU.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rWh); ++k) {
      cute::gemm(mmaU, rWh(_, _, k), rSh(_, _, k), accU);
      mmaU.accumulate_ = GMMA::ScaleOut::One;
    }
    if (prec & kPrecSlo) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rWh); ++k) cute::gemm(mmaU, rWh(_, _, k), rSl(_, _, k), accU);
    }
    mmaU.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rQ); ++k) {
      cute::gemm(mmaU, rQ(_, _, k), rSh(_, _, k), accO);
      mmaU.accumulate_ = GMMA::ScaleOut::One;
    }
    if (prec & kPrecSlo) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rQ); ++k) cute::gemm(mmaU, rQ(_, _, k), rSl(_, _, k), accO);
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accU);
    warpgroup_fence_operand(accO);
    math_bar();  // every warp is done reading S hi/lo: U, X overwrite those bytes

    // U = u - w S (fp32), stored as hi/lo and gated hi/lo; O rows scaled by scale e^gamma.
    CUTE_UNROLL
    for (int i = 0; i < size(accU); i += 2) {
      const int r = get<0>(cU(i)), v = get<1>(cU(i));
      const float2 u2 = *reinterpret_cast<const float2*>(sU + (v / kUT) * (kC * kUT) + r * kUT + v % kUT);
      const float gq = sG[r], gk = sG[kC + r];
      const float x0 = u2.x - accU(i), x1 = u2.y - accU(i + 1);
      __align__(4) T uh[2], ul[2], xh[2], xl[2];
      split2(x0, uh[0], ul[0]);
      split2(x1, uh[1], ul[1]);
      split2(gk * x0, xh[0], xl[0]);
      split2(gk * x1, xh[1], xl[1]);
      const int off = static_cast<int>(&tUh(v, r) - sUh);
      *reinterpret_cast<uint32_t*>(sUh + off) = *reinterpret_cast<uint32_t*>(uh);
      *reinterpret_cast<uint32_t*>(sUl + off) = *reinterpret_cast<uint32_t*>(ul);
      *reinterpret_cast<uint32_t*>(sXh + off) = *reinterpret_cast<uint32_t*>(xh);
      *reinterpret_cast<uint32_t*>(sXl + off) = *reinterpret_cast<uint32_t*>(xl);
      accO(i) *= gq;
      accO(i + 1) *= gq;
    }
    const float eG = sG[2 * kC];
    fence_async_smem();
    math_bar();

    // Batch 2: O += A U (A_hi U_hi [+ A_hi U_lo] [+ A_lo U_hi]); S = e^Gamma S + K^T X (X_hi [+ X_lo]).
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) accS(i) *= eG;
    warpgroup_fence_operand(accO);
    warpgroup_fence_operand(accS);
    warpgroup_arrive();
    mmaU.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rAh); ++k) cute::gemm(mmaU, rAh(_, _, k), rUh(_, _, k), accO);
    if (prec & kPrecUlo) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rAh); ++k) cute::gemm(mmaU, rAh(_, _, k), rUl(_, _, k), accO);
    }
    if (prec & kPrecAlo) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rAl); ++k) cute::gemm(mmaU, rAl(_, _, k), rUh(_, _, k), accO);
    }
    mmaS.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rKt); ++k) cute::gemm(mmaS, rKt(_, _, k), rXh(_, _, k), accS);
    if (prec & kPrecXlo) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rKt); ++k) cute::gemm(mmaS, rKt(_, _, k), rXl(_, _, k), accS);
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accO);
    warpgroup_fence_operand(accS);
    mbar_arrive(&empty[st]);  // stage fully consumed (all wgmma reading it are done)
    math_bar();               // every warp is done reading U, X: the state images overwrite them

    // O (rows past the sequence end are not written: they belong to the next sequence).
    const int rows = static_cast<int>(min<int64_t>(kC, slen - static_cast<int64_t>(c) * kC));
    CUTE_UNROLL
    for (int i = 0; i < size(accO); i += 2) {
      const int r = get<0>(cU(i)), v = get<1>(cU(i));
      if (r < rows) {
        __align__(4) T pr[2] = {T(accO(i)), T(accO(i + 1))};
        *reinterpret_cast<uint32_t*>(ob + (t0 + static_cast<int64_t>(c) * kC + r) * p.so[1] + v) =
            *reinterpret_cast<uint32_t*>(pr);
      }
    }
    // New state copies for the next chunk.
    store_state();
  }

  if (p.hT) {
    const int64_t fb = static_cast<int64_t>(n) * p.shT[0] + static_cast<int64_t>(hv) * p.shT[1];
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) {
      const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
      p.hT[fb + (p.vk ? v * p.shT[2] + d : d * p.shT[2] + v)] = accS(i);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
#ifdef QLA_SM90_TEST_HOOKS
int g_test_prec = -1;    // test builds only: overrides kPrecDefault when >= 0
int g_test_stages = 3;   // test builds only: bit 1 = table + prep, bit 2 = recurrence (timing)
int g_test_vt = 0;       // test builds only: 32 or 64 forces the recurrence V tile (0: auto)
#endif

Status cuda_err(cudaError_t e, const char* what) {
  return Status::Error(StatusCode::kCudaError, std::string("sm90 forward: ") + what + ": " + cudaGetErrorString(e));
}
#define QLA_CUDA_TRY(expr, what)              \
  do {                                        \
    cudaError_t e_ = (expr);                  \
    if (e_ != cudaSuccess) return cuda_err(e_, what); \
  } while (0)

int64_t num_seqs(const GdnForwardParams& p) { return p.cu_seqlens.data ? p.num_seqs : p.shape.batch; }

// Upper bound on the total chunk count, from shapes only.
int64_t max_chunks(const GdnForwardParams& p) {
  const int64_t T = p.shape.seqlen;
  if (p.cu_seqlens.data) return T / kC + p.num_seqs;  // sum ceil(l/64) <= floor(T/64) + N
  return p.shape.batch * ((T + kC - 1) / kC);
}

struct WsLayout {
  size_t table = 0, regions = 0, total = 0;
};
WsLayout ws_layout(const GdnForwardParams& p) {
  auto up = [](size_t x) { return (x + 1023) & ~size_t(1023); };
  const size_t N = static_cast<size_t>(num_seqs(p));
  const size_t mc = static_cast<size_t>(max_chunks(p));
  const size_t HV = static_cast<size_t>(p.shape.num_v_heads);
  WsLayout w;
  w.table = 0;
  w.regions = up(4 * (N + 1));
  w.total = w.regions + mc * HV * kRegionBytes;
  return w;
}

const char* dt_name(DType d) {
  switch (d) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "fp32";
    case DType::kFloat64: return "fp64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

bool aligned(const void* ptr, size_t a) { return (reinterpret_cast<uintptr_t>(ptr) % a) == 0; }

// Tensor map of q or k as (d, head, token, batch) with a (64, 1, 64, 1) box and 128-byte
// swizzle: one box is one K-block (64 tokens x 64 d) of the recurrence's GMMA tile. The driver
// entry point comes through the runtime (no libcuda link).
Status make_qk_map(CUtensorMap* map, const TensorRef& t, const GdnForwardParams& p) {
  *map = CUtensorMap{};
  if (p.shape.seqlen == 0 || p.shape.batch == 0) return Status::Ok();  // never read
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;  // benign race: same value
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
      return cuda_err(e != cudaSuccess ? e : cudaErrorNotSupported, "cuTensorMapEncodeTiled entry point");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(kDK), static_cast<cuuint64_t>(p.shape.num_qk_heads),
                              static_cast<cuuint64_t>(p.shape.seqlen), static_cast<cuuint64_t>(p.shape.batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(t.stride[2]) * 2, static_cast<cuuint64_t>(t.stride[1]) * 2,
                                 static_cast<cuuint64_t>(t.stride[0]) * 2};
  const cuuint32_t box[4] = {64, 1, kC, 1};
  const cuuint32_t estride[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, t.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            4, const_cast<void*>(t.data), dims, strides, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Error(StatusCode::kInvalidArgument,
                         "sm90 forward: cuTensorMapEncodeTiled failed for q/k (error " + std::to_string(int(r)) + ")");
  return Status::Ok();
}

template <class T>
Status launch(const GdnForwardParams& p) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const WsLayout wl = ws_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  const int N = static_cast<int>(num_seqs(p));
  const int HV = static_cast<int>(p.shape.num_v_heads);
  const int64_t mc = max_chunks(p);
  if (N == 0) return Status::Ok();

  SeqDesc sd;
  sd.cu = p.cu_seqlens.data;
  sd.cu64 = p.cu_seqlens.dtype == DType::kInt64;
  sd.T = p.shape.seqlen;
  int* table = reinterpret_cast<int*>(ws + wl.table);

  int stages = 3;
#ifdef QLA_SM90_TEST_HOOKS
  stages = g_test_stages;
#endif
  if (stages & 1) {
    gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");

    if (mc > 0) {
      PrepParams pp{};
      pp.q = p.q.data; pp.k = p.k.data; pp.v = p.v.data; pp.g = p.g.data; pp.beta = p.beta.data;
      for (int i = 0; i < 3; ++i) { pp.sq[i] = p.q.stride[i]; pp.sk[i] = p.k.stride[i]; pp.sv[i] = p.v.stride[i]; }
      for (int i = 0; i < 2; ++i) { pp.sg[i] = p.g.stride[i]; pp.sb[i] = p.beta.stride[i]; }
      pp.g_dt = static_cast<int>(p.g.dtype);
      pp.b_dt = static_cast<int>(p.beta.dtype);
      pp.sd = sd;
      pp.N = N;
      pp.H = static_cast<int>(p.shape.num_qk_heads);
      pp.HV = HV;
      pp.chunk_off = table;
      pp.regions = ws + wl.regions;
      pp.scale = p.scale;
      QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_prep<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kPrepSmem),
                   "cudaFuncSetAttribute(gdn_prep)");
      gdn_prep<T><<<dim3(static_cast<unsigned>(mc), HV), 128, kPrepSmem, stream>>>(pp);
      QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_prep");
    }
  }
  if (!(stages & 2)) return Status::Ok();

  RecParams rp{};
  Status ms = make_qk_map(&rp.tmq, p.q, p);
  if (!ms.ok()) return ms;
  ms = make_qk_map(&rp.tmk, p.k, p);
  if (!ms.ok()) return ms;
  rp.sd = sd;
  rp.chunk_off = table;
  rp.regions = ws + wl.regions;
  rp.h0 = static_cast<const float*>(p.initial_state.data);
  rp.hT = static_cast<float*>(p.final_state.data);
  for (int i = 0; i < 3; ++i) { rp.sh0[i] = p.initial_state.stride[i]; rp.shT[i] = p.final_state.stride[i]; rp.so[i] = p.o.stride[i]; }
  rp.vk = p.state_layout == StateLayout::kVK;
  rp.o = p.o.data;
  rp.H = static_cast<int>(p.shape.num_qk_heads);
  rp.HV = HV;
  rp.prec = kPrecDefault;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_prec >= 0) rp.prec = g_test_prec;
#endif
  // V tile 32 (4 CTAs per sequence and head) when that still fits on the SMs: the sequential
  // chunk loop is latency-bound, and a narrower tile roughly halves its per-chunk work.
  int dev = 0, sms = 0;
  QLA_CUDA_TRY(cudaGetDevice(&dev), "cudaGetDevice");
  QLA_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  bool vt32 = static_cast<int64_t>(N) * HV * (kDV / 32) <= sms;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_vt) vt32 = g_test_vt == 32;
#endif
  if (vt32) {
    QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur<T, 32>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecCfg<32>::kSmem),
                 "cudaFuncSetAttribute(gdn_recur)");
    gdn_recur<T, 32><<<dim3(N, HV, kDV / 32), 160, RecCfg<32>::kSmem, stream>>>(rp);
  } else {
    QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur<T, 64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecCfg<64>::kSmem),
                 "cudaFuncSetAttribute(gdn_recur)");
    gdn_recur<T, 64><<<dim3(N, HV, kDV / 64), 160, RecCfg<64>::kSmem, stream>>>(rp);
  }
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_recur");
  return Status::Ok();
}

}  // namespace

bool compiled() { return true; }

#ifdef QLA_SM90_TEST_HOOKS
// Test builds only (tests/cuda/sm90_forward_test.cu): pick the recurrence's hi/lo correction
// products (kPrec* bits; -1 restores the default) to measure precision against speed.
void set_test_precision(int bits) { g_test_prec = bits; }
void set_test_stages(int bits) { g_test_stages = bits; }
void set_test_vt(int vt) { g_test_vt = vt; }
#endif

Status check_supported(const GdnForwardParams& p) {
  auto ns = [](std::string m) { return Status::Error(StatusCode::kNotSupported, "sm90 forward: " + m); };
  if (p.shape.head_dim_k != kDK || p.shape.head_dim_v != kDV)
    return ns("only K = V = 128 is supported (got K = " + std::to_string(p.shape.head_dim_k) +
              ", V = " + std::to_string(p.shape.head_dim_v) + ")");
  const DType dq = p.q.dtype;
  if (dq != DType::kBFloat16 && dq != DType::kFloat16)
    return ns(std::string("q/k/v must be bf16 or fp16 (got ") + dt_name(dq) + ")");
  if (p.k.dtype != dq || p.v.dtype != dq || p.o.dtype != dq)
    return ns("q, k, v and o must share one dtype");
  for (const TensorRef* t : {&p.g, &p.beta})
    if (t->dtype != DType::kFloat32 && t->dtype != DType::kBFloat16 && t->dtype != DType::kFloat16)
      return ns(std::string("g and beta must be fp32, bf16 or fp16 (got ") + dt_name(t->dtype) + ")");
  if ((p.initial_state.data && p.initial_state.dtype != DType::kFloat32) ||
      (p.final_state.data && p.final_state.dtype != DType::kFloat32))
    return ns("initial/final state must be fp32");
  // 16-byte vector loads of q/k/v rows, 4-byte pair stores of o.
  for (const TensorRef* t : {&p.q, &p.k, &p.v}) {
    if (!aligned(t->data, 16) || t->stride[0] % 8 || t->stride[1] % 8 || t->stride[2] % 8)
      return ns("q, k, v need 16-byte aligned data and strides that are multiples of 8 elements");
  }
  if (!aligned(p.o.data, 4) || p.o.stride[0] % 2 || p.o.stride[1] % 2 || p.o.stride[2] % 2)
    return ns("o needs 4-byte aligned data and even strides");
  if (num_seqs(p) > 2147483647LL || max_chunks(p) > 2147483647LL / 2 || p.shape.num_v_heads > 65535)
    return ns("too many sequences, chunks or value heads for the sm90 grid");
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return ns(std::string("no CUDA device: ") + cudaGetErrorString(e));
  int major = 0;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) return ns(std::string("cannot query the CUDA device: ") + cudaGetErrorString(e));
  if (major != 9) return ns("device is compute capability " + std::to_string(major) + ".x, the sm90 backend needs 9.x");
  return Status::Ok();
}

Status forward_workspace_size(const GdnForwardParams& p, size_t* bytes) {
  if (!bytes) return Status::Error(StatusCode::kInvalidArgument, "sm90 forward: bytes is null");
  *bytes = ws_layout(p).total;
  return Status::Ok();
}

Status forward(const GdnForwardParams& p) {
  Status s = check_supported(p);
  if (!s.ok()) return s;
  const size_t need = ws_layout(p).total;
  if (p.workspace_bytes < need || (need > 0 && p.workspace == nullptr))
    return Status::Error(StatusCode::kInvalidArgument,
                         "sm90 forward: workspace too small (" + std::to_string(p.workspace_bytes) + " < " +
                             std::to_string(need) + " bytes)");
  if (!aligned(p.workspace, 16))
    return Status::Error(StatusCode::kInvalidArgument, "sm90 forward: workspace must be 16-byte aligned");
  if (p.q.dtype == DType::kBFloat16) return launch<cutlass::bfloat16_t>(p);
  return launch<cutlass::half_t>(p);
}

}  // namespace sm90
}  // namespace qla
