// Sequence splitting in the fused forward (docs/split.md): what each CTA of the fused recurrence
// (fused_chunks.cuh) runs when sequences are cut into pieces, and the scan of the transfer maps.
//
// A piece (whole chunks of one sequence) maps its entering state linearly, per state column:
// S_end = M S_start + R, M (K x K) the product of its chunk transitions, R the piece run from
// zero. Per (sequence, value head) one of two paths, chosen on the device from the gates alone:
//   warm-up: every boundary has a few chunks before it (at most warm_max) whose gates sum to at
//            most warm_decay, so the state entering a piece is the last of those chunks rerun
//            from zero (the dropped part is scaled by e^(sum g) <= e^warm_decay); every piece
//            runs in pass 1, independently (pass 0 holds the exact path's larger share).
//   exact:   pass 0 (the lean kernel, no o) runs piece 0 from h0 and, for the middle pieces, R
//            (the V columns, from zero) and M (K more columns: from the identity with v = 0)
//            into `maps`; the scan turns R into the state entering the next piece (S_{j+1} =
//            M_j S_j + R_j, fp32, in place); pass 1 runs piece 0 again from h0 and pieces 1..
//            from those states, all with o (RecParams::lean_maps).
// Heads with g = 0 never warm up. The plan (piece lengths) is a function of each sequence's
// chunk count (piece_split), and the path of its gates, so a sequence's result does not
// depend on the rest of the batch for a fixed plan.
#pragma once

#include "inverse.cuh"
#include "recurrence.cuh"

namespace qla {
namespace sm90 {
namespace {

constexpr int kMapCols = kDV + kDK;  // maps: [K][V + K] per (piece, value head): R | M
// Only pieces followed by another of the same sequence have maps: piece j of the sequence of
// rank r (first piece at slot first) has map index first - r + j, so the maps of a call number
// at most the sum over sequences of (pieces - 1) <= chunks / piece_chunks, whatever N is.
__device__ __forceinline__ float* map_at(const RecParams& p, int index, int hv) {
  return p.maps + (static_cast<size_t>(index) * p.HV + hv) * kDK * kMapCols;
}
// The warm-up rule: the chunks before a boundary must sum g to at most kWarmLogDecay within
// kWarmMaxChunks chunks. The dropped part is then at most e^-16 = 1.1e-7 of the state where the
// warm-up starts; relative to the state at the boundary it is larger only by how much the state
// shrinks over the warm-up (keys far below unit norm after a large h0: e^-10 gave 3.7e-3 on the
// test with |k| = 2^-12; e^-16 keeps such cases far below the bound). The benchmark's gates
// (about -3.2 per chunk) take 5 or 6 chunks.
constexpr float kWarmLogDecay = -16.f;
constexpr int kWarmMaxChunks = 8;

// Gamma (the sum of g) of chunk ci (global index) of value head hv, from the inverse kernel's region.
__device__ __forceinline__ float chunk_log_decay(const RecParams& p, int ci, int hv) {
  const uint8_t* reg = static_cast<const uint8_t*>(p.regions) + (static_cast<size_t>(ci) * p.HV + hv) * kInvRegionBytes;
  return reinterpret_cast<const float*>(reg + kInvGam)[kC - 1];
}
// The warm-up length of the boundary before chunk bc of a sequence (first chunk ci0): the fewest
// chunks before it whose gates sum to at most warm_decay, 0 if warm_max chunks do not.
__device__ __forceinline__ int warm_chunks(const RecParams& p, int ci0, int hv, int bc) {
  // The kWarmMaxChunks decays are loaded together (one load latency, not one per chunk: this
  // runs at the start of every piece's CTA and of the scan), then summed in order.
  float dec[kWarmMaxChunks];
  CUTE_UNROLL
  for (int w = 1; w <= kWarmMaxChunks; ++w) dec[w - 1] = w <= p.warm_max && w <= bc ? chunk_log_decay(p, ci0 + bc - w, hv) : 0.f;
  float s = 0.f;
  CUTE_UNROLL
  for (int w = 1; w <= kWarmMaxChunks; ++w) {
    if (w > p.warm_max || w > bc) return 0;
    s += dec[w - 1];
    if (s <= p.warm_decay) return w;
  }
  return 0;
}
// Whether (sequence, head) takes the warm-up path: every one of its np - 1 boundaries (one warp).
__device__ __forceinline__ bool warm_path(const RecParams& p, int ci0, int hv, PieceSplit sp, int lane) {
  bool ok = p.warm_max > 0;
  for (int j = 1 + lane; ok && j < sp.np; j += 32) ok = warm_chunks(p, ci0, hv, j * sp.len) > 0;
  return __all_sync(0xffffffffu, ok);
}

// A fused-recurrence CTA's coordinates before its role is known.
struct PieceCta {
  int vt, hv, n;        // column tile (of [V | K] in pass 0 with maps), value head, sequence
  bool live;            // false: a padding CTA past the last piece or sequence
  int j;                // the piece's index within its sequence
  int map;              // its map index (map_at), valid for j < np - 1
  PieceSplit sp;        // the sequence's pieces
  int64_t b, t0, slen;  // batch row, first token, length of the sequence
  int ci0;              // the sequence's first chunk (global index)
};
__device__ __forceinline__ PieceCta piece_cta(const RecParams& p) {
  PieceCta c;
  c.vt = static_cast<int>(blockIdx.x & ((1u << p.tiles_log2) - 1u));
  c.hv = static_cast<int>(blockIdx.x >> p.tiles_log2);
  const int idx = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  int rank = idx;
  c.j = 0;
  if (p.pieces) {
    c.live = idx < p.pieces[p.N];
    rank = c.live ? p.pieces[p.N + 1 + idx] : 0;
    c.j = idx - p.pieces[rank];
  } else {
    c.live = idx < p.N;
  }
  c.map = idx - rank;
  c.n = c.live ? p.chunk_off[p.N + 2 + rank] : 0;
  seq_bounds(p.sd, c.n, c.b, c.t0, c.slen);
  const int nch = static_cast<int>((c.slen + kC - 1) / kC);
  c.sp = p.pieces ? piece_split(nch, rec_plan(p)) : PieceSplit{1, nch};
  c.ci0 = p.chunk_off[c.n];
  return c;
}

enum : int { kInitZero, kInitH0, kInitIdentity, kInitMaps };  // the state a CTA starts from
enum : int { kEndNone, kEndFinal, kEndMaps };                 // where its last state goes
// What a CTA runs: chunks c0 .. c0 + nch - 1 of its sequence, the first nwarm without output.
struct PieceRole {
  bool run;
  int c0, nch, nwarm;
  int init, end;
  bool out;  // o is written (the chunks after the warm-up)
};
// The role of column tile vt (nr: tiles of V), given the path (warm, and this piece's warm-up
// length wj); see the top of this file.
__device__ __forceinline__ PieceRole piece_role(const RecParams& p, const PieceCta& c, int nr, bool warm, int wj) {
  PieceRole r{true, 0, 0, 0, kInitZero, kEndNone, true};
  const int c0 = c.j * c.sp.len;
  const int plen = min(c.sp.len, static_cast<int>((c.slen + kC - 1) / kC) - c0);  // the piece's chunks
  const bool last = c.j == c.sp.np - 1, rt = c.vt < nr;
  r.c0 = c0;
  r.nch = plen;
  if (p.pass == 0) {
    if (c.sp.np == 1) {  // a whole sequence (also every sequence when unsplit); lean: in pass 1
      r.run = rt && !p.lean_maps;
      r.init = kInitH0;
      r.end = kEndFinal;
      return r;
    }
    if (warm || last || (!rt && c.j == 0)) { r.run = false; return r; }
    r.init = rt ? (c.j == 0 ? kInitH0 : kInitZero) : kInitIdentity;
    r.out = rt && c.j == 0;  // the transfer map's columns (v = 0: their tiles lie past v) write none
    if (p.lean_maps) r.out = false;  // piece 0's o comes from pass 1
    r.end = kEndMaps;
    return r;
  }
  // pass 1: the warm-up path's pieces (beside the exact path's, which are fewer), and the exact
  // path's pieces 1.. from the scanned states
  r.end = last ? kEndFinal : kEndNone;
  if (warm) {
    r.run = rt;
    r.init = c.j == 0 ? kInitH0 : kInitZero;
    r.nwarm = c.j == 0 ? 0 : wj;
    r.c0 = c0 - r.nwarm;
    r.nch = plen + r.nwarm;
    return r;
  }
  r.run = rt && c.j > 0;
  r.init = kInitMaps;
  if (p.lean_maps && c.j == 0) {  // piece 0 (or the whole sequence) again from h0, now with o
    r.run = rt;
    r.init = kInitH0;
  }
  return r;
}

// The scan of the exact path (between passes 0 and 1), per (sequence, value head, 8 state
// columns): S_{j+1} = M_j S_j + R_j for j = 1 .. np - 2, in place of R_j (R_0 is already S_1, the
// state after piece 0 run from h0). fp32 with a fixed summation order (bitwise deterministic).
// The chain is the np - 2 dependent steps, so a step must be short:
//   - M_j does not depend on the chain: it is copied into shared memory a step ahead (cp.async,
//     coalesced: split-9 in docs/design.md; bulk copies from one warp were slower, split-6);
//   - only S crosses the threads, through shared memory, read as broadcasts; a thread computes
//     a block of kScanRows rows, so each S load feeds kScanRows x 4 FMAs.
// Thread t holds rows t % 32 + 32 i (i < kScanRows) of M over the reduction part t / 32 (16
// indices); the 8 parts' sums meet in shared memory, where thread t adds them in order for row
// t / 2, columns 4 (t & 1) .. + 3, then R. 16 CTAs per (sequence, value head).
constexpr int kScanCols = 8;
constexpr int kScanThreads = 256;
constexpr int kScanRows = 4;                                       // rows of M per thread
constexpr int kScanParts = kScanThreads / (kDK / kScanRows);       // 8 parts of the reduction
constexpr int kScanSpan = kDK / kScanParts;                        // 16 reduction indices per thread
static_assert(kScanCols == 8 && kScanThreads == 2 * kDK, "the final sum: a thread per (row, 4 columns)");

// A scan CTA's chain: (sequence, value head, column slice), its pieces and first map; false
// (the same in every thread) when it has none: fewer than three pieces, or the warm-up path.
struct ScanCta {
  int hv, c0, np, map0;
};
__device__ __forceinline__ bool scan_cta(const RecParams& p, int* s_warm, ScanCta& sc, int cols = kScanCols) {
  const int slices = kDV / cols;
  sc.hv = static_cast<int>(blockIdx.x / slices);
  sc.c0 = static_cast<int>(blockIdx.x % slices) * cols;
  const int rank = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  if (rank >= p.N || p.chunk_off[p.N + 1]) return false;
  const int n = p.chunk_off[p.N + 2 + rank];
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const PieceSplit sp = piece_split(static_cast<int>((slen + kC - 1) / kC), rec_plan(p));
  if (sp.np < 3) return false;
  if (threadIdx.x < 32) {
    const bool w = warm_path(p, p.chunk_off[n], sc.hv, sp, threadIdx.x);
    if (threadIdx.x == 0) *s_warm = w;
  }
  __syncthreads();
  if (*s_warm) return false;
  sc.np = sp.np;
  sc.map0 = p.pieces[rank] - rank;
  return true;
}

// M_j's K x K block of a map ([R_j | M_j], rows of kMapCols) into shared memory by every
// thread's 16-byte cp.async: thread tid copies rows tid / 32 + 8 q, so a warp copies one row's
// 512 contiguous bytes (coalesced). dst(row, col) places 4 floats (the layouts pad or swizzle
// rows so that the products' reads hit distinct banks). The caller commits the group.
template <class Dst>
__device__ __forceinline__ void scan_copy_m(const float* map, Dst dst) {
  static_assert(kScanThreads == 8 * 32, "8 warps: rows w + 8 q");
  const int tid = threadIdx.x;
  const float* src = map + (tid / 32) * kMapCols + kDV + 4 * (tid % 32);
  CUTE_UNROLL
  for (int q = 0; q < kDK / 8; ++q)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst(tid / 32 + 8 * q, 4 * (tid % 32)))),
                 "l"(src + 8 * q * kMapCols)
                 : "memory");
}

// One step of the scan after M_j's part is in this thread's registers (m: rows r0 + 32 i over
// indices e0 ..): the products with S_j (sS, read as broadcasts) into sPart; after the barrier,
// row fd, columns fc .. fc + 3 of S_{j+1} = the parts' sums in order + R_j (r) into sS and dst.
// The caller's barrier must follow before sS or sPart is used again.
__device__ __forceinline__ void scan_step(const float (&m)[kScanRows][kScanSpan], float (*sS)[kScanCols],
                                          float (*sPart)[kDK][kScanCols], int r0, int part, int fd, int fc,
                                          const float4& r, float4* dst) {
  const int e0 = part * kScanSpan;
  float4 acc[kScanRows][2];
  CUTE_UNROLL
  for (int i = 0; i < kScanRows; ++i) acc[i][0] = acc[i][1] = make_float4(0.f, 0.f, 0.f, 0.f);
  CUTE_UNROLL
  for (int e = 0; e < kScanSpan; ++e) {
    const float4 s_lo = reinterpret_cast<const float4*>(sS[e0 + e])[0];  // broadcasts
    const float4 s_hi = reinterpret_cast<const float4*>(sS[e0 + e])[1];
    CUTE_UNROLL
    for (int i = 0; i < kScanRows; ++i) {
      const float me = m[i][e];
      acc[i][0].x = fmaf(me, s_lo.x, acc[i][0].x), acc[i][0].y = fmaf(me, s_lo.y, acc[i][0].y);
      acc[i][0].z = fmaf(me, s_lo.z, acc[i][0].z), acc[i][0].w = fmaf(me, s_lo.w, acc[i][0].w);
      acc[i][1].x = fmaf(me, s_hi.x, acc[i][1].x), acc[i][1].y = fmaf(me, s_hi.y, acc[i][1].y);
      acc[i][1].z = fmaf(me, s_hi.z, acc[i][1].z), acc[i][1].w = fmaf(me, s_hi.w, acc[i][1].w);
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < kScanRows; ++i) {
    float4* pd = reinterpret_cast<float4*>(sPart[part][r0 + 32 * i]);
    pd[0] = acc[i][0], pd[1] = acc[i][1];
  }
  __syncthreads();  // every part's sums are in sPart; every read of sS for this step is done
  float4 sn = reinterpret_cast<const float4*>(&sPart[0][fd][fc])[0];
  CUTE_UNROLL
  for (int q = 1; q < kScanParts; ++q) {
    const float4 v = reinterpret_cast<const float4*>(&sPart[q][fd][fc])[0];
    sn.x += v.x, sn.y += v.y, sn.z += v.z, sn.w += v.w;
  }
  sn.x += r.x, sn.y += r.y, sn.z += r.z, sn.w += r.w;
  reinterpret_cast<float4*>(&sS[fd][fc])[0] = sn;
  *dst = sn;
}

// The scan over one (sequence, value head)'s pieces, a slice of kScanCols state columns per
// CTA: S_{j+1} = M_j S_j + R_j (written over R_j). M_j is copied into padded shared memory by
// every thread's 16-byte cp.async a step ahead (split-9 in docs/design.md): a warp copies one
// row's 512 contiguous bytes, overlapped with the step before, and the products read it back
// without bank conflicts (pitch kDK + 4 floats). Loading it straight into registers instead
// cost 4096 L1 wavefronts a step (a warp's load spanned 32 rows), and ptxas sank those loads
// below the products: 3.6 against 2.2 us a step at 2/8 1x32768.
constexpr int kScanMPitch = kDK + 4;  // floats: the products' 16-byte reads hit distinct banks
constexpr size_t kScanSmem = sizeof(float) * (2 * kDK * kScanMPitch + kScanParts * kDK * kScanCols + kDK * kScanCols);
__global__ void __launch_bounds__(kScanThreads, 1) gdn_fwd_scan(const __grid_constant__ RecParams p) {
  extern __shared__ __align__(16) float scan_smem[];
  float (*sM)[kDK][kScanMPitch] = reinterpret_cast<float (*)[kDK][kScanMPitch]>(scan_smem);  // [2]: M_j, M_{j+1}
  float (*sPart)[kDK][kScanCols] = reinterpret_cast<float (*)[kDK][kScanCols]>(scan_smem + 2 * kDK * kScanMPitch);  // each part's sums
  float (*sS)[kScanCols] = reinterpret_cast<float (*)[kScanCols]>(scan_smem + 2 * kDK * kScanMPitch + kScanParts * kDK * kScanCols);  // S_j, this CTA's columns
  __shared__ int s_warm;
  ScanCta sc;
  if (!scan_cta(p, &s_warm, sc)) return;
  const int tid = threadIdx.x;
  auto map_of = [&](int j) { return map_at(p, sc.map0 + j, sc.hv); };  // [R_j | M_j], rows of kMapCols
  auto copy_m = [&](int j) {  // M_j into buffer (j - 1) & 1, rows padded to kScanMPitch floats
    scan_copy_m(map_of(j), [&](int row, int col) { return &sM[(j - 1) & 1][row][col]; });
  };
  auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
  // The products: rows r0 + 32 i of M_j over indices e0 .. e0 + kScanSpan - 1.
  const int r0 = tid % 32, part = tid / 32, e0 = part * kScanSpan;
  // The final sums: row fd, columns fc .. fc + 3 of this CTA's slice (R_j's part of them in r).
  const int fd = tid / 2, fc = 4 * (tid & 1);
  auto r_of = [&](int j) { return reinterpret_cast<float4*>(map_of(j) + fd * kMapCols + sc.c0 + fc); };
  copy_m(1);
  commit();
  if (sc.np > 3) copy_m(2);
  commit();  // (one group per step from here on, empty when nothing is left to copy)
  reinterpret_cast<float4*>(&sS[fd][fc])[0] = *r_of(0);  // S_1 = R_0
  float4 r = *r_of(1), rn = r;
  for (int j = 1; j + 1 < sc.np; ++j) {
    if (j + 2 < sc.np) rn = *r_of(j + 1);  // off the chain
    asm volatile("cp.async.wait_group 1;" ::: "memory");  // this thread's copies of M_j
    __syncthreads();  // everyone's; S_j is in sS, and sPart may be written again
    float m[kScanRows][kScanSpan];
    const int buf = (j - 1) & 1;
    CUTE_UNROLL
    for (int i = 0; i < kScanRows; ++i)
      CUTE_UNROLL
      for (int q = 0; q < kScanSpan / 4; ++q) {
        const float4 v = reinterpret_cast<const float4*>(&sM[buf][r0 + 32 * i][e0])[q];
        m[i][4 * q] = v.x, m[i][4 * q + 1] = v.y, m[i][4 * q + 2] = v.z, m[i][4 * q + 3] = v.w;
      }
    scan_step(m, sS, sPart, r0, part, fd, fc, r, r_of(j));  // S_{j+1} in place of R_j
    // scan_step's barrier: every thread has read buffer buf, which now takes M_{j+2}.
    if (j + 3 < sc.np) copy_m(j + 2);
    commit();
    r = rn;
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

#ifdef QLA_SM90_TEST_HOOKS
// The scan on the tensor cores (split-11 in docs/design.md; test builds, chosen by
// set_test_scan_mma until it has run on the device). The FMA scan's step (2.3 us at 2/8
// 1x32768) is two barriers and the 8 parts' ordered sums (ncu: 0.27 issued per cycle), and each
// of its 16 CTAs per (sequence, value head) reads all of M_j from L2 every step: 128 CTAs x 64
// KiB = 8 MiB a step at 2/8, ~1.5 us of L2 bandwidth. Here
//   - a CTA takes kScanMmaCols = 16 state columns (8 CTAs per (sequence, value head)): half the
//     L2 traffic, and 16/16's 256 CTAs of 8 columns (two rounds) become 128 (one);
//   - the products run transposed on the tensor cores, S_{j+1}^T = S_j^T M_j^T (+ R_j^T), as
//     mma.sync m16n8k8 with tf32 operands and fp32 accumulators: m = the CTA's 16 columns,
//     n = state rows (warp w owns rows 16 w .. 16 w + 15, two n8 tiles, over the whole
//     reduction: no partial sums cross warps);
//   - kTerms = 1: tf32 operands (hi hi); kTerms = 3: every operand split into tf32 hi + lo and
//     three products (hi hi, hi lo, lo hi), fp32's accuracy. bench/scan_precision.py measures
//     tf32 alone at 2e-5 to 8e-5 of the state for g = 0 at 32 to 64 pieces, 4.3e-4 at pieces of
//     one chunk (maps near the identity), against the bound's 3e-3;
//   - the reduction index is permuted (one bijection on A's columns and B's rows: the same sum
//     in another order): fragment slot t of k8 step 2 kp + h is index 16 kp + 4 t + 2 h, slot
//     t + 4 the next one, so a lane's B fragments (M_j's row, two adjacent floats) come from one
//     16-byte load of M_j (row-major in shared memory, scan_swz: bit 4 of the index flipped on
//     odd rows, which makes those loads and the copies free of bank conflicts), and S_j is kept
//     in shared memory in fragment order (scan_frag): one 16-byte load per A fragment, one
//     16-byte store per n8 tile of S_{j+1};
//   - M_j is copied two steps ahead (kScanMmaBufs buffers) and S_j is double-buffered, so one
//     barrier a step suffices.
// A fixed order of products and sums: bitwise deterministic.
constexpr int kScanMmaCols = 16;
constexpr int kScanMmaBufs = 3;  // M_j being read, M_{j+1} landing, M_{j+2} being copied
static_assert(kScanThreads / 32 * 16 == kDK, "a warp per 16 rows of S_{j+1}: two n8 tiles");
constexpr int kScanFragFloats = kScanMmaCols * kDK;  // S_j in fragment order, one buffer
constexpr size_t kScanMmaSmem = sizeof(float) * (kScanMmaBufs * kDK * kDK + 2 * kScanFragFloats);
__device__ __forceinline__ int scan_swz(int r, int x) { return r * kDK + (x ^ ((r & 1) << 4)); }
// S_j in fragment order: the 16-byte chunk of lane (g, t) for k8 step 2 kp + h holds
// S[k][g], S[k][g + 8], S[k + 1][g], S[k + 1][g + 8] (k = 16 kp + 4 t + 2 h; columns of the
// CTA's slice): the A fragment a0 .. a3. Chunks ordered (kp, h, g, t).
__device__ __forceinline__ int scan_frag(int kp, int h, int g, int t) { return 4 * (((kp * 2 + h) * 8 + g) * 4 + t); }

// x = hi + lo with hi a tf32 value (round to nearest) and lo = x - hi exactly in fp32, which the
// tensor core reads as tf32 (its low 13 bits dropped: ~2^-22 of x).
__device__ __forceinline__ uint32_t tf32_round(float x) {
  uint32_t hi;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  return hi;
}
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_round(x);
  lo = __float_as_uint(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// S_j's value as the products read it from shared memory: fp32 for three products (hi and lo
// are taken there), else rounded to tf32 once where it is written.
template <int kTerms>
__device__ __forceinline__ float scan_mma_image(float x) {
  if constexpr (kTerms == 1) return __uint_as_float(tf32_round(x));
  return x;
}

// One step's products for warp w, lane 4 g + t: acc[n] = (S_j^T M_j^T)[columns g, g + 8 of the
// slice][rows 16 w + 8 n + 2 t, + 1] in the m16n8 accumulator layout. sM: M_j (scan_swz), sF:
// S_j (scan_frag). Two accumulators per tile (h = 0, 1) halve the dependent mma chain.
template <int kTerms>
__device__ __forceinline__ void scan_mma_products(const float* sM, const float* sF, int warp, int g, int t,
                                                  float (&acc)[2][4]) {
  float part[2][2][4] = {};
  CUTE_UNROLL
  for (int kp = 0; kp < kDK / 16; ++kp) {
    float4 mv[2];  // M_j[16 w + 8 n + g][16 kp + 4 t .. + 3]
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n)
      mv[n] = *reinterpret_cast<const float4*>(sM + scan_swz(16 * warp + 8 * n + g, 16 * kp + 4 * t));
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float4 sv = *reinterpret_cast<const float4*>(sF + scan_frag(kp, h, g, t));
      const float a[4] = {sv.x, sv.y, sv.z, sv.w};
      uint32_t ah[4], al[4];
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        if constexpr (kTerms == 3) tf32_split(a[e], ah[e], al[e]);
        else ah[e] = __float_as_uint(a[e]);  // rounded where it was written
      }
      CUTE_UNROLL
      for (int n = 0; n < 2; ++n) {
        const float b[2] = {h ? mv[n].z : mv[n].x, h ? mv[n].w : mv[n].y};
        uint32_t bh[2], bl[2];
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
          if constexpr (kTerms == 3) tf32_split(b[e], bh[e], bl[e]);
          else bh[e] = tf32_round(b[e]);
        }
        if constexpr (kTerms == 3) {
          mma_tf32(part[h][n], al, bh);
          mma_tf32(part[h][n], ah, bl);
        }
        mma_tf32(part[h][n], ah, bh);
      }
    }
  }
  CUTE_UNROLL
  for (int n = 0; n < 2; ++n)
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) acc[n][e] = part[0][n][e] + part[1][n][e];
}

template <int kTerms>
__global__ void __launch_bounds__(kScanThreads, 1) gdn_fwd_scan_mma(const __grid_constant__ RecParams p) {
  static_assert(kTerms == 1 || kTerms == 3, "one or three tf32 products");
  extern __shared__ __align__(16) float scan_smem[];
  float* sM = scan_smem;                             // [kScanMmaBufs][kDK * kDK]: M_j in buffer j % kScanMmaBufs
  float* sF = scan_smem + kScanMmaBufs * kDK * kDK;  // [2][kScanFragFloats]: S_j in buffer j & 1
  __shared__ int s_warm;
  ScanCta sc;
  if (!scan_cta(p, &s_warm, sc, kScanMmaCols)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto map_of = [&](int j) { return map_at(p, sc.map0 + j, sc.hv); };  // [R_j | M_j], rows of kMapCols
  auto copy_m = [&](int j) {
    float* dst = sM + (j % kScanMmaBufs) * kDK * kDK;
    scan_copy_m(map_of(j), [&](int row, int col) { return dst + scan_swz(row, col); });
  };
  auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
  // This lane's places of S (accumulator layout): rows 16 w + 8 n + 2 t + e (e = 0, 1), columns
  // g and g + 8 of the slice. Element q of a tile: row + (q & 1), column g + 8 (q >> 1).
  const int g = lane / 4, t = lane % 4;
  auto at = [&](int j, int n, int q) {  // R_j's element (map row-major, kMapCols a row)
    return map_of(j) + (16 * warp + 8 * n + 2 * t + (q & 1)) * kMapCols + sc.c0 + g + 8 * (q >> 1);
  };
  // A tile of S into fragment order: rows 16 w + 8 n + 2 t (+ 1) are index 16 kp + 4 t' + 2 h + e
  // with kp = w, t' = 2 n + t / 2, h = t & 1: one chunk, in the order (e, column half).
  auto put_s = [&](float* frag, int n, const float (&v)[4]) {
    const float4 c = make_float4(scan_mma_image<kTerms>(v[0]), scan_mma_image<kTerms>(v[2]), scan_mma_image<kTerms>(v[1]),
                                 scan_mma_image<kTerms>(v[3]));
    *reinterpret_cast<float4*>(frag + scan_frag(warp, t & 1, g, 2 * n + t / 2)) = c;
  };
  copy_m(1);
  commit();
  if (sc.np > 3) copy_m(2);
  commit();  // (one group per step from here on, empty when nothing is left to copy)
  float rc[2][4];  // R_j at this lane's places
  CUTE_UNROLL
  for (int n = 0; n < 2; ++n) {
    float s1[4];
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) s1[q] = *at(0, n, q), rc[n][q] = *at(1, n, q);
    put_s(sF + kScanFragFloats, n, s1);  // S_1 = R_0 (step j reads buffer j & 1)
  }
  for (int j = 1; j + 1 < sc.np; ++j) {
    float rn[2][4];
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n)
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) rn[n][q] = j + 2 < sc.np ? *at(j + 1, n, q) : rc[n][q];  // off the chain
    asm volatile("cp.async.wait_group 1;" ::: "memory");  // this thread's copies of M_j
    // Everyone's copies of M_j have landed and S_j is in its buffer; every read of step j - 1
    // (M_{j-1}'s buffer, S_{j-1}'s) is done, so those buffers take M_{j+2} and S_{j+1}.
    __syncthreads();
    if (j + 2 < sc.np - 1) copy_m(j + 2);
    commit();
    float acc[2][4];
    scan_mma_products<kTerms>(sM + (j % kScanMmaBufs) * kDK * kDK, sF + (j & 1) * kScanFragFloats, warp, g, t, acc);
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      float v[4];
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        v[q] = acc[n][q] + rc[n][q];
        *at(j, n, q) = v[q];  // S_{j+1} in place of R_j
        rc[n][q] = rn[n][q];
      }
      put_s(sF + ((j + 1) & 1) * kScanFragFloats, n, v);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#endif  // QLA_SM90_TEST_HOOKS

}  // namespace
}  // namespace sm90
}  // namespace qla
