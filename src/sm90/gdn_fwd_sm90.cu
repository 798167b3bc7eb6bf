// sm90 (Hopper, sm_90a) forward backend of the Gated DeltaNet chunked prefill. Two forwards,
// chosen per call by forward_choice() (the shape alone); both run three launches on p.stream with no
// host synchronisation (graph-capturable):
// The fused forward (docs/fused.md; >= 20 (sequence, value head) pairs):
//   1. gdn_chunk_table: per-sequence chunk offsets (prefix sum of ceil(len/64)) and the check of
//                       the device cu_seqlens, on device.
//   2. gdn_fwd_inverse<T> (inverse.cuh): chunk-parallel, per (chunk, value head): gamma, K K^T,
//                       Tu = (I + L)^-1 diag(beta) as an fp16 image and the gates, 9 KiB.
//   3. gdn_fwd_chunks<T, 1 or 2> (fused_chunks.cuh): per (sequence, value head, V tile of 64 or
//                       128), chunks in order: the state S^T in registers, Q K^T, the five
//                       products in fp16 single pass with per-row power-of-two units, o.
// The two-pass forward (fewer pairs, until sequences are split):
//   2. gdn_prep<T>:     chunk-parallel, persistent, one warpgroup per (chunk, value head) region:
//                       gamma, K K^T, Q K^T, Tm = (I+L)^-1, and the wgmma-ready operand images.
//   3. the recurrence:  sequential over chunks per (sequence, value head, V tile of 32 or 64):
//                       U = u - w S, O = diag(scale e^gamma) Q S + A U,
//                       S = e^Gamma S + K^T diag(e^(Gamma-gamma)) U (all wgmma), with the
//                       operands that are not exact inputs (Tm, A, S, U, X) split into 16-bit
//                       hi + lo parts except w.
// This file holds the host side (checks, workspace layout, tensor maps, the launch decisions);
// the kernels are in common.cuh (layouts, PTX helpers), prep.cuh, inverse.cuh, recurrence.cuh
// and fused_chunks.cuh. It also holds the fused backward's host side (launch_backward, which
// gdn_bwd_sm90.cu dispatches to), beside the forward kernels its states pass runs; its own
// kernels are in fused_step.cuh (the reverse step, with the split passes' helpers of
// fused_reverse.cuh), split.cuh (gdn_bwd_scan) and bwd_finish.cuh. See src/sm90/README.md for
// the design and budgets.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include "../backends.h"
#include "../core/validate.h"  // forward_states_overlap
#include "common.cuh"
#include "prep.cuh"
#include "inverse.cuh"
#include "recurrence.cuh"
#include "fused_chunks.cuh"
#include "split.cuh"
#include "split_plan.cuh"
#include "host_util.cuh"
#include "fused_step.cuh"     // the fused backward's reverse step (chain and gradients in one CTA)
#include "bwd_finish.cuh"     // the backward's dq, dk group sums

namespace qla {
namespace sm90 {
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------
#ifdef QLA_SM90_TEST_HOOKS
int g_test_stages = 3;   // test builds only: bit 1 = table + prep, bit 2 = recurrence (timing)
int g_test_overlap = -1;   // test builds only: 0/1 forces the overlapped prep (-1: auto)
int g_test_fused = 0;      // test builds only: 64 / 128 forces the fused forward at that V tile, -1 the two-pass one (0: auto)
int g_test_inv_group = 0;  // test builds only: the inverse kernel's value heads per item, -1 the key head's all (0: auto)
int g_test_fused_skip = 0;  // test builds only: RecParams::skip of the fused recurrence (timing variants)
int g_test_fused_overlap = 0;  // test builds only: 1 runs the fused recurrence beside the inverse kernel (ready flags)
int g_test_reverse_maps_ready = 0;  // test builds only: the reverse step's table, regions and maps left by a states pass
int g_test_pass1_vt = 0;  // test builds only: 64 / 128 sets a split call's pass-1 V tile and the states pass's (0: the plan's)
#endif

// The inverse kernel's value heads per work item (inverse_group in inverse.cuh).
int inverse_group_for(int64_t nregions, int G, int sms) {
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_inv_group < 0) return G;
  if (g_test_inv_group > 0 && G % g_test_inv_group == 0) return g_test_inv_group;
#endif
  return inverse_group(nregions, G, sms);
}

// The sequences in chunks as the plan sees them: from the host lengths when given, the longest
// and the total; else the bound T for the longest (total 0: unknown).
struct ChunkCounts {
  int64_t longest = 0, total = 0;
};
ChunkCounts chunk_counts(const GdnForwardParams& p) {
  ChunkCounts c;
  if (!(p.cu_seqlens.data && p.cu_seqlens_host)) {
    c.longest = (p.shape.seqlen + kC - 1) / kC;
    return c;
  }
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const int64_t chunks = (p.cu_seqlens_host[n + 1] - p.cu_seqlens_host[n] + kC - 1) / kC;
    c.longest = std::max(c.longest, chunks);
    c.total += chunks;
  }
  return c;
}

// Which forward runs (the one place that decides, with forward_choice below). The fused forward
// (inverse kernel + fused recurrence, docs/fused.md) once there are at least kFusedMinPairs
// (sequence, value head) pairs, or whenever splitting is forced on; sequences of at least
// kFusedMinChunks chunks take it when the cost model splits them (split.cuh): 2/8 at 1x4096
// (64 chunks) 0.094 against the two-pass 0.131 ms, 4096+4096 0.122 against 0.133, 4/16 at
// 1x4096 0.119 against 0.130, 2/8 at 1x32768 0.282 against 0.860 (2026-12-04); at 32 chunks
// (1x2048) the model keeps the sequence whole and the two-pass forward is faster (0.076 against
// the fused 0.083). Below that (few pairs of short sequences) the two-pass forward's V tile 32
// with the prep beside it is faster. The pair threshold lies between the grid's 16 and 24 pairs
// (the harness's --short-bench, 2026-12-01): at 16 pairs of 32 chunks the two-pass forward is
// faster (16/16 at 1x2048: 0.082 against 0.090, 2026-12-04), at 24 pairs the fused one wins
// (8/24 at 1x2048: 0.095 against 0.115). batch_invariant calls take the fused forward
// always (the choice would depend on the rest of the batch). fp16 inputs take it at any size
// unless q, k are declared unit-norm: the two-pass forward's fp16 operand images overflow for
// keys far from unit norm (|k| ~ 2^9: o error 1.4e-2), the fused forward scales them; and so
// they do for a scale outside [kFp16ScaleMin, kFp16ScaleMax] (host_util.cuh), which the two-pass
// forward folds into its fp16 score images; the fused forward applies scale to o alone, in
// fp32. Depends on the params and the host lengths (cu_seqlens_host) when
// given, never on device data, so a workspace query with the same params agrees with the launch.
constexpr int64_t kFusedMinPairs = 20;
constexpr int64_t kFusedMinChunks = 64;
enum class Path { kTwoPass, kFused, kFusedIfSplit };
Path path_rule(const GdnForwardParams& p) {
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_fused) return g_test_fused > 0 ? Path::kFused : Path::kTwoPass;
  if (g_test_overlap >= 0 || g_test_stages != 3) return Path::kTwoPass;  // two-pass options
#endif
  if (p.q.dtype == DType::kFloat16 &&
      (!p.qk_l2_normalized || !fp16_scale_in_window(p.scale)))
    return Path::kFused;
  if (p.split == SplitMode::kOn || p.batch_invariant) return Path::kFused;
  if (num_seqs(p) * p.shape.num_v_heads >= kFusedMinPairs) return Path::kFused;
  if (p.split == SplitMode::kAuto && chunk_counts(p).longest >= kFusedMinChunks) return Path::kFusedIfSplit;
  return Path::kTwoPass;
}

// Sequence splitting (split.cuh, docs/split.md), decided from the params and the host lengths
// when given (so a workspace query with the same params agrees with the launch): the piece plan
// and a bound on the pieces of the whole call (0: unsplit), by the cost model of split_plan.cuh. Without host lengths the plan is made for
// sequences of the mean length and refined on the device (gdn_chunk_table, refine_plan).
constexpr int kInvariantPieceChunks = 64;  // batch_invariant's pieces: 4096 tokens
// Below kFusedMinPairs the two-pass forward takes about 0.87 of the unsplit fused time (2/8 at
// 1x2048 0.91, 1x4096 0.92, 1x8192 0.85; 4/16 at 1x4096 0.87; 16/16 at 1x2048 0.87): a split
// must beat that to be taken there (4/16 at 1x4096 splits into 4 pieces at 0.91 of unsplit: not).
constexpr double kTwoPassShare = 0.87;
struct SplitChoice {
  bool fused = false;      // the fused forward (else the two-pass one)
  bool pass1_vt128 = false;  // a split call's pass 1 at V tile 128 (pass 0 runs lean at 64)
  bool device_plan = false;  // plan refined by gdn_chunk_table (device-only lengths)
  bool fill = false;  // the fused backward's plan (step_choice): its pieces' CTAs within the SMs
  PiecePlan plan;
  int64_t max_pieces = 0;  // over all sequences; 0: unsplit
  int64_t max_maps = 0;    // pieces followed by another of their sequence (split.cuh, map_at)
};
// fused_only: the plan of the fused backward's states pass and reverse step, which have no
// two-pass alternative: the split model's alone, without the forward's two-pass rules (which
// keep few pairs of sequences under kFusedMinChunks whole, and split the others only below
// kTwoPassShare of the unsplit cost).
SplitChoice forward_choice(const GdnForwardParams& p, int sms, bool fused_only = false) {
  SplitChoice sc;
  const Path path = fused_only ? Path::kFused : path_rule(p);
  if (path == Path::kTwoPass) return sc;
  sc.fused = path == Path::kFused;
  if (p.split == SplitMode::kOff) return sc;
  const int64_t N = num_seqs(p);
  const ChunkCounts counts = chunk_counts(p);
  const int64_t longest = counts.longest;  // device cu_seqlens alone: a bound
  if (longest < 2) return sc;
  // The (sequence, value head) pairs as the model counts them: every pair as long as the
  // longest sequence, unless the host lengths say otherwise; then each sequence by its share of
  // the longest chain (a short sequence is cut into few pieces or none and adds few CTAs:
  // counted whole, 28672 + 4096 tokens at 16/16 looked like 32 full pairs, and the model kept
  // the sequence whole, 1.04 ms against 0.66 split).
  const double pairs = static_cast<double>(counts.total ? counts.total / static_cast<double>(longest) : N) *
                       p.shape.num_v_heads;
  int best = 1;
  if ((p.split == SplitMode::kOn && p.split_chunks > 0) || p.batch_invariant) {
    // A plan from the caller, or for batch invariance one that no other sequence or head can
    // change (piece_split applies it to each sequence's own length).
    sc.plan.piece_chunks = p.split_chunks > 0 ? p.split_chunks : kInvariantPieceChunks;
    sc.plan.max_pieces = kMaxPiecesPerSeq;
    // Pass 1's tile by the model for the longest sequence's pieces (either tile gives the same
    // bits, so batch_invariant may take either).
    const int np = piece_split(static_cast<int>(std::min<int64_t>(longest, INT32_MAX)), sc.plan).np;
    sc.pass1_vt128 = np > 1 && split_cost(pairs, longest, np, sms, true) < split_cost(pairs, longest, np, sms, false);
  } else {
    // Device-only lengths of several sequences: the plan for sequences of the mean length (the
    // longest is at least that), any number of pieces per sequence; gdn_chunk_table refines it
    // from the true lengths (refine_plan), within the grids and maps it sizes.
    sc.device_plan = p.cu_seqlens.data && !p.cu_seqlens_host && N > 1 &&
                     p.split == SplitMode::kAuto;
    const int64_t model_longest = sc.device_plan ? (longest + N - 1) / N : longest;
    const double unsplit = split_cost(pairs, model_longest, 1, sms);
    double best_cost = unsplit;
    for (int np = 2; np <= kMaxPiecesPerSeq && np <= model_longest; ++np) {
      for (bool v128 : {false, true}) {
        const double c = split_cost(pairs, model_longest, np, sms, v128);
        if (c < best_cost || (p.split == SplitMode::kOn && best == 1)) best_cost = c, best = np, sc.pass1_vt128 = v128;
      }
    }
    if (best == 1 || (p.split == SplitMode::kAuto && best_cost >= kSplitMinGain * unsplit) ||
        (path == Path::kFusedIfSplit && best_cost >= kTwoPassShare * unsplit)) {
      sc.device_plan = false;
      return sc;
    }
    sc.fused = true;
    sc.plan.piece_chunks = static_cast<int>((model_longest + best - 1) / best);
    sc.plan.max_pieces = sc.device_plan ? kMaxPiecesPerSeq : best;
  }
  if (longest <= sc.plan.piece_chunks) {  // every sequence whole
    sc.plan = PiecePlan{};
    sc.device_plan = false;
    return sc;
  }
  // The maps then take at most 1/8 of v's bytes with pieces of 64 chunks (batch_invariant),
  // however many short sequences the call holds (piece_bounds, common.cuh).
  const int64_t tokens = p.cu_seqlens.data ? p.shape.seqlen : p.shape.batch * p.shape.seqlen;
  const PieceBounds pb = piece_bounds(N, tokens, max_chunks(p), sc.plan);
  sc.max_pieces = pb.pieces;
  sc.max_maps = pb.maps;
  return sc;
}

struct WsLayout {
  size_t table = 0, places = 0, ready = 0, pieces = 0, plan = 0, regions = 0, maps = 0, h0_copy = 0, total = 0;
  bool copy_h0 = false;  // split, with initial and final states in shared memory (RecParams::h0_copy)
};
WsLayout ws_layout(const GdnForwardParams& p, const SplitChoice& sc) {
  auto up = [](size_t x) { return (x + 1023) & ~size_t(1023); };
  const size_t N = static_cast<size_t>(num_seqs(p));
  const size_t mc = static_cast<size_t>(max_chunks(p));
  const size_t HV = static_cast<size_t>(p.shape.num_v_heads);
  const size_t np = static_cast<size_t>(sc.max_pieces);
  WsLayout w;
  w.table = 0;
  w.places = up(4 * chunk_table_ints(N));  // after the chunk table; an int2 per chunk (the inverse kernel's)
  w.ready = w.places + up(8 * mc);  // one int per (chunk, value head)
  w.pieces = w.ready + up(4 * mc * HV);
  w.plan = w.pieces + (np ? up(4 * piece_table_ints(N, np)) : 0);  // the refined plan (2 ints)
  w.regions = w.plan + (sc.device_plan ? up(8) : 0);
  w.maps = w.regions + up(mc * HV * (sc.fused ? kInvRegionBytes : kRegionBytes));
  const size_t maps = static_cast<size_t>(sc.max_maps) * HV * kDK * kMapCols * 4;
  w.copy_h0 = sc.max_pieces > 0 && forward_states_overlap(p);
  w.h0_copy = w.maps + up(maps);
  w.total = w.copy_h0 ? w.h0_copy + static_cast<size_t>(sc.max_maps) * HV * kDK * kDV * 4 : w.maps + maps;
  return w;
}
WsLayout ws_layout(const GdnForwardParams& p) {
  DeviceInfo* dinfo = nullptr;
  const int sms = device_info(&dinfo).ok() ? dinfo->sms : 132;
  return ws_layout(p, forward_choice(p, sms));
}

// The one-time work of a first call, per device and dtype: opt in to more than 48 KiB of
// shared memory, which also loads each kernel (with lazy module loading, a kernel's first
// attribute call or launch loads it; gdn_chunk_table needs no opt-in and is loaded by a query).
template <class T>
Status prepare_kernels(DeviceInfo* dinfo) {
  const int dt = std::is_same_v<T, cutlass::bfloat16_t> ? 0 : 1;
  if (__atomic_load_n(&dinfo->smem_ready[dt], __ATOMIC_ACQUIRE)) return Status::Ok();
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_prep<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kPrepSmem),
               "cudaFuncSetAttribute(gdn_prep)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur_ws<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecWsCfg::kSmem),
               "cudaFuncSetAttribute(gdn_recur_ws)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_inverse<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kInvSmem),
               "cudaFuncSetAttribute(gdn_fwd_inverse)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_inverse<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kInvSmemTm),
               "cudaFuncSetAttribute(gdn_fwd_inverse<T'>)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_chunks<T, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FusedCfg<1>::kSmem),
               "cudaFuncSetAttribute(gdn_fwd_chunks<1>)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_chunks<T, 2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FusedCfg<2>::kSmem),
               "cudaFuncSetAttribute(gdn_fwd_chunks<2>)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_chunks<T, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FusedCfg<1>::kSmem),
               "cudaFuncSetAttribute(gdn_fwd_chunks<1, lean>)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_chunks<T, 2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)FusedCfg<2>::kSmem),
               "cudaFuncSetAttribute(gdn_fwd_chunks<2, lean>)");
  // The fused backward's (its states pass runs the kernels above).
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_bwd_fused_step<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)StepCfg::kSmem),
               "cudaFuncSetAttribute(gdn_bwd_fused_step)");
  cudaFuncAttributes attr;
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_bwd_finish<T>), "cudaFuncGetAttributes(gdn_bwd_finish)");
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_chunk_table), "cudaFuncGetAttributes(gdn_chunk_table)");
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_fwd_scan), "cudaFuncGetAttributes(gdn_fwd_scan)");
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_bwd_scan), "cudaFuncGetAttributes(gdn_bwd_scan)");
  __atomic_store_n(&dinfo->smem_ready[dt], true, __ATOMIC_RELEASE);
  return Status::Ok();
}

// A state pool's indices for the kernels (PoolIndex, common.cuh).
PoolIndex pool_index(const TensorRef& idx, int64_t slots) {
  PoolIndex pi;
  pi.idx = idx.data;
  pi.is64 = idx.dtype == DType::kInt64;
  pi.slots = slots;
  return pi;
}

// The recurrence kernels' arguments common to every launch (sequences, states, o, heads).
RecParams rec_params(const GdnForwardParams& p, const CUtensorMap& tmq, const CUtensorMap& tmk, const SeqDesc& sd,
                     const int* table, const void* regions) {
  RecParams rp{};
  rp.tmq = tmq;
  rp.tmk = tmk;
  rp.sd = sd;
  rp.chunk_off = table;
  rp.regions = regions;
  rp.h0 = static_cast<const float*>(p.initial_state.data);
  rp.hT = static_cast<float*>(p.final_state.data);
  for (int i = 0; i < 3; ++i) { rp.sh0[i] = p.initial_state.stride[i]; rp.shT[i] = p.final_state.stride[i]; rp.so[i] = p.o.stride[i]; }
  rp.vk = p.state_layout == StateLayout::kVK;
  rp.h0_pool = pool_index(p.initial_state_indices, p.initial_state_slots);
  rp.hT_pool = pool_index(p.final_state_indices, p.final_state_slots);
  rp.o = p.o.data;
  rp.N = static_cast<int>(num_seqs(p));
  rp.H = static_cast<int>(p.shape.num_qk_heads);
  rp.HV = static_cast<int>(p.shape.num_v_heads);
  return rp;
}

// Launches kernel<<<grid, block, smem, stream>>>(args); with `dependent`, as a programmatic
// dependent launch: its CTAs may be placed (and their launch latency paid) while the previous
// kernel on the stream finishes, on the SMs that kernel leaves free, and the kernel calls
// wait_for_previous_kernels() before it reads their outputs (common.cuh). Captured in CUDA
// graphs as a programmatic edge.
template <class Kernel, class... Args>
cudaError_t launch_kernel(bool dependent, Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          const Args&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// The fused recurrence's V tile: 128 (two math warpgroups sharing every load; a chunk step
// ~1.5x V tile 64's) once V tile 64 would need more than one wave of CTAs (16/32 at 8192x4:
// 0.68 against 0.78 ms), else 64 (twice the CTAs for the few-pair rows). A varlen call of fewer
// than four sequences keeps 64 unless the host lengths show sequences of about one length: a
// long sequence beside short ones sets the time by its chain, which V tile 64 shortens (16/64
// at 1024+7168: 0.43 against 0.52 ms), while sequences of one length fill the SMs as a batch
// (16/64 at 16384+16384: 1.01 against 1.27 ms).
bool fused_v_tile_128(const GdnForwardParams& p, int64_t N, int64_t HV, int sms) {
  if (2 * N * HV <= sms) return false;
  if (!p.cu_seqlens.data || N >= 4) return true;
  if (!p.cu_seqlens_host) return false;
  const ChunkCounts c = chunk_counts(p);
  return 5 * c.total >= 4 * N * c.longest;  // the mean length at least 0.8 of the longest
}

// The backward's states pass (docs/backward.md section 10) runs the forward's launch with these
// set: the lean kernel in every pass (no o), storing each chunk's entering state as the image S'
// (RecParams::grad_simg, kSImgBytes per region), split as the forward splits, on the warm-up
// path only where the chunks both before and after every boundary decay (elsewhere the exact
// path: the reverse step's exact path needs every piece's map); tm, when set, takes the inverse
// kernel's T' images (its backward instantiation).
struct StatesPass {
  void* tm = nullptr;
  void* simg = nullptr;  // the reverse step's state images (RecParams::grad_simg)
};

// The fused forward (docs/fused.md): the chunk table, the inverse kernel into `regions`
// (kInvRegionBytes each), then the fused recurrence, in stream order; the V tile by
// fused_v_tile_128. With `states`, the backward's states pass instead (StatesPass).
template <class T>
Status launch_fused(const GdnForwardParams& p, const SplitChoice& sc, const WsLayout& wl, const CUtensorMap& tmq,
                    const CUtensorMap& tmk, const SeqDesc& sd, int sms, const StatesPass* states = nullptr,
                    const CUtensorMap* tmv_made = nullptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int N = static_cast<int>(num_seqs(p));
  const int HV = static_cast<int>(p.shape.num_v_heads);
  const int64_t nregions = max_chunks(p) * HV;
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  int* table = reinterpret_cast<int*>(ws + wl.table);
  int* pieces = sc.max_pieces ? reinterpret_cast<int*>(ws + wl.pieces) : nullptr;
  void* regions = ws + wl.regions;
  // Dependent launches (launch_kernel) only where the inverse kernel leaves SMs free
  // for the recurrence's CTAs to wait on: there they hide the launch latencies of a short call.
  // With the inverse kernel on every SM no recurrence CTA can be placed early, so nothing is
  // gained (fused-16 in docs/design.md: the wide rows' 1-2% cost stayed with them off).
  int inv_group = 1;
  unsigned inv_grid = 0;
  if (nregions > 0) {
    inv_group = inverse_group_for(nregions, HV / static_cast<int>(p.shape.num_qk_heads), sms);
    inv_grid = inverse_grid(nregions, inv_group, sms);
  }
  const bool dependent = inv_grid < static_cast<unsigned>(sms);
  int* ready = nullptr;  // test builds, overlapped variant: per-region flags (the table kernel clears them)
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_fused_overlap && dependent && !sc.max_pieces && nregions > 0) ready = reinterpret_cast<int*>(ws + wl.ready);
#endif
  int2* places = reinterpret_cast<int2*>(ws + wl.places);
  DevicePlan dp;
  if (sc.device_plan) {
    dp.out = reinterpret_cast<int*>(ws + wl.plan);
    dp.hv = HV;
    dp.sms = sms;
    dp.pass1_v128 = sc.pass1_vt128;
    dp.fill = sc.fill;
  }
  gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table, ready, ready ? nregions : 0, sc.plan, pieces, places, dp,
                                          pool_index(p.initial_state_indices, p.initial_state_slots),
                                          pool_index(p.final_state_indices, p.final_state_slots));
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");
  CUtensorMap tmv;  // (v's map, unless the caller made it: the backward's)
  Status s = Status::Ok();
  if (tmv_made) tmv = *tmv_made;
  else s = make_tile_map(&tmv, p.v, p.shape.num_v_heads, p.shape);
  if (!s.ok()) return s;
  if (nregions > 0) {
    PrepParams pp = chunk_params(p, sd, N, table);
    pp.places = places;
    if (p.qk_l2_normalized) pp.q = nullptr;  // unit rows: the inverse kernel skips q's norms (eq = 0)
    pp.tmk = tmk;
    pp.regions = regions;
    set_inverse_items(pp, inv_group);
    pp.ready = ready;  // (then launched in stream order: the recurrence beside it reads the chunk table)
    const bool with_tm = states && states->tm;  // the backward instantiation, which also stores T'
    pp.tm = with_tm ? states->tm : nullptr;
    QLA_CUDA_TRY(launch_kernel(dependent && !ready, with_tm ? gdn_fwd_inverse<T, true> : gdn_fwd_inverse<T>,
                               dim3(inv_grid), dim3(128 * kInvWarpgroups), with_tm ? kInvSmemTm : kInvSmem, stream, pp),
                 "launch gdn_fwd_inverse");
  }
  RecParams rp = rec_params(p, tmq, tmk, sd, table, regions);
  rp.tmv = tmv;
#ifdef QLA_SM90_TEST_HOOKS
  rp.skip = g_test_fused_skip;
  rp.ready = ready;
#endif
  rp.scale = static_cast<float>(p.scale);
  if (states) {
    rp.o = nullptr;
    rp.grad_simg = states->simg;
  }
  bool vt128 = fused_v_tile_128(p, N, HV, sms);
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_fused > 0) vt128 = g_test_fused == 128;
#endif
  const int slots = static_cast<int>(sc.max_pieces ? sc.max_pieces : N);
  if (sc.max_pieces) {
    rp.pieces = pieces;
    rp.plan = sc.plan;
    rp.maps = reinterpret_cast<float*>(ws + wl.maps);
    if (wl.copy_h0) rp.h0_copy = reinterpret_cast<float*>(ws + wl.h0_copy);
    rp.warm_decay = kWarmLogDecay;
    rp.warm_max = kWarmMaxChunks;
    // The states pass warms up only where the reverse step's mirror does too (split.cuh): the
    // reverse step's exact path needs this pass's transfer maps.
    rp.warm_rule = states ? kWarmBefore | kWarmAfter : kWarmBefore;
    rp.lean_maps = 1;
    rp.plan_dev = dp.out;
  }
  // Pass 0 (every forward): whole sequences; or, split, the lean kernel at V tile 64 for the
  // transfer maps (V + K columns) and the first pieces, writing no o; then the scan and pass 1
  // (split.cuh) at the plan's V tile: the warm-up pieces, the exact path's pieces from the
  // scanned states, piece 0 and the whole sequences. Pass 0 may follow the inverse kernel as a
  // dependent launch (its CTAs then wait on the SMs the inverse kernel leaves free); pass 1
  // follows the scan in stream order.
  auto chunks = [&](bool v128, bool lean) -> Status {
    // Column tiles per value head: V's (1 at V tile 128, 2 at 64), and as many for K's columns
    // in a split call's pass 0 (the transfer maps).
    const int tiles = (v128 ? 1 : 2) * (rp.pass == 0 && sc.max_pieces ? 2 : 1);
    rp.tiles_log2 = tiles == 4 ? 2 : tiles == 2 ? 1 : 0;
    const dim3 grid = seq_grid(slots, HV, tiles);
    const bool dep = dependent && rp.pass == 0;
    if (v128)
      QLA_CUDA_TRY(launch_kernel(dep, lean ? gdn_fwd_chunks<T, 2, true> : gdn_fwd_chunks<T, 2, false>, grid,
                                 dim3(FusedCfg<2>::kThreads), FusedCfg<2>::kSmem, stream, rp),
                   "launch gdn_fwd_chunks");
    else
      QLA_CUDA_TRY(launch_kernel(dep, lean ? gdn_fwd_chunks<T, 1, true> : gdn_fwd_chunks<T, 1, false>, grid,
                                 dim3(FusedCfg<1>::kThreads), FusedCfg<1>::kSmem, stream, rp),
                   "launch gdn_fwd_chunks");
    return Status::Ok();
  };
  // The states pass's chunks from their entering states (pass 1, or the one pass unsplit): at V
  // tile 128 where V tile 64's two CTAs per piece and value head would not fit one wave of the
  // SMs (the backward's plan keeps its pieces x value heads within one), else at V tile 64. The
  // lean step is bound by what a CTA's math warpgroups share (the producer's loads, the aux's
  // conversion: bwd-55 in docs/design.md), which at 64 two CTAs repeat for the same chunk. The
  // pieces: the bound less one per sequence (piece_bounds: N + chunks / piece_chunks), exact for
  // equal pieces; the fused backward's own plan keeps them within sms / HV (step_choice).
  int64_t states_pieces = sc.max_pieces ? std::max<int64_t>(1, sc.max_pieces - N) : N;
  if (sc.fill) states_pieces = std::min<int64_t>(states_pieces, sms / HV);
  bool states_vt128 = 2 * states_pieces * HV > sms;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_pass1_vt) states_vt128 = g_test_pass1_vt == 128;
#endif
  rp.pass = 0;
  if (!sc.max_pieces) return states ? chunks(states_vt128, true) : chunks(vt128, false);
  s = chunks(false, true);
  if (!s.ok()) return s;
  gdn_fwd_scan<<<seq_grid(N, HV, kDV / kScanCols), kScanThreads, kScanSmem, stream>>>(rp);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_fwd_scan");
  rp.pass = 1;
  // The passes differ in V tile where the plan says so: the maps hold true units by state
  // column, whatever tile wrote them (test builds may force pass 1's tile).
  bool vt128_pass1 = sc.pass1_vt128;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_pass1_vt) vt128_pass1 = g_test_pass1_vt == 128;
#endif
  return states ? chunks(states_vt128, true) : chunks(vt128_pass1, false);
}

// sc, wl: the split plan and workspace layout, made once per call by forward().
template <class T>
Status launch(const GdnForwardParams& p, const SplitChoice& sc, const WsLayout& wl) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  const int N = static_cast<int>(num_seqs(p));
  const int HV = static_cast<int>(p.shape.num_v_heads);
  const int64_t mc = max_chunks(p);
  if (N == 0) return Status::Ok();

  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (ds.ok()) ds = prepare_kernels<T>(dinfo);
  if (!ds.ok()) return ds;

  // Tensor maps of q and k (shared by prep and recurrence); v's is made for prep below.
  CUtensorMap tmq, tmk;
  Status ms = make_tile_map(&tmq, p.q, p.shape.num_qk_heads, p.shape);
  if (ms.ok()) ms = make_tile_map(&tmk, p.k, p.shape.num_qk_heads, p.shape);
  if (!ms.ok()) return ms;

  const SeqDesc sd = seq_desc(p);
  int* table = reinterpret_cast<int*>(ws + wl.table);
  if (sc.fused) return launch_fused<T>(p, sc, wl, tmq, tmk, sd, dinfo->sms);

  // The two-pass forward.
  int stages = 3;
#ifdef QLA_SM90_TEST_HOOKS
  stages = g_test_stages;
#endif
  // The recurrence at V tile 32 (4 CTAs per sequence and head, warp-specialized kernel): this
  // forward serves fewer than kFusedMinPairs pairs, at most 80 CTAs, where the sequential chunk
  // loop is latency-bound and a narrow tile cuts its per-chunk work. (Its V-tile-64 kernel, faster
  // only for many equal sequences, went once the fused forward took those.)
  const int64_t rec_ctas = static_cast<int64_t>(N) * HV * (kDV / kWsVT);
  // Overlapped mode: when the recurrence takes at most half the SMs, the prep runs beside it on
  // the others (the recurrence is launched as its programmatic dependent and waits per region
  // on a ready flag) instead of before it. Without programmatic launch the two kernels simply
  // run in order, and every flag is already set.
  bool overlap = 2 * rec_ctas <= dinfo->sms;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_overlap >= 0) overlap = g_test_overlap && rec_ctas < dinfo->sms;
#endif
  // No chunks (T = 0 without cu_seqlens): no prep either, so a programmatic launch would make the
  // recurrence a dependent of the chunk table, which allows it to start at once (it reads the
  // table before it is written); it follows the table in stream order instead.
  if (mc == 0) overlap = false;
  int* ready = reinterpret_cast<int*>(ws + wl.ready);
  const int64_t nregions = mc * HV;

  if (stages & 1) {
    gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table, overlap ? ready : nullptr, overlap ? nregions : 0, PiecePlan{},
                                            nullptr, nullptr, DevicePlan{},
                                            pool_index(p.initial_state_indices, p.initial_state_slots),
                                            pool_index(p.final_state_indices, p.final_state_slots));
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");

    if (mc > 0) {
      PrepParams pp = chunk_params(p, sd, N, table);
      pp.tmq = tmq;
      pp.tmk = tmk;
      Status ms = make_tile_map(&pp.tmv, p.v, p.shape.num_v_heads, p.shape);
      if (!ms.ok()) return ms;
      pp.regions = ws + wl.regions;
      pp.ready = overlap ? ready : nullptr;
      // Persistent: one CTA (two warpgroups) per SM, or per SM the recurrence leaves free.
      const int64_t want = overlap ? dinfo->sms - rec_ctas : dinfo->sms;
      const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, (nregions + 1) / 2)));
      gdn_prep<T><<<grid, 256, kPrepSmem, stream>>>(pp);
      QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_prep");
    }
  }
  if (!(stages & 2)) return Status::Ok();

  RecParams rp = rec_params(p, tmq, tmk, sd, table, ws + wl.regions);
  rp.ready = overlap ? ready : nullptr;
  // Longest sequence first (seq_cta); overlapped: beside the prep, polling its ready flags.
  QLA_CUDA_TRY(launch_kernel(overlap, gdn_recur_ws<T>, seq_grid(N, HV, kDV / kWsVT), dim3(288), RecWsCfg::kSmem,
                             stream, rp),
               "launch gdn_recur_ws");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// The fused backward (docs/backward.md section 10), here beside the forward's kernels it runs.
// Three steps on p.stream, no host synchronisation (graph-capturable):
//   1. the states pass: the forward's launch with a StatesPass (chunk table, the inverse kernel
//      with the T' images, the lean kernel storing each chunk's entering state as the image S'),
//      split as the forward splits (its warm-up path only where the reverse step's is taken
//      too, its exact path with every piece's transfer map elsewhere);
//   2. the reverse step (fused_step.cuh): each (sequence, value head) from d(final state) back
//      to d(initial state), forming every gradient of each chunk it leaves; split, per (sequence,
//      value head): the warm-up mirror where the chunks after every boundary decay (one pass,
//      each piece from its warm-up), else the exact path: pass 0 (pieces 1 .. np - 1 alone),
//      gdn_bwd_scan (the gradient crossing the pieces by the transposed maps), pass 1 (every
//      piece, with the gradients);
//   3. gdn_bwd_finish (bwd_finish.cuh): dq, dk summed over each value-head group from the
//      step's per-value-head partials, and NaN in every output on malformed device cu_seqlens.
//      No partials where a group is one value head (the step writes dq, dk in place) or two:
//      gdn_bwd_zero_dqk zeroes dq, dk first and the step adds each value head's part in
//      (RecParams::dqk_add: two additions onto zero commute, so the bits are those of the
//      finish's sum whichever CTA comes first), without the partials' round trip (at 8/16
//      1x32768 ~670 MB of traffic less ~270) or their workspace.
// Workspace: the forward's layout for its plan, then T' (8 KiB) and S' (kSImgBytes) per (chunk,
// value head), and with groups of more than two value heads the dq, dk partials (input type,
// 2 x 256 bytes per token and value head).
// ---------------------------------------------------------------------------------------------

// The states pass's forward params (no o, no final state).
GdnForwardParams states_params(const GdnBackwardParams& b) {
  GdnForwardParams f;
  f.shape = b.shape;
  f.q = b.q;
  f.k = b.k;
  f.v = b.v;
  f.g = b.g;
  f.beta = b.beta;
  f.initial_state = b.initial_state;
  f.cu_seqlens = b.cu_seqlens;
  f.num_seqs = b.num_seqs;
  f.cu_seqlens_host = b.cu_seqlens_host;
  f.o.dtype = b.q.dtype;
  f.scale = b.scale;
  f.state_layout = b.state_layout;
  f.split = b.split;
  f.split_chunks = b.split_chunks;
  f.batch_invariant = b.batch_invariant;  // (the plan per sequence, each path from the sequence's own gates)
  f.device = b.device;
  f.stream = b.stream;
  f.workspace = b.workspace;
  f.workspace_bytes = b.workspace_bytes;
  return f;
}

struct BwdLayout {
  SplitChoice sc;  // the split model's plan for the fused kernels (forward_choice, fused_only)
  WsLayout fwd;    // its workspace, at the start
  size_t tm = 0, simg = 0, dqp = 0, dkp = 0, total = 0;
  bool partials = false;  // dq, dk per value head into dqp, dkp (groups of more than two value heads)
  bool dqk_add = false;   // two value heads a key head: the step adds dq, dk into the caller's (RecParams::dqk_add)
};
// The fused backward's pieces. Its reverse step takes ~15-20 us a chunk on one SM, about ten
// times the forward's chunk, so the forward's plan, which weighs the forward's costs, left SMs
// idle where the sequences are few or uneven (bwd-54 in docs/design.md: 2/4 at 8192 tokens in
// four sequences 3.9x the chunked backward). Instead, unless the call brings a plan (split on
// with split_chunks, batch_invariant) or turns splitting off, and while the (sequence, value
// head) pairs fill at most half the SMs (beyond, the forward's plan): the shortest pieces whose
// CTAs all fit in one wave of the SMs (fill_piece_chunks in split_plan.cuh), so that no CTA
// waits for another's SM and the longest piece's chain is as short as the SMs allow:
//   lengths known on the host (a batch of rows, one sequence, or cu_seqlens_host): that plan;
//   device-only lengths: the bound pc >= ceil(HV chunks / sms) (the pieces number at least
//     chunks / pc) sizes the grids and the workspace, and gdn_chunk_table makes the plan from
//     the true lengths (DevicePlan::fill). Until the forty-ninth session this case took pc =
//     ceil(HV chunks / (sms - pairs)), a bound for any lengths made on the host: at 64 pairs of
//     four 8192-token sequences pieces of 121 and 7 chunks instead of 64 (bwd-66).
// No piece shorter than kStepMinPieceChunks (each adds a warm-up or a transfer map and a scan
// step: bwd-54 measured 8 against 16 and 32); sequences no longer than a piece stay whole.
constexpr int kStepMinPieceChunks = 8;
#ifdef QLA_SM90_TEST_HOOKS
int g_test_step_min_piece = 0;  // test builds: > 0 the shortest piece, -1 the forward's plan
#endif
SplitChoice step_choice(const GdnForwardParams& f, int sms) {
  const int64_t N = num_seqs(f), HV = f.shape.num_v_heads, pairs = N * HV;
  if (f.split != SplitMode::kAuto || f.batch_invariant || pairs == 0 || 2 * pairs > sms)
    return forward_choice(f, sms, /*fused_only=*/true);
  int shortest = kStepMinPieceChunks;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_step_min_piece < 0) return forward_choice(f, sms, true);
  if (g_test_step_min_piece > 0) shortest = g_test_step_min_piece;
#endif
  GdnForwardParams g = f;
  const ChunkCounts counts = chunk_counts(f);
  const int longest = static_cast<int>(std::min<int64_t>(counts.longest, INT32_MAX));
  const bool device_lengths = f.cu_seqlens.data && !f.cu_seqlens_host && N > 1;
  int64_t pc = 0;
  if (device_lengths) {
    pc = std::max<int64_t>(shortest, (HV * max_chunks(f) + sms - 1) / sms);
  } else {
    // The host's lengths (chunks): sequence n's, or every row's.
    auto chunks_of = [&](int64_t n) {
      return f.cu_seqlens.data && f.cu_seqlens_host ? static_cast<int>((f.cu_seqlens_host[n + 1] - f.cu_seqlens_host[n] + kC - 1) / kC) : longest;
    };
    pc = fill_piece_chunks(shortest, longest, sms, [&](int c) {
      const PiecePlan pl{c, kMaxPiecesPerSeq};
      int64_t n_pieces = 0;
      for (int64_t n = 0; n < N; ++n) n_pieces += piece_split(chunks_of(n), pl).np;
      return n_pieces * HV;
    });
  }
  g.split = counts.longest <= pc ? SplitMode::kOff : SplitMode::kOn;
  g.split_chunks = g.split == SplitMode::kOn ? static_cast<int>(pc) : 0;
  SplitChoice sc = forward_choice(g, sms, /*fused_only=*/true);
  sc.fill = sc.max_pieces > 0;
  sc.device_plan = sc.fill && device_lengths;
  return sc;
}

#ifdef QLA_SM90_TEST_HOOKS
int g_test_dqk_partials = 0;  // test builds: 1 keeps pairs of value heads on the partials and the finish's sums
#endif
BwdLayout bwd_layout(const GdnForwardParams& f, int sms) {
  auto up = [](size_t x) { return (x + 1023) & ~size_t(1023); };
  BwdLayout l;
  l.sc = step_choice(f, sms);
  l.fwd = ws_layout(f, l.sc);
  const size_t nreg = static_cast<size_t>(max_chunks(f)) * static_cast<size_t>(f.shape.num_v_heads);
  const size_t part = static_cast<size_t>(f.shape.batch) * static_cast<size_t>(f.shape.seqlen) *
                      static_cast<size_t>(f.shape.num_v_heads) * kDK * 2;
  l.dqk_add = f.shape.num_v_heads == 2 * f.shape.num_qk_heads;
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_dqk_partials) l.dqk_add = false;
#endif
  l.partials = f.shape.num_v_heads != f.shape.num_qk_heads && !l.dqk_add;
  l.tm = up(l.fwd.total);
  l.simg = l.tm + up(nreg * kImgTokTok * 2);
  l.dqp = l.simg + up(nreg * kSImgBytes);
  l.dkp = l.dqp + (l.partials ? up(part) : 0);
  l.total = l.dkp + (l.partials ? part : 0);
  return l;
}

// The backward's four tensor maps (q, k, v, dO), encoded once per call and shared by its launches.
struct BwdMaps {
  CUtensorMap q, k, v, d_o;
};
Status make_bwd_maps(const GdnForwardParams& f, const TensorRef& d_o, BwdMaps& m) {
  Status s = make_tile_map(&m.q, f.q, f.shape.num_qk_heads, f.shape);
  if (s.ok()) s = make_tile_map(&m.k, f.k, f.shape.num_qk_heads, f.shape);
  if (s.ok()) s = make_tile_map(&m.v, f.v, f.shape.num_v_heads, f.shape);
  if (s.ok()) s = make_tile_map(&m.d_o, d_o, f.shape.num_v_heads, f.shape);
  return s;
}

// The reverse passes of the fused backward's reverse step: unsplit, one launch; split (the
// forward's plan), pass 0 (pieces 1 .. np - 1 alone, into the map slots), the transposed scan
// (gdn_bwd_scan) and pass 1 (every piece from the gradient leaving it). The warm-up mirror where
// the chunks after every boundary decay (split.cuh); the exact path elsewhere.
// launch(rp, what) launches the kernel on rp (rp.pieces null: unsplit; rp.pass).
template <class Launch>
Status run_reverse_passes(RecParams rp, const SplitChoice& sc, const WsLayout& wl, const GdnForwardParams& f, Launch launch) {
  rp.pass = 0;
  if (!sc.max_pieces) return launch(rp, "");
  uint8_t* ws = static_cast<uint8_t*>(f.workspace);
  const int N = static_cast<int>(num_seqs(f)), HV = static_cast<int>(f.shape.num_v_heads);
  rp.pieces = reinterpret_cast<int*>(ws + wl.pieces);
  rp.plan = sc.plan;
  rp.maps = reinterpret_cast<float*>(ws + wl.maps);
  rp.plan_dev = sc.device_plan ? reinterpret_cast<int*>(ws + wl.plan) : nullptr;
  rp.warm_decay = kWarmLogDecay;
  rp.warm_max = kWarmMaxChunks;
  rp.warm_rule = kWarmAfter;
  Status s = launch(rp, " (pass 0)");
  if (!s.ok()) return s;
  gdn_bwd_scan<<<seq_grid(N, HV, kDV / kScanCols), kScanThreads, kScanSmem, static_cast<cudaStream_t>(f.stream)>>>(rp);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_scan");
  rp.pass = 1;
  return launch(rp, " (pass 1)");
}

// The reverse step's params after the states pass: the chunk table, regions and (split) maps in
// wl's places; q, k, v's tensor maps; dht (null: zero) in, dh0 (null: not written) out, in
// f.state_layout.
RecParams reverse_params(const GdnForwardParams& f, const WsLayout& wl, const CUtensorMap& tmq, const CUtensorMap& tmk,
                         const CUtensorMap& tmv, const TensorRef& dht, const MutTensorRef& dh0) {
  uint8_t* ws = static_cast<uint8_t*>(f.workspace);
  RecParams rp = rec_params(f, tmq, tmk, seq_desc(f), reinterpret_cast<int*>(ws + wl.table), ws + wl.regions);
  rp.tmv = tmv;
  rp.scale = static_cast<float>(f.scale);
  rp.o = nullptr;
  rp.h0 = static_cast<const float*>(dht.data);
  rp.hT = static_cast<float*>(dh0.data);
  for (int i = 0; i < 3; ++i) { rp.sh0[i] = dht.stride[i]; rp.shT[i] = dh0.stride[i]; }
  rp.h0_pool = rp.hT_pool = PoolIndex{};
  return rp;
}

// Step 2: the reverse step (fused_step.cuh) in those passes: d(initial state) and dv (written
// in the pass that runs whole pieces) out; simg: the states pass's S' images (kSImgBytes per region); dq per value head; with dk set,
// dk per value head and dbeta too (and dg with dg set), from the T' images tm (8 KiB per region).
template <class T>
Status launch_fused_step(const GdnForwardParams& f, const SplitChoice& sc, const WsLayout& wl, const BwdMaps& maps,
                         const TensorRef& dht, const MutTensorRef& dh0, const MutTensorRef& dv, const void* simg,
                         const MutTensorRef& dq, const MutTensorRef* dk, const MutTensorRef* dbeta, const void* tm,
                         const MutTensorRef* dg, bool dqk_add = false) {
  RecParams rp = reverse_params(f, wl, maps.q, maps.k, maps.v, dht, dh0);
  rp.tmdo = maps.d_o;
  rp.o = dv.data;
  rp.dq = dq.data;
  rp.grad_simg = const_cast<void*>(simg);
  for (int i = 0; i < 3; ++i) { rp.so[i] = dv.stride[i]; rp.sdq[i] = dq.stride[i]; }
  if (dk && dk->data && dbeta && dbeta->data && tm && dq.data && simg) {
    rp.dk = dk->data;
    rp.dbeta = dbeta->data;
    rp.db_dt = static_cast<int>(dbeta->dtype);
    rp.beta = f.beta.data;
    rp.b_dt = static_cast<int>(f.beta.dtype);
    rp.grad_tm = tm;
    for (int i = 0; i < 3; ++i) rp.sdk[i] = dk->stride[i];
    for (int i = 0; i < 2; ++i) {
      rp.sdb[i] = dbeta->stride[i];
      rp.sb[i] = f.beta.stride[i];
    }
    if (dg && dg->data) {
      rp.dg = dg->data;
      rp.dg_dt = static_cast<int>(dg->dtype);
      for (int i = 0; i < 2; ++i) rp.sdg[i] = dg->stride[i];
    }
  }
  // Full chunks of dq and dv by bulk tensor stores where the layout allows a tensor map.
  // (dq, dk added in: per key head, RecParams::dqk_add.)
  auto store_map = [&](const MutTensorRef& m, CUtensorMap* map, int64_t heads) {
    TensorRef t;
    t.data = m.data;
    t.dtype = m.dtype;
    for (int i = 0; i < 3; ++i) t.stride[i] = m.stride[i];
    return m.data && make_tile_map(map, t, heads, f.shape).ok() ? 1 : 0;
  };
  rp.dqk_add = dqk_add ? 1 : 0;
  const int64_t dqk_heads = dqk_add ? f.shape.num_qk_heads : f.shape.num_v_heads;
  rp.dq_tma = store_map(dq, &rp.tmdq, dqk_heads);
  rp.dv_tma = store_map(dv, &rp.tmdv, f.shape.num_v_heads);
  rp.dk_tma = rp.dk ? store_map(*dk, &rp.tmdk, dqk_heads) : 0;
  rp.tiles_log2 = 0;  // one V tile of 128 per value head
  cudaStream_t stream = static_cast<cudaStream_t>(f.stream);
  const int N = static_cast<int>(num_seqs(f)), HV = static_cast<int>(f.shape.num_v_heads);
  const dim3 grid = seq_grid(static_cast<int>(sc.max_pieces ? sc.max_pieces : N), HV, 1);
  return run_reverse_passes(rp, sc, wl, f, [&](const RecParams& q, const char* what) {
    gdn_bwd_fused_step<T><<<grid, StepCfg::kThreads, StepCfg::kSmem, stream>>>(q);
    QLA_CUDA_TRY(cudaGetLastError(), (std::string("launch gdn_bwd_fused_step") + what).c_str());
    return Status::Ok();
  });
}

// The three steps, with the plan and layout fused_backward made (once per call: the eager path
// encodes four tensor maps and plans once).
template <class T>
Status launch_backward(const GdnBackwardParams& b, const GdnForwardParams& f, const BwdLayout& bl, DeviceInfo* dinfo) {
  if (num_seqs(f) == 0) return Status::Ok();
  Status s = prepare_kernels<T>(dinfo);
  if (!s.ok()) return s;
  BwdMaps maps;
  s = make_bwd_maps(f, b.d_o, maps);
  if (!s.ok()) return s;
  uint8_t* ws = static_cast<uint8_t*>(f.workspace);
  StatesPass sp;
  sp.tm = ws + bl.tm;
  sp.simg = ws + bl.simg;
  cudaStream_t stream = static_cast<cudaStream_t>(f.stream);
  FinishParams fp{};
  fp.dqp = ws + bl.dqp;
  fp.dkp = ws + bl.dkp;
  fp.partial_bytes = bl.partials ? 2 : 0;
  fp.dq = b.dq.data;
  fp.dk = b.dk.data;
  fp.dq_vec16 = rows_vec16(b.dq);
  fp.dk_vec16 = rows_vec16(b.dk);
  for (int i = 0; i < 3; ++i) {
    fp.sdq[i] = b.dq.stride[i], fp.sdk[i] = b.dk.stride[i], fp.sdv[i] = b.dv.stride[i];
    fp.sdh0[i] = b.d_initial_state.stride[i];
  }
  fp.B = f.shape.batch;
  fp.T = f.shape.seqlen;
  fp.H = static_cast<int>(f.shape.num_qk_heads), fp.HV = static_cast<int>(f.shape.num_v_heads);
  fp.N = static_cast<int>(num_seqs(f));
  fp.chunk_off = reinterpret_cast<const int*>(ws + bl.fwd.table);
  fp.dv = b.dv.data;
  fp.dg = b.dg.data;
  fp.dbeta = b.dbeta.data;
  for (int i = 0; i < 2; ++i) fp.sdg[i] = b.dg.stride[i], fp.sdb[i] = b.dbeta.stride[i];
  fp.dg_dt = static_cast<int>(b.dg.dtype);
  fp.db_dt = static_cast<int>(b.dbeta.dtype);
  fp.dh0 = static_cast<float*>(b.d_initial_state.data);
  const int64_t work = std::max<int64_t>(f.shape.batch * f.shape.seqlen * f.shape.num_qk_heads * (kDK / 8), 1);
  const unsigned fgrid = static_cast<unsigned>(std::min<int64_t>((work + 255) / 256, int64_t(dinfo->sms) * 8));
  if (bl.dqk_add) {  // (the step adds each value head's dq, dk into them)
    gdn_bwd_zero_dqk<T><<<fgrid, 256, 0, stream>>>(fp);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_zero_dqk");
  }
  s = launch_fused<T>(f, bl.sc, bl.fwd, maps.q, maps.k, seq_desc(f), dinfo->sms, &sp, &maps.v);
  // dq, dk per value head: the caller's tensors where each group is one value head (or two,
  // added in), else the partials (contiguous [B * T][HV][K]) that the finish kernel sums.
  MutTensorRef dq = b.dq, dk = b.dk;
  if (bl.partials) {
    const int64_t HV = f.shape.num_v_heads;
    for (MutTensorRef* r : {&dq, &dk}) {
      r->stride[0] = f.shape.seqlen * HV * kDK, r->stride[1] = HV * kDK, r->stride[2] = kDK;
    }
    dq.data = ws + bl.dqp;
    dk.data = ws + bl.dkp;
  }
  if (s.ok())
    s = launch_fused_step<T>(f, bl.sc, bl.fwd, maps, b.d_final_state, b.d_initial_state, b.dv, sp.simg, dq, &dk, &b.dbeta,
                             sp.tm, &b.dg, bl.dqk_add);
  if (!s.ok()) return s;
  // Nothing left to do where the step wrote dq, dk in place and no device cu_seqlens can be malformed.
  if (!bl.partials && !f.cu_seqlens.data) return Status::Ok();
  gdn_bwd_finish<T><<<fgrid, 256, 0, stream>>>(fp);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_finish");
  return Status::Ok();
}

#ifdef QLA_SM90_TEST_HOOKS
// Test builds only: the fused forward's inverse kernel (docs/fused.md v2, step 1) alone, into
// `regions` (max_chunks x HV x kInvRegionBytes), with the chunk table in p.workspace.
int g_test_inverse_skip = 0;  // test builds only: PrepParams::skip of the inverse kernel

template <class T>
Status launch_inverse_alone(const GdnForwardParams& p, void* regions, void* tm = nullptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int N = static_cast<int>(num_seqs(p));
  const int64_t nregions = max_chunks(p) * p.shape.num_v_heads;
  if (N == 0) return Status::Ok();
  DeviceInfo* dinfo = nullptr;
  Status s = device_info(&dinfo);
  if (!s.ok()) return s;
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_inverse<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kInvSmem),
               "cudaFuncSetAttribute(gdn_fwd_inverse)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_fwd_inverse<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kInvSmemTm),
               "cudaFuncSetAttribute(gdn_fwd_inverse<T'>)");
  const SeqDesc sd = seq_desc(p);
  int* table = static_cast<int*>(p.workspace);
  int2* places = reinterpret_cast<int2*>(static_cast<uint8_t*>(p.workspace) + ws_layout(p).places);
  gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table, nullptr, 0, PiecePlan{}, nullptr, places);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");
  if (nregions == 0) return Status::Ok();
  PrepParams pp = chunk_params(p, sd, N, table);
  pp.places = places;
  s = make_tile_map(&pp.tmk, p.k, p.shape.num_qk_heads, p.shape);
  if (!s.ok()) return s;
  pp.regions = regions;
  pp.tm = tm;
  pp.skip = g_test_inverse_skip;
  set_inverse_items(pp, inverse_group_for(nregions, pp.HV / pp.H, dinfo->sms));
  const dim3 grid(inverse_grid(nregions, pp.inv_group, dinfo->sms));
  if (tm) gdn_fwd_inverse<T, true><<<grid, 128 * kInvWarpgroups, kInvSmemTm, stream>>>(pp);  // (and the T' images)
  else gdn_fwd_inverse<T><<<grid, 128 * kInvWarpgroups, kInvSmem, stream>>>(pp);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_fwd_inverse");
  return Status::Ok();
}

// Test builds only. What the backward's test hooks below share: the device, the kernels' attributes, the
// backward's plan and layout (checked against p.workspace) and its tensor maps (d_o's from d_o).
template <class T>
Status test_backward_setup(const GdnForwardParams& p, const TensorRef& d_o, const char* what, DeviceInfo*& dinfo,
                           BwdLayout& bl, BwdMaps& maps) {
  Status s = device_info(&dinfo);
  if (s.ok()) s = prepare_kernels<T>(dinfo);
  if (!s.ok()) return s;
  bl = bwd_layout(p, dinfo->sms);
  s = check_workspace(what, p.workspace, p.workspace_bytes, bl.fwd.total);
  return s.ok() ? make_bwd_maps(p, d_o, maps) : s;
}

// The backward's states pass (StatesPass) as the library runs it: the backward's plan (split
// where the fused kernels' split model splits), its workspace layout in p.workspace.
template <class T>
Status launch_states(const GdnForwardParams& p, void* tm, void* simg) {
  if (num_seqs(p) == 0) return Status::Ok();
  DeviceInfo* dinfo = nullptr;
  BwdLayout bl;
  BwdMaps maps;
  Status s = test_backward_setup<T>(p, p.v, "sm90 states pass (test)", dinfo, bl, maps);  // (no dO here)
  if (!s.ok()) return s;
  StatesPass sp;
  sp.tm = tm;
  sp.simg = simg;
  return launch_fused<T>(p, bl.sc, bl.fwd, maps.q, maps.k, seq_desc(p), dinfo->sms, &sp, &maps.v);
}

// Test builds only: what the reverse step reads, as the library leaves it: the chunk table and
// regions (and, split, the maps) of a states pass in p.workspace, run here first (a states pass
// without images; unsplit, the table and the inverse kernel) unless g_test_reverse_maps_ready
// says an earlier call left them. Leaves the backward's layout and tensor maps.
template <class T>
Status test_reverse_setup(const GdnForwardParams& p, const TensorRef& d_o, const char* what, BwdLayout& bl, BwdMaps& maps) {
  DeviceInfo* dinfo = nullptr;
  Status s = test_backward_setup<T>(p, d_o, what, dinfo, bl, maps);
  if (!s.ok() || g_test_reverse_maps_ready) return s;
  GdnForwardParams fp = p;
  fp.final_state.data = nullptr;  // (the states pass's final state is not wanted here)
  StatesPass sp;
  return bl.sc.max_pieces ? launch_fused<T>(fp, bl.sc, bl.fwd, maps.q, maps.k, seq_desc(p), dinfo->sms, &sp, &maps.v)
                          : launch_inverse_alone<T>(p, static_cast<uint8_t*>(p.workspace) + bl.fwd.regions);
}

// Test builds only: the reverse step (launch_fused_step).
template <class T>
Status launch_step(const GdnForwardParams& p, const TensorRef& d_o, const TensorRef& dht, const MutTensorRef& dh0,
                   const MutTensorRef& dv, const void* simg, const MutTensorRef& dq, const MutTensorRef* dk,
                   const MutTensorRef* dbeta, const void* tm, const MutTensorRef* dg) {
  if (num_seqs(p) == 0) return Status::Ok();
  BwdLayout bl;
  BwdMaps maps;
  Status s = test_reverse_setup<T>(p, d_o, "sm90 reverse step (test)", bl, maps);
  if (!s.ok()) return s;
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_bwd_fused_step<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)StepCfg::kSmem),
               "cudaFuncSetAttribute(gdn_bwd_fused_step)");
  return launch_fused_step<T>(p, bl.sc, bl.fwd, maps, dht, dh0, dv, simg, dq, dk, dbeta, tm, dg);
}

#endif

}  // namespace

bool compiled() { return true; }

#ifdef QLA_SM90_TEST_HOOKS
// Test builds only (tests/cuda/sm90_forward_test.cu).
void set_test_stages(int bits) { g_test_stages = bits; }
void set_test_overlap(int on) { g_test_overlap = on; }
int set_test_fused(int mode) {
  const int was = g_test_fused;
  g_test_fused = mode;
  return was;
}
size_t test_inverse_region_bytes() { return kInvRegionBytes; }
void set_test_inverse_skip(int bits) { g_test_inverse_skip = bits; }
void set_test_inverse_group(int group) { g_test_inv_group = group; }
void set_test_fused_skip(int bits) { g_test_fused_skip = bits; }
void set_test_fused_overlap(int on) { g_test_fused_overlap = on; }
void set_test_pass1_vt(int vt) { g_test_pass1_vt = vt; }
void set_test_reverse_maps_ready(int on) { g_test_reverse_maps_ready = on; }
void set_test_step_min_piece(int chunks) { g_test_step_min_piece = chunks; }
void set_test_dqk_partials(int on) { g_test_dqk_partials = on; }
#ifdef QLA_FUSED_PROFILE
void test_print_phases() {  // the phase records of the kernels run since the last call
  print_phase_records<<<1, 1>>>();
  cudaDeviceSynchronize();
}
void test_set_phase_cta(int y) { cudaMemcpyToSymbol(g_phase_cta_y, &y, sizeof(int)); }
#endif
Status test_run_inverse(const GdnForwardParams& p, void* regions, void* tm) {
  Status s = check_supported(p);
  if (!s.ok()) return s;
  if (p.q.dtype == DType::kBFloat16) return launch_inverse_alone<cutlass::bfloat16_t>(p, regions, tm);
  return launch_inverse_alone<cutlass::half_t>(p, regions, tm);
}
size_t test_state_image_bytes() { return kSImgBytes; }
Status test_run_states_pass(const GdnForwardParams& p, void* tm, void* simg) {
  Status s = check_supported(p);
  if (!s.ok()) return s;
  return p.q.dtype == DType::kBFloat16 ? launch_states<cutlass::bfloat16_t>(p, tm, simg)
                                       : launch_states<cutlass::half_t>(p, tm, simg);
}
Status test_run_fused_step(const GdnForwardParams& p, const TensorRef& d_o, const TensorRef& dht, const MutTensorRef& dh0,
                           const MutTensorRef& dv, const void* simg, const MutTensorRef& dq, const MutTensorRef* dk,
                           const MutTensorRef* dbeta, const void* tm, const MutTensorRef* dg) {
  Status s = check_supported(p);
  if (!s.ok()) return s;
  return p.q.dtype == DType::kBFloat16 ? launch_step<cutlass::bfloat16_t>(p, d_o, dht, dh0, dv, simg, dq, dk, dbeta, tm, dg)
                                       : launch_step<cutlass::half_t>(p, d_o, dht, dh0, dv, simg, dq, dk, dbeta, tm, dg);
}
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
  // 16-bit states (an engine's bf16 or fp16 state cache) run on the cpu backend; here not yet.
  for (const auto& st : {std::make_pair("initial_state", p.initial_state.data ? p.initial_state.dtype : DType::kFloat32),
                         std::make_pair("final_state", p.final_state.data ? p.final_state.dtype : DType::kFloat32)})
    if (st.second != DType::kFloat32)
      return ns(std::string(st.first) + ": expected dtype float32 on this backend (bf16 and fp16 states run on the "
                "cpu backend only for now), got " + dt_name(st.second));
  // 16-byte vector loads of q/k/v rows, 4-byte pair stores of o.
  for (const TensorRef* t : {&p.q, &p.k, &p.v}) {
    if (!aligned(t->data, 16) || t->stride[0] % 8 || t->stride[1] % 8 || t->stride[2] % 8)
      return ns("q, k, v need 16-byte aligned data and strides that are multiples of 8 elements");
  }
  if (!aligned(p.o.data, 4) || p.o.stride[0] % 2 || p.o.stride[1] % 2 || p.o.stride[2] % 2)
    return ns("o needs 4-byte aligned data and even strides");
  // Flat grids of N * HV * 4 CTAs (sequential passes) and int chunk indices.
  if (num_seqs(p) * p.shape.num_v_heads > 2147483647LL / 4 || max_chunks(p) > 2147483647LL / 2 ||
      max_chunks(p) * p.shape.num_v_heads > 2147483647LL)
    return ns("too many sequences, chunks or value heads for the sm90 grid");
  // Token coordinates (chunk places, TMA boxes) are ints.
  if (p.shape.seqlen > 2147483647LL)
    return ns("T: at most 2^31 - 1 tokens per batch row (got " + std::to_string(p.shape.seqlen) + ")");
  // The chunk places (write_chunk_places) hold a batch row in 24 bits; varlen calls use row 0.
  if (!p.cu_seqlens.data && p.shape.batch >= kMaxPlaceBatch)
    return ns("batch: at most " + std::to_string(kMaxPlaceBatch - 1) + " rows without cu_seqlens (got " +
              std::to_string(p.shape.batch) + "); pass more sequences as varlen (cu_seqlens)");
  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (!ds.ok()) return ds;
  const int major = dinfo->major;
  if (major != 9) return ns("device is compute capability " + std::to_string(major) + ".x, the sm90 backend needs 9.x");
  return Status::Ok();
}

Status prepare_forward() {
  DeviceInfo* dinfo = nullptr;
  Status s = hopper_device_info(&dinfo);
  if (s.ok()) s = prepare_kernels<cutlass::bfloat16_t>(dinfo);
  if (s.ok()) s = prepare_kernels<cutlass::half_t>(dinfo);
  return s;
}

Status init_runtime() {
  int count = 0;  // the runtime's first call; a device count query creates no context
  QLA_CUDA_TRY(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return Status::Ok();
}

Status forward_workspace_size(const GdnForwardParams& p, size_t* bytes) {
  if (!bytes) return Status::Error(StatusCode::kInvalidArgument, "sm90 forward: bytes is null");
  *bytes = ws_layout(p).total;
  return Status::Ok();
}

Status fused_backward_workspace_size(const GdnBackwardParams& p, size_t* bytes) {
  *bytes = 0;
  const GdnForwardParams f = states_params(p);
  Status s = check_supported(f);
  if (!s.ok()) return s;
  DeviceInfo* dinfo = nullptr;
  s = device_info(&dinfo);  // cached; check_supported has read it
  if (!s.ok()) return s;
  *bytes = bwd_layout(f, dinfo->sms).total;
  return Status::Ok();
}

Status fused_backward(const GdnBackwardParams& p) {
  const GdnForwardParams f = states_params(p);
  Status s = check_supported(f);
  if (!s.ok()) return s;
  DeviceInfo* dinfo = nullptr;
  s = device_info(&dinfo);  // cached; check_supported has read it
  if (!s.ok()) return s;
  const BwdLayout bl = bwd_layout(f, dinfo->sms);
  s = check_workspace("sm90 backward", p.workspace, p.workspace_bytes, bl.total);
  if (!s.ok()) return s;
  if (p.q.dtype == DType::kBFloat16) return launch_backward<cutlass::bfloat16_t>(p, f, bl, dinfo);
  return launch_backward<cutlass::half_t>(p, f, bl, dinfo);
}

Status forward(const GdnForwardParams& p) {
  Status s = check_supported(p);
  if (!s.ok()) return s;
  DeviceInfo* dinfo = nullptr;
  s = device_info(&dinfo);  // cached; check_supported has read it
  if (!s.ok()) return s;
  const SplitChoice sc = forward_choice(p, dinfo->sms);
  const WsLayout wl = ws_layout(p, sc);
  s = check_workspace("sm90 forward", p.workspace, p.workspace_bytes, wl.total);
  if (!s.ok()) return s;
  if (p.q.dtype == DType::kBFloat16) return launch<cutlass::bfloat16_t>(p, sc, wl);
  return launch<cutlass::half_t>(p, sc, wl);
}

}  // namespace sm90
}  // namespace qla
