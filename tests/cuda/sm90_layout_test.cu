// Host-only check of the sm90 backward's image layouts (runs anywhere nvcc builds; no GPU):
// a V-tile-32 chain kernel stores its block of a state or -dU image with one bulk copy of its
// shared-memory operand, which is only right if the block of the global image (Lay<T>::DD_K,
// ::TokV_K) is byte-identical to that operand (RecLay<T, 32>::VD_MN, ::VTok_MN), and the
// gradients kernel's second views (DD_MN, VTok_MN) must name the same bytes. Also the sort key
// of the sequential passes' longest-first launch order (order_bucket), and the split forward's
// pieces (piece_split) against the workspace bounds computed from shapes (piece_bounds), and the
// overlapped prep's level order of chunks (level_order_chunk), the fused backward's pieces
// (fill_piece_chunks), and the rows of a TMA box as zero_box_rows sees them.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "sm90/common.cuh"
#include "sm90/fused_chunks.cuh"
#include "sm90/split_plan.cuh"

namespace {
using namespace qla::sm90;

template <class Layout, class T>
int offset(T* base, int i, int j) {
  return img_off<Layout>(base, i, j);
}

template <class T>
int count_mismatches(T* base) {
  using L = Lay<T>;
  using RL = RecLay<T, 32>;
  constexpr int kBlocks = kDV / 32;
  int bad = 0;
  for (int vt = 0; vt < kBlocks; ++vt) {
    for (int v = 0; v < 32; ++v) {
      const int col = 32 * vt + v;
      for (int d = 0; d < kDK; ++d) {
        const int img = offset<typename L::DD_K>(base, d, col);
        if (img != offset<typename L::DD_MN>(base, col, d)) ++bad;
        if (img != offset<typename RL::VD_MN>(base, v, d) + vt * (kDK * kDV / kBlocks)) ++bad;
      }
      for (int t = 0; t < kC; ++t) {
        const int img = offset<typename L::TokV_K>(base, t, col);
        if (img != offset<typename L::VTok_MN>(base, col, t)) ++bad;
        if (img != offset<typename RL::VTok_MN>(base, v, t) + vt * (kC * kDV / kBlocks)) ++bad;
      }
    }
  }
  return bad;
}

// order_bucket must never put a longer sequence before a shorter one (non-decreasing in the
// chunk count), must separate counts 1.25x apart (the launch order then runs the long chains
// first), and must stay inside the counting sort's kOrderBuckets bins for every int count.
int order_key_violations() {
  int bad = order_bucket(0) != 0 || order_bucket(-5) != 0;
  int prev = 0;
  for (int c = 1; c <= (1 << 22); ++c) {
    const int b = order_bucket(c);
    if (b < prev || b < 1 || b >= kOrderBuckets) ++bad;
    prev = b;
    const long long c125 = (5LL * c + 3) / 4;  // ceil(1.25 c)
    if (c125 <= (1 << 22) && order_bucket(static_cast<int>(c125)) <= b) ++bad;
  }
  for (int c : {(1 << 30) - 1, 1 << 30, 2147483647})
    if (order_bucket(c) >= kOrderBuckets || order_bucket(c) < order_bucket(1 << 22)) ++bad;
  return bad;
}
// piece_split: pieces cover the sequence, none empty, at most max_pieces, each at most
// piece_chunks long unless max_pieces binds; and for random calls (varlen and batched, empty and ragged sequences,
// random plans) the pieces and the pieces with transfer maps never exceed piece_bounds, which
// sizes the workspace from the shapes alone (an undersized workspace would be written past).
int piece_violations() {
  int bad = 0;
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    PiecePlan pl;
    pl.piece_chunks = 1 + static_cast<int>(rng() % (trial % 3 == 0 ? 4 : 96));
    pl.max_pieces = 1 + static_cast<int>(rng() % 64);
    const bool varlen = trial % 2 == 0;
    const int N = 1 + static_cast<int>(rng() % 40);
    std::vector<int64_t> lens(N);
    const int64_t T1 = static_cast<int64_t>(rng() % 20000);
    for (auto& l : lens) {
      const int kind = static_cast<int>(rng() % 4);
      l = !varlen ? T1 : kind == 0 ? 0 : kind == 1 ? static_cast<int64_t>(rng() % 200) : static_cast<int64_t>(rng() % 30000);
    }
    int64_t tokens = 0, chunks = 0, pieces = 0, maps = 0;
    for (int64_t l : lens) {
      const int nch = static_cast<int>((l + kC - 1) / kC);
      const PieceSplit sp = piece_split(nch, pl);
      tokens += l;
      chunks += nch;
      pieces += sp.np;
      maps += sp.np - 1;
      if (sp.np < 1 || sp.np > (nch > pl.piece_chunks ? pl.max_pieces : 1)) ++bad;
      if (nch > 0 && (sp.len < 1 || int64_t(sp.np - 1) * sp.len >= nch || int64_t(sp.np) * sp.len < nch)) ++bad;
      const bool capped = (nch + pl.piece_chunks - 1) / pl.piece_chunks > pl.max_pieces;
      if (!capped && nch > pl.piece_chunks && sp.len > pl.piece_chunks) ++bad;
    }
    // The forward's chunk bound (host_util.cuh max_chunks): T / 64 + N for varlen, exact batched.
    const int64_t chunks_bound = varlen ? tokens / kC + N : chunks;
    const PieceBounds pb = piece_bounds(N, tokens, chunks_bound, pl);
    if (chunks > chunks_bound || pieces > pb.pieces || maps > pb.maps) ++bad;
  }
  return bad;
}
// level_order_chunk: over i in [0, off[N]) a permutation of the chunks, in levels (a chunk's
// place in its sequence never decreases with i), each sequence's chunks in order; for random
// ragged calls with empty sequences. A chunk left out would leave an overlapped recurrence
// waiting on its region's flag for ever.
int level_order_violations() {
  int bad = 0;
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 3000; ++trial) {
    const int N = 1 + static_cast<int>(rng() % kLevelOrderMaxSeqs);
    std::vector<int> off(N + 1, 0), seq_of;
    for (int n = 0; n < N; ++n) {
      const int kind = static_cast<int>(rng() % 4);
      const int cnt = kind == 0 ? 0 : kind == 1 ? 1 + static_cast<int>(rng() % 3) : static_cast<int>(rng() % 600);
      off[n + 1] = off[n] + cnt;
      for (int c = 0; c < cnt; ++c) seq_of.push_back(n);
    }
    std::vector<int> seen(off[N], 0), next(N, 0);
    int level = 0;
    for (int i = 0; i < off[N]; ++i) {
      const int ci = level_order_chunk(off.data(), N, i);
      if (ci < 0 || ci >= off[N] || seen[ci]++) { ++bad; continue; }
      const int n = seq_of[ci], c = ci - off[n];
      if (c < level || c != next[n]) ++bad;
      level = c;
      next[n] = c + 1;
    }
  }
  return bad;
}
// refine_plan (split_plan.cuh: gdn_chunk_table's plan from the true lengths, within the bound
// plan that sized the grids and maps): over random calls, no sequence gets more pieces than the
// bound gave it (so the piece table and maps fit), pieces are no shorter than the bound's, the
// longest sequence gets the plan's piece count, the plan is the cheapest feasible candidate
// (ties to fewer pieces), and a split is taken only under kSplitMinGain of unsplit.
int refine_violations() {
  std::mt19937 rng(11);
  int bad = 0;
  for (int it = 0; it < 3000; ++it) {
    const int N = 2 + static_cast<int>(rng() % 40);
    const int hv = 1 << (rng() % 6);
    std::vector<int> nch(N);
    int longest = 0, total = 0;
    for (int& c : nch) {
      c = rng() % 4 == 0 ? static_cast<int>(rng() % 3) : static_cast<int>(rng() % (1 + rng() % 1024));
      longest = std::max(longest, c);
      total += c;
    }
    const PiecePlan bound{1 + static_cast<int>(rng() % 64), kMaxPiecesPerSeq};
    const bool v128 = rng() % 2;
    const double pairs = longest ? static_cast<double>(total) / longest * hv : 0.0;
    const PiecePlan r = refine_plan(bound, longest, pairs, 132, v128);
    if (r.piece_chunks != 0 && r.piece_chunks < bound.piece_chunks) ++bad;
    for (int c : nch)
      if (piece_split(c, r).np > piece_split(c, bound).np) ++bad;
    if (longest == 0) {
      if (r.piece_chunks != 0) ++bad;
      continue;
    }
    const int np = piece_split(longest, r).np;
    if (r.piece_chunks != 0 && np != r.max_pieces) ++bad;
    const double unsplit = refine_cost(longest, pairs, 132, v128, 1);
    const double cost = np > 1 ? refine_cost(longest, pairs, 132, v128, np) : unsplit;
    if (np > 1 && !(cost < kSplitMinGain * unsplit)) ++bad;
    PiecePlan cand;
    for (int k = 2; k <= kMaxPiecesPerSeq; ++k) {
      if (!refine_candidate(bound, longest, k, cand)) continue;
      const double ck = refine_cost(longest, pairs, 132, v128, k);
      if (np > 1 && (ck < cost || (ck == cost && k < np))) ++bad;         // a cheaper one was left
      if (np == 1 && ck < kSplitMinGain * unsplit) ++bad;                // a split that pays was left
    }
  }
  return bad;
}
// fill_piece_chunks (split_plan.cuh: the fused backward's pieces, on the host with the host
// lengths and in gdn_chunk_table with the true ones): over random calls of at most sms / 2
// pairs, the least piece length in [lo, longest] whose CTAs fit the SMs (against a linear scan),
// and within the bound plan {lo} that sized the grids and the workspace (no sequence gets more
// pieces than under it, the call no more than piece_bounds gives).
int fill_violations() {
  std::mt19937 rng(13);
  const int sms = 132;
  int bad = 0;
  for (int it = 0; it < 3000; ++it) {
    const int hv = 1 << (rng() % 6);
    const int N = 1 + static_cast<int>(rng() % std::max(1, sms / 2 / hv));
    std::vector<int> nch(N);
    int longest = 0, total = 0;
    for (int& c : nch) {
      c = rng() % 5 == 0 ? static_cast<int>(rng() % 3) : static_cast<int>(rng() % (1 + rng() % 1024));
      longest = std::max(longest, c);
      total += c;
    }
    const int bound_chunks = total + static_cast<int>(rng() % 64);  // the shapes' bound on the total
    const int shortest = 1 + static_cast<int>(rng() % 16);
    const int lo = std::max(shortest, (hv * bound_chunks + sms - 1) / sms);
    auto pieces_at = [&](int pc, int n) { return piece_split(nch[n], PiecePlan{pc, kMaxPiecesPerSeq}).np; };
    auto ctas = [&](int pc) {
      int64_t c = 0;
      for (int n = 0; n < N; ++n) c += pieces_at(pc, n);
      return c * hv;
    };
    const int pc = fill_piece_chunks(lo, longest, sms, ctas);
    int least = longest;  // the linear scan's answer
    for (int c = lo; c < longest; ++c)
      if (ctas(c) <= sms) { least = c; break; }
    if (pc != least) ++bad;
    if (pc >= longest) continue;  // every sequence whole
    if (pc < lo || ctas(pc) > sms) ++bad;
    const PiecePlan bound{lo, kMaxPiecesPerSeq};
    int64_t n_pieces = 0;
    for (int n = 0; n < N; ++n) {
      n_pieces += pieces_at(pc, n);
      if (pieces_at(pc, n) > piece_split(nch[n], bound).np) ++bad;
    }
    if (n_pieces > piece_bounds(N, int64_t(64) * bound_chunks, bound_chunks, bound).pieces) ++bad;
  }
  return bad;
}
}  // namespace

// zero_box_rows (common.cuh) zeroes rows len .. 63 of a TMA box as the bytes from row_bytes len
// on: in the K-major 128-byte-swizzled tiles of 64-column boxes (a K tile, Lay<T>::TokD_K, boxes
// 8 KiB apart; a V box, TokTok_K), element (row, col) must lie in bytes [128 row, 128 row + 128)
// of box col / 64; in the reverse chain's dO box (RecLay<T, 32>::VTok_MN, (v, tok), 64-byte
// swizzle), element (v, tok) in bytes [64 tok, 64 tok + 64).
template <class T>
int row_box_violations(T* base) {
  using L = Lay<T>;
  int bad = 0;
  auto in_row = [](int off_elems, int row, int col) {
    const int byte = 2 * off_elems, lo = (col / 64) * 8192 + 128 * row;
    return byte >= lo && byte < lo + 128;
  };
  for (int r = 0; r < kC; ++r) {
    for (int c = 0; c < kDK; ++c) {
      bad += !in_row(offset<typename L::TokD_K>(base, r, c), r, c);
      bad += 2 * offset<typename L::TokD_K>(base, r, c) != static_cast<int>(tokd_byte(r, c));  // the kernels' formula
    }
    for (int c = 0; c < kC; ++c) {
      bad += !in_row(offset<typename L::TokTok_K>(base, r, c), r, c);
      bad += 2 * offset<typename L::TokTok_K>(base, r, c) != static_cast<int>(tokd_byte(r, c));
    }
    for (int v = 0; v < 32; ++v) {
      const int byte = 2 * offset<typename RecLay<T, 32>::VTok_MN>(base, v, r);
      bad += byte < 64 * r || byte >= 64 * r + 64;
    }
  }
  return bad;
}
// The 128-row K-major tiles (QK_K, the reverse step's dSn'; TW_K, the forward's Tu|W): tokd_byte
// with 16 KiB boxes. TokdLane, the stmatrix / ldmatrix lane addresses of stmatrix_tokd and
// tokd_pairs: lane l of warp w at row 16 w + 8 (m & 1) + l % 8, column 8 (tb + m / 2), m = l / 8,
// for both box sizes.
int tall_tile_violations(cutlass::half_t* base) {
  int bad = 0;
  for (int r = 0; r < 128; ++r) {
    for (int c = 0; c < 128; ++c) bad += 2 * offset<QK_K>(base, r, c) != static_cast<int>(tokd_byte(r, c, 16384u));
    for (int c = 0; c < 64; ++c) bad += 2 * offset<TW_K>(base, r, c) != static_cast<int>(tokd_byte(r, c, 16384u));
  }
  for (int wt = 0; wt < 128; ++wt) {
    const int lane = wt & 31, m = lane >> 3, row = 16 * (wt >> 5) + 8 * (m & 1) + (lane & 7);
    const TokdLane ln(4096u, wt);
    for (int tb = 0; tb < 16; tb += 2) {
      bad += ln.at<8192u>(tb) != 4096u + tokd_byte(row, 8 * (tb + m / 2), 8192u);
      bad += ln.at<16384u>(tb) != 4096u + tokd_byte(row, 8 * (tb + m / 2), 16384u);
    }
  }
  return bad;
}

int main() {
  // Offsets only: any 1024-byte aligned base gives the swizzle its address bits.
  void* raw = std::aligned_alloc(1024, 1024);
  const int bf = count_mismatches(static_cast<cutlass::bfloat16_t*>(raw)) +
                 row_box_violations(static_cast<cutlass::bfloat16_t*>(raw));
  const int fp = count_mismatches(static_cast<cutlass::half_t*>(raw)) + row_box_violations(static_cast<cutlass::half_t*>(raw)) +
                 tall_tile_violations(static_cast<cutlass::half_t*>(raw));
  std::free(raw);
  const int key = order_key_violations();
  const int pcs = piece_violations();
  const int lvl = level_order_violations();
  const int ref = refine_violations();
  const int fill = fill_violations();
  std::printf("image layout mismatches: bf16 %d, fp16 %d; launch-order key violations %d; piece plan violations %d; "
              "level order violations %d; refined plan violations %d; fill plan violations %d\n", bf, fp, key, pcs, lvl,
              ref, fill);
  return bf == 0 && fp == 0 && key == 0 && pcs == 0 && lvl == 0 && ref == 0 && fill == 0 ? 0 : 1;
}
