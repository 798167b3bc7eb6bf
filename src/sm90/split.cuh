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
// The scan's copy of h0 for a split sequence (RecParams::h0_copy), by its piece 0's map index.
__device__ __forceinline__ float* h0_copy_at(const RecParams& p, int index, int hv) {
  return p.h0_copy + (static_cast<size_t>(index) * p.HV + hv) * kDK * kDV;
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
// The backward's mirror (docs/backward.md "The warm-up mirror"): the state gradient at a boundary
// comes from the chunks after it, so the reverse step's warm-up runs the fewest chunks bc ..
// bc + w - 1 (of the sequence's nch) whose gates sum to at most warm_decay from a zero gradient;
// 0 if warm_max chunks do not.
__device__ __forceinline__ int warm_chunks_after(const RecParams& p, int ci0, int hv, int bc, int nch) {
  float dec[kWarmMaxChunks];
  CUTE_UNROLL
  for (int w = 1; w <= kWarmMaxChunks; ++w)
    dec[w - 1] = w <= p.warm_max && bc + w <= nch ? chunk_log_decay(p, ci0 + bc + w - 1, hv) : 0.f;
  float s = 0.f;
  CUTE_UNROLL
  for (int w = 1; w <= kWarmMaxChunks; ++w) {
    if (w > p.warm_max || bc + w > nch) return 0;
    s += dec[w - 1];
    if (s <= p.warm_decay) return w;
  }
  return 0;
}
// Which chunks warm_path asks to decay (RecParams::warm_rule): those before every boundary (the
// forward's warm-up), those after (the reverse step's mirror), or both (the backward's states
// pass: it may warm up only where the reverse step does too, since the reverse step's exact
// path needs the transfer maps that only the states pass's exact path forms).
enum : int { kWarmBefore = 1, kWarmAfter = 2 };
// Whether (sequence, head) takes the warm-up path: every one of its np - 1 boundaries (one warp;
// nch: the sequence's chunks).
__device__ __forceinline__ bool warm_path(const RecParams& p, int ci0, int hv, PieceSplit sp, int nch, int lane) {
  bool ok = p.warm_max > 0 && p.warm_rule != 0;
  for (int j = 1 + lane; ok && j < sp.np; j += 32) {
    if (p.warm_rule & kWarmBefore) ok = warm_chunks(p, ci0, hv, j * sp.len) > 0;
    if (ok && (p.warm_rule & kWarmAfter)) ok = warm_chunks_after(p, ci0, hv, j * sp.len, nch) > 0;
  }
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

// The scan of the exact path (between passes 0 and 1): S_{j+1} = M_j S_j + R_j for
// j = 1 .. np - 2, written over R_j (R_0 is already S_1, the state after piece 0 run from h0).
// The np - 2 steps are one dependent chain, so the step must be short (split-11 in
// docs/design.md):
//   - a CTA takes kScanCols = 16 state columns of one (sequence, value head): 8 CTAs per pair;
//   - the products run transposed on the tensor cores, S_{j+1}^T = S_j^T M_j^T (+ R_j^T), as
//     mma.sync m16n8k8 with tf32 operands and fp32 accumulators: m = the CTA's 16 columns,
//     n = state rows (warp w owns rows 16 w .. 16 w + 15, two n8 tiles, over the whole
//     reduction: no partial sums cross warps, one barrier a step). M_j is rounded to tf32 where
//     pass 0 writes it, S_j where the scan writes it. tf32 operands cost 2e-5 to
//     8e-5 of the state at 32 to 64 pieces with g = 0 and 4.3e-4 at pieces of one chunk
//     (bench/scan_precision.py), against the bound's 3e-3;
//   - the reduction index is permuted (one bijection on A's columns and B's rows: the same sum
//     in another order): fragment slot t of k8 step 2 kp + h is index 16 kp + 4 t + 2 h, slot
//     t + 4 the next one, so a lane's B fragments (M_j's row, two adjacent floats) come from one
//     16-byte load of M_j, and S_j is kept in shared memory in fragment order (scan_frag): one
//     16-byte load per A fragment, one 16-byte store per n8 tile of S_{j+1};
//     bench/scan_mma_layout.py checks these layouts;
//   - each warp loads its own rows of M_j (its B fragments, 8 KiB) straight from the map into
//     registers, a step ahead (a register set for odd steps, one for even), with no copy of M
//     through shared memory (split-12: the copies' 64 KiB a step written and read back there
//     made the step 1.84 us, 1.56 without them on the H100); R_j is loaded two steps ahead
//     (its own odd and even sets: a move between sets would wait for the load).
// A fixed order of products and sums: bitwise deterministic.
constexpr int kScanCols = 16;
constexpr int kScanThreads = 256;
static_assert(kScanThreads / 32 * 16 == kDK, "a warp per 16 rows of S_{j+1}: two n8 tiles");
constexpr int kScanFragFloats = kScanCols * kDK;  // S_j in fragment order, one buffer
constexpr size_t kScanSmem = sizeof(float) * 2 * kScanFragFloats;

// Where a split sequence's initial and final states share memory (RecParams::h0_copy), the
// scan CTAs of (sequence n, value head hv) copy their 16 columns of its h0 (zeros for a
// negative pool index) for pass 1's piece 0: every path's scan CTAs, before they leave.
__device__ __forceinline__ void scan_copy_h0(const RecParams& p, int n, int hv, int c0, int map0) {
  const int64_t slot = p.h0 ? pool_slot(p.h0_pool, n) : -1;
  const int64_t hb = slot * p.sh0[0] + static_cast<int64_t>(hv) * p.sh0[1];
  float* dst = h0_copy_at(p, map0, hv);
  for (int e = threadIdx.x; e < kDK * kScanCols; e += blockDim.x) {
    const int d = e / kScanCols, v = c0 + e % kScanCols;
    dst[d * kDV + v] = slot >= 0 ? p.h0[hb + (p.vk ? v * p.sh0[2] + d : d * p.sh0[2] + v)] : 0.f;
  }
}

// A scan CTA's chain: (sequence, value head, column slice), its pieces and first map; false
// (the same in every thread) when it has none: fewer than three pieces, or the warm-up path.
struct ScanCta {
  int hv, c0, np, map0;
};
__device__ __forceinline__ bool scan_cta(const RecParams& p, int* s_warm, ScanCta& sc) {
  constexpr int slices = kDV / kScanCols;
  sc.hv = static_cast<int>(blockIdx.x / slices);
  sc.c0 = static_cast<int>(blockIdx.x % slices) * kScanCols;
  const int rank = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  if (rank >= p.N || p.chunk_off[p.N + 1]) return false;
  const int n = p.chunk_off[p.N + 2 + rank];
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const PieceSplit sp = piece_split(static_cast<int>((slen + kC - 1) / kC), rec_plan(p));
  if (sp.np > 1 && p.h0_copy) scan_copy_h0(p, n, sc.hv, sc.c0, p.pieces[rank] - rank);
  if (sp.np < 3) return false;
  if (threadIdx.x < 32) {
    const bool w = warm_path(p, p.chunk_off[n], sc.hv, sp, static_cast<int>((slen + kC - 1) / kC), threadIdx.x);
    if (threadIdx.x == 0) *s_warm = w;
  }
  __syncthreads();
  if (*s_warm) return false;
  sc.np = sp.np;
  sc.map0 = p.pieces[rank] - rank;
  return true;
}

// S_j in fragment order: the 16-byte chunk of lane (g, t) for k8 step 2 kp + h holds
// S[k][g], S[k][g + 8], S[k + 1][g], S[k + 1][g + 8] (k = 16 kp + 4 t + 2 h; columns of the
// CTA's slice): the A fragment a0 .. a3. Chunks ordered (kp, h, g, t).
__device__ __forceinline__ int scan_frag(int kp, int h, int g, int t) { return 4 * (((kp * 2 + h) * 8 + g) * 4 + t); }

// x rounded to tf32 (to nearest), as the bits the tensor core reads.
__device__ __forceinline__ uint32_t tf32_round(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One step's products for warp w, lane 4 g + t: acc[n] = (S_j^T M_j^T)[columns g, g + 8 of the
// slice][rows 16 w + 8 n + 2 t, + 1] in the m16n8 accumulator layout. m: the lane's B fragments
// (scan_load_m); sF: S_j (scan_frag, tf32 values). Two accumulators per tile (h = 0, 1) halve the
// dependent mma chain.
__device__ __forceinline__ void scan_products(const float4 (&m)[kDK / 16][2], const float* sF, int g, int t,
                                              float (&acc)[2][4]) {
  float part[2][2][4] = {};
  CUTE_UNROLL
  for (int kp = 0; kp < kDK / 16; ++kp) {
    const float4 (&mv)[2] = m[kp];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float4 sv = *reinterpret_cast<const float4*>(sF + scan_frag(kp, h, g, t));
      const uint32_t a[4] = {__float_as_uint(sv.x), __float_as_uint(sv.y), __float_as_uint(sv.z), __float_as_uint(sv.w)};
      CUTE_UNROLL
      for (int n = 0; n < 2; ++n) {
        const uint32_t b[2] = {__float_as_uint(h ? mv[n].z : mv[n].x), __float_as_uint(h ? mv[n].w : mv[n].y)};
        mma_tf32(part[h][n], a, b);
      }
    }
  }
  CUTE_UNROLL
  for (int n = 0; n < 2; ++n)
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) acc[n][e] = part[0][n][e] + part[1][n][e];
}

// A scan lane's places of S (accumulator layout): rows 16 w + 8 n + 2 t + e (e = 0, 1), columns
// g and g + 8 of the CTA's slice; element q of a tile: row + (q & 1), column g + 8 (q >> 1).
struct ScanLane {
  const RecParams& p;
  const ScanCta& sc;
  int warp, g, t;
  bool transposed;  // the backward's chain (gdn_bwd_scan): slots walked last first, M transposed
  // Step j's map slot, whose R columns it reads and overwrites: j, or np - 2 - j backward.
  __device__ __forceinline__ int slot(int j) const { return transposed ? sc.np - 2 - j : j; }
  __device__ __forceinline__ float* map_of(int j) const { return map_at(p, sc.map0 + slot(j), sc.hv); }  // [R | M]
  // Step j's M: its own slot's, or backward the next piece's (the slot after its own).
  __device__ __forceinline__ const float* m_of(int j) const { return map_at(p, sc.map0 + slot(j) + transposed, sc.hv); }
  __device__ __forceinline__ float* r_at(int j, int n, int q) const {  // R_j's element (rows of kMapCols)
    return map_of(j) + (16 * warp + 8 * n + 2 * t + (q & 1)) * kMapCols + sc.c0 + g + 8 * (q >> 1);
  }
  __device__ __forceinline__ void load_r(int j, float (&r)[2][4]) const {
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n)
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) r[n][q] = *r_at(j, n, q);
  }
  // A tile of S into fragment order, rounded to tf32 once: rows 16 w + 8 n + 2 t (+ 1) are index
  // 16 kp + 4 t' + 2 h + e with kp = w, t' = 2 n + t / 2, h = t & 1: one chunk, in the order
  // (e, column half).
  __device__ __forceinline__ void put_s(float* frag, int n, const float (&v)[4]) const {
    auto r = [](float x) { return __uint_as_float(tf32_round(x)); };
    *reinterpret_cast<float4*>(frag + scan_frag(warp, t & 1, g, 2 * n + t / 2)) = make_float4(r(v[0]), r(v[2]), r(v[1]), r(v[3]));
  }
  // S_{j+1} = acc + R_j: over R_j in the map, and in fragment order into sF_next.
  __device__ __forceinline__ void finish_step(int j, const float (&acc)[2][4], const float (&r)[2][4], float* sF_next) const {
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      float v[4];
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        v[q] = acc[n][q] + r[n][q];
        *r_at(j, n, q) = v[q];
      }
      put_s(sF_next, n, v);
    }
  }
};

// M_j's fragments are read once per SM (each CTA its own copy of the map's rows): no L1 line.
__device__ __forceinline__ float4 ld_nc_stream(const float* a) {
  float4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
               : "l"(a));
  return r;
}
// Warp w's B fragments of M_j (map: [R_j | M_j], rows of kMapCols): m[kp][n] = M_j[16 w + 8 n +
// g][16 kp + 4 t .. + 3] (tf32 values, rounded by pass 0).
__device__ __forceinline__ void scan_load_m(const float* map, int warp, int g, int t, float4 (&m)[kDK / 16][2]) {
  CUTE_UNROLL
  for (int kp = 0; kp < kDK / 16; ++kp)
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) m[kp][n] = ld_nc_stream(map + (16 * warp + 8 * n + g) * kMapCols + kDV + 16 * kp + 4 * t);
}
__device__ __forceinline__ float ld_nc_stream1(const float* a) {
  float r;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(r) : "l"(a));
  return r;
}
// The backward's B fragments, of M_j^T: m[kp][n] = M_j[16 kp + 4 t .. + 3][16 w + 8 n + g], four
// rows of one column (a warp's load covers 8 adjacent floats of 4 rows: whole 32-byte sectors).
__device__ __forceinline__ void scan_load_mt(const float* map, int warp, int g, int t, float4 (&m)[kDK / 16][2]) {
  CUTE_UNROLL
  for (int kp = 0; kp < kDK / 16; ++kp)
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      const float* c = map + (16 * kp + 4 * t) * kMapCols + kDV + 16 * warp + 8 * n + g;
      m[kp][n] = make_float4(ld_nc_stream1(c), ld_nc_stream1(c + kMapCols), ld_nc_stream1(c + 2 * kMapCols),
                             ld_nc_stream1(c + 3 * kMapCols));
    }
}
// The chain of either scan. Forward (gdn_fwd_scan): S_{j+1} = M_j S_j + R_j over slot j. Backward
// (gdn_bwd_scan, docs/backward.md "Build step 4, second half"): X_s = M_{s+1}^T X_{s+1} + D_{s+1}
// for s = np - 3 down to 0, X_s the state gradient leaving piece s, over slot s (where the reverse
// step's pass 0 left D_{s+1}; X_{np-2} is already in slot np - 2): the same chain with step j's
// slot np - 2 - j, its M the next slot's, transposed (the products compute X_s^T = X_{s+1}^T M).
template <bool kTransposed>
__device__ __forceinline__ void scan_chain(const RecParams& p) {
  extern __shared__ __align__(16) float scan_smem[];
  float* sF = scan_smem;  // [2][kScanFragFloats]: S_j in buffer j & 1
  __shared__ int s_warm;
  ScanCta sc;
  if (!scan_cta(p, &s_warm, sc)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const ScanLane ln{p, sc, warp, lane / 4, lane % 4, kTransposed};
  auto load_m = [&](const float* map, float4 (&m)[kDK / 16][2]) {
    if (kTransposed) scan_load_mt(map, warp, ln.g, ln.t, m);
    else scan_load_m(map, warp, ln.g, ln.t, m);
  };
  const int last = sc.np - 2;
  // Test builds' timing variants (RecParams::skip; 0 in the library, results then wrong): 16
  // leaves out M's loads, 32 the products.
  const bool loads = !(p.skip & 16), products = !(p.skip & 32);
  float4 m_odd[kDK / 16][2], m_even[kDK / 16][2];  // M_j of the odd and the even steps
  float r_odd[2][4], r_even[2][4];
  if (loads) load_m(ln.m_of(1), m_odd);
  {
    float s1[2][4];
    ln.load_r(0, s1);
    ln.load_r(1, r_odd);
    if (last >= 2) ln.load_r(2, r_even);
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) ln.put_s(sF + kScanFragFloats, n, s1[n]);
  }
  auto step = [&](int j, float (&r)[2][4], const float4 (&mj)[kDK / 16][2], float4 (&m_next)[kDK / 16][2]) {
    if (loads && j + 1 <= last) load_m(ln.m_of(j + 1), m_next);  // a step ahead
    __syncthreads();  // S_j is in its buffer; every read of S_{j-1}'s buffer is done
    float acc[2][4] = {};
    if (products) scan_products(mj, sF + (j & 1) * kScanFragFloats, ln.g, ln.t, acc);
    ln.finish_step(j, acc, r, sF + ((j + 1) & 1) * kScanFragFloats);
    if (j + 2 <= last) ln.load_r(j + 2, r);
  };
  for (int j = 1; j <= last; j += 2) {
    step(j, r_odd, m_odd, m_even);
    if (j + 1 <= last) step(j + 1, r_even, m_even, m_odd);
  }
}
__global__ void __launch_bounds__(kScanThreads, 1) gdn_fwd_scan(const __grid_constant__ RecParams p) { scan_chain<false>(p); }
__global__ void __launch_bounds__(kScanThreads, 1) gdn_bwd_scan(const __grid_constant__ RecParams p) { scan_chain<true>(p); }
}  // namespace
}  // namespace sm90
}  // namespace qla
