// sm90 two-pass forward, kernel 3: the recurrence over chunks at V tile 32 (warp-specialized:
// state and output warpgroups), and its states role for the backward. See README.md in this folder.
#pragma once

#include "common.cuh"

namespace qla {
namespace sm90 {
// Anonymous: these headers are included by gdn_fwd_sm90.cu alone (internal linkage).
namespace {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// 3. Recurrence. One CTA per (sequence, value head, V tile of 32 columns); a producer warp feeds
//    a 2-stage mbarrier ring (bulk copies of the chunk's 32 KiB image, its u tile and gates, TMA
//    loads of its Q and K tiles); the math loops read only shared memory and registers.
// ---------------------------------------------------------------------------------------------

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
  void* states;  // backward (kStates): the state entering every chunk, 16-bit DD_K image per region
  const int* ready;  // overlapped mode: wait for each region's flag (prep runs concurrently); else null
  CUtensorMap tmv;   // the fused forward (fused_chunks.cuh): v as (d, head, token, batch), box (64, 1, 64, 1)
  float scale;       // the fused forward: the output scale
  // The split fused forward (split.cuh, docs/split.md); pieces == nullptr: whole sequences.
  const int* pieces;  // the piece table (piece_table_ints)
  PiecePlan plan;
  const int* plan_dev;  // non-null: the plan as gdn_chunk_table refined it (device-only lengths), for plan
  float* maps;        // per (piece followed by another of its sequence, value head): [K][V + K] fp32, the piece's
                      // end state from zero | its transfer map (split.cuh, map_at)
  int pass;           // 0: the exact path's piece 0 and transfer maps (no o); 1: every piece with o (split.cuh)
  int tiles_log2;     // column tiles per value head in the grid: 1 << tiles_log2 (V, or V + K with maps)
  float warm_decay;   // warm-up when the chunks next to a boundary sum g to at most this (log) ...
  int warm_max;       // ... within this many chunks (0: never; at most kWarmMaxChunks, split.cuh)
  int warm_rule;      // which chunks: kWarmBefore (the forward), kWarmAfter (the reverse step), or both (split.cuh)
  // Test builds only (set_test_fused_skip): what the fused recurrence leaves out, for timing
  // by difference, its results then wrong: 1 K and Q's loads, 2 V's, 4 the regions' (Tu image,
  // gates), 8 o's stores; the scan (split.cuh): 16 M's loads, 32 the products. 0 in the library.
  int skip;
  // A split call's pass 0 runs the lean kernel (gdn_fwd_chunks<.., true>, split-8 in
  // docs/design.md): its CTAs write no o; pass 1 runs piece 0 again from h0, and the whole
  // sequences, with o (piece_role in split.cuh).
  int lean_maps;
  // State pools: sequence n reads h0's slot pool_slot(h0_pool, n) and writes hT's slot
  // pool_slot(hT_pool, n) (none where negative; without indices slot n).
  PoolIndex h0_pool, hT_pool;
  // A split call whose initial and final states share memory: pass 1 reads piece 0's entering
  // state from this copy of h0 (made by the scan, per piece-0 map index and value head, [K][V]),
  // since its last piece writes the final state into that memory in the same launch.
  float* h0_copy;
  // The reverse step's state images (fused_chunks.cuh, store_state_image; null: none stored): the
  // lean kernel's states role leaves each chunk's entering state there, the step loads it.
  void* grad_simg;
  // The fused backward's reverse step (fused_step.cuh): dq per value head ((b, t, value head, d),
  // q's dtype; null: not formed), summed over each group after it.
  void* dq;
  int64_t sdq[3];
  CUtensorMap tmdo;  // the reverse step: dO's tensor map (tmv is v's there)
  CUtensorMap tmdq;  // the reverse step: dq's and dv's, where dq_tma, dv_tma (full chunks stored
  CUtensorMap tmdv;  // by the tensor engine)
  int dq_tma, dv_tma;
  // The reverse step's dk (per value head, as dq; null: dk, dbeta, dg not formed) and dbeta
  // ((b, t, value head), its dtype db_dt), from beta (its dtype b_dt) and the inverse kernel's T'
  // images (8 KiB per region); full chunks of dk by bulk tensor stores where dk_tma.
  void* dk;
  int64_t sdk[3];
  CUtensorMap tmdk;
  int dk_tma;
  void* dbeta;
  int64_t sdb[2];
  int db_dt;
  const void* beta;
  int64_t sb[2];
  int b_dt;
  const void* grad_tm;
  void* dg;  // with dk: dg ((b, t, value head), its dtype dg_dt; null: not formed)
  int64_t sdg[2];
  int dg_dt;
  // Pairs of value heads a key head (HV = 2 H): dq and dk are the caller's tensors, per key head
  // (tmdq, tmdk over the key heads), zeroed before the step, and each value head's part is added
  // into them (bulk tensor reductions; generic 16-bit pair additions for partial chunks). Two
  // additions onto zero commute, 0 + a + b = 0 + b + a, so the bits do not depend on which CTA
  // comes first; they equal the group sum of the 16-bit partials (round(a + b)).
  int dqk_add;
};

// The piece plan a pass or the scan splits by.
__device__ __forceinline__ PiecePlan rec_plan(const RecParams& p) {
  return p.plan_dev ? PiecePlan{p.plan_dev[0], p.plan_dev[1]} : p.plan;
}

constexpr int kStages = 2;
// Stage: 16-bit image | Q | K | u tile (fp32, 64 x VT) | gates (528 B, padded to 1 KiB: keeps the
// next stage 1024-byte aligned for the 128-byte swizzle; the mbarriers live in stage 0's padding).
template <int VT>
struct RecCfg {
  static constexpr uint32_t kUBytes = kC * VT * 4;  // u of the CTA's V tile
  static constexpr uint32_t kStQ = kImgBytes, kStK = kStQ + kQKBytes, kStU = kStK + kQKBytes, kStG = kStU + kUBytes;
  static constexpr uint32_t kStageBytes = kStG + 1024;
  static constexpr uint32_t kBarOff = kStG + 768;
  static constexpr uint32_t kStageTx = kImgBytes + 2 * kQKBytes + kUBytes + kGateBytes;
};
static_assert(kGateBytes <= 768, "gates overlap the mbarriers");

// A recurrence CTA's coordinates (grid order: seq_cta in common.cuh).
struct RecTile {
  int vt, n, hv;
  bool live;            // false: a padding CTA past the last sequence (seq_grid)
  int64_t b, t0, slen;  // batch row, first token, length of the sequence
  int nch, ci0;         // its chunks and the index of its first one
};
template <int VT>
__device__ __forceinline__ RecTile rec_tile(const RecParams& p) {
  RecTile t;
  const SeqCta c = seq_cta<kDV / VT>(p.chunk_off, p.N);
  t.vt = c.vt;
  t.n = c.n;
  t.hv = c.hv;
  t.live = c.live;
  seq_bounds(p.sd, t.n, t.b, t.t0, t.slen);
  t.nch = static_cast<int>((t.slen + kC - 1) / kC);
  t.ci0 = p.chunk_off[t.n];
  return t;
}

// An fp32 state tile (d, v) of the CTA (columns v0 .. v0 + VT) from a [N, HV, K, V] or
// [N, HV, V, K] tensor (zeros without one: src == nullptr), and back; either state layout
// (vk = 0: [d][v], vk = 1: [v][d]). Used for h0 / final state here, dht / dh0 in the backward.
template <class Acc, class Coord>
__device__ __forceinline__ void load_state_tile(const float* src, const int64_t* st, int vk, int64_t n, int hv, int v0,
                                                Acc& acc, const Coord& cS) {
  const int64_t hbase = n * st[0] + static_cast<int64_t>(hv) * st[1];
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
    acc(i) = src ? src[hbase + (vk ? v * st[2] + d : d * st[2] + v)] : 0.f;
  }
}
template <class Acc, class Coord>
__device__ __forceinline__ void store_state_tile(float* dst, const int64_t* st, int vk, int64_t n, int hv, int v0,
                                                 const Acc& acc, const Coord& cS) {
  if (!dst) return;
  const int64_t fb = n * st[0] + static_cast<int64_t>(hv) * st[1];
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int d = get<0>(cS(i)), v = v0 + get<1>(cS(i));
    dst[fb + (vk ? v * st[2] + d : d * st[2] + v)] = acc(i);
  }
}
template <class Acc, class Coord>
__device__ __forceinline__ void load_initial_state(const RecParams& p, int n, int hv, int v0, Acc& accS, const Coord& cS) {
  const int64_t slot = pool_slot(p.h0_pool, n);  // negative: no state (zeros)
  load_state_tile(slot >= 0 ? p.h0 : nullptr, p.sh0, p.vk, slot, hv, v0, accS, cS);
}
template <class Acc, class Coord>
__device__ __forceinline__ void store_final_state(const RecParams& p, int n, int hv, int v0, const Acc& accS,
                                                  const Coord& cS) {
  const int64_t slot = pool_slot(p.hT_pool, n);  // negative: not written
  if (slot >= 0) store_state_tile(p.hT, p.shT, p.vk, slot, hv, v0, accS, cS);
}
// Backward: the V-tile-32 block vt of region (ci, hv) in an image of `elems` 16-bit elements per
// region (Lay<T>::DD_K or ::TokV_K); its bytes equal the CTA's RecLay<T, 32> hi operand.
template <class T>
__device__ __forceinline__ T* image_block(void* images, int elems, int HV, int ci, int hv, int vt) {
  return static_cast<T*>(images) + (static_cast<size_t>(ci) * HV + hv) * elems + vt * (elems / (kDV / 32));
}

// Malformed device cu_seqlens or a state-pool index past its pool (flagged by gdn_chunk_table):
// instead of a silent wrong answer, every element of o and of the final state becomes NaN
// (grid-stride over the whole grid).
template <class T>
__device__ void fill_nan_outputs(const RecParams& p) {
  const int64_t nthreads = grid_blocks() * blockDim.x;
  const int64_t first = flat_block() * blockDim.x + threadIdx.x;
  const int64_t HV = p.HV, no = p.sd.T * HV * kDV;  // varlen: B == 1
  T* o = static_cast<T*>(p.o);
  for (int64_t i = first; o && i < no; i += nthreads) {  // (no o: the backward's states pass)
    const int64_t v = i % kDV, h = (i / kDV) % HV, t = i / (kDV * HV);
    o[t * p.so[1] + h * p.so[2] + v] = T(__int_as_float(0x7fc00000));
  }
  if (p.hT) {  // every sequence's final slot (those in the pool's range, with indices)
    const int64_t nh = static_cast<int64_t>(p.N) * HV * kDK * kDV;
    for (int64_t i = first; i < nh; i += nthreads) {
      const int64_t j = i % (kDK * kDV), h = (i / (kDK * kDV)) % HV, n = i / (kDK * kDV * HV);
      const int64_t slot = pool_slot(p.hT_pool, n);
      if (slot < 0 || (p.hT_pool.idx && slot >= p.hT_pool.slots)) continue;
      p.hT[slot * p.shT[0] + h * p.shT[1] + (j / kDV) * p.shT[2] + j % kDV] = __int_as_float(0x7fc00000);
    }
  }
}

// Producer loop (one thread): for each chunk of the sequence, wait for a free stage, then the
// bulk copy of the chunk's 16-bit image, TMA loads of its Q and K tiles straight from q and k,
// and bulk copies of the CTA's u tile and the gates, all completing on the stage's `full`.
// states_only (the backward's state pass, no O): w of the image, K, u and the gates.
template <int VT>
__device__ __forceinline__ void produce_chunks(const RecParams& p, uint8_t* sm, uint64_t* full, uint64_t* empty,
                                               int n, int hv, int vt, int64_t b, int64_t t0, int nch, int ci0,
                                               bool states_only = false) {
  using Cfg = RecCfg<VT>;
  const uint8_t* regions = static_cast<const uint8_t*>(p.regions);
  const int hq = hv / (p.HV / p.H);
  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    const uint8_t* src = regions + (static_cast<size_t>(ci0 + c) * p.HV + hv) * kRegionBytes;
    uint8_t* dst = sm + st * Cfg::kStageBytes;
    // Rows past the sequence end are the next sequence's tokens (zeros past the tensor end):
    // the state warpgroup zeroes K's (S's update contracts over tokens); Q's reach only O rows
    // that are not stored.
    const int tok = static_cast<int>(t0) + c * kC;
    mbar_wait(&empty[st], ((c / kStages) & 1) ^ 1);
    if (p.ready) {  // overlapped mode: the region is written by a concurrently running prep
      const int* f = p.ready + static_cast<size_t>(ci0 + c) * p.HV + hv;
      while (ld_acquire(f) == 0) __nanosleep(200);
      asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk copies below read it
    }
    mbar_expect_tx(&full[st], states_only ? Cfg::kStageTx - (kImgBytes - kImgTokD * 2) - kQKBytes : Cfg::kStageTx);
    bulk_g2s(dst, src, states_only ? kImgTokD * 2 : kImgBytes, &full[st]);  // w_hi | A_hi, A_lo
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {  // two 64-column boxes = the two K-blocks of the GMMA tile
      if (!states_only)
        tma_load_4d(dst + Cfg::kStQ + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, static_cast<int>(b), &full[st]);
      tma_load_4d(dst + Cfg::kStK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, static_cast<int>(b), &full[st]);
    }
    // u tiles [V/32][tok][32] of this V tile are consecutive: one copy.
    bulk_g2s(dst + Cfg::kStU, src + kF32Off + size_t(vt) * Cfg::kUBytes, Cfg::kUBytes, &full[st]);
    bulk_g2s(dst + Cfg::kStG, src + kF32Off + kFGq * 4, kGateBytes, &full[st]);
  }
}

// ---------------------------------------------------------------------------------------------
// 3b. Warp-specialized recurrence (V tile 32): the state chain and the output run on two math
//     warpgroups, so the products that only feed O (Q S, A U) leave the sequential path.
//     warps 0-3 (state WG):  U = u - w S, X = diag(e^(Gamma-gamma)) U, S = e^Gamma S + K^T X
//     warps 4-7 (output WG): O = diag(scale e^gamma) Q S + A U, stored to o
//     warp 8 (producer):     produce_chunks.
//   S_c (the state entering chunk c) and U_c live in double buffers (parity c % 2). The state WG
//   arrives on `uready[c%2]` once S_c and U_c are written; the output WG arrives on `ofree[c%2]`
//   once its products have read them. Before writing S_{c+1} (parity of c-1) the state WG waits
//   for `ofree` of chunk c-1, which also frees U's buffer for chunk c+1.
//   kStates (the backward's state pass): no O. The output WG leaves at once, the producer skips
//   Q and the A image, and the state WG stores each S_c hi buffer as its image block (one bulk
//   copy by one thread, off the chain's critical path).
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

// kStates: the backward's state pass (stores every chunk's entering state to p.states). A
// compile-time role: the forward's instantiation carries none of its code or registers.
template <class T, bool kStates = false>
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
  const RecTile tile = rec_tile<VT>(p);
  const int vt = tile.vt, n = tile.n, hv = tile.hv;
  const int64_t b = tile.b, t0 = tile.t0, slen = tile.slen;
  const int nch = tile.nch, ci0 = tile.ci0;
  if (p.chunk_off[p.N + 1]) {  // malformed device cu_seqlens: NaN outputs, nothing else
    fill_nan_outputs<T>(p);
    return;
  }
  if (!tile.live) return;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kStates ? 128 : 256);  // the math warpgroups release a stage
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&uready[s], 128);
      mbar_init(&ofree[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 8) {  // producer
    if ((tid & 31) == 0) produce_chunks<VT>(p, sm, full, empty, n, hv, vt, b, t0, nch, ci0, kStates);
    return;
  }
  if (kStates && warp >= 4) return;  // the state pass has no O: the output warpgroup idles

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

    load_initial_state(p, n, hv, v0, accS, cS);
    store_state(0);

    for (int c = 0; c < nch; ++c) {
      const int st = c % kStages, par = c & 1;
      uint8_t* stb = sm + st * Cfg::kStageBytes;
      const float* sU = reinterpret_cast<const float*>(stb + Cfg::kStU);  // [V/32][tok][32]
      const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);  // gq | gk | e^Gamma
      T* sK = reinterpret_cast<T*>(stb + Cfg::kStK);
      if constexpr (kStates) {
        if (wt == 0) {  // S_c hi (stored and fenced before the last barrier) is the image block
          bulk_s2g(image_block<T>(p.states, kDK * kDV, p.HV, ci0 + c, hv, vt), sbuf(par), kDK * VT * sizeof(T));
          bulk_commit();
        }
      }
      mbar_wait(&full[st], (c / kStages) & 1);
      if (const int64_t left = slen - static_cast<int64_t>(c) * kC; left < kC) {
        // The sequence's last chunk: K's rows past its end zeroed (their X rows are zero, and
        // 0 x Inf would be NaN), before the products read the stage.
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(sK) + h * kQKBytes / 2, static_cast<int>(left), wt, 128);
        fence_async_smem();
        math_bar();
      }
      Tensor rWh = thrU.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<T*>(stb) + kOffWh), typename L::TokD_K{}));
      Tensor rKt = thrS.partition_fragment_A(make_tensor(make_smem_ptr(sK), typename L::DTok_MN{}));
      Tensor rSh = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par)), typename RL::VD_MN{}));
      Tensor rSl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sbuf(par) + kDK * VT), typename RL::VD_MN{}));

      // U' = w S (w_hi S_hi + w_hi S_lo).
      warpgroup_fence_operand(accU);
      warpgroup_arrive();
      gemm_k(mmaU, rWh, rSh, accU, GMMA::ScaleOut::Zero);
      gemm_k(mmaU, rWh, rSl, accU, GMMA::ScaleOut::One);
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
      if (!kStates) mbar_arrive(&uready[par]);  // S_c and U_c are readable by the output WG
      // The previous chunk's image block has left S buffer par ^ 1: store_state may refill it.
      if (kStates && wt == 0) bulk_wait_read_but_last();
      math_bar();                 // X is complete

      // S = e^Gamma S + K^T X (X_hi + X_lo).
      CUTE_UNROLL
      for (int i = 0; i < size(accS); ++i) accS(i) *= eG;
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      gemm_k(mmaS, rKt, rXh, accS, GMMA::ScaleOut::One);
      gemm_k(mmaS, rKt, rXl, accS, GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      mbar_arrive(&empty[st]);  // w, K, u and the gates of this stage are consumed

      // S_{c+1} goes to the other parity, last read by the output WG for chunk c-1.
      if (!kStates && c >= 1) mbar_wait(&ofree[par ^ 1], ((c - 1) >> 1) & 1);
      store_state(par ^ 1);  // its barrier also ends every warp's reads of X
    }

    if (kStates && wt == 0) bulk_wait_all();
    store_final_state(p, n, hv, v0, accS, cS);
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
      gemm_k(mmaU, rQ, rSh, accQS, GMMA::ScaleOut::Zero);
      gemm_k(mmaU, rQ, rSl, accQS, GMMA::ScaleOut::One);
      gemm_k(mmaU, rAh, rUh, accAU, GMMA::ScaleOut::Zero);
      gemm_k(mmaU, rAh, rUl, accAU, GMMA::ScaleOut::One);
      gemm_k(mmaU, rAl, rUh, accAU, GMMA::ScaleOut::One);
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


}  // namespace
}  // namespace sm90
}  // namespace qla
