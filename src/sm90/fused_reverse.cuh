// The fused backward's reverse chain (docs/backward.md section 10, build step 2): the gradient of
// the state carried from a sequence's last chunk to its first, d(final state) in, d(initial
// state) out, on the fused forward's roles, loaders and stage layouts (fused_chunks.cuh) and the
// inverse kernel's regions (inverse.cuh: the Tu' image, the gates, the per-token exponents).
//
// Per chunk, last to first (C = 64 tokens, gamma = cumsum g, Gamma = gamma_last; dSn the
// gradient of the state leaving the chunk, dS the one entering it; rows v of the transposed forms):
//   dU^T = dO^T A + dSn^T Kd^T          A_ij = scale e^(gamma_i - gamma_j) q_i.k_j (i >= j),
//                                        Kd = diag(e^(Gamma - gamma)) K
//   dS^T = e^Gamma dSn^T + dO^T Qg - dU^T W,   Qg = diag(scale e^gamma) Q, W = Tu diag(e^gamma) K
// carried in fp16 operands with power-of-two units (bench/reverse_chain_model.py, whose fp64 form
// matches the CPU backend's dh0): the inverse kernel's K = 2^-ek K', Q = 2^-eq Q' and
// Tu' = 2^et diag(2^-ek) Tu, and one unit R_v = 2^esc_v per row of dS^T, kept so that
// max(|dSn^T row| , |D row|) lies in [2^2, 2^6).
//
// One CTA per (sequence, value head, V tile of 64 or 128), 1 + kAuxWGs + kMathWGs warpgroups:
//   WG0 warp 0, producer (one thread): produce_chunk as in the forward, the dO tile in V's slot
//       (d_o's tensor map in RecParams::tmv), the chunks in reverse order, into a ring of kStages.
//   aux, a chunk ahead of the chain, from the raw 16-bit K|Q tile (RevAux's steps; at V tile 64
//       two warpgroups share them, A the scores and the in-place pass, B Kw and W'):
//         A''  = e^(gamma_i - gamma_j) 2^(eq_i + ek_j) q_i.k_j (i >= j, i < len), an fp16 image;
//         Kw   = diag(e^gamma) K into W''s buffer, then over it
//         W'   = -2^-et Tu' Kw (= -diag(2^-ek) W, negated: the math warpgroup accumulates);
//         Kd'  = diag(e^(Gamma - gamma) 2^ek) K and Qg' = diag(e^gamma 2^eq) Q in place;
//         D's per-token factors scale 2^-eq (zero past the sequence's end).
//   math, 64 v rows of dS^T each (fp32 wgmma accumulators, row v in units R_v); per chunk
//         D    = fp16(R_v scale 2^-eq_i dO^T)                     (registers; dO^T by ldmatrix.trans)
//         dU'  = D A'' + dSn' Kd'^T         (64 x 64, k = 64 + 128; it holds R_v 2^ek_j dU^T)
//         dS'  = f e^Gamma dS' + D Qg' + dU' W'                   (64 x 128, k = 64 + 64)
//       with dSn' the fp16 copy of dS'^T leaving the chunk and f the change of units. The chain
//       is the dU' product, its fp16 copy and the W' product; D Qg' runs under the first.
//       With RecParams::grad_frags set, dSn', dU' and their row units also go to memory, for the
//       chunk-parallel gradients kernel (fused_chunks.cuh's kFrag* layout; docs/backward.md
//       section 10).
#pragma once

#include "fused_chunks.cuh"

namespace qla {
namespace sm90 {
namespace {

// kMathWGs math warpgroups of 64 v rows each: V tile 64 (one) or 128 (two, sharing every load and
// the aux's work, as the forward's FusedCfg). V tile 64 splits the aux's work between two
// warpgroups (its step was the aux's: bwd-9, bwd-10 in docs/design.md); V tile 128 has the
// registers for one.
template <int kMathWGs_>
struct RevCfg {
  static constexpr int kMathWGs = kMathWGs_;
  static constexpr int kAuxWGs = kMathWGs == 1 ? 2 : 1;
  static constexpr int kStages = 3;
  static constexpr int kVT = 64 * kMathWGs;
  static constexpr int kThreads = 128 * (1 + kAuxWGs + kMathWGs);
  // Registers per thread by role (setmaxnreg; the SM's 64 Ki registers are 512 per thread of a
  // warpgroup slot): producer, aux (A), aux B (V tile 64), each math warpgroup. The single aux of
  // V tile 128 holds two accumulators in flight (Q K^T, W') and A'': at 120 it spilled 532 bytes
  // and ptxas serialized its wgmma (C7512), as it does the math warpgroups' below 176.
  static constexpr int kRegs[4] = {24, kMathWGs == 1 ? 128 : 136, 128, kMathWGs == 1 ? 232 : 176};
  static constexpr int kEntryRegs = (65536 / kThreads) & ~7;  // what every thread starts with
  static_assert(kRegs[0] + kRegs[1] + (kAuxWGs - 1) * kRegs[2] + kMathWGs * kRegs[3] <= 512,
                "register budgets over the SM's");
  // Stage (1 KiB aligned parts): K|Q stacked as the forward's (raw, then Kd', Qg'); the dO tile
  // (one 64-column box per math warpgroup); the region's Tu' image; A'' (at V tile 128 over Tu':
  // the aux stores it once its W' product has read Tu'); W' (64 tokens x 128 d, TokD_K);
  // the region's gates and exponents (kGateCopy bytes), then D's per-token factors.
  static constexpr uint32_t kQK = 0, kV = 2 * kQKBytes, kTu = kV + kC * kVT * 2;
  static constexpr uint32_t kA2 = kMathWGs == 1 ? kTu + kImgTokTok * 2 : kTu;  // over Tu' at V tile 128
  static constexpr uint32_t kW = kA2 + kImgTokTok * 2, kGates = kW + kQKBytes;
  static constexpr uint32_t kGateCopy = kInvGateCopy;
  static constexpr uint32_t kTokD = kGates + 1024;
  static constexpr uint32_t kStageBytes = kGates + 2048;
  static constexpr uint32_t kTx = 2 * kQKBytes + kC * kVT * 2 + kImgTokTok * 2 + kGateCopy;
  static constexpr uint32_t kBar = kStages * kStageBytes;
  static constexpr size_t kSmem = 1024 + kBar + 4 * kStages * 8;  // full, aready, empty, kw_loaded
  static_assert(kSmem <= 232448, "reverse chain smem over the 227 KiB limit");
  static_assert(kGateCopy <= 1024 && kTokD + kC * 4 <= kStageBytes, "stage parts overlap");
};

// This warpgroup's registers to n (setmaxnreg: up or down from the entry count).
template <int n, int kEntry>
__device__ __forceinline__ void set_role_registers() {
  if constexpr (n > kEntry) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(n) : "memory");
  else if constexpr (n < kEntry) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(n) : "memory");
}

constexpr int kRevUnitsLo = 2;  // row units: max(|dSn^T row|, |D row|) in [2^2, 2^6)

// Eight 16-bit values (type T) times sc, in type E.
template <class T, class E>
__device__ __forceinline__ uint4 scaled_run(uint4 u, float sc) {
  uint32_t* pu = &u.x;
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(pu[i]);
    pu[i] = pack2<E>(f.x * sc, f.y * sc);
  }
  return u;
}

// The aux's steps on one chunk's stage (see the top of this file), from the raw 16-bit K|Q tile
// (type T) as it landed: one read of each K run for Kw, one of each run for Kd' and Qg' (written
// in place), the scores from the raw tile on the tensor cores with the exponents folded into
// their gates. Thread wt of the aux warpgroup takes the 16-byte runs wt + 128 it of the stacked
// operand: row wt / 8 + 16 (it & 3) of d-block it / 8, K rows for it & 7 < 4, Q rows after (as
// aux_convert_qk's). The 128-byte swizzle moves runs within their row only, so a K run at byte o
// of d-block h lies at o in W''s d-block h (8 KiB blocks instead of 16).
template <class T, class Cfg>
struct RevAux {
  using H = cutlass::half_t;
  using LH = Lay<H>;
  using WMma = decltype(make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>()));
  using AccW = decltype(partition_fragment_C(WMma{}, Shape<_64, _128>{}));
  uint8_t* stb;
  int len, wt, r0;
  const float* sGam;
  const int8_t *kexp, *qexp;
  uint32_t qk, w;  // this thread's first run of K|Q, and of W''s buffer

  __device__ __forceinline__ RevAux(uint8_t* stb_, int len_, int wt_) : stb(stb_), len(len_), wt(wt_), r0(wt_ >> 3) {
    sGam = reinterpret_cast<const float*>(stb + Cfg::kGates);
    kexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvKexp - kInvGam));
    qexp = reinterpret_cast<const int8_t*>(stb + Cfg::kGates + (kInvQexp - kInvGam));
    qk = smem_u32(stb + Cfg::kQK) + 16u * wt;
    w = smem_u32(stb + Cfg::kW) + 16u * wt;
  }
  __device__ __forceinline__ const float* eg() const { return sGam + (kInvEg - kInvGam) / 4; }
  __device__ __forceinline__ const float* egk() const { return sGam + (kInvEgk - kInvGam) / 4; }
  __device__ __forceinline__ uint32_t run(int it) const { return qk + 16u * 128u * it; }

  // D's per-token factors: scale 2^-eq_i (scale and q's exponents ride on D, so that A'' and Qg'
  // stay near unit size whatever scale is), zero past the sequence's end (D's rows there).
  __device__ __forceinline__ void tok_factors(float scale) const {
    if (wt < kC) reinterpret_cast<float*>(stb + Cfg::kTokD)[wt] = wt < len ? scale * pow2i(-qexp[wt]) : 0.f;
  }
  __device__ __forceinline__ void issue_qk(AuxAcc& acc) const { aux_issue_qk(reinterpret_cast<const T*>(stb + Cfg::kQK), wt, acc); }
  // This thread's eight K runs (d-blocks 0 and 1), then Kw = e^gamma K of them into W''s buffer.
  __device__ __forceinline__ void load_k(uint4 (&u)[8]) const {
    CUTE_UNROLL
    for (int r = 0; r < 8; ++r) u[r] = lds_u128(run(8 * (r >> 2) + (r & 3)));
  }
  // Rows past the sequence's end hold the next sequence's tokens (any value, Inf or NaN): the
  // in-place and copied operands take zeros there (a select: zero times Inf would be NaN).
  __device__ __forceinline__ uint4 scaled_row(uint4 u, float sc, int row) const {
    return row < len ? scaled_run<T, H>(u, sc) : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void store_kw(const uint4 (&u)[8]) const {
    float kw[4];
    CUTE_UNROLL
    for (int r = 0; r < 4; ++r) kw[r] = eg()[r0 + 16 * r];
    CUTE_UNROLL
    for (int r = 0; r < 8; ++r)
      sts128(w + 8192u * (r >> 2) + 16u * 128u * (r & 3), scaled_row(u[r], kw[r & 3], r0 + 16 * (r & 3)));
  }
  // W'acc = Tu' Kw (j, d), issued and committed.
  __device__ __forceinline__ void issue_w(AccW& acc) const {
    auto mma = WMma{};
    auto thr = mma.get_thread_slice(wt);
    Tensor rTu = thr.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kTu)), typename LH::TokTok_K{}));
    Tensor rKw = thr.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kW)), typename LH::DTok_MN{}));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm_k(mma, rTu, rKw, acc, GMMA::ScaleOut::Zero);
    warpgroup_commit_batch();
  }
  // A'' from S = Q K^T (waited for), in registers.
  __device__ __forceinline__ void gate(const AuxAcc& acc, AuxA16& rA16) const {
    aux_gate_scores<true>(sGam, qexp, kexp, len, wt, acc, rA16);
  }
  // Kd' = e^(Gamma - gamma) 2^ek K and Qg' = e^gamma 2^eq Q in place (zero past the sequence's
  // end: the region's gates are zero there), four runs at a time.
  __device__ __forceinline__ void kd_qg() const {
    float kd[4], qg[4];
    CUTE_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int row = r0 + 16 * r;
      kd[r] = egk()[row] * pow2i(kexp[row]);
      qg[r] = eg()[row] * pow2i(qexp[row]);
    }
#pragma unroll 1
    for (int hb = 0; hb < 2; ++hb) {  // d-block hb: its K runs, then its Q runs
      uint4 u[4];
      CUTE_UNROLL
      for (int r = 0; r < 4; ++r) u[r] = lds_u128(run(8 * hb + r));
      CUTE_UNROLL
      for (int r = 0; r < 4; ++r) sts128(run(8 * hb + r), scaled_row(u[r], kd[r], r0 + 16 * r));
      CUTE_UNROLL
      for (int r = 0; r < 4; ++r) u[r] = lds_u128(run(8 * hb + 4 + r));
      CUTE_UNROLL
      for (int r = 0; r < 4; ++r) sts128(run(8 * hb + 4 + r), scaled_row(u[r], qg[r], r0 + 16 * r));
    }
  }
  __device__ __forceinline__ void store_a2(const AuxA16& rA16) const {
    Tensor tA2 = make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kA2)), typename LH::TokTok_K{});
    stmatrix_rows<64>(tA2, wt, [&](int i) { return static_cast<float>(rA16(i)); });
  }
  // W' = -2^-et W'acc over Kw.
  __device__ __forceinline__ void store_w(const AccW& acc) const {
    const float wsc = -pow2i(-tu_exp_of<Cfg>(stb));
    Tensor tW = make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kW)), typename LH::TokD_K{});
    stmatrix_rows<128>(tW, wt, [&](int i) { return wsc * acc(i); });
  }
};

// One aux warpgroup (V tile 128): every step of a chunk, interleaved so that its two products
// run under its other work. Ends with the operands fenced for the async proxy.
//   1. D's factors; issue S = Q K^T;  2. Kw; issue W'acc = Tu' Kw;  3. A'' from S (registers);
//   4. Kd', Qg' in place;  5. A'' over Tu' (the product has read it), W' over Kw.
template <class T, class Cfg>
__device__ __forceinline__ void aux_reverse_operands(const RecParams& p, uint8_t* stb, int len, int wt QLA_PHASE_ARGS) {
  RevAux<T, Cfg> a(stb, len, wt);
  a.tok_factors(p.scale);
  AuxAcc accS;  // Q K^T
  a.issue_qk(accS);
  QLA_PHASE(1);
  {
    uint4 u[8];
    a.load_k(u);
    a.store_kw(u);
  }
  fence_async_smem();
  wg_bar(kBarAux);  // Kw written by every thread before the wgmma reads it
  QLA_PHASE(2);
  typename RevAux<T, Cfg>::AccW accW;
  a.issue_w(accW);
  warpgroup_wait<1>();
  warpgroup_fence_operand(accS);
  QLA_PHASE(3);
  AuxA16 rA16;
  a.gate(accS, rA16);
  wg_bar(kBarAux);  // every warp's Q K^T has read the raw tile before it changes in place
  QLA_PHASE(4);
  a.kd_qg();
  QLA_PHASE(5);
  warpgroup_wait<0>();
  warpgroup_fence_operand(accW);
  wg_bar(kBarAux);  // every warp's product has read Tu' and Kw
  QLA_PHASE(6);
  a.store_a2(rA16);
  a.store_w(accW);
  fence_async_smem();  // the generic stores before the math warpgroup's wgmma reads them
  QLA_PHASE(7);
}

// Two aux warpgroups (V tile 64, whose registers leave room for a fourth warpgroup): A takes the
// scores and the in-place pass, B Kw and W'; B's loads of the raw K runs are done (kw_loaded,
// an mbarrier per stage) before A overwrites them. A'' has its own slot here.
constexpr int kBarAuxB = 3;
template <class T, class Cfg>
__device__ __forceinline__ void aux_a_operands(const RecParams& p, uint8_t* stb, int len, int wt, uint64_t* kw_loaded,
                                               uint32_t parity QLA_PHASE_ARGS) {
  RevAux<T, Cfg> a(stb, len, wt);
  a.tok_factors(p.scale);
  AuxAcc accS;
  a.issue_qk(accS);
  warpgroup_wait<0>();
  warpgroup_fence_operand(accS);
  QLA_PHASE(1);
  AuxA16 rA16;
  a.gate(accS, rA16);
  a.store_a2(rA16);
  wg_bar(kBarAux);  // every warp's Q K^T has read the raw tile before it changes in place
  mbar_wait(kw_loaded, parity);
  QLA_PHASE(2);
  a.kd_qg();
  fence_async_smem();
  QLA_PHASE(3);
}
template <class T, class Cfg>
__device__ __forceinline__ void aux_b_operands(uint8_t* stb, int len, int wt, uint64_t* kw_loaded QLA_PHASE_ARGS) {
  RevAux<T, Cfg> a(stb, len, wt);
  {
    uint4 u[8];
    a.load_k(u);
    mbar_arrive(kw_loaded);
    a.store_kw(u);
  }
  fence_async_smem();
  wg_bar(kBarAuxB);  // Kw written by every thread before the wgmma reads it
  QLA_PHASE(1);
  typename RevAux<T, Cfg>::AccW accW;
  a.issue_w(accW);
  warpgroup_wait<0>();
  warpgroup_fence_operand(accW);
  wg_bar(kBarAuxB);  // every warp's product has read Kw
  QLA_PHASE(2);
  a.store_w(accW);
  fence_async_smem();
  QLA_PHASE(3);
}

// The units of a chunk (see the top of this file): from max |dS^T row| (current units) and
// max |D row| (this thread's dO^T pairs vp times D's per-token factors tf, in the current units);
// leaves rS16 = dSn' (the fp16 copy of dS^T in the new units), D in rD16, f and esc.
template <class T, class AccS, class S16, class D16>
__device__ __forceinline__ void reverse_units(const AccS& accS, S16& rS16, D16& rD16, const uint32_t (&vp)[16],
                                              const float2 (&tf)[8], int (&esc)[2], float (&f)[2]) {
  using H = cutlass::half_t;
  float m[2];
  row_abs_max(accS, m);
  float mv[2] = {0.f, 0.f};
  // D = dO^T diag(tf): tf is zero past the sequence's end, where dO holds the next sequence's
  // tokens (any value): selected, not multiplied (zero times Inf would be NaN).
  float2 d[16];
  CUTE_UNROLL
  for (int k = 0; k < 16; ++k) {  // pair k: elements 2 k, 2 k + 1 (row half k & 1), tokens of tf[k / 2]
    const float2 a = unpack2<T>(vp[k]), t = tf[k >> 1];
    d[k] = make_float2(t.x != 0.f ? a.x * t.x : 0.f, t.y != 0.f ? a.y * t.y : 0.f);
    mv[k & 1] = fmaxf(mv[k & 1], fmaxf(fabsf(d[k].x), fabsf(d[k].y)));
  }
  CUTE_UNROLL
  for (int i = 0; i < size(accS); ++i) rS16(i) = H(accS(i));  // (the units rarely change: see chunk_units)
  float sc[2];
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) quad_row_units(fmaxf(m[h], mv[h] * pow2i(esc[h])), kRevUnitsLo, esc[h], f[h], sc[h]);
  if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) {
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) rS16(i) = H(accS(i) * f[acc_half(i)]);
  }
  CUTE_UNROLL
  for (int k = 0; k < 16; ++k) {
    const float2 a = unpack2<T>(vp[k]), t = tf[k >> 1];
    const float s = sc[k & 1];
    rD16(2 * k) = H(t.x != 0.f ? a.x * (t.x * s) : 0.f);
    rD16(2 * k + 1) = H(t.y != 0.f ? a.y * (t.y * s) : 0.f);
  }
}

// A reverse-chain CTA's role (docs/backward.md "Build step 4, second half" and "The warm-up
// mirror"). Unsplit calls (no pieces): one pass, each sequence from d(final state) to d(initial
// state). Split calls (the forward's plan) take one of two paths per (sequence, value head),
// chosen from the gates (warm_path with kWarmAfter, split.cuh):
//   warm-up mirror (warm; wj: the warm-up of the boundary after this piece): pass 1 only, every
//           piece at once, the last from d(final state), the others from zero at the wj-th chunk
//           after their end, run back through those chunks without fragments (the dropped part
//           is scaled by their decay), then through the piece with them;
//   exact (the states pass's maps M_j of pieces 0 .. np - 2 in `maps`):
//     pass 0: pieces 1 .. np - 1 alone, the last from d(final state), the others from zero; each
//             writes the gradient entering it into the R columns of the map slot before its own
//             (the last one's is the gradient leaving piece np - 2, the others' D_j);
//     gdn_bwd_scan turns the D_j into the gradients leaving pieces np - 3 .. 0;
//     pass 1: every piece from the gradient leaving it (its slot; d(final state) for the last),
//             with the fragments.
// Piece 0 writes d(initial state). Whole sequences run in pass 1 (or the one pass, unsplit).
// Loop step c takes chunk c0 + nch - 1 - c; the first nwarm steps store no fragments.
__device__ __forceinline__ PieceRole reverse_role(const RecParams& p, const PieceCta& c, int nr, bool warm, int wj) {
  PieceRole r{true, 0, 0, 0, kInitH0, kEndFinal, true};
  const int nch = static_cast<int>((c.slen + kC - 1) / kC);
  r.c0 = c.j * c.sp.len;
  r.nch = min(c.sp.len, nch - r.c0);
  const bool last = c.j == c.sp.np - 1;
  r.run = c.vt < nr;
  if (!p.pieces) return r;
  if (p.pass == 0) {
    r.run = r.run && c.j > 0 && !warm;
    r.init = last ? kInitH0 : kInitZero;
    r.end = kEndMaps;
    r.out = false;
    return r;
  }
  r.end = c.j == 0 ? kEndFinal : kEndNone;
  if (warm) {
    r.init = last ? kInitH0 : kInitZero;
    r.nwarm = last ? 0 : wj;
    r.nch += r.nwarm;
    return r;
  }
  r.init = last ? kInitH0 : kInitMaps;
  return r;
}
// The piece's path, by warp 1 into sflags: [0] the warm-up mirror, [1] the warm-up of the
// boundary after the piece.
__device__ __forceinline__ void reverse_path_flags(const RecParams& p, const PieceCta& tile, int* sflags, int tid) {
  if (tid >= 32 && tid < 64) {
    const int nch = static_cast<int>((tile.slen + kC - 1) / kC);
    const bool warm = p.pieces && tile.sp.np > 1 && warm_path(p, tile.ci0, tile.hv, tile.sp, nch, tid - 32);
    if (tid == 32) {
      sflags[0] = warm;
      sflags[1] = warm && tile.j < tile.sp.np - 1 ? warm_chunks_after(p, tile.ci0, tile.hv, (tile.j + 1) * tile.sp.len, nch) : 0;
    }
  }
}

// The reverse chain: RecParams as the fused forward's (tiles_log2 = 1 at V tile 64, 0 at
// 128; pieces and maps as reverse_role says), with tmv d_o's tensor map, h0 / sh0 d(final state) (null: zero) and hT / shT
// d(initial state), in the state layout vk.
template <class T, int kMathWGs>
__global__ void __launch_bounds__(RevCfg<kMathWGs>::kThreads, 1) gdn_bwd_fused_reverse(const __grid_constant__ RecParams p) {
  using Cfg = RevCfg<kMathWGs>;
  using H = cutlass::half_t;
  using LH = Lay<H>;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBar);
  uint64_t* aready = full + kStages;
  uint64_t* empty = aready + kStages;
  uint64_t* kw_loaded = empty + kStages;  // (two aux warpgroups) B has read the raw K runs

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
  wait_for_previous_kernels();  // the chunk table and the inverse kernel's regions
  const PieceCta tile = piece_cta(p);
  if (fused_cta_idle<T>(p, tile)) return;  // (malformed cu_seqlens: d(initial state) NaN)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&aready[s], 128 * Cfg::kAuxWGs);
      mbar_init(&empty[s], 128 * kMathWGs);
      mbar_init(&kw_loaded[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __shared__ int sflags[2];
  reverse_path_flags(p, tile, sflags, tid);
  __syncthreads();
  const PieceRole role = reverse_role(p, tile, kDV / Cfg::kVT, sflags[0], sflags[1]);
  if (!role.run) return;
  // Loop step c takes chunk c0 + nch - 1 - c of the sequence (last first).
  const int nch = role.nch;
  auto chunk_of = [&](int c) { return role.c0 + nch - 1 - c; };
  auto stage = [&](int c) { return sm + (c % kStages) * Cfg::kStageBytes; };
  auto parity = [&](int c) { return static_cast<uint32_t>((c / kStages) & 1); };
  auto role_region = [&](int c) { return static_cast<size_t>(tile.ci0 + chunk_of(c)) * p.HV + tile.hv; };

  if (wg == 0) {
    // ---------------- producer ----------------
    set_role_registers<Cfg::kRegs[0], Cfg::kEntryRegs>();
    if (wt != 0) return;
    const int hq = tile.hv / (p.HV / p.H);
    for (int c = 0; c < nch; ++c) {
      const int st = c % kStages, cc = chunk_of(c);
      const int tok = static_cast<int>(tile.t0) + cc * kC, bb = static_cast<int>(tile.b);
      mbar_wait(&empty[st], parity(c) ^ 1);
      produce_chunk<Cfg>(p, stage(c), &full[st], role_region(c), hq, tile.hv, tile.vt * Cfg::kVT, tok, bb);
    }
    return;
  }

  if (wg == 1 || (Cfg::kAuxWGs == 2 && wg == 2)) {
    // ---------------- aux: the chunk's operands (one warpgroup, or A and B) ----------------
    const bool b = wg == 2;
    if (b) set_role_registers<Cfg::kRegs[2], Cfg::kEntryRegs>();
    else set_role_registers<Cfg::kRegs[1], Cfg::kEntryRegs>();
    QLA_PHASES(8);
    for (int c = 0; c < nch; ++c) {
      uint8_t* stb = stage(c);
      mbar_wait(&full[c % kStages], parity(c));
      QLA_PHASE(0);
      const int len = static_cast<int>(min<int64_t>(kC, tile.slen - static_cast<int64_t>(chunk_of(c)) * kC));
      if constexpr (Cfg::kAuxWGs == 1) {
        aux_reverse_operands<T, Cfg>(p, stb, len, wt QLA_PHASE_PASS);
      } else {
        if (b) aux_b_operands<T, Cfg>(stb, len, wt, &kw_loaded[c % kStages] QLA_PHASE_PASS);
        else aux_a_operands<T, Cfg>(p, stb, len, wt, &kw_loaded[c % kStages], parity(c) QLA_PHASE_PASS);
      }
      mbar_arrive(&aready[c % kStages]);
    }
    if constexpr (Cfg::kAuxWGs == 1)
      QLA_PHASES_PRINT("reverse aux (wait, QK^T issued, Kw, W' issued + QK^T wait, A'' gate, Kd' Qg', W' wait, A'' + W' store)", 8, nch);
    else if (b)
      QLA_PHASES_PRINT("reverse aux B (wait, Kw, W' product, W' store)", 4, nch);
    else
      QLA_PHASES_PRINT("reverse aux A (wait, QK^T, A'' + wait for B's K loads, Kd' Qg')", 4, nch);
    return;
  }

  // ---------------- math: the chain ----------------
  set_role_registers<Cfg::kRegs[3], Cfg::kEntryRegs>();
  const int mw = wg - 1 - Cfg::kAuxWGs;  // this math warpgroup's 64 v rows of the tile
  auto mmaU = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});    // B = Kd' (j, d)
  auto mmaA = make_tiled_mma(SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});   // B = A'' as (j, i)
  auto mmaS = make_tiled_mma(SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>{});  // B = Qg', W' as (d, tok)
  auto thrU = mmaU.get_thread_slice(wt);
  auto thrA = mmaA.get_thread_slice(wt);
  auto thrS = mmaS.get_thread_slice(wt);
  Tensor accS = partition_fragment_C(mmaS, Shape<_64, _128>{});  // dS^T (v, d), row v in units 2^esc_v
  Tensor accU = partition_fragment_C(mmaU, Shape<_64, _64>{});   // dU' (v, tok)
  Tensor cS = thrS.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  Tensor cU = thrU.partition_C(make_identity_tensor(Shape<_64, _64>{}));
  // Register A operands (fp16; the accumulator's element order, as in the forward).
  Tensor rS16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});  // dSn'
  Tensor rD16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // D
  Tensor rU16 = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _4>{});  // dU'
  const int v0 = tile.vt * Cfg::kVT + 64 * mw;
  // d(final state), or the gradient leaving the piece (its map slot), or zero.
  load_entering_state(p, role.init, tile.n, tile.hv, v0, role.init == kInitMaps ? map_at(p, tile.map, tile.hv) : nullptr,
                      nullptr, accS, cS);
  int esc[2] = {0, 0};
  QLA_PHASES(5);  // wait, units and D, decay + dU' issued, D Qg' + dU' copy, W' product

  for (int c = 0; c < nch; ++c) {
    const int st = c % kStages;
    uint8_t* stb = stage(c);
    H* sQK = reinterpret_cast<H*>(stb + Cfg::kQK);
    const float* sG = reinterpret_cast<const float*>(stb + Cfg::kGates);
    const float* sTokD = reinterpret_cast<const float*>(stb + Cfg::kTokD);
    mbar_wait(&full[st], parity(c));
    mbar_wait(&aready[st], parity(c));
    QLA_PHASE(0);
    const float eG = sG[(kInvEG - kInvGam) / 4];
    uint32_t vp[16];  // dO^T pairs
    load_vt_pairs(reinterpret_cast<const T*>(stb + Cfg::kV) + mw * kC * 64, wt, vp);
    float2 tf[8];  // D's factors of this thread's 8 token pairs
    CUTE_UNROLL
    for (int k = 0; k < 8; ++k) tf[k] = *reinterpret_cast<const float2*>(sTokD + get<1>(cU(4 * k)));
    float f[2];
    reverse_units<T>(accS, rS16, rD16, vp, tf, esc, f);
    QLA_PHASE(1);

    // The gradients' copy of dSn' and its units (before the product: a wgmma's register operand
    // may not be read while it runs).
    uint8_t* frags = role.out && c >= role.nwarm ? frag_block(p, role_region(c), v0) : nullptr;
    if (frags) store_fragments(rS16, frags + kFragDSn, wt, reinterpret_cast<int*>(frags + kFragEsc), get<0>(cS(0)), esc);
    // dS' = f e^Gamma dS' (its products come below), then dU' = D A'' + dSn' Kd'^T.
    CUTE_UNROLL
    for (int i = 0; i < size(accS); ++i) accS(i) *= f[acc_half(i)] * eG;
    Tensor rA2 = thrA.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kA2)), typename LH::TokTok_MN{}));
    Tensor rKd = thrU.partition_fragment_B(local_tile(make_tensor(make_smem_ptr(sQK), QK_K{}), Shape<_64, _128>{}, make_coord(0, 0)));
    warpgroup_fence_operand(rD16);
    warpgroup_fence_operand(rS16);
    warpgroup_fence_operand(accU);
    warpgroup_arrive();
    gemm_k(mmaA, rD16, rA2, accU, GMMA::ScaleOut::Zero);
    gemm_k(mmaU, rS16, rKd, accU, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    QLA_PHASE(2);
    // dS' += D Qg', under the first product.
    Tensor rQg = thrS.partition_fragment_B(local_tile(make_tensor(make_smem_ptr(sQK), QK_MN{}), Shape<_128, _64>{}, make_coord(0, 1)));
    warpgroup_fence_operand(accS);
    warpgroup_arrive();
    gemm_k(mmaS, rD16, rQg, accS, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    // dU' in fp16 once the first product is done, then dS' += dU' W'.
    warpgroup_wait<1>();
    warpgroup_fence_operand(accU);
    CUTE_UNROLL
    for (int i = 0; i < size(accU); ++i) rU16(i) = H(accU(i));
    if (frags) store_fragments(rU16, frags + kFragDU, wt, nullptr, 0, esc);  // the gradients' copy
    QLA_PHASE(3);
    Tensor rW = thrS.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<H*>(stb + Cfg::kW)), typename LH::DTok_MN{}));
    warpgroup_fence_operand(rU16);
    warpgroup_arrive();
    gemm_k(mmaS, rU16, rW, accS, GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accS);
    mbar_arrive(&empty[st]);  // every read of the stage is done
    QLA_PHASE(4);
  }
  QLA_PHASES_PRINT("reverse math (wait, units + D, decay + dU' issued, D Qg' + dU' copy, W')", 5, nch);

  // d(initial state), or (pass 0) the gradient entering the piece into the slot before its own.
  store_leaving_state<false>(p, role.end, tile.n, tile.hv, v0, role.end == kEndMaps ? map_at(p, tile.map - 1, tile.hv) : nullptr,
                             accS, cS, esc);
}

}  // namespace
}  // namespace sm90
}  // namespace qla
