// sm90 (Hopper, sm_90a) forward backend of the Gated DeltaNet chunked prefill.
// Three launches on p.stream, no host synchronisation (graph-capturable):
//   1. gdn_chunk_table: per-sequence chunk offsets (prefix sum of ceil(len/64)) and the check of
//                       the device cu_seqlens, on device.
//   2. gdn_prep<T>:     chunk-parallel, persistent, one warpgroup per (chunk, value head) region:
//                       gamma, K K^T, Q K^T, Tm = (I+L)^-1, and the wgmma-ready operand images.
//   3. the recurrence:  sequential over chunks per (sequence, value head, V tile of 32 or 64):
//                       U = u - w S, O = diag(scale e^gamma) Q S + A U,
//                       S = e^Gamma S + K^T diag(e^(Gamma-gamma)) U (all wgmma).
// Precision: the wgmma operands that are not exact inputs (Tm, A, S, U, X) are split into
// bf16/fp16 hi + lo parts (x = hi + lo to ~16 mantissa bits) except w (hi only); u and the gates
// stay fp32. Plain 16-bit rounding of all intermediates cost ~3.4e-3 relative L2 on bf16 inputs.
// See src/sm90/README.md for the design and budgets.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

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
//   u [V/32][tok][32] (each recurrence CTA's V tile contiguous; columns swizzled, u_index) | gq[64] = scale e^gamma |
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

// Index of u element (token r, column v) inside one 32-column u tile [tok][32]: groups of 8
// columns are XOR-swizzled by r mod 4, so the recurrence's reads (8 rows x 8 columns per warp
// instruction) and the prep's writes hit each bank at most twice instead of eight times.
__host__ __device__ constexpr int u_index(int r, int v) { return r * kUT + ((((v >> 3) ^ r) & 3) << 3) + (v & 7); }
// The swizzle only permutes the columns inside each row (prep writes and recurrence reads agree).
constexpr bool u_index_is_row_permutation() {
  for (int r = 0; r < kC; ++r) {
    unsigned seen = 0;
    for (int v = 0; v < kUT; ++v) {
      const int i = u_index(r, v) - r * kUT;
      if (i < 0 || i >= kUT || (seen >> i & 1u)) return false;
      seen |= 1u << i;
    }
  }
  return true;
}
static_assert(u_index_is_row_permutation(), "u_index must permute the 32 columns of each row");

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
//    Also clears the ready flags of the overlapped mode.
// ---------------------------------------------------------------------------------------------
// off[N + 1] is set to 1 when the device cu_seqlens are malformed (first entry not 0, a
// decreasing step, or last entry not T): every offset is then 0 (no chunk is read or written)
// and the recurrence fills o and the final state with NaN instead (see fill_nan_outputs).
__global__ void __launch_bounds__(1024) gdn_chunk_table(SeqDesc sd, int N, int* off, int* ready, int64_t nready) {
  for (int64_t i = threadIdx.x; i < nready; i += 1024) ready[i] = 0;  // overlapped mode's flags
  __shared__ int warp_sum[32];
  __shared__ int carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  int bad = 0;
  if (sd.cu) {
    for (int n = tid; n < N; n += 1024) bad |= cu_at(sd, n + 1) < cu_at(sd, n);
    if (tid == 0) bad |= cu_at(sd, 0) != 0 || cu_at(sd, N) != sd.T;
  }
  if (__syncthreads_or(bad)) {
    for (int n = tid; n <= N; n += 1024) off[n] = 0;
    if (tid == 0) off[N + 1] = 1;
    return;
  }
  if (tid == 0) off[N + 1] = 0;
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
  void* regions;  // kRegionBytes per (chunk, value head)
  int* ready;     // overlapped mode: per (chunk, value head) flag set once its region is written; else null
  float scale;
};

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

template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
}
// hi + lo split of a pair, each packed as two 16-bit values.
template <class T>
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(a, b);
  const float2 h = unpack2<T>(hi);
  lo = pack2<T>(a - h.x, b - h.y);
}
__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void sts128f(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// Bulk copy shared -> global (async proxy), completion tracked by bulk groups.
__device__ __forceinline__ void bulk_s2g(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until the issued bulk stores have read their shared-memory source.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

constexpr float kLog2e = 1.4426950408889634f;
// 2^x on the special-function unit (relative error ~2^-22; flushes results below 2^-126 to 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// 2. Chunk-parallel prep, one warpgroup per (chunk, value head) region.
//    TMA loads of Q, K, V -> wgmma K K^T, Q K^T -> L (fp32) and A (hi/lo image, bulk-stored)
//    -> Tm = (I + L)^-1 blockwise on all four warps -> Tu, Tw images -> wgmma w = Tw K,
//    u = Tu V -> w_hi image and u staged in shared memory and bulk-stored.
// ---------------------------------------------------------------------------------------------
// Barrier among the 128 threads of one prep warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
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

  // Q, K, V tiles by TMA (two 64-column boxes each = the two K-blocks of the GMMA tile). Rows
  // past the sequence end are the next sequence's tokens (zeros past the tensor end): finite,
  // and their beta is 0 below, so they reach neither L, Tm, w nor u; their A rows are never used.
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
  if (tid < kC) {
    float gv = 0.f, bv = 0.f;
    if (tid < len) {
      const int64_t t = t0 + tid;
      gv = load_f(p.g, p.g_dt, b * p.sg[0] + t * p.sg[1] + hv);
      bv = load_f(p.beta, p.b_dt, b * p.sb[0] + t * p.sb[1] + hv);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, gv, o);
      if (lane >= o) gv += y;
    }
    sGam[tid] = gv;
    sBeta[tid] = bv;
  }
  wg_bar(barid);
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  wg_bar(barid);
  const float gam_last = sGam[len - 1];

  uint8_t* regb = static_cast<uint8_t*>(p.regions) + (static_cast<size_t>(ci) * p.HV + hv) * kRegionBytes;
  float* regf = reinterpret_cast<float*>(regb + kF32Off);
  if (tid < kC) {  // row gates of the recurrence, fp32 (coalesced)
    sBw[tid] = sBeta[tid] * expf(sGam[tid]);
    regf[kFGq + tid] = p.scale * expf(sGam[tid]);
    regf[kFGk + tid] = tid < len ? expf(gam_last - sGam[tid]) : 0.f;
  } else if (tid == kC) {
    regf[kFEG] = expf(gam_last);
  }

  Tensor tQ = make_tensor(make_smem_ptr(sQ), typename L::TokD_K{});
  Tensor tK = make_tensor(make_smem_ptr(sK), typename L::TokD_K{});
  Tensor tVmn = make_tensor(make_smem_ptr(sV), typename L::DTok_MN{});  // (v, tok)
  mbar_wait(bar, phase);

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
      uint32_t ah, al;
      split_pair<T>(p.scale * e0 * accQK(i), p.scale * e1 * accQK(i + 1), ah, al);
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

  // Tm = (I + L)^-1 in 16 x 16 blocks. Phase 1: warp w inverts its diagonal block
  // D_w = I + L_ww by forward substitution (lane c: column c; L rows are broadcasts).
  {
    const int w = warp, c = lane & 15;
    float x[16];
    CUTE_UNROLL
    for (int i = 0; i < 16; ++i) {
      float a0 = (i == c) ? 1.f : 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      const uint32_t Lr = smem_u32(sL + (16 * w + i) * kLd + 16 * w);
      CUTE_UNROLL
      for (int j4 = 0; j4 < i / 4; ++j4) {
        const float4 l = lds128(Lr + 16 * j4);
        a0 -= l.x * x[4 * j4 + 0];
        a1 -= l.y * x[4 * j4 + 1];
        a2 -= l.z * x[4 * j4 + 2];
        a3 -= l.w * x[4 * j4 + 3];
      }
      CUTE_UNROLL
      for (int j = 4 * (i / 4); j < i; ++j) a0 -= sL[(16 * w + i) * kLd + 16 * w + j] * x[j];
      x[i] = (a0 + a1) + (a2 + a3);
    }
    if (lane < 16) {
      CUTE_UNROLL
      for (int i = 0; i < 16; ++i) sT[(16 * w + i) * kLd + 16 * w + c] = x[i];
    }
  }
  wg_bar(barid);
  // Phase 2: warp w walks down its block column: Tm_aw = -D_a^-1 sum_{m=w}^{a-1} L_am Tm_mw.
  // Lane: row r of the block, columns hc .. hc+7. Only __syncwarp inside (the column is the
  // warp's own; the diagonal inverses come from phase 1).
  {
    const int w = warp, r = lane >> 1, hc = (lane & 1) * 8;
    float* sP = reinterpret_cast<float*>(sm + kPrepP) + w * 16 * kPd;
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
      if ((i >> 4) >= (j8 >> 4)) {
        const float4 t0 = lds128(smem_u32(sT + i * kLd + j8)), t1 = lds128(smem_u32(sT + i * kLd + j8 + 4));
        t[0] = t0.x; t[1] = t0.y; t[2] = t0.z; t[3] = t0.w; t[4] = t1.x; t[5] = t1.y; t[6] = t1.z; t[7] = t1.w;
      } else {
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) t[e] = 0.f;
      }
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
// first), so an overlapped recurrence finds its early chunks ready first.
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
  for (int r = blockIdx.x * 2 + wg; r < nreg; r += gridDim.x * 2, phase ^= 1)
    prep_region<T>(p, sm, tid, 1 + wg, bar, phase, r / p.HV, r % p.HV);
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
  int N, H, HV;
  int prec;      // kPrec* bits
  const int* ready;  // overlapped mode: wait for each region's flag (prep runs concurrently); else null
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

// Malformed device cu_seqlens (flagged by gdn_chunk_table): instead of a silent wrong answer,
// every element of o and of the final state becomes NaN (grid-stride over the whole grid).
template <class T>
__device__ void fill_nan_outputs(const RecParams& p) {
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t first = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t HV = p.HV, no = p.sd.T * HV * kDV;  // varlen: B == 1
  T* o = static_cast<T*>(p.o);
  for (int64_t i = first; i < no; i += nthreads) {
    const int64_t v = i % kDV, h = (i / kDV) % HV, t = i / (kDV * HV);
    o[t * p.so[1] + h * p.so[2] + v] = T(__int_as_float(0x7fc00000));
  }
  if (p.hT) {
    const int64_t nh = static_cast<int64_t>(p.N) * HV * kDK * kDV;
    for (int64_t i = first; i < nh; i += nthreads) {
      const int64_t j = i % (kDK * kDV), h = (i / (kDK * kDV)) % HV, n = i / (kDK * kDV * HV);
      p.hT[n * p.shT[0] + h * p.shT[1] + (j / kDV) * p.shT[2] + j % kDV] = __int_as_float(0x7fc00000);
    }
  }
}

// Producer loop (one thread): for each chunk of the sequence, wait for a free stage, then the
// bulk copy of the chunk's 16-bit image, TMA loads of its Q and K tiles straight from q and k,
// and bulk copies of the CTA's u tile and the gates, all completing on the stage's `full`.
template <int VT>
__device__ __forceinline__ void produce_chunks(const RecParams& p, uint8_t* sm, uint64_t* full, uint64_t* empty,
                                               int n, int hv, int vt, int64_t b, int64_t t0, int nch, int ci0) {
  using Cfg = RecCfg<VT>;
  const uint8_t* regions = static_cast<const uint8_t*>(p.regions);
  const int hq = hv / (p.HV / p.H);
  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    const uint8_t* src = regions + (static_cast<size_t>(ci0 + c) * p.HV + hv) * kRegionBytes;
    uint8_t* dst = sm + st * Cfg::kStageBytes;
    // Rows past the sequence end are the next sequence's tokens (zeros past the tensor end):
    // finite, and harmless (their O rows are not stored, their X rows are zero).
    const int tok = static_cast<int>(t0) + c * kC;
    mbar_wait(&empty[st], ((c / kStages) & 1) ^ 1);
    if (p.ready) {  // overlapped mode: the region is written by a concurrently running prep
      const int* f = p.ready + static_cast<size_t>(ci0 + c) * p.HV + hv;
      while (ld_acquire(f) == 0) __nanosleep(200);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk copies below read it
    }
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
  // blockIdx.x = V tile fastest, then sequence: the CTAs of one (sequence, head) launch together,
  // so they read each chunk's data from L2 at about the same time (and a later wave does not split them).
  const int vt = blockIdx.x % (kDV / VT), n = blockIdx.x / (kDV / VT), hv = blockIdx.y;
#ifdef QLA_SM90_TEST_HOOKS
  const int prec = p.prec;
#else
  const int prec = kPrecDefault;  // compile-time: no branches around the wgmma batches
#endif
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int nch = static_cast<int>((slen + kC - 1) / kC);
  const int ci0 = p.chunk_off[n];
  if (p.chunk_off[p.N + 1]) {  // malformed device cu_seqlens: NaN outputs, nothing else
    fill_nan_outputs<T>(p);
    return;
  }

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4) {  // producer
    if ((tid & 31) == 0) produce_chunks<VT>(p, sm, full, empty, n, hv, vt, b, t0, nch, ci0);
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
      const float2 u2 = *reinterpret_cast<const float2*>(sU + (v / kUT) * (kC * kUT) + u_index(r, v % kUT));
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
// 3b. Warp-specialized recurrence (V tile 32): the state chain and the output run on two math
//     warpgroups, so the products that only feed O (Q S, A U) leave the sequential path.
//     warps 0-3 (state WG):  U = u - w S, X = diag(e^(Gamma-gamma)) U, S = e^Gamma S + K^T X
//     warps 4-7 (output WG): O = diag(scale e^gamma) Q S + A U, stored to o
//     warp 8 (producer):     as in gdn_recur.
//   S_c (the state entering chunk c) and U_c live in double buffers (parity c % 2). The state WG
//   arrives on `uready[c%2]` once S_c and U_c are written; the output WG arrives on `ofree[c%2]`
//   once its products have read them. Before writing S_{c+1} (parity of c-1) the state WG waits
//   for `ofree` of chunk c-1, which also frees U's buffer for chunk c+1.
// ---------------------------------------------------------------------------------------------
constexpr int kWsVT = 32;
struct RecWsCfg {
  using Base = RecCfg<kWsVT>;
  static constexpr uint32_t kSBytes = 2 * kDK * kWsVT * 2;  // S hi/lo (16-bit)
  static constexpr uint32_t kUBytes = 2 * kC * kWsVT * 2;   // U or X hi/lo
  static constexpr uint32_t kOffS = kStages * Base::kStageBytes;       // 2 S buffers
  static constexpr uint32_t kOffU = kOffS + 2 * kSBytes;               // 2 U buffers
  static constexpr uint32_t kOffX = kOffU + 2 * kUBytes;               // 1 X buffer
  static constexpr uint32_t kOffBar = kOffX + kUBytes;                 // uready[2], ofree[2]
  static constexpr size_t kSmem = 1024 + kOffBar + 64;
  static_assert(kSmem <= 232448, "warp-specialized recurrence smem over the 227 KiB limit");
};

template <class T>
__global__ void __launch_bounds__(288, 1) gdn_recur_ws(const __grid_constant__ RecParams p) {
  constexpr int VT = kWsVT;
  using L = Lay<T>;
  using RL = RecLay<T, VT>;
  using Cfg = RecCfg<VT>;
  using W = RecWsCfg;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBarOff);
  uint64_t* empty = full + kStages;
  uint64_t* uready = reinterpret_cast<uint64_t*>(sm + W::kOffBar);
  uint64_t* ofree = uready + 2;
  auto sbuf = [&](int par) { return reinterpret_cast<T*>(sm + W::kOffS + par * W::kSBytes); };  // hi | lo
  auto ubuf = [&](int par) { return reinterpret_cast<T*>(sm + W::kOffU + par * W::kUBytes); };  // hi | lo
  T* sXh = reinterpret_cast<T*>(sm + W::kOffX);
  T* sXl = sXh + kC * VT;

  const int tid = threadIdx.x, warp = tid >> 5;
  // blockIdx.x = V tile fastest, then sequence: the CTAs of one (sequence, head) launch together,
  // so they read each chunk's data from L2 at about the same time (and a later wave does not split them).
  const int vt = blockIdx.x % (kDV / VT), n = blockIdx.x / (kDV / VT), hv = blockIdx.y;
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int nch = static_cast<int>((slen + kC - 1) / kC);
  const int ci0 = p.chunk_off[n];
  if (p.chunk_off[p.N + 1]) {  // malformed device cu_seqlens: NaN outputs, nothing else
    fill_nan_outputs<T>(p);
    return;
  }

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);  // both math warpgroups release a stage
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&uready[s], 128);
      mbar_init(&ofree[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 8) {  // producer
    if ((tid & 31) == 0) produce_chunks<VT>(p, sm, full, empty, n, hv, vt, b, t0, nch, ci0);
    return;
  }

  auto mmaU = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto mmaS = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::MN, GMMA::Major::MN>());
  const int wt = tid & 127;  // thread index within its warpgroup
  auto thrU = mmaU.get_thread_slice(wt);
  auto thrS = mmaS.get_thread_slice(wt);
  Tensor cU = thrU.partition_C(make_identity_tensor(Shape<_64, Int<VT>>{}));
  const int v0 = vt * VT;

  if (warp < 4) {
    // ---------------- state warpgroup ----------------
    Tensor tS0 = make_tensor(make_smem_ptr(sbuf(0)), typename RL::VD_MN{});  // (v, d), offsets
    Tensor tU0 = make_tensor(make_smem_ptr(ubuf(0)), typename RL::VTok_MN{});  // (v, tok), offsets
    Tensor accS = partition_fragment_C(mmaS, Shape<_128, Int<VT>>{});  // (d, v) fp32 state
    Tensor accU = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});
    Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_128, Int<VT>>{}));
    Tensor rXh = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sXh), typename RL::VTok_MN{}));
    Tensor rXl = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sXl), typename RL::VTok_MN{}));

    // S -> hi/lo copies in buffer `par` (pairs of adjacent v columns as 4-byte stores).
    auto store_state = [&](int par) {
      T* sh = sbuf(par);
      T* sl = sh + kDK * VT;
      CUTE_UNROLL
      for (int i = 0; i < size(accS); i += 2) {
        uint32_t h, l;
        split_pair<T>(accS(i), accS(i + 1), h, l);
        const int off = static_cast<int>(&tS0(get<1>(cS(i)), get<0>(cS(i))) - sbuf(0));
        *reinterpret_cast<uint32_t*>(sh + off) = h;
        *reinterpret_cast<uint32_t*>(sl + off) = l;
      }
      fence_async_smem();
      math_bar();
    };

    const int64_t hbase = static_cast<int64_t>(n) * p.sh0[0] + static_cast<int64_t>(hv) * p.sh0[1];
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) {
      const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
      accS(i) = p.h0 ? p.h0[hbase + (p.vk ? v * p.sh0[2] + d : d * p.sh0[2] + v)] : 0.f;
    }
    store_state(0);

    for (int c = 0; c < nch; ++c) {
      const int st = c % kStages, par = c & 1;
      uint8_t* stb = sm + st * Cfg::kStageBytes;
      const float* sU = reinterpret_cast<const float*>(stb + Cfg::kStU);  // [V/32][tok][32]
      const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);  // gq | gk | e^Gamma
      T* sK = reinterpret_cast<T*>(stb + Cfg::kStK);
      mbar_wait(&full[st], (c / kStages) & 1);
      Tensor rWh = thrU.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<T*>(stb) + kOffWh), typename L::TokD_K{}));
      Tensor rKt = thrS.partition_fragment_A(make_tensor(make_smem_ptr(sK), typename L::DTok_MN{}));
      Tensor rSh = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par)), typename RL::VD_MN{}));
      Tensor rSl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par) + kDK * VT), typename RL::VD_MN{}));

      // U' = w S (w_hi S_hi + w_hi S_lo).
      warpgroup_fence_operand(accU);
      warpgroup_arrive();
      mmaU.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rWh); ++k) {
        cute::gemm(mmaU, rWh(_, _, k), rSh(_, _, k), accU);
        mmaU.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rWh); ++k) cute::gemm(mmaU, rWh(_, _, k), rSl(_, _, k), accU);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accU);

      // U = u - w S -> U buffer (for the output WG), X = diag(e^(Gamma-gamma)) U -> X buffer.
      T* uh = ubuf(par);
      T* ul = uh + kC * VT;
      CUTE_UNROLL
      for (int i = 0; i < size(accU); i += 2) {
        const int r = get<0>(cU(i)), v = get<1>(cU(i));
        const float2 u2 = *reinterpret_cast<const float2*>(sU + (v / kUT) * (kC * kUT) + u_index(r, v % kUT));
        const float gk = sG[kC + r];
        const float x0 = u2.x - accU(i), x1 = u2.y - accU(i + 1);
        uint32_t h, l;
        const int off = static_cast<int>(&tU0(v, r) - ubuf(0));
        split_pair<T>(x0, x1, h, l);
        *reinterpret_cast<uint32_t*>(uh + off) = h;
        *reinterpret_cast<uint32_t*>(ul + off) = l;
        split_pair<T>(gk * x0, gk * x1, h, l);
        *reinterpret_cast<uint32_t*>(sXh + off) = h;
        *reinterpret_cast<uint32_t*>(sXl + off) = l;
      }
      const float eG = sG[2 * kC];
      fence_async_smem();
      mbar_arrive(&uready[par]);  // S_c and U_c are readable by the output WG
      math_bar();                 // X is complete

      // S = e^Gamma S + K^T X (X_hi + X_lo).
      CUTE_UNROLL
      for (int i = 0; i < size(accS); ++i) accS(i) *= eG;
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      mmaS.accumulate_ = GMMA::ScaleOut::One;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rKt); ++k) cute::gemm(mmaS, rKt(_, _, k), rXh(_, _, k), accS);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rKt); ++k) cute::gemm(mmaS, rKt(_, _, k), rXl(_, _, k), accS);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      mbar_arrive(&empty[st]);  // w, K, u and the gates of this stage are consumed

      // S_{c+1} goes to the other parity, last read by the output WG for chunk c-1.
      if (c >= 1) mbar_wait(&ofree[par ^ 1], ((c - 1) >> 1) & 1);
      store_state(par ^ 1);  // its barrier also ends every warp's reads of X
    }

    if (p.hT) {
      const int64_t fb = static_cast<int64_t>(n) * p.shT[0] + static_cast<int64_t>(hv) * p.shT[1];
      CUTE_UNROLL
      for (int i = 0; i < size(accS); ++i) {
        const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
        p.hT[fb + (p.vk ? v * p.shT[2] + d : d * p.shT[2] + v)] = accS(i);
      }
    }
  } else {
    // ---------------- output warpgroup ----------------
    Tensor accQS = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});
    Tensor accAU = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});
    T* ob = static_cast<T*>(p.o) + b * p.so[0] + static_cast<int64_t>(hv) * p.so[2] + v0;
    for (int c = 0; c < nch; ++c) {
      const int st = c % kStages, par = c & 1;
      uint8_t* stb = sm + st * Cfg::kStageBytes;
      T* base = reinterpret_cast<T*>(stb);
      const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);
      T* sQ = reinterpret_cast<T*>(stb + Cfg::kStQ);
      Tensor rQ = thrU.partition_fragment_A(make_tensor(make_smem_ptr(sQ), typename L::TokD_K{}));
      Tensor rAh = thrU.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAh), typename L::TokTok_K{}));
      Tensor rAl = thrU.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAl), typename L::TokTok_K{}));
      Tensor rSh = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par)), typename RL::VD_MN{}));
      Tensor rSl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par) + kDK * VT), typename RL::VD_MN{}));
      Tensor rUh = thrU.partition_fragment_B(make_tensor(make_smem_ptr(ubuf(par)), typename RL::VTok_MN{}));
      Tensor rUl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(ubuf(par) + kC * VT), typename RL::VTok_MN{}));
      mbar_wait(&full[st], (c / kStages) & 1);
      mbar_wait(&uready[par], (c >> 1) & 1);

      // Q S (S_hi + S_lo) and A U (A_hi U_hi + A_hi U_lo + A_lo U_hi), two accumulators: the
      // row gate scale e^gamma applies to Q S only.
      warpgroup_fence_operand(accQS);
      warpgroup_fence_operand(accAU);
      warpgroup_arrive();
      mmaU.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rQ); ++k) {
        cute::gemm(mmaU, rQ(_, _, k), rSh(_, _, k), accQS);
        mmaU.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rQ); ++k) cute::gemm(mmaU, rQ(_, _, k), rSl(_, _, k), accQS);
      mmaU.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rAh); ++k) {
        cute::gemm(mmaU, rAh(_, _, k), rUh(_, _, k), accAU);
        mmaU.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rAh); ++k) cute::gemm(mmaU, rAh(_, _, k), rUl(_, _, k), accAU);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(rAl); ++k) cute::gemm(mmaU, rAl(_, _, k), rUh(_, _, k), accAU);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accQS);
      warpgroup_fence_operand(accAU);
      // Row gates of this thread's rows, read before the stage is released.
      float gq[size(accQS) / 2];
      CUTE_UNROLL
      for (int i = 0; i < size(accQS); i += 2) gq[i / 2] = sG[get<0>(cU(i))];
      mbar_arrive(&ofree[par]);
      mbar_arrive(&empty[st]);

      const int rows = static_cast<int>(min<int64_t>(kC, slen - static_cast<int64_t>(c) * kC));
      CUTE_UNROLL
      for (int i = 0; i < size(accQS); i += 2) {
        const int r = get<0>(cU(i)), v = get<1>(cU(i));
        if (r < rows) {
          *reinterpret_cast<uint32_t*>(ob + (t0 + static_cast<int64_t>(c) * kC + r) * p.so[1] + v) =
              pack2<T>(gq[i / 2] * accQS(i) + accAU(i), gq[i / 2] * accQS(i + 1) + accAU(i + 1));
        }
      }
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
int g_test_overlap = -1;   // test builds only: 0/1 forces the overlapped prep (-1: auto)
#endif

Status cuda_err(cudaError_t e, const char* what) {
  return Status::Error(StatusCode::kCudaError, std::string("sm90 forward: ") + what + ": " + cudaGetErrorString(e));
}
#define QLA_CUDA_TRY(expr, what)              \
  do {                                        \
    cudaError_t e_ = (expr);                  \
    if (e_ != cudaSuccess) return cuda_err(e_, what); \
  } while (0)

// Per-device facts queried once (the eager path calls the op every few microseconds):
// compute capability major, SM count, and whether the kernels' shared-memory opt-in is set.
struct DeviceInfo {
  int major = 0, sms = 0;
  bool smem_ready[2] = {false, false};  // [bf16, fp16]
};
constexpr int kMaxDevices = 64;
DeviceInfo g_devices[kMaxDevices];
std::mutex g_devices_mu;

Status device_info(DeviceInfo** out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess)
    return Status::Error(StatusCode::kNotSupported, std::string("sm90 forward: no CUDA device: ") + cudaGetErrorString(e));
  if (dev < 0 || dev >= kMaxDevices)
    return Status::Error(StatusCode::kNotSupported, "sm90 forward: device index out of range");
  DeviceInfo& d = g_devices[dev];
  if (__atomic_load_n(&d.sms, __ATOMIC_ACQUIRE) == 0) {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    if (d.sms == 0) {
      int major = 0, sms = 0;
      e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      if (e != cudaSuccess)
        return Status::Error(StatusCode::kNotSupported,
                             std::string("sm90 forward: cannot query the CUDA device: ") + cudaGetErrorString(e));
      d.major = major;
      __atomic_store_n(&d.sms, sms, __ATOMIC_RELEASE);
    }
  }
  *out = &d;
  return Status::Ok();
}

int64_t num_seqs(const GdnForwardParams& p) { return p.cu_seqlens.data ? p.num_seqs : p.shape.batch; }

// Upper bound on the total chunk count, from shapes only.
int64_t max_chunks(const GdnForwardParams& p) {
  const int64_t T = p.shape.seqlen;
  if (p.cu_seqlens.data) return T / kC + p.num_seqs;  // sum ceil(l/64) <= floor(T/64) + N
  return p.shape.batch * ((T + kC - 1) / kC);
}

struct WsLayout {
  size_t table = 0, ready = 0, regions = 0, total = 0;
};
WsLayout ws_layout(const GdnForwardParams& p) {
  auto up = [](size_t x) { return (x + 1023) & ~size_t(1023); };
  const size_t N = static_cast<size_t>(num_seqs(p));
  const size_t mc = static_cast<size_t>(max_chunks(p));
  const size_t HV = static_cast<size_t>(p.shape.num_v_heads);
  WsLayout w;
  w.table = 0;
  w.ready = up(4 * (N + 2));             // after off[0..N] and the cu_seqlens check; one int per (chunk, value head)
  w.regions = w.ready + up(4 * mc * HV);
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

// Tensor map of q, k or v as (d, head, token, batch) with a (64, 1, 64, 1) box and 128-byte
// swizzle: one box is one K-block (64 tokens x 64 d) of the recurrence's GMMA tile. The driver
// entry point comes through the runtime (no libcuda link).
Status make_tile_map(CUtensorMap* map, const TensorRef& t, int64_t heads, const GdnForwardParams& p) {
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
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(kDK), static_cast<cuuint64_t>(heads),
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
                         "sm90 forward: cuTensorMapEncodeTiled failed for q/k/v (error " + std::to_string(int(r)) + ")");
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

  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (!ds.ok()) return ds;
  const int dt = std::is_same_v<T, cutlass::bfloat16_t> ? 0 : 1;
  if (!__atomic_load_n(&dinfo->smem_ready[dt], __ATOMIC_ACQUIRE)) {  // opt in to > 48 KiB of shared memory, once
    QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_prep<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kPrepSmem),
                 "cudaFuncSetAttribute(gdn_prep)");
    QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur_ws<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecWsCfg::kSmem),
                 "cudaFuncSetAttribute(gdn_recur_ws)");
    QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur<T, 64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecCfg<64>::kSmem),
                 "cudaFuncSetAttribute(gdn_recur)");
    __atomic_store_n(&dinfo->smem_ready[dt], true, __ATOMIC_RELEASE);
  }

  // Tensor maps of q and k (shared by prep and recurrence); v's is made for prep below.
  CUtensorMap tmq, tmk;
  Status ms = make_tile_map(&tmq, p.q, p.shape.num_qk_heads, p);
  if (ms.ok()) ms = make_tile_map(&tmk, p.k, p.shape.num_qk_heads, p);
  if (!ms.ok()) return ms;

  SeqDesc sd;
  sd.cu = p.cu_seqlens.data;
  sd.cu64 = p.cu_seqlens.dtype == DType::kInt64;
  sd.T = p.shape.seqlen;
  int* table = reinterpret_cast<int*>(ws + wl.table);

  int stages = 3;
#ifdef QLA_SM90_TEST_HOOKS
  stages = g_test_stages;
#endif
  // Recurrence shape. V tile 32 (4 CTAs per sequence and head, warp-specialized kernel) when that
  // makes at most two waves, or when there are one or two sequences: the sequential chunk loop is
  // latency-bound, a narrower tile cuts its per-chunk work, and with two sequences of unequal
  // length the longer one sets the time (16/64 at 24576+8192: 4.0 ms with V tile 64).
  // Otherwise V tile 64 (2 CTAs per sequence and head, one math warpgroup), measured faster
  // with many equal sequences (16/32 at 8192x4: 1.61 vs 1.77 ms).
  bool vt32 = N <= 2 || static_cast<int64_t>(N) * HV * (kDV / 32) <= 2 * static_cast<int64_t>(dinfo->sms);
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_vt) vt32 = g_test_vt == 32;
#endif
  const int64_t rec_ctas = static_cast<int64_t>(N) * HV * (kDV / (vt32 ? kWsVT : 64));
  // Overlapped mode: when the recurrence takes at most half the SMs, the prep runs beside it on
  // the others (the recurrence is launched as its programmatic dependent and waits per region
  // on a ready flag) instead of before it. Without programmatic launch the two kernels simply
  // run in order, and every flag is already set.
  bool overlap = vt32 && 2 * rec_ctas <= dinfo->sms;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_overlap >= 0) overlap = g_test_overlap && vt32 && rec_ctas < dinfo->sms;
#endif
  int* ready = reinterpret_cast<int*>(ws + wl.ready);
  const int64_t nregions = mc * HV;

  if (stages & 1) {
    gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table, overlap ? ready : nullptr, overlap ? nregions : 0);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");

    if (mc > 0) {
      PrepParams pp{};
      pp.tmq = tmq;
      pp.tmk = tmk;
      Status ms = make_tile_map(&pp.tmv, p.v, p.shape.num_v_heads, p);
      if (!ms.ok()) return ms;
      pp.g = p.g.data; pp.beta = p.beta.data;
      for (int i = 0; i < 2; ++i) { pp.sg[i] = p.g.stride[i]; pp.sb[i] = p.beta.stride[i]; }
      pp.g_dt = static_cast<int>(p.g.dtype);
      pp.b_dt = static_cast<int>(p.beta.dtype);
      pp.sd = sd;
      pp.N = N;
      pp.H = static_cast<int>(p.shape.num_qk_heads);
      pp.HV = HV;
      pp.chunk_off = table;
      pp.regions = ws + wl.regions;
      pp.ready = overlap ? ready : nullptr;
      pp.scale = p.scale;
      // Persistent: one CTA (two warpgroups) per SM, or per SM the recurrence leaves free.
      const int64_t want = overlap ? dinfo->sms - rec_ctas : dinfo->sms;
      const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, (nregions + 1) / 2)));
      gdn_prep<T><<<grid, 256, kPrepSmem, stream>>>(pp);
      QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_prep");
    }
  }
  if (!(stages & 2)) return Status::Ok();

  RecParams rp{};
  rp.tmq = tmq;
  rp.tmk = tmk;
  rp.sd = sd;
  rp.chunk_off = table;
  rp.regions = ws + wl.regions;
  rp.h0 = static_cast<const float*>(p.initial_state.data);
  rp.hT = static_cast<float*>(p.final_state.data);
  for (int i = 0; i < 3; ++i) { rp.sh0[i] = p.initial_state.stride[i]; rp.shT[i] = p.final_state.stride[i]; rp.so[i] = p.o.stride[i]; }
  rp.vk = p.state_layout == StateLayout::kVK;
  rp.o = p.o.data;
  rp.N = N;
  rp.H = static_cast<int>(p.shape.num_qk_heads);
  rp.HV = HV;
  rp.prec = kPrecDefault;
  rp.ready = overlap ? ready : nullptr;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_prec >= 0) rp.prec = g_test_prec;
#endif
  if (vt32) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(N * (kDV / kWsVT), HV);
    cfg.blockDim = dim3(288);
    cfg.dynamicSmemBytes = RecWsCfg::kSmem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = overlap ? 1 : 0;
    QLA_CUDA_TRY(cudaLaunchKernelEx(&cfg, gdn_recur_ws<T>, rp), "launch gdn_recur_ws");
  } else {
    gdn_recur<T, 64><<<dim3(N * (kDV / 64), HV), 160, RecCfg<64>::kSmem, stream>>>(rp);
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
void set_test_overlap(int on) { g_test_overlap = on; }
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
  if (num_seqs(p) > 2147483647LL / 4 || max_chunks(p) > 2147483647LL / 2 || p.shape.num_v_heads > 65535)
    return ns("too many sequences, chunks or value heads for the sm90 grid");
  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (!ds.ok()) return ds;
  const int major = dinfo->major;
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
