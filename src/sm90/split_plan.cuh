// The sequence-splitting plan's cost model (docs/split.md), host and device: forward_choice
// (gdn_fwd_sm90.cu) plans from it, and with device-only cu_seqlens gdn_chunk_table (prep.cuh)
// refines that plan from the true lengths (refine_plan). bench/split_cost_model.py reads the
// constants below from this file (calibration and check against the harness's --split --bench).
#pragma once

#include <cmath>

#include "common.cuh"

namespace qla {
namespace sm90 {

// The cost model (microseconds) counts the fused recurrence's chunk steps on the longest
// sequence (V tile 64; unsplit also 128, split pass 1 64 or 128), one CTA per SM, with a step
// time that grows with the CTAs in flight (their loads share L2 and HBM): 2.0 us alone, 3.0 us
// on every SM; each wave pays the pipeline's fill and the state's load and store (about 3
// steps). Which heads take the warm-up path is known on the device only; the model assumes a
// quarter take the exact path (the benchmark's share of g = 0 heads): pass 0 then runs their
// piece 0 (V columns) and middle pieces (V + K columns), pass 1 every piece beside the warm-up
// path's pieces, each with its warm-up of about 5 chunks. Calibrated on the H200 with the
// few-pair rows of tests/cuda/sm90_forward_test.cu --split --bench (bench/results/h200.md).
constexpr int kMaxPiecesPerSeq = 64;
constexpr double kStepUs = 2.0, kStepLoadedUs = 1.0;  // chunk step: kStepUs + kStepLoadedUs (CTAs / SMs)^2
constexpr double kWaveSteps = 3.0;                     // a wave's fill and state traffic, in steps
constexpr double kScanStepUs = 2.5;                    // one step of the scan (split-9: 2.3 us measured)
constexpr double kPassUs = 10.0;                       // the scan and pass 1 launches
constexpr double kExactShare = 0.25;                   // heads assumed to take the exact path
constexpr int kWarmChunksTypical = 5;
// Split calls run pass 0 on the lean kernel at V tile 64 and pass 1 at V tile 64 or 128 (half
// the CTAs, a longer step), whichever the model prefers. The step scales as fitted (split-7,
// split-8 in docs/design.md) by `bench/split_cost_model.py --plan` on the kept kernels'
// --split --bench, every forced piece count at both pass-1 tiles: the plan then picks the
// measured best option on every mixed-gate row but one (regret 1.002).
constexpr double kLeanStepScale = 0.7;
constexpr double kStep128Scale = 1.35;
// A split is taken when the model puts it under kSplitMinGain of the unsplit forward: the
// gains it predicts on the calibration rows are within 0.02-0.05 of the measured ones, and
// closer calls (two pieces of 48 or 64 long pairs, which fill the SMs unsplit) are unmeasured.
constexpr double kSplitMinGain = 0.93;

// One pass: whole waves for equal pieces; the unsplit pass counts its waves as a fraction (its
// pairs are a length-weighted count, its longest sequences' CTAs run in the first wave and the
// shorter ones fill in; whole waves there split 16/64 at 28672+4096 into 2 pieces: 1.80 ms
// against 1.48 unsplit, split-3).
__host__ __device__ inline double split_pass_cost(double ctas, double steps, bool fractional, double step_scale,
                                                  int sms) {
  if (ctas <= 0) return 0.0;
  const double waves = fractional ? fmax(1.0, ctas / sms) : ceil(ctas / sms);
  const double active = fmin(ctas, static_cast<double>(sms)) / sms;
  return waves * (steps + kWaveSteps) * step_scale * (kStepUs + kStepLoadedUs * active * active);
}
// pairs: (sequence, value head) pairs, length-weighted by the longest sequence's chunks.
__host__ __device__ inline double split_cost(double pairs, int64_t longest, int np, int sms, bool pass1_v128 = false) {
  // Unsplit at the cheaper V tile (fused_v_tile_128 takes 128 once 64 needs more than a wave):
  // against V tile 64 alone, the lean pass and pass 1 at 128 split 128 pairs of 128 chunks
  // (16/32 at 8192x4: 0.70 ms against 0.57 unsplit, 2026-12-04).
  const double L = static_cast<double>(longest);
  if (np <= 1) return fmin(split_pass_cost(2.0 * pairs, L, true, 1.0, sms), split_pass_cost(pairs, L, true, kStep128Scale, sms));
  const double len = static_cast<double>((longest + np - 1) / np);
  const double exact = kExactShare * pairs;
  const double tiles1 = pass1_v128 ? 1 : 2;  // pass 1's CTAs per (piece, value head)
  // Pass 0: the exact path's piece 0 (V columns) and middle pieces (V + K columns); pass 1 every
  // piece (the exact path's piece 0 again, with o), the warm-up path's with their warm-ups.
  return split_pass_cost(exact * (2 + 4 * (np - 2)), len, false, kLeanStepScale, sms) +
         split_pass_cost(pairs * tiles1 * np, len + kWarmChunksTypical, false, pass1_v128 ? kStep128Scale : 1.0, sms) +
         (np - 2) * kScanStepUs + kPassUs;
}

// Device-only cu_seqlens: forward_choice plans for sequences of the mean length (the finest
// plan the lengths allow: the longest is at least the mean), which sizes the grids and the
// maps; gdn_chunk_table then knows the lengths and refines it. Candidate np for the longest
// sequence (longest chunks, pairs weighted by it): its pieces no shorter than the bound's,
// at most its max_pieces, so no sequence gets more pieces than the bound gave it; np = 1
// unsplit. pass1_v128 stays the host's (it sets pass 1's grid).
__host__ __device__ inline bool refine_candidate(const PiecePlan& bound, int longest, int np, PiecePlan& plan) {
  if (np <= 1) {
    plan = PiecePlan{};
    return true;
  }
  if (np > longest || np > bound.max_pieces) return false;
  const int pc = (longest + np - 1) / np;
  if (pc < bound.piece_chunks) return false;
  plan = PiecePlan{pc, np};
  return piece_split(longest, plan).np == np;  // (pieces of pc chunks: np of them, none empty)
}
__host__ __device__ inline double refine_cost(int longest, double pairs, int sms, bool pass1_v128, int np) {
  return split_cost(pairs, longest, np, sms, pass1_v128);
}
// The refined plan (host reference of gdn_chunk_table's parallel search; the same order of
// candidates and ties: the lowest cost, then the fewest pieces).
__host__ __device__ inline PiecePlan refine_plan(const PiecePlan& bound, int longest, double pairs, int sms,
                                                 bool pass1_v128) {
  PiecePlan best{}, cand{};
  if (longest <= 0) return best;
  const double unsplit = refine_cost(longest, pairs, sms, pass1_v128, 1);
  double best_cost = unsplit;
  for (int np = 2; np <= kMaxPiecesPerSeq; ++np) {
    if (!refine_candidate(bound, longest, np, cand)) continue;
    const double c = refine_cost(longest, pairs, sms, pass1_v128, np);
    if (c < best_cost) best_cost = c, best = cand;
  }
  return best_cost < kSplitMinGain * unsplit ? best : PiecePlan{};
}

// The fused backward's pieces (step_choice in gdn_fwd_sm90.cu; with device-only lengths
// gdn_chunk_table, from the true ones). Its reverse step takes ~15-20 us a chunk on one SM, so
// a call's time is its longest piece's chain as long as every piece's CTA has an SM: the plan is
// the shortest piece length pc in [lo, longest] whose pieces (piece_split of each sequence,
// times the value heads) fit within cap (the SMs); longest when none does. ctas(pc) counts them;
// it does not grow with pc (piece_split's np = ceil(n / ceil(n / min(ceil(n / pc), max)))), so
// a bisection finds the least. lo: the shortest piece allowed, at least the bound that sized the
// workspace (ceil(HV chunks / sms): the pieces number at least chunks / pc).
template <class Ctas>
__host__ __device__ inline int fill_piece_chunks(int lo, int longest, int64_t cap, Ctas ctas) {
  if (lo >= longest || ctas(lo) <= cap) return lo < longest ? lo : longest;
  int a = lo, b = longest;  // ctas(a) > cap; b fits or is the fallback
  while (b - a > 1) {
    const int m = a + (b - a) / 2;
    if (ctas(m) <= cap) b = m;
    else a = m;
  }
  return b;
}

}  // namespace sm90
}  // namespace qla
