// sm90 forward: shapes, the workspace region layout, shared-memory layouts and the small PTX
// helpers (mbarriers, bulk copies, TMA, fences, named barriers) used by the kernels.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_types.h>

#include "qla/qla.h"

namespace qla {
namespace sm90 {
// Anonymous: these headers are included by gdn_fwd_sm90.cu alone (internal linkage).
namespace {

using namespace cute;


constexpr int kC = 64;    // chunk length
constexpr int kDK = 128;  // head dim of q/k
constexpr int kDV = 128;  // head dim of v
constexpr int kUT = 32;   // V columns per u tile of the workspace (recurrence V tiles: 32 or 64)

// Workspace region of one (chunk, value head). The 16-bit part holds the exact shared-memory
// bytes (swizzled GMMA layouts) that the recurrence wants, so one plain bulk copy loads it:
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

// Issue acc (+)= A B over all K blocks of the fragments into the open wgmma batch (between
// warpgroup_arrive and warpgroup_commit_batch). first = ScaleOut::Zero overwrites acc, One adds.
template <class MMA, class FA, class FB, class Acc>
__device__ __forceinline__ void gemm_k(MMA& mma, const FA& rA, const FB& rB, Acc& acc, GMMA::ScaleOut first) {
  mma.accumulate_ = first;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}
// One wgmma product acc (+)= A B (fragments or descriptors) as its own batch, waited for.
template <class MMA, class FA, class FB, class Acc>
__device__ __forceinline__ void gemm_sync(MMA& mma, const FA& rA, const FB& rB, Acc& acc, GMMA::ScaleOut first) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mma, rA, rB, acc, first);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

// Two wgmma products acc (+)= A B, acc2 (+)= A2 B2 of one tiled MMA in one batch, waited for.
template <class MMA, class FA, class FB, class Acc, class FA2, class FB2, class Acc2>
__device__ __forceinline__ void gemm_pair_sync(MMA& mma, const FA& rA, const FB& rB, Acc& acc, const FA2& rA2, const FB2& rB2,
                                               Acc2& acc2, GMMA::ScaleOut first) {
  warpgroup_fence_operand(acc);
  warpgroup_fence_operand(acc2);
  warpgroup_arrive();
  gemm_k(mma, rA, rB, acc, first);
  gemm_k(mma, rA2, rB2, acc2, first);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  warpgroup_fence_operand(acc2);
}

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
  using TokTok_MN = decltype(tile_to_shape(MNAtom{}, Shape<_64, _64>{}));                  // (j, i): same bytes
  // Backward images of a K x V state (d, v) and of -dU (tok, v), v contiguous, with 64-byte
  // swizzle and 32-column blocks of v outermost: the columns 32 vt .. 32 vt + 31 are the vt-th
  // contiguous block (8 KiB of a state, 4 KiB of -dU), byte-identical to RecLay<T, 32>::VD_MN and
  // ::VTok_MN. A V-tile-32 chain kernel stores its block with one bulk copy of its shared-memory
  // operand; the gradients kernel reads both views (tests/cuda/sm90_layout_test.cu checks this).
  using K64Atom = GMMA::Layout_K_SW64_Atom<T>;
  using MN64Atom = GMMA::Layout_MN_SW64_Atom<T>;
  using DD_K = decltype(tile_to_shape(K64Atom{}, Shape<_128, _128>{}));                        // (d, v)
  using DD_MN = decltype(tile_to_shape(MN64Atom{}, Shape<_128, _128>{}, Step<_2, _1>{}));      // (v, d)
  using TokV_K = decltype(tile_to_shape(K64Atom{}, Shape<_64, _128>{}));                       // (tok, v)
  using VTok_MN = decltype(tile_to_shape(MN64Atom{}, Shape<_128, _64>{}, Step<_2, _1>{}));     // (v, tok)
};
// Byte of element (row, col) of a K-major 16-bit tile with 128-byte swizzle: rows of 128 bytes,
// 64-column boxes of box bytes (8 KiB for 64 rows: TokD_K, TokTok_K; 16 KiB for 128: QK_K), a row's
// 16-byte runs swizzled by its low three bits (the layout test checks it against the CuTe
// layouts). Kernels that index such a tile per element use it instead of CuTe's coordinate
// tensors, whose per-element addresses the compiler hoists and holds across a loop.
__host__ __device__ constexpr uint32_t tokd_byte(int row, int col, uint32_t box = 8192u) {
  return box * static_cast<uint32_t>(col >> 6) + 128u * static_cast<uint32_t>(row) +
         16u * static_cast<uint32_t>(((col >> 3) & 7) ^ (row & 7)) + 2u * static_cast<uint32_t>(col & 7);
}
// The x4 ldmatrix / stmatrix address of lane l of warp w over such a tile (tokd_byte's bytes), for
// the 8 x 8 blocks of rows 16 w .. 16 w + 15 and columns 8 tb .. 8 tb + 15 (tb even): lane l
// addresses row 16 w + 8 (m & 1) + l % 8 of column block tb + m / 2, m = l / 8, formed once; each
// block pair then costs one add of an immediate (tb + m / 2 has no carry into bit 3: tb is even).
struct TokdLane {
  uint32_t base, sw;
  __host__ __device__ __forceinline__ TokdLane(uint32_t tile, int wt) {
    const int lane = wt & 31, mtx = lane >> 3;
    base = tile + 128u * static_cast<uint32_t>(16 * (wt >> 5) + 8 * (mtx & 1) + (lane & 7));
    sw = static_cast<uint32_t>((mtx >> 1) ^ (lane & 7));
  }
  template <uint32_t kBox = 8192u>
  __host__ __device__ __forceinline__ uint32_t at(int tb) const { return base + kBox * static_cast<uint32_t>(tb >> 3) + 16u * ((static_cast<uint32_t>(tb) & 7u) ^ sw); }
};

// Element offset of (i, j) in a swizzled image. The GMMA layouts swizzle the shared-memory
// address bits, so evaluating the layout alone would miss the swizzle: go through a tensor over a
// 1024-byte aligned base (any; only the offset is used; the layout test calls it on the host).
// Global copies of an image use the same offsets, so a bulk copy moves them unchanged.
template <class Layout, class T>
__host__ __device__ __forceinline__ int img_off(T* aligned_base, int i, int j) {
  Tensor t = make_tensor(make_smem_ptr(aligned_base), Layout{});
  return static_cast<int>(&t(i, j) - aligned_base);
}

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
// Four bytes of shared memory (written out: through a swizzled CuTe pointer the compiler loses
// the address space and issues generic loads).
__device__ __forceinline__ uint32_t lds_u32(uint32_t a) {
  uint32_t u;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(u) : "r"(a));
  return u;
}
// A 16-byte run of shared memory.
__device__ __forceinline__ uint4 lds_u128(uint32_t a) {
  uint4 u;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "r"(a));
  return u;
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
// L2 prefetches of what a later load will bring (a tensor map's box; bytes from src, a multiple
// of 16): the load then waits on L2, not on HBM.
__device__ __forceinline__ void tma_prefetch_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// 16-byte shared load (a broadcast here). Written out because the compiler otherwise splits
// the substitution's row reads into four scalar LDS, four times the shared-memory instructions.
__device__ __forceinline__ float4 lds128(uint32_t addr) {
  float4 r;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(addr));
  return r;
}
// Phase timers for kernel work (-DQLA_FUSED_PROFILE, test builds): clock64 cycles per phase of
// the warpgroups of one CTA (blockIdx (0, g_phase_cta_y, 0); y = 0 unless test_set_phase_cta
// says otherwise: a split reverse step's pass 0 runs no piece 0), averaged over its chunks (regions), kept as records in
// device memory and printed by print_phase_records (the test hook test_print_phases). Not by a
// printf in the kernel: a call there serializes every wgmma of the kernel (ptxas C7510), which
// is what the timers of 2026-12-01 and before measured. Each phase's cycles go straight to its
// record by a reduction (red.global.add, nothing waits for it): per-phase sums held in the
// kernel spilled to local memory in register-tight kernels (the inverse kernel at 128), and the
// reload after each clock read, an L2 round trip when shared memory leaves L1 little room,
// was counted in the next phase. A thread keeps only its record's index and the last clock.
// QLA_PHASE_ARGS / QLA_PHASE_PASS carry the timers into a device function.
#ifdef QLA_FUSED_PROFILE
constexpr int kPhaseMax = 16;
struct PhaseRecord {
  const char* what;
  int wg, phases;
  long long chunks;
  unsigned long long t[kPhaseMax];
};
constexpr int kPhaseRecords = 64;
__device__ PhaseRecord g_phase_records[kPhaseRecords];
__device__ int g_phase_count;
__device__ int g_phase_cta_y;  // the recorded CTA's blockIdx.y (test_set_phase_cta: pieces, sequences)
__device__ __forceinline__ void phase_add(int slot, int k, long long cycles) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(&g_phase_records[slot].t[k]),
               "l"(static_cast<unsigned long long>(cycles))
               : "memory");
}
// ph_slot: the record of this thread (thread 0 of a warpgroup of CTA 0), else kPhaseRecords.
// QLA_PHASES_SMEM(n, slots): the sums kept in n shared-memory slots of the thread's own and sent
// to the record at QLA_PHASES_PRINT. For kernels that fence shared memory for the async proxy:
// the fence (MEMBAR.ALL.CTA) waits for the thread's reductions in flight, which then counted in
// every phase with a fence.
#define QLA_PHASES_SMEM(n, slots)                                                                       \
  static_assert((n) <= kPhaseMax, "too many phases");                                                  \
  const int ph_slot = (threadIdx.x & 127) == 0 && blockIdx.x == 0 && blockIdx.y == g_phase_cta_y      \
                          ? min(atomicAdd(&g_phase_count, 1), kPhaseRecords)                           \
                          : kPhaseRecords;                                                             \
  unsigned long long* const ph_sm = (slots);                                                           \
  if (ph_slot < kPhaseRecords && ph_sm)                                                                \
    for (int k_ = 0; k_ < (n); ++k_) ph_sm[k_] = 0;                                                    \
  long long ph_p = clock64()
#define QLA_PHASES(n) QLA_PHASES_SMEM(n, nullptr)
#define QLA_PHASE(k)                                                   \
  do {                                                                 \
    const long long t_ = clock64();                                    \
    if (ph_slot < kPhaseRecords) {                                     \
      if (ph_sm)                                                       \
        ph_sm[(k)] += static_cast<unsigned long long>(t_ - ph_p);      \
      else                                                             \
        phase_add(ph_slot, (k), t_ - ph_p);                            \
    }                                                                  \
    ph_p = t_;                                                         \
  } while (0)
#define QLA_PHASES_PRINT(what_, n, nch)                                         \
  do {                                                                          \
    if (ph_slot < kPhaseRecords) {                                              \
      if (ph_sm)                                                                \
        for (int k_ = 0; k_ < (n); ++k_) phase_add(ph_slot, k_, ph_sm[k_]);     \
      g_phase_records[ph_slot].what = what_;                                    \
      g_phase_records[ph_slot].wg = int(threadIdx.x >> 7);                      \
      g_phase_records[ph_slot].phases = (n);                                    \
      g_phase_records[ph_slot].chunks = (nch);                                  \
    }                                                                           \
  } while (0)
// Prints the records (a record's sums over its chunks, divided by them) and clears them.
__global__ void print_phase_records() {
  for (int r = 0; r < min(g_phase_count, kPhaseRecords); ++r) {
    PhaseRecord& x = g_phase_records[r];
    if (x.chunks > 0 && x.what) {
      printf("%s, warpgroup %d, cycles per chunk:", x.what, x.wg);
      for (int k = 0; k < x.phases; ++k) printf(" %llu", x.t[k] / static_cast<unsigned long long>(x.chunks));
      printf("\n");
    }
    x = PhaseRecord{};
  }
  g_phase_count = 0;
}
#define QLA_PHASE_ARGS , int ph_slot, long long& ph_p, unsigned long long* ph_sm
#define QLA_PHASE_PASS , ph_slot, ph_p, ph_sm
#else
#define QLA_PHASE_ARGS
#define QLA_PHASE_PASS
#define QLA_PHASES(n) do {} while (0)
#define QLA_PHASES_SMEM(n, slots) do {} while (0)
#define QLA_PHASE(k) do {} while (0)
#define QLA_PHASES_PRINT(what, n, nch) do {} while (0)
#endif

// Warp-level fragments of 16 x 16 fp16 blocks for mma.sync.m16n8k16 (lane l: g = l / 4,
// t = l % 4). A 16 x 16 fp32 block as two m16n8 accumulators, c[8]: c[0..3] the columns 0-7
// ((g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)), c[4..7] the columns 8-15; the same order
// as a 16-column block of a warp's rows in a wgmma accumulator. An A operand, a[4]: the same
// pairs packed (rows g and g + 8, columns 2t and 2t + 8). A B operand, b[4]: (b[0], b[1]) the
// 16 x 8 half of columns 0-7, (b[2], b[3]) of columns 8-15.
// Row-major 16 x 16 fp16 blocks in shared memory move by ldmatrix.trans (as B operands) and
// stmatrix (from accumulators) with lane l addressing row (l % 8) + 8 ((l / 8) % 2), column
// 8 (l / 16) (block_lane_addr).
__device__ __forceinline__ uint32_t block_lane_addr(uint32_t base, int pitch_bytes, int lane) {
  return base + ((lane & 7) + 8 * ((lane >> 3) & 1)) * pitch_bytes + 16 * (lane >> 4);
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {  // B operand of a row-major block
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {  // four 8 x 8 blocks, row-major
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void stmatrix4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// An 8 x 8 block of 16-bit pairs transposed in registers.
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
// acc += a b over a 16 x 16 block (two m16n8k16 products, fp16 operands, fp32 accumulation).
__device__ __forceinline__ void block_mma_f16(float (&acc)[8], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  CUTE_UNROLL
  for (int nt = 0; nt < 2; ++nt)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[4 * nt]), "+f"(acc[4 * nt + 1]), "+f"(acc[4 * nt + 2]), "+f"(acc[4 * nt + 3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2 * nt]), "r"(b[2 * nt + 1]));
}

// Generic-proxy smem writes must be made visible to wgmma (async proxy) before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Programmatic dependent launch (launch_kernel, gdn_fwd_sm90.cu): a kernel launched so
// may start while the previous one on the stream finishes, once that one has let it
// (allow_dependent_launch); it waits here, before its first read of anything the previous
// kernels wrote, until they have completed and their writes are visible. Both are no-ops for
// kernels launched the ordinary way.
__device__ __forceinline__ void wait_for_previous_kernels() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Barrier 1 among the 128 math threads only (the producer warp never joins it).
__device__ __forceinline__ void math_bar() { asm volatile("bar.sync 1, 128;" ::: "memory"); }

__device__ __forceinline__ float load_f(const void* p, int dt, int64_t i) {
  if (dt == static_cast<int>(DType::kFloat32)) return static_cast<const float*>(p)[i];
  if (dt == static_cast<int>(DType::kBFloat16))
    return float(static_cast<const cutlass::bfloat16_t*>(p)[i]);
  return float(static_cast<const cutlass::half_t*>(p)[i]);
}

// load_f in two halves: the element's bits (fp32, or fp16 / bf16 zero-extended), then their
// value. A kernel that loads a region ahead keeps the bits, so that the dtype's branch does not
// wait for the load (a conversion inside the branch would).
__device__ __forceinline__ uint32_t load_bits(const void* p, int dt, int64_t i) {
  if (dt == static_cast<int>(DType::kFloat32)) return __ldg(static_cast<const unsigned int*>(p) + i);
  return __ldg(static_cast<const unsigned short*>(p) + i);
}
// x into element i of p in the dtype dt (fp32, bf16 or fp16).
__device__ __forceinline__ void store_f(void* p, int dt, int64_t i, float x) {
  if (dt == static_cast<int>(DType::kFloat32)) static_cast<float*>(p)[i] = x;
  else if (dt == static_cast<int>(DType::kBFloat16)) static_cast<cutlass::bfloat16_t*>(p)[i] = cutlass::bfloat16_t(x);
  else static_cast<cutlass::half_t*>(p)[i] = cutlass::half_t(x);
}

__device__ __forceinline__ float bits_value(uint32_t x, int dt) {
  if (dt == static_cast<int>(DType::kFloat32)) return __uint_as_float(x);
  if (dt == static_cast<int>(DType::kBFloat16)) return __uint_as_float(x << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
}

// Gates of token tid (< kC) of a chunk starting at token t0 of batch row b: g and beta (0 past
// len, the sequence end).
template <class Params>
__device__ __forceinline__ void load_gates(const Params& p, int tid, int len, int64_t b, int64_t t0, int hv,
                                           float& g, float& beta) {
  g = beta = 0.f;
  if (tid < len) {
    const int64_t t = t0 + tid;
    g = load_f(p.g, p.g_dt, b * p.sg[0] + t * p.sg[1] + hv);
    beta = load_f(p.beta, p.b_dt, b * p.sb[0] + t * p.sb[1] + hv);
  }
}
// Inclusive sum over the lanes of a warp (lane i: x_0 + .. + x_i).
__device__ __forceinline__ float warp_inclusive_sum(float x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}
// load_gates, then g summed over the tokens 0..tid of the thread's warp (the caller adds warp
// 0's total to warp 1).
template <class Params>
__device__ __forceinline__ void load_gates_scan(const Params& p, int tid, int len, int64_t b, int64_t t0, int hv,
                                                float& gam, float& beta) {
  float gv;
  load_gates(p, tid, len, b, t0, hv, gv, beta);
  gam = warp_inclusive_sum(gv);
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
// A state pool's indices (GdnForwardParams::initial_state_indices / final_state_indices):
// sequence n's slot is entry n (negative: none); without indices (idx == nullptr) it is n.
struct PoolIndex {
  const void* idx = nullptr;
  int is64 = 0;
  int64_t slots = 0;
};
__device__ __forceinline__ int64_t pool_slot(const PoolIndex& pi, int64_t n) {
  if (!pi.idx) return n;
  return pi.is64 ? static_cast<const int64_t*>(pi.idx)[n] : static_cast<const int32_t*>(pi.idx)[n];
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

// The chunk table that gdn_chunk_table writes into the workspace (ints): [0, N] chunk offsets
// (prefix sums of ceil(len / 64)), [N + 1] the malformed-cu_seqlens flag, [N + 2, 2N + 2) the
// sequences longest first (the launch order of the sequential passes).
__host__ __device__ constexpr int64_t chunk_table_ints(int64_t N) { return 2 * N + 2; }

// Sequence splitting (docs/split.md): a sequence of nch chunks runs as np pieces of len chunks
// (the last one shorter, none empty): np = ceil(nch / piece_chunks) capped at max_pieces, len =
// ceil(nch / np), so the pieces are at most piece_chunks long unless the cap binds. The split is a
// function of nch and the plan alone, so a sequence's pieces never depend on the rest of the
// batch once the plan is fixed. piece_chunks = 0 (or nch <= piece_chunks) keeps it whole.
struct PiecePlan {
  int piece_chunks = 0;  // the longest piece, in chunks (0: no splitting)
  int max_pieces = 1;  // and at most this many per sequence
};
struct PieceSplit {
  int np, len;
};
__host__ __device__ __forceinline__ PieceSplit piece_split(int nch, const PiecePlan& pl) {
  if (pl.piece_chunks <= 0 || nch <= pl.piece_chunks) return {1, nch};
  int np = (nch + pl.piece_chunks - 1) / pl.piece_chunks;
  np = np < pl.max_pieces ? np : pl.max_pieces;
  const int len = (nch + np - 1) / np;
  return {(nch + len - 1) / len, len};
}
// Bounds from the shapes alone (the workspace), for any lengths the shapes allow: the pieces of a
// call (a sequence of nch chunks has at most ceil(nch / piece_chunks), or 1) and the pieces with
// transfer maps (those followed by another of their sequence: np - 1 <= (nch - 1) / piece_chunks
// < len / (64 piece_chunks) for a sequence of len tokens). chunks_bound: at least the call's total
// chunk count; tokens: its total length.
struct PieceBounds {
  int64_t pieces, maps;
};
__host__ __device__ inline PieceBounds piece_bounds(int64_t N, int64_t tokens, int64_t chunks_bound,
                                                    const PiecePlan& pl) {
  const int64_t a = N * pl.max_pieces, b = N + chunks_bound / pl.piece_chunks;
  const int64_t c = N * (pl.max_pieces - 1), d = tokens / (int64_t(kC) * pl.piece_chunks);
  return {a < b ? a : b, c < d ? c : d};
}
// The piece table (split forward, ints, after the chunk table): [0, N] piece offsets of the
// sequences in launch order (the chunk table's longest-first ranks), then each piece's rank
// ([max_pieces) entries; max_pieces >= the actual total, from shapes).
__host__ __device__ constexpr int64_t piece_table_ints(int64_t N, int64_t max_pieces) { return N + 1 + max_pieces; }

// The i-th chunk (global index) of a call in level order: chunk c of every sequence (in index
// order, among those longer than c) before chunk c + 1 of any. off: the chunk table's N + 1
// offsets. The overlapped two-pass forward's prep walks its regions so (gdn_prep): in the
// global chunk order a second sequence's first chunks came after all of the first one's, and
// its recurrence waited for them. O(N log(longest)) per call, for the few sequences of that
// mode (at most kLevelOrderMaxSeqs).
constexpr int kLevelOrderMaxSeqs = 32;
__host__ __device__ inline int level_order_chunk(const int* off, int N, int i) {
  auto chunks_below = [&](int c) {  // the chunks of levels 0 .. c - 1
    int s = 0;
    for (int n = 0; n < N; ++n) {
      const int cnt = off[n + 1] - off[n];
      s += cnt < c ? cnt : c;
    }
    return s;
  };
  int lo = 0, hi = 0;  // the level of chunk i: the last c with chunks_below(c) <= i, in [lo, hi)
  for (int n = 0; n < N; ++n) hi = off[n + 1] - off[n] > hi ? off[n + 1] - off[n] : hi;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (chunks_below(mid) <= i) lo = mid;
    else hi = mid;
  }
  int k = i - chunks_below(lo);  // its place among the sequences longer than lo
  for (int n = 0; n < N; ++n)
    if (off[n + 1] - off[n] > lo && k-- == 0) return off[n] + lo;
  return i;  // not reached for 0 <= i < off[N]
}

// Sort key of the longest-first order (gdn_chunk_table): the chunk count at quarter-octave
// resolution (bucket 1 + 4 e + m for cnt = 2^e * 1.m..., 0 for an empty sequence). Counts 1.25x
// apart always differ, which is all the launch order needs, and 128 buckets let a counting sort
// in one block do it in O(N / 1024) steps. Host and device (tests/cuda/sm90_layout_test.cu).
constexpr int kOrderBuckets = 128;
__host__ __device__ __forceinline__ int order_bucket(int cnt) {
  if (cnt <= 0) return 0;
#ifdef __CUDA_ARCH__
  const int e = 31 - __clz(cnt);
#else
  const int e = 31 - __builtin_clz(static_cast<unsigned>(cnt));
#endif
  const int m = e >= 2 ? (cnt >> (e - 2)) & 3 : (cnt << (2 - e)) & 3;
  return 1 + 4 * e + m;  // <= 124
}

// A CTA of a sequential pass (forward recurrence, backward states pass and reverse step).
// Launch order = blockIdx x, then y, then z: x = V tile fastest, then value head (a (sequence,
// head)'s V-tile CTAs start together and read each chunk's data from L2 at about the same
// time); y + gridDim.y * z = the sequence's rank in the longest-first order. When the grid
// takes more than one wave, a short sequence launched ahead of a long one would delay the long
// chain by its whole length (8/32 at 6144+2048: 192 chunk steps instead of 128); longest first
// bounds that. x and the rank keep vt, hv in uniform registers (a flat index needs a runtime
// division, which moved them to vector registers in the SASS).
// z is 1 unless N > 65535; CTAs past N (live = false) leave after the malformed-input check.
constexpr int kMaxGridY = 65535;
inline dim3 seq_grid(int N, int HV, int nvt) {
  const int z = (N + kMaxGridY - 1) / kMaxGridY, y = (N + z - 1) / z;  // y * z - N < z padding CTAs
  return dim3(static_cast<unsigned>(nvt * HV), static_cast<unsigned>(y), static_cast<unsigned>(z));
}
struct SeqCta {
  int vt, hv, n;
  bool live;
};
template <int NVT>
__device__ __forceinline__ SeqCta seq_cta(const int* table, int N) {
  SeqCta c;
  c.vt = static_cast<int>(blockIdx.x % NVT);
  c.hv = static_cast<int>(blockIdx.x / NVT);
  const int rank = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  c.live = rank < N;
  c.n = c.live ? table[N + 2 + rank] : 0;
  return c;
}
// Blocks and this block's index over a whole (up to 3-D) grid: grid-stride loops.
__device__ __forceinline__ int64_t grid_blocks() { return static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z; }
__device__ __forceinline__ int64_t flat_block() {
  return (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}


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
    // A bf16 value is the top half of its fp32: one shift and one mask a pair (the intrinsic
    // took three instructions a pair in the reverse step's row passes, docs/design.md bwd-60).
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
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

// Rows len .. kC - 1 of a TMA box of kC token rows of row_bytes bytes (128: 64 16-bit columns
// with 128-byte swizzle; 64: 32 columns with 64-byte swizzle; the swizzle permutes a row's
// 16-byte chunks within the row's own bytes) set to zero by `threads` threads (index tid). A
// sequence's last chunk tile also holds the next sequence's first tokens (or TMA's zeros past
// the tensor): zeroed, they cannot reach this sequence's products, whatever they hold
// (Inf x 0 would be NaN), nor its units.
__device__ __forceinline__ void zero_box_rows(uint32_t box, int len, int tid, int threads, uint32_t row_bytes = 128) {
  for (uint32_t off = row_bytes * len + 16u * tid; off < row_bytes * kC; off += 16u * threads)
    sts128(box + off, make_uint4(0u, 0u, 0u, 0u));
}
__device__ __forceinline__ void sts128f(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// Bulk copy shared -> global (async proxy), completion tracked by bulk groups.
__device__ __forceinline__ void bulk_s2g(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
// 4-d tiled TMA store of one box from shared memory (the tensor map's swizzle), a bulk group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
// As tma_store_4d, but each element added into the global tensor's (its type: the map's).
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until the issued bulk stores have read their shared-memory source.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// As above, but the most recent bulk group may still be reading.
__device__ __forceinline__ void bulk_wait_read_but_last() { asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); }
// Every bulk store of this thread complete (writes performed), before the kernel ends.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Row dots <acc_r, X_(r, c + coff)> for the thread's two rows (r0 = 16 warp + lane/4 and r0 + 8),
// summed over the quad that holds each row (a partial over the warpgroup's columns). X is a
// 16-bit image; accumulator pairs are adjacent columns.
template <class T, class Layout, class Acc, class Coord>
__device__ __forceinline__ float2 row_dot(const Acc& acc, const Coord& cc, const T* X, int coff) {
  float s[2] = {0.f, 0.f};
  const uint32_t base = smem_u32(X);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(cc(i)), c = get<1>(cc(i)) + coff;
    uint32_t w;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w) : "r"(base + 2u * img_off<Layout>(const_cast<T*>(X), r, c)));
    const float2 x = unpack2<T>(w);
    s[(r >> 3) & 1] += acc(i) * x.x + acc(i + 1) * x.y;
  }
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    s[h] += __shfl_xor_sync(0xffffffffu, s[h], 1);
    s[h] += __shfl_xor_sync(0xffffffffu, s[h], 2);
  }
  return make_float2(s[0], s[1]);
}

// Sums over the rows of a 64 x N fragment's column pairs, added to col[] (shared, this warp's
// own 64 columns): the 8 row groups of a warp are reduced by shuffles, then one lane per column
// adds, so every sum is taken in a fixed order (no atomics: the backward is bitwise
// deterministic); the reader sums the warps' slots in warp order.
template <class Acc, class Coord>
__device__ __forceinline__ void add_col_sums(const Acc& v, const Coord& cc, float* col, int coff, int lane) {
  CUTE_UNROLL
  for (int i = 0; i < size(v); i += 4) {  // elements i, i+1: row r0; i+2, i+3: row r0+8 (same columns)
    float a = v(i) + v(i + 2), b = v(i + 1) + v(i + 3);
    CUTE_UNROLL
    for (int o = 4; o < 32; o <<= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (lane < 4) {
      const int c = get<1>(cc(i)) + coff;
      col[c] += a;
      col[c + 1] += b;
    }
  }
}

constexpr float kLog2e = 1.4426950408889634f;
// 2^x on the special-function unit (relative error ~2^-22; flushes results below 2^-126 to 0).
// Exponent of a positive finite float (unbiased; subnormals count as -127).
__device__ __forceinline__ int float_exponent(float m) { return ((__float_as_int(m) >> 23) & 255) - 127; }
// 2^e for e in [-126, 127].
__device__ __forceinline__ float pow2i(int e) { return __int_as_float((e + 127) << 23); }
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}


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


}  // namespace
}  // namespace sm90
}  // namespace qla
