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
//   exact:   pass 0 runs piece 0 from h0 (with o) and, for the middle pieces, R (the V columns,
//            from zero) and M (K more columns: from the identity with v = 0) into `maps`; the
//            scan turns R into the state entering the next piece (S_{j+1} = M_j S_j + R_j, fp32,
//            in place); pass 1 runs pieces 1.. from those states (with o).
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
  float s = 0.f;
  for (int w = 1; w <= p.warm_max && w <= bc; ++w) {
    s += chunk_log_decay(p, ci0 + bc - w, hv);
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
  c.sp = p.pieces ? piece_split(nch, p.plan) : PieceSplit{1, nch};
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
    if (c.sp.np == 1) {  // a whole sequence (also every sequence when unsplit)
      r.run = rt;
      r.init = kInitH0;
      r.end = kEndFinal;
      return r;
    }
    if (warm || last || (!rt && c.j == 0)) { r.run = false; return r; }
    r.init = rt ? (c.j == 0 ? kInitH0 : kInitZero) : kInitIdentity;
    r.out = rt && c.j == 0;  // the transfer map's columns (v = 0: their tiles lie past v) write none
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
  return r;
}

// The scan of the exact path (between passes 0 and 1), per (sequence, value head, 8 state
// columns): S_{j+1} = M_j S_j + R_j for j = 1 .. np - 2, in place of R_j (R_0 is already S_1, the
// state after piece 0 run from h0). fp32 with a fixed summation order (bitwise deterministic).
// The chain is the np - 2 dependent steps, so a step must be short: M_j does not depend on the
// chain, so each thread loads its part of M_{j+1} (and R_{j+1}) into registers while it computes
// step j, and only S crosses the threads (shared memory, read as broadcasts). Thread t holds row
// d = t % 128 of M over the half h = t / 128 of the reduction; the two halves' sums meet in
// shared memory (half 0 adds half 1's, then R). 16 CTAs per (sequence, value head) each read all
// of M_j per step from L2 (64 KiB: about the step's compute at 8 columns).
constexpr int kScanCols = 8;
constexpr int kScanThreads = 256;
constexpr int kScanHalf = kDK / 2;  // reduction indices per thread
__global__ void __launch_bounds__(kScanThreads, 1) gdn_fwd_scan(const __grid_constant__ RecParams p) {
  __shared__ __align__(16) float sS[kDK][kScanCols];  // the state entering piece j (this CTA's columns)
  __shared__ __align__(16) float sPart[kDK][kScanCols];  // half 1's sums
  __shared__ int s_warm;
  const int tid = threadIdx.x;
  constexpr int kSlices = kDV / kScanCols;
  const int cs = static_cast<int>(blockIdx.x % kSlices), hv = static_cast<int>(blockIdx.x / kSlices);
  const int rank = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  if (rank >= p.N || p.chunk_off[p.N + 1]) return;
  const int n = p.chunk_off[p.N + 2 + rank];
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const PieceSplit sp = piece_split(static_cast<int>((slen + kC - 1) / kC), p.plan);
  if (sp.np < 3) return;
  const int ci0 = p.chunk_off[n];
  if (tid < 32) {
    const bool w = warm_path(p, ci0, hv, sp, tid);
    if (tid == 0) s_warm = w;
  }
  __syncthreads();
  if (s_warm) return;
  const int map0 = p.pieces[rank] - rank;
  const int d = tid % kDK, h = tid / kDK, c0 = cs * kScanCols;
  auto row_of = [&](int j) { return map_at(p, map0 + j, hv) + d * kMapCols; };  // row d of [R_j | M_j]
  // M_j's row d, this thread's half of the reduction, and (half 0) R_j's row d, this CTA's columns.
  float m[kScanHalf], mn[kScanHalf];
  float4 r[2], rn[2];
  auto load_m = [&](int j, float* dst) {
    const float4* src = reinterpret_cast<const float4*>(row_of(j) + kDV + h * kScanHalf);
    CUTE_UNROLL
    for (int i = 0; i < kScanHalf / 4; ++i) {
      const float4 v = src[i];
      dst[4 * i] = v.x, dst[4 * i + 1] = v.y, dst[4 * i + 2] = v.z, dst[4 * i + 3] = v.w;
    }
  };
  auto load_r = [&](int j, float4* dst) {
    const float4* src = reinterpret_cast<const float4*>(row_of(j) + c0);
    dst[0] = src[0], dst[1] = src[1];
  };
  if (h == 0) {  // S_1 = R_0
    float4 s0[2];
    load_r(0, s0);
    reinterpret_cast<float4*>(sS[d])[0] = s0[0];
    reinterpret_cast<float4*>(sS[d])[1] = s0[1];
    load_r(1, r);
  }
  load_m(1, m);
  __syncthreads();
  for (int j = 1; j + 1 < sp.np; ++j) {
    const bool more = j + 2 < sp.np;
    if (more) {  // the next step's operands, off the chain
      load_m(j + 1, mn);
      if (h == 0) load_r(j + 1, rn);
    }
    float acc[kScanCols] = {};
    CUTE_UNROLL
    for (int e = 0; e < kScanHalf; ++e) {
      const float4 s_lo = reinterpret_cast<const float4*>(sS[h * kScanHalf + e])[0];
      const float4 s_hi = reinterpret_cast<const float4*>(sS[h * kScanHalf + e])[1];
      const float sv[kScanCols] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
      CUTE_UNROLL
      for (int c = 0; c < kScanCols; ++c) acc[c] = fmaf(m[e], sv[c], acc[c]);
    }
    if (h == 1) {
      reinterpret_cast<float4*>(sPart[d])[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      reinterpret_cast<float4*>(sPart[d])[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    __syncthreads();  // half 1's sums are in sPart; every read of sS for this step is done
    if (h == 0) {
      const float4 q_lo = reinterpret_cast<const float4*>(sPart[d])[0];
      const float4 q_hi = reinterpret_cast<const float4*>(sPart[d])[1];
      const float4 s_lo = make_float4((acc[0] + q_lo.x) + r[0].x, (acc[1] + q_lo.y) + r[0].y, (acc[2] + q_lo.z) + r[0].z,
                                      (acc[3] + q_lo.w) + r[0].w);
      const float4 s_hi = make_float4((acc[4] + q_hi.x) + r[1].x, (acc[5] + q_hi.y) + r[1].y, (acc[6] + q_hi.z) + r[1].z,
                                      (acc[7] + q_hi.w) + r[1].w);
      reinterpret_cast<float4*>(sS[d])[0] = s_lo;
      reinterpret_cast<float4*>(sS[d])[1] = s_hi;
      float4* dst = reinterpret_cast<float4*>(row_of(j) + c0);  // S_{j+1} in place of R_j
      dst[0] = s_lo, dst[1] = s_hi;
      r[0] = rn[0], r[1] = rn[1];
    }
    CUTE_UNROLL
    for (int e = 0; e < kScanHalf; ++e) m[e] = mn[e];
    __syncthreads();  // S_{j+1} is in sS; sPart may be written again
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
