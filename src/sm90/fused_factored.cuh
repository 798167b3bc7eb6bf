// The fused forward's recurrence in the factored transfer form (docs/fused.md section 7, v3b):
// the same inputs and outputs as gdn_fwd_chunks at V tile 64 or 128 (fused_chunks.cuh), with
// two products on the chain per chunk instead of three. Test builds only (set_test_fused_form) until
// it is measured against gdn_fwd_chunks on the device.
//
// Per chunk, with W = A Tu (A = scale e^(gamma_i - gamma_j) Q K^T, i >= j), D1 = diag(e^gamma)
// and D2 = diag(e^(Gamma - gamma)):
//   F = D2 Tu D1 K,  E = D2 Tu V,  G = diag(scale e^gamma) Q - W D1 K,  H = W V,
//   S' = e^Gamma S + K^T (E - F S),   O = G S + H.
// F, G, W and D2 Tu come from the aux warpgroup one chunk ahead; everything with the state from
// the math warpgroups, which hold S^T (v, d) in fp32 accumulators as gdn_fwd_chunks does:
//   X^T  = V^T (D2 Tu)^T - S^T F^T          64 x 64 x 192   chain (the V^T half needs no state)
//   S'^T = e^Gamma S^T + X^T K               64 x 128 x 64   chain
//   O^T  = S^T G^T + V^T W^T                64 x 64 x 192   after the chain's products
// Units as gdn_fwd_chunks: row v of S^T, V^T and X^T in 2^esc_v; K' = diag(2^ek) K, Q' =
// diag(2^eq) Q, Tu' = 2^et diag(2^-ek) Tu. The aux makes Tu'' = diag(e^(Gamma - gamma)) Tu'
// (= 2^(et - ek) D2 Tu) and F' = Tu'' diag(e^gamma 2^-ek) K' (= 2^(et - ek) F); the math takes
// 2^-et off X (an fp32 multiply before its fp16 copy, as gdn_fwd_chunks does for its X), so X'^T
// carries 2^-ek per token and X'^T K' is S's update. O carries 2^(eq + et + dl) per token: W'' =
// 2^dl W' (W' = 2^(eq + et) W from Q', K', Tu') and G'' = diag(scale e^gamma 2^(et + dl)) Q' -
// W'' diag(e^gamma 2^-ek) K', with dl <= 0 chosen per chunk so that G'' stays below 2^14 when et
// is large (small beta); dl = 0 for unit keys with some beta >= 1/2. In such chunks V's side of
// the rows' unit window also moves up (up to 2^4), since X ~ beta V would otherwise fall to fp16
// subnormals when S ~ beta V (no h0). precision_model.py --kernel-units checks these units on
// inputs far from unit norm and on small beta.
// Precision (bench/precision_model.py --factored): o 1.73e-3, state 4.30e-4 over the benchmark,
// strong-decay and g = 0 cases (v2: 1.74e-3 / 4.79e-4).
//
// Warp roles (2 + kMathWGs warpgroups; registers 40 / 160 / 232 at V tile 64, 24 / 88 / 200 / 200
// at 128):
//   WG0 warp 0 producer: TMA of K|Q, the V tile, the region's Tu image and gates into a 3-stage
//       ring (`full` / `empty`), as gdn_fwd_chunks (produce_chunk).
//   WG0 warps 1-3 output store: chunk c's O tile from slot c % 2 (`oready`), then `afree`.
//   WG1 aux: K' and Q' to fp16 in place, Q K^T, A, W; then W'' into slot c % 2, G'' over Q' and
//       Tu'' over Tu' in the stage, -F' into slot c % 2 (once `afree` says chunk c - 2's O left
//       it); `aready`.
//   WG2.. math, 64 v rows each: the table above; `fdone` when both are done reading F' (its
//       bytes then stage O), `empty` when done with the stage.
#pragma once

#include "fused_chunks.cuh"

namespace qla {
namespace sm90 {
namespace {

template <int kMathWGs_>
struct FactoredCfg {
  static constexpr int kMathWGs = kMathWGs_;  // V tile 64 (one) or 128 (two, sharing the loads and the aux)
  static constexpr int kVT = 64 * kMathWGs;
  static constexpr int kStages = 3;  // the TMA ring
  static constexpr int kSlots = 2;   // the aux's outputs (the aux runs at most one chunk ahead)
  static constexpr int kThreads = 128 * (2 + kMathWGs);
  // Stage: K|Q (QK_K; the aux writes G'' over Q'), the V tile (two 64-column boxes), the region's
  // Tu image, its gates, then the aux's per-token factors (as FusedCfg).
  static constexpr uint32_t kQK = 0, kV = 2 * kQKBytes, kTu = kV + kC * kVT * 2, kGates = kTu + kImgTokTok * 2;
  static constexpr uint32_t kGateCopy = (kInvRegionTail - kInvGam + 15) & ~15u;
  static constexpr uint32_t kEgZ = kGates + 1024, kEgP = kEgZ + kC * 4, kInvTok = kEgP + kC * 4;
  static constexpr uint32_t kStageBytes = kGates + 2048;
  static constexpr uint32_t kTx = 2 * kQKBytes + kC * kVT * 2 + kImgTokTok * 2 + kGateCopy;
  // Slot: F' (TokD_K, 64 x 128 fp16), reused as chunk c's O staging once both math warpgroups
  // have read F' (64 tokens x 128 v, rows of 256 bytes, 16-byte chunks XOR-swizzled by token);
  // then W'' (TokTok_K).
  static constexpr uint32_t kF = 0, kW = kImgTokD * 2, kSlotBytes = kW + kImgTokTok * 2;
  static constexpr uint32_t kSlot0 = kStages * kStageBytes;
  static constexpr uint32_t kBar = kSlot0 + kSlots * kSlotBytes;
  // full, empty [kStages]; aready, fdone, oready, afree [kSlots]
  static constexpr uint32_t kFlags = kBar + (2 * kStages + 4 * kSlots) * 8;
  static constexpr size_t kSmem = 1024 + kFlags + 16;
  static_assert(kSmem <= 232448, "factored recurrence smem over the 227 KiB limit");
  static_assert(kGateCopy <= 1024 && kInvTok + kC * 4 <= kStageBytes, "stage parts overlap");
  static_assert(kStageBytes % 1024 == 0 && kSlotBytes % 1024 == 0, "128-byte swizzled operands need 1 KiB alignment");
};

template <class T, int kMathWGs>
__global__ void __launch_bounds__(FactoredCfg<kMathWGs>::kThreads, 1) gdn_fwd_factored(const __grid_constant__ RecParams p) {
  using Cfg = FactoredCfg<kMathWGs>;
  using H = cutlass::half_t;
  using LH = Lay<H>;
  constexpr int kStages = Cfg::kStages, VT = Cfg::kVT;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBar);
  uint64_t* empty = full + kStages;
  uint64_t* aready = empty + kStages;  // [slot]: the aux's outputs for the chunk are in place
  uint64_t* fdone = aready + 2;        // [slot]: both math warpgroups have read its F'
  uint64_t* oready = fdone + 2;        // [slot]: its O tile is staged
  uint64_t* afree = oready + 2;        // [slot]: the store threads have copied the O tile out

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
  wait_for_previous_kernels();  // the chunk table and the inverse kernel's regions
  const PieceCta tile = piece_cta(p);
  const int vt = tile.vt, n = tile.n, hv = tile.hv;
  const int64_t b = tile.b, t0 = tile.t0, slen = tile.slen;
  if (fused_cta_idle<T>(p, tile)) return;
  int* sflags = reinterpret_cast<int*>(sm + Cfg::kFlags);
  piece_path_flags(p, tile, sflags, tid);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128 * Cfg::kMathWGs);
    }
    for (int s = 0; s < Cfg::kSlots; ++s) {
      mbar_init(&aready[s], 128);
      mbar_init(&fdone[s], 128 * Cfg::kMathWGs);
      mbar_init(&oready[s], 128 * Cfg::kMathWGs);
      mbar_init(&afree[s], kFusedStoreThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const PieceRole role = piece_role(p, tile, kDV / VT, sflags[0] != 0, sflags[1]);
  if (!role.run) return;
  const int nch = role.nch, c0 = role.c0, nwarm = role.nwarm;
  auto stage = [&](int c) { return sm + (c % kStages) * Cfg::kStageBytes; };
  auto slot = [&](int c) { return sm + Cfg::kSlot0 + (c & 1) * Cfg::kSlotBytes; };
  auto parity = [&](int c) { return static_cast<uint32_t>((c / kStages) & 1); };
  auto slot_parity = [&](int c) { return static_cast<uint32_t>((c >> 1) & 1); };

  if (wg == 0) {
    // ---------------- producer and output store ----------------
    // Register budgets (per thread): 40 / 160 / 232 with one math warpgroup, 24 / 88 / 200
    // with two (the 64 Ki registers of the SM).
    if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
    if (wt >= 32) {
      const int st_t = wt - 32;
      T* ob = static_cast<T*>(p.o) + b * p.so[0] + static_cast<int64_t>(hv) * p.so[2] + vt * VT;
      const bool vec = (reinterpret_cast<uintptr_t>(ob) & 15) == 0 && (p.so[1] & 7) == 0;
      for (int c = 0; c < nch; ++c) {
        const T* sO = reinterpret_cast<const T*>(slot(c) + Cfg::kF);
        const int64_t cs = static_cast<int64_t>(c0 + c) * kC;  // within the sequence
        const int rows = role.out && c >= nwarm ? static_cast<int>(min<int64_t>(kC, slen - cs)) : 0;
        mbar_wait(&oready[c & 1], slot_parity(c));
        copy_o_rows<T, VT>(sO, [](int j, int e) { return o_stage_at<VT>(j, e); }, ob + (t0 + cs) * p.so[1], p.so[1], rows, st_t, vec);
        mbar_arrive(&afree[c & 1]);
      }
      return;
    }
    if (wt == 0) run_producer<Cfg>(p, tile, role, sm, full, empty);
    return;
  }

  // The B operand of the 64 x 128 products with K' (d, tok), and of the 64 x 64 ones.
  auto mmaS = make_tiled_mma(SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = K' as (d, tok)
  auto mma64 = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});   // B (n, k) K-major
  auto thrS = mmaS.get_thread_slice(wt);
  auto thr64 = mma64.get_thread_slice(wt);
  Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_64, _128>{}));  // (row, d) of a 64 x 128 accumulator
  Tensor c64 = thr64.partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (row, col) of a 64 x 64 one
  const int lane = wt & 31, w = wt >> 5;

  if (wg == 1) {
    // ---------------- aux: K', Q', W'', G'', F' ----------------
    if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 160;" ::: "memory");
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 88;" ::: "memory");
    auto mmaH = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = K' as (d, tok)
    auto thrH = mmaH.get_thread_slice(wt);
    // G'' stays below 2^14 when scale < 2^es.
    const int es = max(0, float_exponent(p.scale) + 1);
    QLA_PHASES(8);  // wait, exponents, conversion, factors, Q K^T, A and W, G, F
    for (int c = 0; c < nch; ++c) {
      uint8_t* stb = stage(c);
      uint8_t* slb = slot(c);
      H* sQK = reinterpret_cast<H*>(stb + Cfg::kQK);
      const H* sTu = reinterpret_cast<const H*>(stb + Cfg::kTu);
      const float* sGam = reinterpret_cast<const float*>(stb + Cfg::kGates);
      const float* sEgZ = reinterpret_cast<const float*>(stb + Cfg::kEgZ);
      const float* sEgP = reinterpret_cast<const float*>(stb + Cfg::kEgP);
      const float* sEgk = sGam + (kInvEgk - kInvGam) / 4;  // e^(Gamma - gamma) 2^-et after aux_convert_qk
      // (Fragments declared per chunk: none of them carries a value from one chunk to the next.)
      AuxAcc acc;  // W' = A' Tu' (i, j)
      Tensor rWn = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // -W'' diag(e^gamma 2^-ek): G's A operand
      Tensor rTuS = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // -Tu'' diag(e^gamma 2^-ek): F's A operand
      Tensor accH = partition_fragment_C(mmaH, Shape<_64, _64>{});  // 64 columns of G'', then of -F'
      mbar_wait(&full[c % kStages], parity(c));
      QLA_PHASE(0);
      const int et = tu_exp_of<Cfg>(stb);
      const int dl = min(0, 13 - et - es);
      aux_convert_qk<T, Cfg>(p, stb, wt, dl QLA_PHASE_PASS);
      QLA_PHASE(3);
      const int len = static_cast<int>(min<int64_t>(kC, slen - static_cast<int64_t>(c0 + c) * kC));
      aux_scores_w(sQK, sTu, sGam, len, p.scale, wt, acc QLA_PHASE_PASS);
      QLA_PHASE(5);

      // The slot is free once the store threads have copied chunk c - 2's O out of it.
      if (c >= 2) mbar_wait(&afree[c & 1], slot_parity(c) ^ 1);
      // W'' = 2^dl W' into the slot (H's B operand, (i, j)); -W'' diag(e^gamma 2^-ek) as G's A operand.
      const float sdl = pow2i(dl);
      {
        Tensor tW = make_tensor(make_smem_ptr(reinterpret_cast<H*>(slb + Cfg::kW)), typename LH::TokTok_K{});
        stmatrix_rows<64>(tW, wt, [&](int i) { return acc(i) * sdl; });
      }
      CUTE_UNROLL
      for (int i = 0; i < size(acc); i += 2) {
        const float2 z = *reinterpret_cast<const float2*>(sEgZ + get<1>(c64(i)));
        rWn(i) = H(-sdl * z.x * acc(i));
        rWn(i + 1) = H(-sdl * z.y * acc(i + 1));
      }
      // G'' = -W'' diag(e^gamma 2^-ek) K' + diag(scale e^gamma 2^(et + dl)) Q' (Q' from its rows),
      // in two halves of 64 columns d (32 accumulator registers each: the aux has 88).
      Tensor tKt = make_tensor(make_smem_ptr(sQK), QK_MN{});  // K' as (d, tok): rows 0-63 of the K|Q operand
      Tensor tQ = local_tile(make_tensor(make_smem_ptr(sQK), QK_K{}), Shape<_64, _128>{}, make_coord(1, 0));  // Q' (i, d)
      auto half_product = [&](auto& rA, int h) {
        Tensor rKt = thrH.partition_fragment_B(local_tile(tKt, Shape<_64, _64>{}, make_coord(h, 0)));
        warpgroup_fence_operand(rA);
        warpgroup_fence_operand(accH);
        warpgroup_arrive();
        gemm_k(mmaH, rA, rKt, accH, GMMA::ScaleOut::Zero);
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(accH);
      };
      const int g8 = lane >> 2, t4 = lane & 3;
      const float egp[2] = {sEgP[16 * w + g8], sEgP[16 * w + g8 + 8]};
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        half_product(rWn, h);
        CUTE_UNROLL
        for (int kb = 0; kb < 4; ++kb) {  // Q' by ldmatrix: its fragment order is the accumulator's
          uint32_t q4[4];
          ldsm_x4(smem_u32(&tQ(16 * w + (lane & 15), 64 * h + 16 * kb + 8 * (lane >> 4))), q4);
          CUTE_UNROLL
          for (int r = 0; r < 4; ++r) {  // elements 8 kb + 2 r, + 1: row half r & 1
            const float2 q = unpack2<H>(q4[r]);
            accH(8 * kb + 2 * r) += egp[r & 1] * q.x;
            accH(8 * kb + 2 * r + 1) += egp[r & 1] * q.y;
          }
        }
        // Before the first G'' store: every warp's Q K^T and W = A Tu' done (the stores below and
        // Tu'' replace their operands); each warp then reads and writes only its own 16 rows.
        if (h == 0) wg_bar(kBarAux);
        Tensor tG = local_tile(tQ, Shape<_64, _64>{}, make_coord(0, h));
        stmatrix_rows<64>(tG, wt, [&](int i) { return accH(i); });
      }
      QLA_PHASE(6);

      // Tu'' = diag(e^(Gamma - gamma)) Tu' in place (E's B operand), and -F' = -Tu''
      // diag(e^gamma 2^-ek) K' into the slot. Both keep Tu''s 2^et (a chunk of tiny beta would
      // leave fp16's range without it); the math takes 2^-et off X. Tu's rows come by ldmatrix (lane l: row l % 16,
      // columns 8 (l / 16) of each 16-column block) and go back by stmatrix to the same
      // addresses (each warp its own 16 rows).
      {
        Tensor tTu = make_tensor(make_smem_ptr(const_cast<H*>(sTu)), typename LH::TokTok_K{});
        const float p2et = pow2i(et);  // sEgk holds e^(Gamma - gamma) 2^-et
        const float egk[2] = {sEgk[16 * w + g8] * p2et, sEgk[16 * w + g8 + 8] * p2et};
        CUTE_UNROLL
        for (int kb = 0; kb < 4; ++kb) {
          uint32_t a[4];
          const uint32_t addr = smem_u32(&tTu(16 * w + (lane & 15), 16 * kb + 8 * (lane >> 4)));
          ldsm_x4(addr, a);
          CUTE_UNROLL
          for (int r = 0; r < 4; ++r) {  // register r: row 16 w + g8 + 8 (r & 1), columns 16 kb + 8 (r / 2) + 2 t4, + 1
            const float2 x = unpack2<H>(a[r]);
            a[r] = pack2<H>(x.x * egk[r & 1], x.y * egk[r & 1]);
            const float2 y = unpack2<H>(a[r]);
            const float2 z = *reinterpret_cast<const float2*>(sEgZ + 16 * kb + 8 * (r >> 1) + 2 * t4);
            rTuS(8 * kb + 2 * r) = H(-y.x * z.x);
            rTuS(8 * kb + 2 * r + 1) = H(-y.y * z.y);
          }
          stmatrix4(addr, a[0], a[1], a[2], a[3]);
        }
      }
      {
        Tensor tF = make_tensor(make_smem_ptr(reinterpret_cast<H*>(slb + Cfg::kF)), typename LH::TokD_K{});
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          half_product(rTuS, h);
          Tensor tFh = local_tile(tF, Shape<_64, _64>{}, make_coord(0, h));
          stmatrix_rows<64>(tFh, wt, [&](int i) { return accH(i); });
        }
      }
      fence_async_smem();  // the generic stores before the math warpgroups' wgmma reads
      mbar_arrive(&aready[c & 1]);
      QLA_PHASE(7);
    }
    QLA_PHASES_PRINT("aux (wait, exponents, convert, factors, QK^T, A and W, G, F)", 8, nch);
    return;
  }

  // ---------------- math: the chain ----------------
  if constexpr (kMathWGs == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  else asm volatile("setmaxnreg.inc.sync.aligned.u32 200;" ::: "memory");
  const int mw = wg - 2;  // this math warpgroup's 64 v rows of the tile
  Tensor accS = partition_fragment_C(mmaS, Shape<_64, _128>{});  // S^T (v, d), row v in units 2^esc_v
  // Register A operands (fp16), element i of each the element i of the accumulator it comes from.
  Tensor rS16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});

  const int v0 = vt * VT + 64 * mw;  // the first of this warpgroup's columns of [V | K]
  float* maps = p.maps ? map_at(p, tile.map - (role.init == kInitMaps), hv) : nullptr;
  load_entering_state(p, role.init, n, hv, v0, maps, accS, cS);
  int esc[2] = {0, 0};  // row v's units: 2^esc
  QLA_PHASES(8);

  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    uint8_t* stb = stage(c);
    uint8_t* slb = slot(c);
    const H* sQK = reinterpret_cast<const H*>(stb + Cfg::kQK);
    const H* sTu = reinterpret_cast<const H*>(stb + Cfg::kTu);
    const float* sG = reinterpret_cast<const float*>(stb + Cfg::kGates);
    const float* sInvTok = reinterpret_cast<const float*>(stb + Cfg::kInvTok);
    const T* sV = reinterpret_cast<const T*>(stb + Cfg::kV) + mw * kC * 64;
    // (Fragments declared per chunk: none of them carries a value from one chunk to the next.)
    Tensor accX = partition_fragment_C(mma64, Shape<_64, _64>{});  // X'^T (v, tok)
    Tensor accO = partition_fragment_C(mma64, Shape<_64, _64>{});  // O''^T (v, tok)
    Tensor rV16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // V^T (v, tok) in the row units
    Tensor rX16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // X'^T
    static_assert(size(decltype(accS){}) == size(decltype(rS16){}) && size(decltype(accX){}) == size(decltype(rX16){}),
                  "A operands are the accumulators' elements");
    mbar_wait(&full[st], parity(c));
    mbar_wait(&aready[c & 1], slot_parity(c));
    QLA_PHASE(0);
    const float eG = sG[(kInvEG - kInvGam) / 4];
    const float kn = sG[(kInvKn - kInvGam) / 4];  // bounds the chunk's key norms (>= 1)
    uint32_t vp[16];  // this thread's V^T pairs
    load_vt_pairs(sV, wt, vp);
    // In a chunk of small beta (et > 1) X ~ beta V: V's rows may go up to 2^4 higher in the
    // units (S's bound unchanged), which keeps X out of fp16's subnormals while V and X stay
    // below 2^15.
    const int et = tu_exp_of<Cfg>(stb);
    float f[2], sc[2];  // this chunk's change of units, and its units
    chunk_units<T>(accS, rS16, vp, kn, esc, f, sc, max(0, min(4, et - 1)));
    CUTE_UNROLL
    for (int k = 0; k < 16; ++k) {  // pair k: elements 2 k, 2 k + 1
      const float2 vv = unpack2<T>(vp[k]);
      const float s_ = sc[acc_half(2 * k)];
      rV16(2 * k) = H(vv.x * s_);
      rV16(2 * k + 1) = H(vv.y * s_);
    }
    QLA_PHASE(1);

    // X'^T = (V^T Tu''^T - S^T F'^T) 2^-et (the chain): E'^T diag(e^(Gamma - gamma) 2^-et) - Y'^T,
    // from -F' and Tu'' (the aux) in one accumulator.
    Tensor rF = thr64.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(slb + Cfg::kF)), typename LH::TokD_K{}));
    Tensor rTu = thr64.partition_fragment_B(make_tensor(make_smem_ptr(sTu), typename LH::TokTok_K{}));
    warpgroup_fence_operand(rS16);
    warpgroup_fence_operand(rV16);
    warpgroup_fence_operand(accX);
    warpgroup_arrive();
    gemm_k(mma64, rS16, rF, accX, GMMA::ScaleOut::Zero);
    gemm_k(mma64, rV16, rTu, accX, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accX);
    mbar_arrive(&fdone[c & 1]);  // this thread's reads of F' are done
    QLA_PHASE(2);
    const float inv_et = pow2i(-et);
    CUTE_UNROLL
    for (int i = 0; i < size(accX); ++i) rX16(i) = H(accX(i) * inv_et);
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) accS(i) *= f[acc_half(i)] * eG;  // new units, decay
    QLA_PHASE(3);

    // S^T += X'^T K' (the chain), then O''^T = S^T G''^T + V^T W''^T.
    Tensor rKs = thrS.partition_fragment_B(local_tile(make_tensor(make_smem_ptr(sQK), QK_MN{}), Shape<_128, _64>{}, make_coord(0, 0)));
    Tensor rG = thr64.partition_fragment_B(local_tile(make_tensor(make_smem_ptr(sQK), QK_K{}), Shape<_64, _128>{}, make_coord(1, 0)));
    Tensor rW = thr64.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(slb + Cfg::kW)), typename LH::TokTok_K{}));
    warpgroup_fence_operand(rX16);
    warpgroup_fence_operand(accS);
    warpgroup_fence_operand(accO);
    warpgroup_arrive();
    gemm_k(mmaS, rX16, rKs, accS, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    gemm_k(mma64, rS16, rG, accO, GMMA::ScaleOut::Zero);
    gemm_k(mma64, rV16, rW, accO, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    float2 inv_tok[8];  // O's per-token factors (this thread's 8 token pairs), loaded while the products run
    CUTE_UNROLL
    for (int k = 0; k < 8; ++k) inv_tok[k] = *reinterpret_cast<const float2*>(sInvTok + get<1>(c64(4 * k)));
    warpgroup_wait<0>();
    warpgroup_fence_operand(accS);
    warpgroup_fence_operand(accO);
    mbar_arrive(&empty[st]);  // every read of the stage is done
    QLA_PHASE(4);

    // O = O''^T in true units into the slot's staging buffer by stmatrix.trans (rows = tokens,
    // this warpgroup's 64 columns), once both math warpgroups are done with F'.
    mbar_wait(&fdone[c & 1], slot_parity(c));
    {
      const uint32_t sO = smem_u32(slb + Cfg::kF);
      stage_o_trans<T, 0>(accO, esc, inv_tok, wt, [&](int tok, int v) { return sO + o_stage_at<VT>(tok, 64 * mw + v) * 2; });
    }
    mbar_arrive(&oready[c & 1]);
    QLA_PHASE(5);
  }
  QLA_PHASES_PRINT("math (wait, units + S16 V16, X + scale, X16, [S|O], O out)", 8, nch);
  store_leaving_state(p, role.end, n, hv, v0, maps, accS, cS, esc);
}

}  // namespace
}  // namespace sm90
}  // namespace qla
