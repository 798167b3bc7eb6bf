// sm90 backward launches 4-6 (1-3 are the forward's chunk table, prep and recurrence with their
// backward outputs switched on). See docs/backward.md for the algebra (B1)..(B33) and the plan.
//   4. gdn_bwd_reverse: the state-gradient chain, reverse over chunks per (sequence, value head,
//      V tile of 32); stores dSn (the gradient of the state leaving each chunk) and -dU.
//   5. gdn_bwd_grads:   chunk-parallel, one CTA per (chunk, value head): dv, dbeta, dg, and
//      per-value-head fp32 partials of dq and dk.
//   6. gdn_bwd_finish (bwd_finish.cuh): dq, dk = sums of the partials over each value-head
//      group; NaN outputs when the device cu_seqlens are malformed.
#pragma once

#include "bwd_finish.cuh"
#include "common.cuh"
#include "recurrence.cuh"

namespace qla {
namespace sm90 {
// Anonymous: these headers are included by one translation unit each (internal linkage).
namespace {

using namespace cute;

// One synchronous wgmma batch acc (+)= A B over the whole K extent (smem operands).
template <class MMA, class TA, class TB, class Acc>
__device__ __forceinline__ void mma_ss(MMA& mma, int tid, const TA& sA, const TB& sB, Acc& acc, bool accumulate) {
  auto thr = mma.get_thread_slice(tid);
  Tensor rA = thr.partition_fragment_A(sA);
  Tensor rB = thr.partition_fragment_B(sB);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm_k(mma, rA, rB, acc, accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

// ---------------------------------------------------------------------------------------------
// 4. Reverse chain, one CTA per (sequence, value head, V tile of 32), chunks from the last to the
//    first; per chunk, with dSn the current dS (the gradient of the state leaving the chunk):
//      dU = diag(e^(Gamma-gamma)) (K dSn) + P^T dO                                    (B13)
//      dS = e^Gamma dSn + Q^T diag(scale e^gamma) dO - W^T dU                          (B14)
//    dSn and -dU are stored as 16-bit image blocks for the gradients kernel; dS after chunk 0 is
//    dh0. Warp-specialized: the products that do not involve dS leave the sequential path, as
//    the forward's output warpgroup does for O.
//     warps 0-3 (chain WG): dU = gk (K dSn) + PdO; dS = e^Gamma dSn + G - W^T dU
//     warps 4-7 (side WG):  per chunk, ahead of the chain: dOg = diag(scale e^gamma) dO (hi/lo),
//                           PdO = P^T dO (64 x 32) and G = Q^T dOg (128 x 32), fp32, handed to
//                           the chain through double-buffered shared memory
//     warp 8 (producer):    the chunk's image, Q, K, the dO tile (32 columns) and gates.
//   The side WG arrives on `pready[it % 2]` once PdO and G of iteration it are written; the chain
//   arrives on `pfree[it % 2]` once it has read them. The side WG waits for `pfree` of
//   iteration it - 2 before writing iteration it.
// ---------------------------------------------------------------------------------------------
struct RevParams {
  CUtensorMap tmq, tmk;  // q, k as (d, head, token, batch), box (64, 1, 64, 1)
  CUtensorMap tmdo32;    // dO with a (32, 1, 64, 1) box, 64-byte swizzle
  SeqDesc sd;
  const int* chunk_off;
  const void* regions;
  const float* dht;
  int64_t sdht[3];
  float* dh0;
  int64_t sdh0[3];
  int vk;
  void* dsn;  // [region] 16-bit DD_K image of dSn (32 KiB)
  void* du;   // [region] 16-bit TokV_K image of -dU (16 KiB)
  int N, H, HV;
};

constexpr int kRevVT = 32;
struct RevCfg {
  static constexpr int VT = kRevVT;
  static constexpr uint32_t kOBytes = kC * VT * 2;  // dO tile (tok x 32 v), 64-byte swizzle
  static constexpr uint32_t kStQ = kImgBytes, kStK = kStQ + kQKBytes, kStO = kStK + kQKBytes, kStG = kStO + kOBytes;
  static constexpr uint32_t kStageBytes = kStG + 1024;
  static constexpr uint32_t kBarOff = kStG + 768;
  static constexpr uint32_t kStageTx = kImgBytes + 2 * kQKBytes + kOBytes + kGateBytes;
  static constexpr uint32_t kSBytes = 2 * kDK * VT * 2;        // dS hi/lo (v, d)
  static constexpr uint32_t kUBytes = 2 * kC * VT * 2;         // -dU hi/lo (v, tok)
  static constexpr uint32_t kGBytes = 2 * kC * VT * 2;         // dOg hi/lo (v, tok)
  static constexpr uint32_t kHBytes = (kC * VT + kDK * VT) * 4;  // PdO | G fp32 (fragment order, thread-minor: hand_idx)
  static constexpr uint32_t kOffS = kStages * kStageBytes;
  static constexpr uint32_t kOffU = kOffS + kSBytes;
  static constexpr uint32_t kOffG = kOffU + kUBytes;
  static constexpr uint32_t kOffH = kOffG + kGBytes;          // 2 hand-over buffers
  static constexpr uint32_t kOffBar = kOffH + 2 * kHBytes;    // pready[2], pfree[2]
  static constexpr size_t kSmem = 1024 + kOffBar + 64;
  static_assert(kSmem <= 232448, "warp-specialized reverse kernel smem over the 227 KiB limit");
  static_assert(kGateBytes <= 768, "gates overlap the mbarriers");
  static_assert(kStageBytes % 1024 == 0 && kOffS % 1024 == 0 && kOffU % 1024 == 0 && kOffG % 1024 == 0,
                "swizzled images need 1 KiB alignment");
};

template <class T>
__global__ void __launch_bounds__(288, 1) gdn_bwd_reverse(const __grid_constant__ RevParams p) {
  using Cfg = RevCfg;
  constexpr int VT = Cfg::VT;
  using L = Lay<T>;
  using RL = RecLay<T, VT>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  T* sSh = reinterpret_cast<T*>(sm + Cfg::kOffS);  // dS hi/lo (v, d)
  T* sSl = sSh + kDK * VT;
  T* sUh = reinterpret_cast<T*>(sm + Cfg::kOffU);  // -dU hi/lo (v, tok)
  T* sUl = sUh + kC * VT;
  T* sGh = reinterpret_cast<T*>(sm + Cfg::kOffG);  // dOg hi/lo (v, tok)
  T* sGl = sGh + kC * VT;
  auto hbuf = [&](int par) { return reinterpret_cast<float*>(sm + Cfg::kOffH + par * Cfg::kHBytes); };
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBarOff);
  uint64_t* empty = full + kStages;
  uint64_t* pready = reinterpret_cast<uint64_t*>(sm + Cfg::kOffBar);
  uint64_t* pfree = pready + 2;

  const int tid = threadIdx.x, warp = tid >> 5, wt = tid & 127;
  if (p.chunk_off[p.N + 1]) return;  // malformed cu_seqlens: launch 6 writes NaN
  const SeqCta cta = seq_cta<kDV / VT>(p.chunk_off, p.N);
  if (!cta.live) return;
  const int vt = cta.vt, n = cta.n, hv = cta.hv;
  int64_t b, t0, slen;
  seq_bounds(p.sd, n, b, t0, slen);
  const int nch = static_cast<int>((slen + kC - 1) / kC), ci0 = p.chunk_off[n];
  const int v0 = vt * VT;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);  // both math warpgroups release a stage
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(&pready[s], 128);
      mbar_init(&pfree[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 8) {  // producer: chunks in reverse order
    if ((tid & 31) == 0) {
      const uint8_t* regions = static_cast<const uint8_t*>(p.regions);
      const int hq = hv / (p.HV / p.H);
      for (int it = 0; it < nch; ++it) {
        const int c = nch - 1 - it, st = it % kStages;
        const uint8_t* src = regions + (static_cast<size_t>(ci0 + c) * p.HV + hv) * kRegionBytes;
        uint8_t* dst = sm + st * Cfg::kStageBytes;
        const int tok = static_cast<int>(t0) + c * kC;
        mbar_wait(&empty[st], ((it / kStages) & 1) ^ 1);
        mbar_expect_tx(&full[st], Cfg::kStageTx);
        bulk_g2s(dst, src, kImgBytes, &full[st]);
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          tma_load_4d(dst + Cfg::kStQ + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, static_cast<int>(b), &full[st]);
          tma_load_4d(dst + Cfg::kStK + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, static_cast<int>(b), &full[st]);
        }
        // Rows past the sequence end belong to the next sequence: the side warpgroup zeroes its
        // Q and dO rows there once they land (and the A rows and scale e^gamma there are zero).
        tma_load_4d(dst + Cfg::kStO, &p.tmdo32, v0, hv, tok, static_cast<int>(b), &full[st]);
        bulk_g2s(dst + Cfg::kStG, src + kF32Off + kFGq * 4, kGateBytes, &full[st]);
      }
    }
    return;
  }

  auto mmaU = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto mmaS = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<VT>, _16>, GMMA::Major::MN, GMMA::Major::MN>());
  auto thrU = mmaU.get_thread_slice(wt);
  auto thrS = mmaS.get_thread_slice(wt);
  // Fragment sizes per thread: 64 x VT -> 16 floats, 128 x VT -> 32 floats.
  constexpr int kFragU = kC * VT / 128, kFragS = kDK * VT / 128;
  // Hand-over buffers hold fragment element i of thread wt at hand_idx(i) + 4 wt: groups of four
  // elements, thread-minor, so a warp's 16-byte accesses are contiguous (no bank conflicts).
  auto hand_idx = [](int i) { return (i / 4) * (4 * 128) + i % 4; };

  if (warp < 4) {
    // ---------------- chain warpgroup ----------------
    Tensor tS = make_tensor(make_smem_ptr(sSh), typename RL::VD_MN{});   // (v, d), offsets
    Tensor tU = make_tensor(make_smem_ptr(sUh), typename RL::VTok_MN{});  // (v, tok), offsets
    Tensor accS = partition_fragment_C(mmaS, Shape<_128, Int<VT>>{});     // dS (d, v)
    Tensor accU = partition_fragment_C(mmaU, Shape<_64, Int<VT>>{});      // K dSn
    Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_128, Int<VT>>{}));
    Tensor cU = thrU.partition_C(make_identity_tensor(Shape<_64, Int<VT>>{}));
    static_assert(decltype(size(accS))::value == kFragS && decltype(size(accU))::value == kFragU, "fragments");
    Tensor rSh = thrU.partition_fragment_B(tS);
    Tensor rSl = thrU.partition_fragment_B(make_tensor(make_smem_ptr(sSl), typename RL::VD_MN{}));
    Tensor rUh = thrS.partition_fragment_B(tU);
    Tensor rUl = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sUl), typename RL::VTok_MN{}));

    auto store_ds = [&]() {  // dS -> hi/lo images for the next chunk's K dSn
      CUTE_UNROLL
      for (int i = 0; i < size(accS); i += 2) {
        uint32_t h, l;
        split_pair<T>(accS(i), accS(i + 1), h, l);
        const int off = static_cast<int>(&tS(get<1>(cS(i)), get<0>(cS(i))) - sSh);
        *reinterpret_cast<uint32_t*>(sSh + off) = h;
        *reinterpret_cast<uint32_t*>(sSl + off) = l;
      }
      fence_async_smem();
      math_bar();
    };

    load_state_tile(p.dht, p.sdht, p.vk, n, hv, v0, accS, cS);
    store_ds();

    for (int it = 0; it < nch; ++it) {
      const int c = nch - 1 - it, st = it % kStages, par = it & 1, ci = ci0 + c;
      uint8_t* stb = sm + st * Cfg::kStageBytes;
      const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);  // gq | gk | e^Gamma
      if (wt == 0) {  // dSn of chunk c: its hi image (stored by store_ds) is the image block
        bulk_s2g(image_block<T>(p.dsn, kDK * kDV, p.HV, ci, hv, vt), sSh, kDK * VT * sizeof(T));
        bulk_commit();
      }
      mbar_wait(&full[st], (it / kStages) & 1);
      if (const int len = static_cast<int>(slen - static_cast<int64_t>(c) * kC); len < kC) {
        // The sequence's last chunk (the first here): K's rows past its end zeroed before the
        // products (the next sequence's tokens: 0 x Inf would be NaN).
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(stb + Cfg::kStK) + h * kQKBytes / 2, len, wt, 128);
        fence_async_smem();
        math_bar();
      }
      Tensor rK = thrU.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<T*>(stb + Cfg::kStK)), typename L::TokD_K{}));
      Tensor rWt = thrS.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<T*>(stb) + kOffWh), typename L::DTok_MN{}));

      // K dSn (hi + lo).
      warpgroup_fence_operand(accU);
      warpgroup_arrive();
      gemm_k(mmaU, rK, rSh, accU, GMMA::ScaleOut::Zero);
      gemm_k(mmaU, rK, rSl, accU, GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accU);

      // dU = gk (K dSn) + PdO; dS = e^Gamma dSn + G (before W^T dU). Hand-over in fragment order.
      mbar_wait(&pready[par], (it >> 1) & 1);
      const float* hb = hbuf(par);
      const float* hP = hb + 4 * wt;
      const float* hG = hb + kC * VT + 4 * wt;
      CUTE_UNROLL
      for (int i = 0; i < size(accU); i += 2) {
        const int r = get<0>(cU(i)), v = get<1>(cU(i));
        const float gk = sG[kC + r];
        const float2 pd = *reinterpret_cast<const float2*>(hP + hand_idx(i));
        const float d0 = gk * accU(i) + pd.x, d1 = gk * accU(i + 1) + pd.y;
        uint32_t h, l;
        split_pair<T>(-d0, -d1, h, l);
        const int off = static_cast<int>(&tU(v, r) - sUh);
        *reinterpret_cast<uint32_t*>(sUh + off) = h;
        *reinterpret_cast<uint32_t*>(sUl + off) = l;
      }
      const float eG = sG[2 * kC];
      CUTE_UNROLL
      for (int i = 0; i < size(accS); i += 4) {
        const float4 g4 = *reinterpret_cast<const float4*>(hG + hand_idx(i));
        accS(i) = eG * accS(i) + g4.x;
        accS(i + 1) = eG * accS(i + 1) + g4.y;
        accS(i + 2) = eG * accS(i + 2) + g4.z;
        accS(i + 3) = eG * accS(i + 3) + g4.w;
      }
      mbar_arrive(&pfree[par]);  // PdO and G of this iteration are read
      fence_async_smem();
      if (wt == 0) bulk_wait_read();  // the dSn block has left sSh: store_ds may overwrite it
      math_bar();                     // -dU images complete
      if (wt == 0) {                  // -dU hi is the image block
        bulk_s2g(image_block<T>(p.du, kC * kDV, p.HV, ci, hv, vt), sUh, kC * VT * sizeof(T));
        bulk_commit();
      }

      // dS += W^T (-dU) (hi + lo).
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      gemm_k(mmaS, rWt, rUh, accS, GMMA::ScaleOut::One);
      gemm_k(mmaS, rWt, rUl, accS, GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      mbar_arrive(&empty[st]);  // w, K and the gates of this stage are consumed
      if (wt == 0) bulk_wait_read();  // the -dU block has left sUh: the next chunk refills it
      store_ds();               // its barrier also ends every warp's reads of the -dU images
    }
    if (wt == 0) bulk_wait_all();
    store_state_tile(p.dh0, p.sdh0, p.vk, n, hv, v0, accS, cS);
  } else {
    // ---------------- side warpgroup ----------------
    Tensor accP = partition_fragment_C(mmaS, Shape<_64, Int<VT>>{});   // P^T dO
    Tensor accG = partition_fragment_C(mmaS, Shape<_128, Int<VT>>{});  // Q^T dOg
    static_assert(decltype(size(accG))::value == kFragS && decltype(size(accP))::value == kFragU, "fragments");
    Tensor rGh = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sGh), typename RL::VTok_MN{}));
    Tensor rGl = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sGl), typename RL::VTok_MN{}));
    for (int it = 0; it < nch; ++it) {
      const int st = it % kStages, par = it & 1;
      uint8_t* stb = sm + st * Cfg::kStageBytes;
      T* base = reinterpret_cast<T*>(stb);
      T* sO = reinterpret_cast<T*>(stb + Cfg::kStO);
      const float* sG = reinterpret_cast<const float*>(stb + Cfg::kStG);
      mbar_wait(&full[st], (it / kStages) & 1);
      if (const int len = static_cast<int>(slen - static_cast<int64_t>(nch - 1 - it) * kC); len < kC) {
        // The sequence's last chunk (the first here): Q's and dO's rows past its end zeroed
        // (dO's box: 32 columns, rows of 64 bytes) before anything reads them; the fence orders
        // the zeros before the products' async-proxy reads here, not only through the one below.
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(stb + Cfg::kStQ) + h * kQKBytes / 2, len, wt, 128);
        zero_box_rows(smem_u32(sO), len, wt, 128, 2 * VT);
        fence_async_smem();
        asm volatile("bar.sync 2, 128;" ::: "memory");  // side warpgroup only
      }

      // dOg = diag(scale e^gamma) dO as hi/lo (v, tok) images (pairs of adjacent v). The
      // previous iteration's products have read them: every side warp passed its wgmma wait
      // and the barrier below before any of them writes again.
      {
        Tensor tO = make_tensor(make_smem_ptr(sO), typename RL::VTok_MN{});
        CUTE_UNROLL
        for (int k = 0; k < (kC * VT / 2) / 128; ++k) {
          const int q = wt + 128 * k, r = q / (VT / 2), v = (q % (VT / 2)) * 2;
          const int off = static_cast<int>(&tO(v, r) - sO);
          const float2 o2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(sO + off));
          const float gq = sG[r];
          uint32_t h, l;
          split_pair<T>(gq * o2.x, gq * o2.y, h, l);
          *reinterpret_cast<uint32_t*>(sGh + off) = h;
          *reinterpret_cast<uint32_t*>(sGl + off) = l;
        }
      }
      fence_async_smem();
      asm volatile("bar.sync 2, 128;" ::: "memory");  // side warpgroup only

      Tensor rQt = thrS.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<T*>(stb + Cfg::kStQ)), typename L::DTok_MN{}));
      Tensor rPh = thrS.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAh), typename L::TokTok_MN{}));
      Tensor rPl = thrS.partition_fragment_A(make_tensor(make_smem_ptr(base + kOffAl), typename L::TokTok_MN{}));
      Tensor rO = thrS.partition_fragment_B(make_tensor(make_smem_ptr(sO), typename RL::VTok_MN{}));
      warpgroup_fence_operand(accP);
      warpgroup_fence_operand(accG);
      warpgroup_arrive();
      gemm_k(mmaS, rPh, rO, accP, GMMA::ScaleOut::Zero);
      gemm_k(mmaS, rPl, rO, accP, GMMA::ScaleOut::One);
      gemm_k(mmaS, rQt, rGh, accG, GMMA::ScaleOut::Zero);
      gemm_k(mmaS, rQt, rGl, accG, GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accP);
      warpgroup_fence_operand(accG);
      mbar_arrive(&empty[st]);  // Q, A, dO and the gates of this stage are consumed

      // Hand PdO and G over (fragment order: the chain thread with the same index reads them).
      if (it >= 2) mbar_wait(&pfree[par], ((it - 2) >> 1) & 1);
      float* hb = hbuf(par);
      float* hP = hb + 4 * wt;
      float* hG = hb + kC * VT + 4 * wt;
      CUTE_UNROLL
      for (int i = 0; i < size(accP); i += 4)
        *reinterpret_cast<float4*>(hP + hand_idx(i)) = make_float4(accP(i), accP(i + 1), accP(i + 2), accP(i + 3));
      CUTE_UNROLL
      for (int i = 0; i < size(accG); i += 4)
        *reinterpret_cast<float4*>(hG + hand_idx(i)) = make_float4(accG(i), accG(i + 1), accG(i + 2), accG(i + 3));
      mbar_arrive(&pready[par]);
      asm volatile("bar.sync 2, 128;" ::: "memory");  // every side warp is done with this iteration's images
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 5. Chunk-local gradients, one CTA (two warpgroups, each half of every product's columns) per
//    (chunk, value head). All products are
//    wgmma on 16-bit images in shared memory (hi only), fp32 accumulators; see (B15)-(B33).
//    Every tile arrives by TMA or bulk copy, issued up front (dSn and V once their slots are
//    free), so the loads overlap the first products instead of serialising on their latency.
// ---------------------------------------------------------------------------------------------
struct GradParams {
  CUtensorMap tmq, tmk, tmv, tmdo;  // (d, head, token, batch), box (64, 1, 64, 1), 128-byte swizzle
  const void *g, *beta;
  int64_t sg[2], sb[2];
  int g_dt, b_dt;
  SeqDesc sd;
  int N, H, HV;
  int64_t T;  // tokens per batch row (partials are [B * T][HV][K])
  const int* chunk_off;
  const void* regions;
  const void* tm;      // Tm hi|lo images per region
  const void* states;  // S image per region (DD_K)
  const void* dsn;     // dSn image per region (DD_K)
  const void* du;      // -dU image per region (TokV_K)
  float *dqp, *dkp;
  void* dv;
  int64_t sdv[3];
  void* dg;
  int64_t sdg[2];
  int dg_dt;
  void* dbeta;
  int64_t sdb[2];
  int db_dt;
  float scale;
};

// Shared-memory slots (byte offsets from the 1 KiB aligned base) and what they hold, in order.
constexpr uint32_t kGsA = 0;         // Q                -> dW
constexpr uint32_t kGsB = 16384;     // K
constexpr uint32_t kGsC = 32768;     // dO -> V          -> dM (8 KiB)
constexpr uint32_t kGsE = 49152;     // S (32 KiB)
constexpr uint32_t kGsG = 81920;     // W
constexpr uint32_t kGsH = 98304;     // P hi|lo          -> dVb
constexpr uint32_t kGsI = 114688;    // Uv fp32 (32 KiB) -> dSn (32 KiB)
constexpr uint32_t kGsJ = 147456;    // -dU              -> diag(beta) K
constexpr uint32_t kGsK = 163840;    // Tm hi (8 KiB)
constexpr uint32_t kGsL = 172032;    // U -> dA (8 KiB)  -> dKb
constexpr uint32_t kGsM = 188416;    // X
constexpr uint32_t kGsN = 204800;    // Uv image
constexpr uint32_t kGsMisc = 221184; // gamma, beta [64 floats each], column sums of R [8][64], partials [2][4][64], 16 floats, 3 mbarriers
constexpr uint32_t kGradTx0 = 3 * kQKBytes + 2 * kImgTokD * 2 /* S */ + kImgTokD * 2 /* W */ +
                              2 * kImgTokTok * 2 /* P */ + kC * kDV * 4 /* Uv */ + kImgTokD * 2 /* -dU */ +
                              kImgTokTok * 2 /* Tm */;
constexpr size_t kGradSmem = 1024 + kGsMisc + 18 * 64 * 4 + 64 + 3 * 8;
static_assert(kGradSmem <= 232448, "grads smem over the 227 KiB limit");
static_assert(kGsB - kGsA == kQKBytes && kGsI + 32768 == kGsJ && kGsK + 8192 == kGsL, "slot sizes");

template <class T>
__global__ void __launch_bounds__(256, 1) gdn_bwd_grads(const __grid_constant__ GradParams p) {
  using L = Lay<T>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = tid >> 5, lane = tid & 31;
  const int reg = blockIdx.x, ci = reg / p.HV, hv = reg % p.HV;
  if (p.chunk_off[p.N + 1] || ci >= p.chunk_off[p.N]) return;

  T* sQ = reinterpret_cast<T*>(sm + kGsA);
  T* sdW = sQ;
  T* sK = reinterpret_cast<T*>(sm + kGsB);
  T* sO = reinterpret_cast<T*>(sm + kGsC);
  T* sV = sO;
  T* sdM = sO;
  T* sS = reinterpret_cast<T*>(sm + kGsE);
  T* sW = reinterpret_cast<T*>(sm + kGsG);
  T* sP = reinterpret_cast<T*>(sm + kGsH);
  T* sdVb = sP;
  const float* sUv32 = reinterpret_cast<const float*>(sm + kGsI);
  T* sdS = reinterpret_cast<T*>(sm + kGsI);
  T* sndU = reinterpret_cast<T*>(sm + kGsJ);  // -dU
  T* sBK = sndU;
  T* sTm = reinterpret_cast<T*>(sm + kGsK);
  T* sU = reinterpret_cast<T*>(sm + kGsL);
  T* sdA = sU;
  T* sdKb = sU;
  T* sX = reinterpret_cast<T*>(sm + kGsM);
  T* sUvi = reinterpret_cast<T*>(sm + kGsN);
  float* sGam = reinterpret_cast<float*>(sm + kGsMisc);
  float* sBeta = sGam + 64;
  float* sColR = sBeta + 64;          // [8 warps][64]: column sums of R, per warp
  float* sPart = sColR + 8 * 64;      // [2 warpgroups][4 quantities: a, x, dbeta, R rows][64]
  float* sRed = sPart + 2 * 4 * 64;   // [8 warps]: partials of <dSn, S>
  uint64_t* bar = reinterpret_cast<uint64_t*>(sRed + 16);  // [0]: first loads, [1]: dSn, [2]: V

  // The chunk's sequence (largest n with off[n] <= ci skips zero-length sequences).
  int lo = 0, hi = p.N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.chunk_off[mid] <= ci) lo = mid; else hi = mid - 1;
  }
  int64_t b, t0, slen;
  seq_bounds(p.sd, lo, b, t0, slen);
  const int64_t cstart = static_cast<int64_t>(ci - p.chunk_off[lo]) * kC;
  t0 += cstart;
  const int len = static_cast<int>(min<int64_t>(kC, slen - cstart));
  const int hq = hv / (p.HV / p.H);
  const int tok = static_cast<int>(t0), bb = static_cast<int>(b);
  const size_t region = static_cast<size_t>(ci) * p.HV + hv;
  const uint8_t* regb = static_cast<const uint8_t*>(p.regions) + region * kRegionBytes;

  // Rows of the TMA tiles past the sequence end hold the next sequence's tokens: zeroed once
  // they land (Q, K, dO, then V), so that whatever they hold (0 x Inf would be NaN) no product
  // below sees them; the other operands are zero there too (beta, the gates, U, dU, W and the A
  // rows) or masked (dA and R rows), and no output row past the end is stored.
  if (tid == 0) {
    for (int i = 0; i < 3; ++i) mbar_init(&bar[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(&bar[0], kGradTx0);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      tma_load_4d(sm + kGsA + h * kQKBytes / 2, &p.tmq, h * 64, hq, tok, bb, &bar[0]);
      tma_load_4d(sm + kGsB + h * kQKBytes / 2, &p.tmk, h * 64, hq, tok, bb, &bar[0]);
      tma_load_4d(sm + kGsC + h * kQKBytes / 2, &p.tmdo, h * 64, hv, tok, bb, &bar[0]);
    }
    bulk_g2s(sS, static_cast<const T*>(p.states) + region * (kDK * kDV), kDK * kDV * 2, &bar[0]);
    bulk_g2s(sW, regb + kOffWh * sizeof(T), kImgTokD * 2, &bar[0]);
    bulk_g2s(sP, regb + kOffAh * sizeof(T), 2 * kImgTokTok * 2, &bar[0]);
    bulk_g2s(sm + kGsI, regb + kF32Off + kFU * 4, kC * kDV * 4, &bar[0]);
    bulk_g2s(sndU, static_cast<const T*>(p.du) + region * (kC * kDV), kImgTokD * 2, &bar[0]);
    bulk_g2s(sTm, static_cast<const T*>(p.tm) + region * (2 * kImgTokTok), kImgTokTok * 2, &bar[0]);
  }
  // gamma (cumsum of g over the valid rows; padding g = 0, beta = 0) while the loads fly.
  if (tid < kC) load_gates_scan(p, tid, len, b, t0, hv, sGam[tid], sBeta[tid]);
  for (int i = tid; i < 8 * 64; i += 256) sColR[i] = 0.f;
  __syncthreads();
  if (tid >= 32 && tid < kC) sGam[tid] += sGam[31];
  __syncthreads();
  const float gl = sGam[len - 1];

  // Each warpgroup computes half of the columns (N) of every product: wgmma N = 64 for the
  // 64 x 128 products and N = 32 for the 64 x 64 ones. B operands are the column halves.
  auto mma_kmn = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::MN>());
  auto mma_kk = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
  auto mma_mn = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::MN, GMMA::Major::MN>());
  auto mma_kk32 = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _32, _16>, GMMA::Major::K, GMMA::Major::K>());
  auto img = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::TokD_K{}); };     // (tok, d|v)
  auto imgT = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::DTok_MN{}); };   // (d|v, tok)
  auto tt = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::TokTok_K{}); };    // (i, j)
  auto ttT = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::TokTok_MN{}); };  // (j, i)
  auto tv = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::TokV_K{}); };      // (tok, v): -dU
  auto vtk = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::VTok_MN{}); };    // (v, tok): -dU
  auto dd = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::DD_K{}); };        // (d, v)
  auto ddT = [](T* ptr) { return make_tensor(make_smem_ptr(ptr), typename L::DD_MN{}); };      // (v, d)
  // This warpgroup's half of a B operand (N rows 64 wg .. 64 wg + 63, or 32 wg .. for N = 32).
  auto half = [&](auto t) { return local_tile(t, make_shape(Int<64>{}, size<1>(t)), make_coord(wg, 0)); };
  auto half32 = [&](auto t) { return local_tile(t, make_shape(Int<32>{}, size<1>(t)), make_coord(wg, 0)); };
  T* swz = reinterpret_cast<T*>(sm);
  auto tokd = [&](int r, int c) { return img_off<typename L::TokD_K>(swz, r, c); };
  auto toktok = [&](int r, int c) { return img_off<typename L::TokTok_K>(swz, r, c); };
  Tensor acc = partition_fragment_C(mma_kk, Shape<_64, _64>{});   // scratch 64 x 64 (half of 64 x 128)
  Tensor accK = partition_fragment_C(mma_kk, Shape<_64, _64>{});  // dK (this half)
  Tensor acc32 = partition_fragment_C(mma_kk32, Shape<_64, _32>{});
  Tensor cc = mma_kk.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _64>{}));
  Tensor c32 = mma_kk32.get_thread_slice(wt).partition_C(make_identity_tensor(Shape<_64, _32>{}));
  const int co = 64 * wg, co32 = 32 * wg;  // this warpgroup's first column
  // Per-row values of my two rows r0, r0 + 8.
  const int r0 = 16 * (wt >> 5) + (lane >> 2);
  float rg[2], rb[2], reg_[2];
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    rg[h] = sGam[r];
    rb[h] = sBeta[r];
    reg_[h] = exp2_approx(sGam[r] * kLog2e);  // e^gamma
  }
  // a_i, x_i, dbeta_i partials (quad-reduced) and my partial row sums of R (not yet).
  float aR[2] = {0.f, 0.f}, xR[2] = {0.f, 0.f}, dbR[2] = {0.f, 0.f}, rR[2] = {0.f, 0.f};
  mbar_wait(&bar[0], 0);
  if (len < kC) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      zero_box_rows(smem_u32(sm + kGsA + h * kQKBytes / 2), len, tid, 256);
      zero_box_rows(smem_u32(sm + kGsB + h * kQKBytes / 2), len, tid, 256);
      zero_box_rows(smem_u32(sm + kGsC + h * kQKBytes / 2), len, tid, 256);
    }
    fence_async_smem();
    __syncthreads();
  }

  // (B15) U = Uv - W S; U, X = diag(e^(Gamma-gamma)) U and Uv as 16-bit images.
  mma_ss(mma_kmn, wt, img(sW), half(ddT(sS)), acc, false);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(cc(i)), c = get<1>(cc(i)) + co, h = (r >> 3) & 1;
    const float2 u2 = *reinterpret_cast<const float2*>(sUv32 + (c / kUT) * (kC * kUT) + u_index(r, c % kUT));
    const float x0 = u2.x - acc(i), x1 = u2.y - acc(i + 1);
    const float gk = r < len ? exp2_approx((gl - rg[h]) * kLog2e) : 0.f;
    const int off = tokd(r, c);
    *reinterpret_cast<uint32_t*>(sU + off) = pack2<T>(x0, x1);
    *reinterpret_cast<uint32_t*>(sX + off) = pack2<T>(gk * x0, gk * x1);
    *reinterpret_cast<uint32_t*>(sUvi + off) = pack2<T>(u2.x, u2.y);
  }
  fence_async_smem();
  __syncthreads();
  if (tid == 0) {  // Uv fp32 is dead: dSn takes its slot
    mbar_expect_tx(&bar[1], kDK * kDV * 2);
    bulk_g2s(sdS, static_cast<const T*>(p.dsn) + region * (kDK * kDV), kDK * kDV * 2, &bar[1]);
  }

  // (B16, B17, B30) dP = dO U^T; dA = scale causal(E o dP), R1 = strict(dP o P) (rows < len).
  mma_ss(mma_kk32, wt, img(sO), half32(img(sU)), acc32, false);
  __syncthreads();  // U is dead: dA takes its slot
  {
    Tensor rr = make_fragment_like(acc32);
    CUTE_UNROLL
    for (int i = 0; i < size(acc32); i += 2) {
      const int r = get<0>(c32(i)), c = get<1>(c32(i)) + co32, h = (r >> 3) & 1;
      const int off = toktok(r, c);
      const float2 ph = unpack2<T>(*reinterpret_cast<const uint32_t*>(sP + off));
      const float2 pl = unpack2<T>(*reinterpret_cast<const uint32_t*>(sP + kImgTokTok + off));
      const float pv[2] = {ph.x + pl.x, ph.y + pl.y};
      const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
      const float gcv[2] = {gc.x, gc.y};
      float da[2];
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) {
        const bool causal = r < len && r >= c + e;
        const float E = causal ? exp2_approx(fminf(rg[h] - gcv[e], 0.f) * kLog2e) : 0.f;
        const float dp = acc32(i + e);
        da[e] = p.scale * E * dp;
        rr(i + e) = causal && r > c + e ? dp * pv[e] : 0.f;
      }
      *reinterpret_cast<uint32_t*>(sdA + off) = pack2<T>(da[0], da[1]);
      rR[h] += rr(i) + rr(i + 1);
    }
    add_col_sums(rr, c32, sColR + warp * 64, co32, lane);
  }
  fence_async_smem();
  __syncthreads();

  // (B18) dQ = diag(scale e^gamma) dO S^T + dA K; a_i += <scale e^gamma_i (dO S^T)_i, Q_i>.
  mma_ss(mma_kk, wt, img(sO), half(dd(sS)), acc, false);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int r = get<0>(cc(i)), h = (r >> 3) & 1;
    acc(i) *= r < len ? p.scale * reg_[h] : 0.f;
  }
  {
    const float2 a1 = row_dot<T, typename L::TokD_K>(acc, cc, sQ, co);
    aR[0] += a1.x;
    aR[1] += a1.y;
  }
  mma_ss(mma_kmn, wt, tt(sdA), half(imgT(sK)), acc, true);
  {
    float* dq = p.dqp + ((b * p.T + t0) * p.HV + hv) * kDK + co;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int r = get<0>(cc(i)), c = get<1>(cc(i));
      if (r < len) *reinterpret_cast<float2*>(dq + static_cast<int64_t>(r) * p.HV * kDK + c) = make_float2(acc(i), acc(i + 1));
    }
  }
  __syncthreads();  // dO is dead (last read by dO S^T): V takes its slot
  if (tid == 0) {
    fence_async_smem();
    mbar_expect_tx(&bar[2], kQKBytes);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) tma_load_4d(sm + kGsC + h * kQKBytes / 2, &p.tmv, h * 64, hv, tok, bb, &bar[2]);
  }

  // (B19) dK = dA^T Q.
  mma_ss(mma_mn, wt, ttT(sdA), half(imgT(sQ)), accK, false);
  // (B21) dW = -dU S^T (the slot holds -dU).
  mma_ss(mma_kk, wt, tv(sndU), half(dd(sS)), acc, false);
  __syncthreads();  // Q is dead: dW takes its slot
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(cc(i)), c = get<1>(cc(i)) + co;
    *reinterpret_cast<uint32_t*>(sdW + tokd(r, c)) = pack2<T>(acc(i), acc(i + 1));
  }
  fence_async_smem();
  __syncthreads();

  // (B23, B24, B29) dVb = Tm^T dU; dv = diag(beta) dVb; dbeta_i += <dVb_i, V_i>.
  mma_ss(mma_mn, wt, ttT(sTm), half(vtk(sndU)), acc, false);  // = -dVb
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) = -acc(i);
  mbar_wait(&bar[2], 0);
  if (len < kC) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) zero_box_rows(smem_u32(sm + kGsC + h * kQKBytes / 2), len, tid, 256);
    fence_async_smem();
    __syncthreads();
  }
  {
    const float2 d1 = row_dot<T, typename L::TokD_K>(acc, cc, sV, co);
    dbR[0] += d1.x;
    dbR[1] += d1.y;
    T* dvg = static_cast<T*>(p.dv) + b * p.sdv[0] + static_cast<int64_t>(hv) * p.sdv[2];
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int r = get<0>(cc(i)), c = get<1>(cc(i)) + co, h = (r >> 3) & 1;
      *reinterpret_cast<uint32_t*>(sdVb + tokd(r, c)) = pack2<T>(acc(i), acc(i + 1));
      if (r < len)
        *reinterpret_cast<uint32_t*>(dvg + (t0 + r) * p.sdv[1] + c) = pack2<T>(rb[h] * acc(i), rb[h] * acc(i + 1));
    }
  }
  fence_async_smem();
  __syncthreads();

  // (B23, B24, B29, B31) dKb = Tm^T dW; dK_b = diag(beta e^gamma) dKb.
  mma_ss(mma_mn, wt, ttT(sTm), half(imgT(sdW)), acc, false);
  {
    const float2 kd = row_dot<T, typename L::TokD_K>(acc, cc, sK, co);  // <dKb_i, K_i> (this half)
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float kdh = h ? kd.y : kd.x;
      dbR[h] += reg_[h] * kdh;
      aR[h] += rb[h] * reg_[h] * kdh;
    }
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int r = get<0>(cc(i)), c = get<1>(cc(i)) + co, h = (r >> 3) & 1;
      *reinterpret_cast<uint32_t*>(sdKb + tokd(r, c)) = pack2<T>(acc(i), acc(i + 1));
      const float s = rb[h] * reg_[h];
      accK(i) += s * acc(i);
      accK(i + 1) += s * acc(i + 1);
    }
  }
  fence_async_smem();
  __syncthreads();

  // (B25, B26, B30) dL = strict(-(dVb Uv^T + dKb W^T)), L = strict(diag(beta) E o K K^T),
  // R2 = dL o L, dM = E o dL; and the diag(beta) K image.
  mma_ss(mma_kk32, wt, img(sdVb), half32(img(sUvi)), acc32, false);
  mma_ss(mma_kk32, wt, img(sdKb), half32(img(sW)), acc32, true);
  {
    Tensor accKK = partition_fragment_C(mma_kk32, Shape<_64, _32>{});
    mma_ss(mma_kk32, wt, img(sK), half32(img(sK)), accKK, false);
    CUTE_UNROLL
    for (int i = 0; i < size(acc32); i += 2) {
      const int r = get<0>(c32(i)), c = get<1>(c32(i)) + co32, h = (r >> 3) & 1;
      const float2 gc = *reinterpret_cast<const float2*>(sGam + c);
      const float gcv[2] = {gc.x, gc.y};
      float dm[2];
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) {
        const bool strict = r > c + e;
        const float E = strict ? exp2_approx(fminf(rg[h] - gcv[e], 0.f) * kLog2e) : 0.f;
        const float dl = strict ? -acc32(i + e) : 0.f;
        accKK(i + e) = dl * rb[h] * E * accKK(i + e);  // R2
        dm[e] = E * dl;
      }
      *reinterpret_cast<uint32_t*>(sdM + toktok(r, c)) = pack2<T>(dm[0], dm[1]);
      rR[h] += accKK(i) + accKK(i + 1);
    }
    add_col_sums(accKK, c32, sColR + warp * 64, co32, lane);
  }
  CUTE_UNROLL
  for (int k = 0; k < 4; ++k) {  // diag(beta) K (-dU was last read by Tm^T dU)
    const int u = tid + 256 * k, r = u >> 4, c8 = (u & 15) * 8;
    const int off = tokd(r, c8);
    const uint4 kx = *reinterpret_cast<const uint4*>(sK + off);
    const uint32_t* pk = &kx.x;
    uint4 y;
    uint32_t* py = &y.x;
    const float br = sBeta[r];
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) {
      const float2 f = unpack2<T>(pk[e]);
      py[e] = pack2<T>(br * f.x, br * f.y);
    }
    *reinterpret_cast<uint4*>(sBK + off) = y;
  }
  fence_async_smem();
  __syncthreads();

  // (B20, B32) dK_d = X dSn^T; x_i = <dK_d_i, K_i>. And e^Gamma <dSn, S> (same image layout).
  mbar_wait(&bar[1], 0);
  mma_ss(mma_kk, wt, img(sX), half(dd(sdS)), acc, false);
  {
    const float2 x = row_dot<T, typename L::TokD_K>(acc, cc, sK, co);
    xR[0] += x.x;
    xR[1] += x.y;
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) accK(i) += acc(i);
  {
    float part = 0.f;
    CUTE_UNROLL
    for (int k = 0; k < 8; ++k) {
      const int u = tid + 256 * k;
      const uint4 a = reinterpret_cast<const uint4*>(sS)[u], d = reinterpret_cast<const uint4*>(sdS)[u];
      const uint32_t* pa = &a.x;
      const uint32_t* pd = &d.x;
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const float2 x = unpack2<T>(pa[e]), y = unpack2<T>(pd[e]);
        part += x.x * y.x + x.y * y.y;
      }
    }
    CUTE_UNROLL
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) sRed[warp] = part;
  }

  // (B27, B29) dM K: dbeta_i += <(dM K)_i, K_i>, dK += diag(beta) dM K; dK += dM^T diag(beta) K.
  mma_ss(mma_kmn, wt, tt(sdM), half(imgT(sK)), acc, false);
  {
    const float2 kd = row_dot<T, typename L::TokD_K>(acc, cc, sK, co);
    dbR[0] += kd.x;
    dbR[1] += kd.y;
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) accK(i) += rb[(get<0>(cc(i)) >> 3) & 1] * acc(i);
  }
  mma_ss(mma_mn, wt, ttT(sdM), half(imgT(sBK)), accK, true);
  {
    float* dk = p.dkp + ((b * p.T + t0) * p.HV + hv) * kDK + co;
    CUTE_UNROLL
    for (int i = 0; i < size(accK); i += 2) {
      const int r = get<0>(cc(i)), c = get<1>(cc(i));
      if (r < len) *reinterpret_cast<float2*>(dk + static_cast<int64_t>(r) * p.HV * kDK + c) = make_float2(accK(i), accK(i + 1));
    }
  }

  // dbeta, and dg (B33): dg_t = sum_{i >= t} a_i + sum_{i < t} x_i + e^Gamma <dSn, S>, where a_i
  // also collects the row sums of R minus its column sums. Both warpgroups' halves are summed.
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    rR[h] += __shfl_xor_sync(0xffffffffu, rR[h], 1);
    rR[h] += __shfl_xor_sync(0xffffffffu, rR[h], 2);
  }
  if ((lane & 3) == 0) {
    float* pw = sPart + wg * 4 * 64;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      pw[r] = aR[h] + rR[h];
      pw[64 + r] = xR[h];
      pw[128 + r] = dbR[h];
    }
  }
  __syncthreads();  // column sums of R, the halves and the <dSn, S> partials are complete
  float* sA = sPart + 3 * 64;        // a_i (wg 0's R-row slot is free now)
  float* sXr = sPart + 4 * 64 + 3 * 64;
  if (tid < kC) {
    const int r = tid;
    float col = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < 8; ++w) col += sColR[w * 64 + r];
    const float a = sPart[r] + sPart[256 + r] - col;
    const float x = sPart[64 + r] + sPart[256 + 64 + r];
    const float db = sPart[128 + r] + sPart[256 + 128 + r];
    sA[r] = a;
    sXr[r] = x;
    if (r < len) store_f(p.dbeta, p.db_dt, b * p.sdb[0] + (t0 + r) * p.sdb[1] + hv, db);
  }
  __syncthreads();
  if (tid < len) {
    float s = expf(gl) * (sRed[0] + sRed[1] + sRed[2] + sRed[3] + sRed[4] + sRed[5] + sRed[6] + sRed[7]);
    for (int i = tid; i < kC; ++i) s += sA[i];
    for (int i = 0; i < tid; ++i) s += sXr[i];
    store_f(p.dg, p.dg_dt, b * p.sdg[0] + (t0 + tid) * p.sdg[1] + hv, s);
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
