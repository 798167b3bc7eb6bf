// The fused backward's reverse step (docs/backward.md "The fused reverse step"): one CTA per
// (sequence or piece, value head) at V tile 128 walks the chunks last to first and, per chunk,
// runs the state-gradient chain and forms the gradients of the chunk it leaves, every operand in
// shared memory once (single-stage tiles between the roles and, with dq, one input stage).
// The chain, dv, dq, and with RecParams::dk set every other gradient (dk, dbeta, and dg with
// RecParams::dg). The library's fused backward runs it after the states pass and before
// gdn_bwd_finish (launch_backward in gdn_fwd_sm90.cu), with every gradient; test builds also
// run it alone (test_run_fused_step), without dk.
//
// Per chunk (C = 64 tokens, gamma = cumsum g, Gamma = gamma_last; dSn the gradient of the state
// leaving the chunk, dS the one entering it; Pg_ij = scale e^(gamma_i - gamma_j) q_i.k_j for
// j <= i, Kd = diag(e^(Gamma - gamma)) K, Qg = scale diag(e^gamma) Q, Tu = Tm diag(beta),
// W = Tu diag(e^gamma) K):
//   dU = Kd dSn + Pg^T dO,   dS = e^Gamma dSn + Qg^T dO - W^T dU,   dv = Tu^T dU.
// Roles (warpgroups; one-way hand-overs by mbarriers, no CTA barrier in the loop):
//   P (WG0, one thread): q, k, v, dO (two 64-column boxes each) and the region's Tu' image and
//      gates (inverse.cuh) into the stage ring, chunks in reverse order; for the chunks whose
//      gradients are formed, the states pass's S' image (one bulk copy into its own tile), and
//      with dk the region's T' image (into D''s tile once D' is read).
//   Z (WG0's other three warps): at a partial chunk (the piece's first step, chunks run last to
//      first) q, k, v and dO's rows past the sequence's end, which hold the next sequence's
//      tokens (any value, Inf or NaN), zeroed in the stage before A, K and S read it; so every
//      product and elementwise pass reads finite tiles and needs no per-element select.
//   A (WG1): Pg'' (the gated scores, a tile in the input type) and W' (fp16), from the raw q, k
//      tiles; dP, dA (dA'' into Pg''s tile for K's dk), dq; with dg its part of each token's a_i and
//      e^Gamma <dSn, S> (from dSn' and S'); with dk, after dq, K's X block (X, dL, dM, dMb'').
//   K (WG2): Z and U''; dU' (fp16 tile) from the register operand Kd' and the two tiles; dv; with
//      dk, after dv, the rest of the gradients (dk, dbeta, dg) in the tiles the chain has left.
//   S (WG3): dS^T (128 x 128 fp32 accumulators, 128 registers a thread) across the chunks; Qg'
//      and D' (fp16 copies of q and dO; in a chunk without gradients A forms Qg' and K forms D',
//      so that S's serial work there is the chain's alone); the fp16 copy dSn' the next chunk's
//      dU reads.
// Operands with the keys' exponents ek (K' = diag(2^ek) K, unit rows; inverse.cuh) and per-tile
// powers of two (units e*) so that every 16-bit tile stays inside fp16's range; the accumulators
// are fp32 and change units by exact powers of two:
//   Pg''  = 2^ep diag(2^ek) Pg^T, stored as its transpose (i, j); ep from a bound on |q|, |k|
//   Kd'   = diag(e^(Gamma - gamma) 2^ek) K (fp16 register operand, rows near unit norm)
//   dSn'  = 2^en dSn (fp16, en from max |dSn|)
//   accK  = Pg''^T dO (units ep), then x 2^(en - ep) + Kd' dSn': 2^en diag(2^ek) dU
//   dU'   = 2^eu accK (fp16, eu from max |accK|): 2^(en + eu) diag(2^ek) dU
//   dv    = 2^-(et + en + eu) Tu'^T dU'  (Tu' = 2^et diag(2^-ek) Tu, the region's image)
//   W'    = -2^-et Tu' diag(e^gamma) K = -diag(2^-ek) W (fp16)
//   Qg'   = 2^eg Qg (fp16; eg from a bound on |q|), D' = 2^ed dO (fp16; ed from max |dO|)
//   accS  = 2^a dS^T: x e^Gamma 2^(eg + ed - a), + D'^T Qg', x 2^(en + eu - eg - ed), + dU'^T W';
//           a = en + eu.
// dk and dbeta (K, after dv; docs/backward.md (B19)-(B29)), with T' = diag(2^-ek) Tm diag(2^ek)
// the inverse kernel's image and a' = en + eu dU''s units:
//   dK_d  = diag(e^(Gamma - gamma) 2^ek) 2^-(eut + en) U'' dSn'^T
//   dW''  = dU' S'^T (input type) = -2^a' diag(2^ek) dW;  dW''' = 2^ew dW'' (fp16)
//   dVb   = 2^-a' diag(2^-ek) T'^T dU',  dKb = -2^-(ew + a') diag(2^-ek) T'^T dW'''
//   X     = dVb V^T + dKb K^T diag(e^gamma);  X'' = 2^ex X diag(beta 2^-ek) (fp16)
//   dL    = -strict(2^-ex X'' T'^T) diag(2^ek),  dM = E o dL  (dM'' = 2^em dM, dMb'' = diag(beta) dM'')
//   dk    = dK_d + beta e^gamma dKb + dA^T Q + diag(beta) dM K + dM^T diag(beta) K
//   dbeta = <dVb, V> + e^gamma <dKb, K> + <dM K, K>  (row dots).
#pragma once

#include "fused_reverse.cuh"

namespace qla {
namespace sm90 {
namespace {

struct StepCfg {
  static constexpr int kThreads = 512;  // P, A, K, S
  static constexpr int kStages = 1;
  // Registers per thread by role (setmaxnreg; sum <= 512): P, A, K, S.
  static constexpr int kRegs[4] = {24, 160, 168, 160};
  static constexpr int kEntryRegs = (65536 / kThreads) & ~7;
  static_assert(kRegs[0] + kRegs[1] + kRegs[2] + kRegs[3] <= 512, "register budgets over the SM's");
  // The stage (1 KiB aligned parts): q, k, v, dO (16-bit inputs as loaded, (tok, d | v), two
  // 64-column boxes each), the region's Tu' image, its gates and exponents.
  static constexpr uint32_t kQ = 0, kK = kQKBytes, kV = 2 * kQKBytes, kO = 3 * kQKBytes, kTu = 4 * kQKBytes;
  static constexpr uint32_t kGates = kTu + kImgTokTok * 2;
  static constexpr uint32_t kStageBytes = kGates + 1024;
  static constexpr uint32_t kTx = 4 * kQKBytes + kImgTokTok * 2 + kInvGateCopy;
  // Tiles between the roles, one of each: S' (v, d) in the input type (the states pass's image,
  // loaded by P for A and K; with dk then K's dVb'', dMb'', X'' and dg's sums), Pg'' (i, j) then
  // A's dA'', Kw then W' (j, d) (with dk then dv's store tile and dW'''), dU' (j, v) (then dv's
  // store tile, or with dk dKb''), dSn' (v, d), S's Qg' (i, d) then dq's store tile, S's D' (i, v)
  // (with dk then T' and A's dg sums), K's Z' then U'' (tok, v); then the scalars (units,
  // reductions), beta and the mbarriers.
  static constexpr uint32_t kS = kStages * kStageBytes;
  static constexpr uint32_t kPg = kS + 2 * kQKBytes;
  static constexpr uint32_t kW = kPg + kImgTokTok * 2;
  static constexpr uint32_t kDU = kW + kQKBytes;
  static constexpr uint32_t kDSn = kDU + kQKBytes;
  static constexpr uint32_t kQg = kDSn + 2 * kQKBytes;
  static constexpr uint32_t kD = kQg + kQKBytes;
  static constexpr uint32_t kU = kD + kQKBytes;
  static constexpr uint32_t kMisc = kU + kQKBytes;
  static constexpr uint32_t kBeta = kMisc + 512;  // beta of the chunk's tokens (fp32; K, chunks with dk)
  static constexpr uint32_t kBar = kBeta + kC * 4;
  // full, empty, dsn_ready, pg_ready, w_ready, du_ready, d_ready, d_free, s_full, s_empty, u_ready, qg_free,
  // du_free, dsn_free, tm_full, da_ready, vkb_ready, mb_ready, tail_ready, tb_ready, prep_ready, tu_free
  static constexpr int kBars = 2 * kStages + 20;
  static constexpr size_t kSmem = 1024 + kBar + 176;  // (1 KiB of alignment slack first)
  static_assert(kInvGateCopy <= 1024, "the region's gates over their stage part");
  static_assert(kBars * 8 <= 176, "the mbarriers over their part");
  static_assert(kSmem + 64 <= 232448, "reverse step smem (with the kernel's static flags) over the 227 KiB limit");
};

// Scalars in kMisc (ints, then float reduction slots: two alternating sets of four per role).
enum : int { kMiscEn = 0, kMiscEp = 1, kMiscEu = 2, kMiscEd = 3, kMiscEut = 4, kMiscEa = 5 };  // en; ep; en + eu; ed; U'''s units; dA'''s
enum : int { kMiscEvb = 6, kMiscEkb = 7, kMiscEm = 8 };  // dVb'''s and dKb'''s units (K, for A's X), dMb'''s (A, for K)
enum : int { kMiscUb = 9 };                                // Tb'''s unit (S, for K)
constexpr int kMiscRedA = 16, kMiscRedK = 24, kMiscRedS = 32;
// dk's row scratch (floats) after X'' in S''s tile (kSdK bytes on; its first 64 unused): x_i =
// <dK_d_i, K_i>, R_L's rows and its column sums per A warp (A), dbeta's <dM K, K> rows (A), <dK_b,
// K> rows (K), dg's two warp totals (K).
constexpr uint32_t kSdK = kQKBytes + kImgTokTok * 2;
constexpr int kSdX = 64, kSdRows = 128, kSdCols = 192, kSdRr = 448, kSdKb = 512, kSdTot = 576;
constexpr int kMiscSdot = 40;  // dg: A's four warp partials of e^Gamma <dSn, S>
// Named barriers within one role (0 is __syncthreads; 2 is the fused forward's kBarAux).
constexpr int kBarStepA = 4, kBarStepK = 5, kBarStepS = 6;

// Whether the step's tiles in the input type T need power-of-two units: fp16's range does, bf16
// has fp32's exponent range, so a bf16 tile holds the plain values (the same relative rounding,
// no warpgroup reduction for a unit). fp16 tiles of sequential operands keep theirs.
template <class T>
constexpr bool kTileUnits = std::is_same<T, cutlass::half_t>::value;

// A unit for a largest magnitude m: 2^unit m in [2^13, 2^14) (0 for m = 0), kept in [-60, 60] so
// that sums of two units stay inside fp32's exponent range.
__device__ __forceinline__ int step_unit(float m) { return m > 0.f ? max(-60, min(60, 13 - float_exponent(m))) : 0; }
__device__ __forceinline__ float pow2c(int e) { return pow2i(max(-126, min(127, e))); }

// A thread's largest |x| over values it forms in order, in four independent chains (by e % 4)
// instead of one chain of 64-128 dependent FMNMX (~6 cycles a step) before each unit reduction.
// The maximum is exact, so the chains change no bit; its time was measured only within bwd-62
// (design.md; a tree alone, bwd-58, gained nothing measurable).
struct AbsMax4 {
  float m[4] = {0.f, 0.f, 0.f, 0.f};
  __device__ __forceinline__ void add(int e, float x) { m[e & 3] = fmaxf(m[e & 3], fabsf(x)); }
  __device__ __forceinline__ void add2(int e, float x, float y) { m[e & 3] = fmaxf(m[e & 3], fmaxf(fabsf(x), fabsf(y))); }
  __device__ __forceinline__ float get() const { return fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])); }
};
// The largest x over a warpgroup (named barrier id; red: two alternating sets of four slots,
// picked by flip, so that one barrier a call suffices).
__device__ __forceinline__ float wg_max(float x, float* red, int wt, int id, int flip) {
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  float* r = red + 4 * (flip & 1);
  if ((wt & 31) == 0) r[wt >> 5] = x;
  wg_bar(id);
  return fmaxf(fmaxf(r[0], r[1]), fmaxf(r[2], r[3]));
}

// The smallest query exponent over the chunk's tokens (every lane of every warp gets it): |q_i|
// <= 2^(1/2 - eq_i) within a few percent (inverse.cuh), so this bounds the chunk's |q|.
__device__ __forceinline__ int min_qexp(const int8_t* qexp, int len, int lane) {
  int e = 127;
  if (lane < len) e = qexp[lane];
  if (lane + 32 < len) e = min(e, static_cast<int>(qexp[lane + 32]));
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) e = min(e, __shfl_xor_sync(0xffffffffu, e, o));
  return e == 127 ? 0 : e;
}

// A stage's gates and exponents (the region's, from kInvGam on).
struct StepGates {
  const float* base;
  __device__ __forceinline__ explicit StepGates(const uint8_t* stb) : base(reinterpret_cast<const float*>(stb + StepCfg::kGates)) {}
  __device__ __forceinline__ const float* gam() const { return base; }
  __device__ __forceinline__ const float* eg() const { return base + (kInvEg - kInvGam) / 4; }
  __device__ __forceinline__ const float* egk() const { return base + (kInvEgk - kInvGam) / 4; }
  __device__ __forceinline__ float eG() const { return base[(kInvEG - kInvGam) / 4]; }
  __device__ __forceinline__ int et() const { return reinterpret_cast<const int*>(base)[(kInvTuExp - kInvGam) / 4]; }
  __device__ __forceinline__ const int8_t* kexp() const { return reinterpret_cast<const int8_t*>(base) + (kInvKexp - kInvGam); }
  __device__ __forceinline__ const int8_t* qexp() const { return reinterpret_cast<const int8_t*>(base) + (kInvQexp - kInvGam); }
};

// A thread's gate factors for the gated causal 64 x 64 tiles (Pg'', dA, dM) in the accumulator's
// element order (rows r0, r0 + 8; columns 8 b + 2 (lane % 4) + {0, 1}), formed once a tile from the
// stage: scaled(e, x) = 2^(u + ek_j) e^(gamma_i - gamma_j) s x for j <= i < len (j < i with
// kStrict), else 0. With g <= 0 the exponent is at most u + ek_j on and below the diagonal; above it
// ex2 may overflow (as K1's L' in inverse.cuh). The mask is a bound on the exponent instead of a
// select: min(exponent, 2^16 (i - j) +- 2^15) leaves a kept element's exponent (< 2^15) as it is and
// drives a dropped one below -2^15, where ex2 flushes to zero. Per element two adds, a minimum,
// one ex2 and two products, and no compare: a select per element left ptxas short of predicate
// registers, moving them through general ones (P2R, LOP3; docs/design.md bwd-60).
struct GateFactors {
  static constexpr float kMaskScale = 65536.f;
  float gi[2], dj[16], s;  // log2e gamma_i of the rows; u + ek_j - log2e gamma_j of the columns
  float lim[2];            // 2^16 (r0 + 8 h - c0): element e is kept when lim[h] - 2^16 o_e >= 0 (>= 2^16,
                           // strict), o_e = 8 (e / 4) + e % 2 (rows at or past len: -2^36, every element dropped)
  template <class CP>
  __device__ __forceinline__ GateFactors(const StepGates& gt, const CP& cP, int len, int u, float s_) : s(s_) {
    const int r0 = get<0>(cP(0)), c0 = get<1>(cP(0));
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      gi[h] = gt.gam()[r0 + 8 * h] * kLog2e;
      lim[h] = kMaskScale * static_cast<float>(r0 + 8 * h < len ? r0 + 8 * h - c0 : -(1 << 20));
      // (opaque, so that the tiles' 32 bounds are formed where each is used, not computed once for
      // Pg'', dA and dM together and held in spills across them)
      asm volatile("" : "+f"(lim[h]));
    }
    CUTE_UNROLL
    for (int b = 0; b < 16; ++b) {
      const int j = c0 + 8 * (b >> 1) + (b & 1);
      dj[b] = static_cast<float>(u + gt.kexp()[j]) - gt.gam()[j] * kLog2e;
    }
  }
  template <bool kStrict = false>
  __device__ __forceinline__ float scaled(int e, float x) const {
    const int h = (e >> 1) & 1, b = 2 * (e >> 2) + (e & 1), o = 8 * (e >> 2) + (e & 1);
    // (i - j - o_e) 2^16 + 2^15 (- 2^15 strict): >= 2^15 where kept, <= -2^15 where dropped; exact in fp32
    const float bound = lim[h] + (kMaskScale * static_cast<float>(-o) + (kStrict ? -0.5f : 0.5f) * kMaskScale);
    return exp2_approx(fminf(gi[h] + dj[b], bound)) * (s * x);
  }
};

// Sixteen-byte runs of a (tok, 128) 16-bit tile in the TokD_K layout: run r of thread wt (r < 8)
// lies at byte 16 (wt + 128 r) and holds 8 elements of row (byte % 8192) / 128 (the 128-byte
// swizzle moves runs within their row).
__device__ __forceinline__ uint32_t run_byte(int wt, int r) { return 16u * (wt + 128 * r); }
__device__ __forceinline__ int run_row(uint32_t byte) { return static_cast<int>((byte & 8191u) >> 7); }
// dst = diag(factor(row)) src over a (tok, 128) TokD_K tile, in type E (the stage's rows past the
// end are zeros, see role Z, and the factors finite there).
template <class T, class E, class Factor>
__device__ __forceinline__ void scale_rows(uint32_t src, uint32_t dst, int wt, Factor factor) {
  #pragma unroll 2  // (rolled: the roles' hot code must fit the instruction cache, docs/design.md bwd-46)
  for (int r = 0; r < 8; ++r) {
    const uint32_t b = run_byte(wt, r);
    sts128(dst + b, scaled_run<T, E>(lds_u128(src + b), factor(run_row(b))));
  }
}

// S's two fp16 copies of a chunk's inputs for D'^T Qg'. S forms them where the chunk has gradients
// (A's dP and dq share their tiles); elsewhere (pass 0, warm-ups) A forms Qg' and K forms D', so
// that S's own serial work is the chain's alone (docs/design.md bwd-57).
// Qg''s unit eg: |scale e^gamma_i q_i| <= |scale| 2^(1/2 - eq_i) x 1.05 (a bound from the gates'
// query exponents, so S and A find the same eg).
__device__ __forceinline__ int qg_unit(const StepGates& gt, float scale, int len, int wt) {
  return step_unit(fabsf(scale) * 1.5f * pow2c(-min_qexp(gt.qexp(), len, wt & 31)));
}
// Qg' = 2^eg scale diag(e^gamma) Q (fp16, not the input type: in bf16 its rounding runs down the
// chain, dg and dh0 ~3x worse in bench/fused_reverse_model.py).
template <class T>
__device__ __forceinline__ void form_qg(const uint8_t* stb, uint8_t* sm, const StepGates& gt, float scale, int eg, int wt) {
  const float* egv = gt.eg();
  const float sc = scale * pow2c(eg);
  scale_rows<T, cutlass::half_t>(smem_u32(stb + StepCfg::kQ), smem_u32(sm + StepCfg::kQg), wt, [&](int row) { return egv[row] * sc; });
}
// D' = 2^ed dO (fp16; rows past the end zero), ed from max |dO| over the chunk's rows (a
// warpgroup reduction on named barrier bar, red's slots picked by flip); returns ed.
template <class T>
__device__ __forceinline__ int form_d(const uint8_t* stb, uint8_t* sm, float* red, int wt, int bar, int flip) {
  const uint32_t src = smem_u32(stb + StepCfg::kO), dst = smem_u32(sm + StepCfg::kD);
  AbsMax4 m;
  #pragma unroll 2  // (rolled: the roles' hot code must fit the instruction cache)
  for (int r = 0; r < 8; ++r) {
    const uint4 u = lds_u128(src + run_byte(wt, r));  // (rows past the end: zeros)
    const uint32_t* pu = &u.x;
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float2 f = unpack2<T>(pu[i]);
      m.add2(i, f.x, f.y);
    }
  }
  const int ed = step_unit(wg_max(m.get(), red, wt, bar, flip));
  const float sc = pow2c(ed);
  scale_rows<T, cutlass::half_t>(src, dst, wt, [&](int) { return sc; });
  return ed;
}

// wt through an empty volatile asm: the coordinates and shared-memory addresses derived from it
// are formed where they are used instead of being hoisted out of the chunk loop and held across
// it. Held, K's tail spilled them (dozens of tile addresses) to local memory, which misses L1
// beside 227 KiB of shared memory: over half of the step's stall cycles (perf log bwd-41).
__device__ __forceinline__ int fresh(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
// The same for a shared-memory base: the wgmma descriptors of a tile at a fixed offset are formed
// where a product issues instead of being held (spilled) across the tail.
template <class P>
__device__ __forceinline__ P* fresh(P* p) {
  uint64_t x = reinterpret_cast<uint64_t>(p);
  asm volatile("" : "+l"(x));
  return reinterpret_cast<P*>(x);
}

// The thread's element pairs (e, e + 1), e even, of a 64 x 128 accumulator (rows r0 + 8 h,
// columns 8 b + 2 (lane % 4) + {0, 1}; h = (e >> 1) & 1, b = e >> 2) as bytes of a (tok, 128)
// TokD_K tile: tokd_byte (common.cuh) of (row_of(e), col_of(e)), formed from eight swizzled run
// offsets and immediates.
struct TokDPairs {
  uint32_t row, x;
  int r0, c0;
  __device__ __forceinline__ explicit TokDPairs(int wt) {
    const int t = fresh(wt), lane = t & 31;
    r0 = 16 * (t >> 5) + (lane >> 2);
    c0 = 2 * (lane & 3);
    row = 128u * r0 + 4u * (lane & 3);
    x = 16u * (lane >> 2);
  }
  __device__ __forceinline__ uint32_t operator()(int e) const {
    const int b = e >> 2;
    return row + ((16u * (b & 7)) ^ x) + 8192u * (b >> 3) + 1024u * ((e >> 1) & 1);
  }
  __device__ __forceinline__ int row_of(int e) const { return r0 + 8 * ((e >> 1) & 1); }
  __device__ __forceinline__ int col_of(int e) const { return c0 + 8 * (e >> 2) + (e & 1); }
};

// A (tok, 128) 16-bit TokD_K tile at shared address tile, read at a 64 x 128 accumulator's element
// pairs by ldmatrix, four pairs an instruction (the converse of stmatrix_tokd; TokDPairs' bytes):
// f(e, bits) for e = 0, 2, .., 62 in order, bits the pair (e, e + 1) packed (TokdLane's addresses).
template <class F>
__device__ __forceinline__ void tokd_pairs(uint32_t tile, int wt, F f) {
  const TokdLane ln(tile, wt);
  CUTE_UNROLL
  for (int tb = 0; tb < 16; tb += 2) {
    uint32_t r[4];
    ldsm_x4(ln.at(tb), r);
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) f(4 * tb + 2 * q, r[q]);
  }
}

// <acc_i, X_i> over the columns of a 64 x 128 accumulator, X a (tok, 128) TokD_K tile of type T
// at shared address tile; rows r0 and r0 + 8 of the thread, summed over the quad that holds them
// in a fixed order. Per row two FMA chains (the pair's even and odd columns): two instructions a
// pair, where a product, an FMA and an add were three (the step's hot code, design.md bwd-59).
template <class T, class Acc>
__device__ __forceinline__ float2 row_dot(const Acc& acc, uint32_t tile, int wt) {
  float ev[2] = {0.f, 0.f}, od[2] = {0.f, 0.f};
  tokd_pairs(tile, wt, [&](int e, uint32_t bits) {
    const float2 x = unpack2<T>(bits);
    ev[acc_half(e)] = fmaf(acc(e), x.x, ev[acc_half(e)]);
    od[acc_half(e)] = fmaf(acc(e + 1), x.y, od[acc_half(e)]);
  });
  float s[2] = {ev[0] + od[0], ev[1] + od[1]};
  CUTE_UNROLL
  for (int o = 1; o < 4; o <<= 1) {
    s[0] += __shfl_xor_sync(0xffffffffu, s[0], o);
    s[1] += __shfl_xor_sync(0xffffffffu, s[1], o);
  }
  return make_float2(s[0], s[1]);
}
// A gradient's (tok, 128) TokD_K tile in shared memory out through its tensor map's two 64-column
// boxes at (value head hv, token t0, sequence b); one thread issues, one bulk group committed.
// (add: added into the tensor's elements instead, RecParams::dqk_add.)
__device__ __forceinline__ void store_tile_boxes(const CUtensorMap* map, const uint8_t* tile, int hv, int t0, int b,
                                                 bool add = false) {
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    if (add) tma_reduce_add_4d(map, tile + h * (kQKBytes / 2), h * 64, hv, t0, b);
    else tma_store_4d(map, tile + h * (kQKBytes / 2), h * 64, hv, t0, b);
  }
  bulk_commit();
}
// Two 16-bit values added into global memory (one rounding, as the bulk reduction's).
template <class T>
__device__ __forceinline__ void red_add2(uint32_t* g, uint32_t v) {
  if constexpr (std::is_same<T, cutlass::half_t>::value)
    asm volatile("red.global.add.noftz.f16x2 [%0], %1;" ::"l"(g), "r"(v) : "memory");
  else
    asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(g), "r"(v) : "memory");
}
// The same tile out by the warpgroup's generic stores (a partial chunk, whose boxes would write
// past the sequence's end, or strides a tensor map cannot take): its rows < len to base (row
// stride ld elements, unit column stride), four 4-byte stores a 16-byte run. One rolled path for
// every gradient, so that the cold case adds little code beside the hot one.
template <class T>
__device__ __forceinline__ void store_tile_rows(uint32_t tile, T* base, int64_t ld, int len, int wt, bool add = false) {
  #pragma unroll 1
  for (int r = 0; r < 8; ++r) {
    const uint32_t b = run_byte(wt, r);
    const int row = run_row(b);
    if (row < len) {
      const int col = 64 * static_cast<int>(b >> 13) + 8 * static_cast<int>(((b >> 4) & 7u) ^ (row & 7));  // (the swizzle undone)
      const uint4 u = lds_u128(tile + b);
      uint32_t* g = reinterpret_cast<uint32_t*>(base + row * ld + col);
      if (add) {
        red_add2<T>(g, u.x);
        red_add2<T>(g + 1, u.y);
        red_add2<T>(g + 2, u.z);
        red_add2<T>(g + 3, u.w);
      } else {
        g[0] = u.x;
        g[1] = u.y;
        g[2] = u.z;
        g[3] = u.w;
      }
    }
  }
}
// Column sums of a warp's 64 x 64 accumulator block over its eight row groups (lanes l ^ 4, l ^ 8,
// l ^ 16) by recursive halving: at the step of lane bit O each lane keeps the half of its N sums
// that the bit selects and adds the partner's copy of it, so that 8 + 4 + 2 shuffles replace 3 x 16
// (the same pairs added in the same order: the bits of a butterfly). The last two land in
// colp[col0], colp[col0 + 1]; col0 follows the kept half (b -> column 8 (b / 2) + b % 2).
template <int N, int O>
__device__ __forceinline__ void halve_columns(const float (&cs)[N], int lane, float* colp, int col0) {
  if constexpr (N == 2) {
    colp[col0] = cs[0];
    colp[col0 + 1] = cs[1];
  } else {
    const bool hi = (lane & O) != 0;
    float kept[N / 2];
    CUTE_UNROLL
    for (int i = 0; i < N / 2; ++i) {
      const float send = hi ? cs[i] : cs[i + N / 2];
      kept[i] = (hi ? cs[i + N / 2] : cs[i]) + __shfl_xor_sync(0xffffffffu, send, O);
    }
    halve_columns<N / 2, 2 * O>(kept, lane, colp, col0 + (hi ? 2 * N : 0));
  }
}
// Row sums (rows r0, r0 + 8 of the thread, summed over the quad) and the warp's column sums of
// a 64 x 64 accumulator (into colp[64 w + j], w the warp): both in fixed orders (deterministic).
template <class Acc>
__device__ __forceinline__ float2 rows_and_cols(const Acc& r, float* colp, int wt) {
  float rs[2] = {0.f, 0.f}, cs[16];
  CUTE_UNROLL
  for (int b = 0; b < 16; ++b) cs[b] = 0.f;
  CUTE_UNROLL
  for (int e = 0; e < size(r); ++e) {
    rs[(e >> 1) & 1] += r(e);
    cs[2 * (e >> 2) + (e & 1)] += r(e);
  }
  CUTE_UNROLL
  for (int o = 1; o < 4; o <<= 1) {
    rs[0] += __shfl_xor_sync(0xffffffffu, rs[0], o);
    rs[1] += __shfl_xor_sync(0xffffffffu, rs[1], o);
  }
  const int lane = wt & 31;
  halve_columns<16, 4>(cs, lane, colp, 64 * (wt >> 5) + 2 * (lane & 3));
  return make_float2(rs[0], rs[1]);
}
// The largest |acc(e)| of the thread.
template <class Acc>
__device__ __forceinline__ float abs_max(const Acc& acc) {
  AbsMax4 m;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) m.add(e, acc(e));
  return m.get();
}

// Tb'' = 2^ub T' diag(beta e^gamma 2^-ek) (fp16; columns past the end 0: beta and e^gamma are) from
// T' (tile src, (i, k) 64 x 64 fp16) into dst, ub from its largest magnitude (a warpgroup
// reduction on named barrier kBarStepS, red's slots by flip) into *ub_out; dK_b = -2^-(ew + a' +
// ub) Tb''^T dW''' then accumulates with dk's other terms. A thread's four 16-byte runs (rows
// wt / 8 + 16 r) hold the same eight columns (the swizzle moves a run by the row's low bits, equal
// for all four); two passes over shared memory keep S's registers for its accumulators.
__device__ __forceinline__ void form_tb(uint32_t src, uint32_t dst, const float* beta, const float* eg, const int8_t* kexp,
                                        float* red, int wt, int flip, int* ub_out) {
  using H = cutlass::half_t;
  const int col0 = 8 * ((wt & 7) ^ ((wt >> 3) & 7));
  float cf[8];
  CUTE_UNROLL
  for (int q = 0; q < 8; ++q) cf[q] = beta[col0 + q] * eg[col0 + q] * pow2c(-kexp[col0 + q]);
  AbsMax4 m;
  #pragma unroll 1
  for (int r = 0; r < 4; ++r) {
    const uint4 u = lds_u128(src + 16u * (wt + 128 * r));
    const uint32_t* pu = &u.x;
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      const float2 f = unpack2<H>(pu[q]);
      m.add2(q, f.x * cf[2 * q], f.y * cf[2 * q + 1]);
    }
  }
  const int ub = step_unit(wg_max(m.get(), red, wt, kBarStepS, flip));
  const float fu = pow2c(ub);
  CUTE_UNROLL
  for (int q = 0; q < 8; ++q) cf[q] *= fu;
  #pragma unroll 1
  for (int r = 0; r < 4; ++r) {
    uint4 u = lds_u128(src + 16u * (wt + 128 * r));
    uint32_t* pu = &u.x;
    CUTE_UNROLL
    for (int q = 0; q < 4; ++q) {
      const float2 f = unpack2<H>(pu[q]);
      pu[q] = pack2<H>(f.x * cf[2 * q], f.y * cf[2 * q + 1]);  // (T' is finite: the inverse kernel zeroes K's rows past the end)
    }
    sts128(dst + 16u * (wt + 128 * r), u);
  }
  if (wt == 0) *ub_out = ub;
}

// The reverse step: RecParams as launch_fused_step makes them (tiles_log2 = 0: one V tile of 128;
// pieces, maps and passes as reverse_role says), tmv v's tensor map and tmdo dO's, h0 / sh0
// d(final state) (null: zero), hT / shT d(initial state) in the state layout vk, o / so dv
// (written for the chunks after a warm-up, in pass 1 or unsplit).
template <class T>
__global__ void __launch_bounds__(StepCfg::kThreads, 1) gdn_bwd_fused_step(const __grid_constant__ RecParams p) {
  using Cfg = StepCfg;
  using H = cutlass::half_t;
  using LH = Lay<H>;
  using LT = Lay<T>;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sm = static_cast<uint8_t*>(
      __builtin_assume_aligned(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u), 1024));
  uint64_t* full = reinterpret_cast<uint64_t*>(sm + Cfg::kBar);  // kStages of full, then of empty
  uint64_t* empty = full + kStages;
  uint64_t* dsn_ready = empty + kStages;  // S: dSn' and en of the chunk (and S's reads of W' and dU' of the last)
  uint64_t* pg_ready = dsn_ready + 1;     // A: Pg'' and ep
  uint64_t* w_ready = pg_ready + 1;       // A: W'
  uint64_t* du_ready = w_ready + 1;       // K: dU' and its units (and K's reads of Pg'' and dSn')
  uint64_t* d_ready = du_ready + 1;       // S: D' and ed
  uint64_t* d_free = d_ready + 1;         // A: its read of D' (dP) done
  uint64_t* s_full = d_free + 1;          // P: the S' image of the chunk loaded (chunks with gradients)
  uint64_t* s_empty = s_full + 1;         // A and K: their reads of S' done
  uint64_t* u_ready = s_empty + 1;        // K: U'' and its units (chunks with gradients)
  uint64_t* qg_free = u_ready + 1;        // S: its product has read Qg' (A's dA'' goes there)
  uint64_t* du_free = qg_free + 1;        // S: its product has read dU' (K's dv goes there)
  uint64_t* dsn_free = du_free + 1;       // A and K: their reads of dSn' done (S may write the next)
  uint64_t* tm_full = dsn_free + 1;       // P: the region's T' image in D''s tile (chunks with dk)
  uint64_t* da_ready = tm_full + 1;       // A: dA'' in Pg''s tile and its unit ea (chunks with gradients)
  uint64_t* vkb_ready = da_ready + 1;     // K: dVb'' and dKb'' and their units, beta, K's dg rows (chunks with dk)
  uint64_t* mb_ready = vkb_ready + 1;     // A: dMb'' and em, its dbeta and dg rows and columns (chunks with dk)
  uint64_t* tail_ready = mb_ready + 1;    // Z: the stage's rows past the end zeroed (a partial chunk)
  uint64_t* tb_ready = tail_ready + 1;    // S: Tb'' in the stage's Tu' slot and ub (chunks with dk)
  uint64_t* prep_ready = tb_ready + 1;    // A and K: Qg' and D' (and ed) of a chunk without gradients
  uint64_t* tu_free = prep_ready + 1;     // K: its dv has read Tu', and beta is in sBeta (chunks with dk)
  int* misc = reinterpret_cast<int*>(sm + Cfg::kMisc);
  float* fmisc = reinterpret_cast<float*>(misc);

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
  wait_for_previous_kernels();  // the chunk table and the inverse kernel's regions
  const PieceCta tile = piece_cta(p);
  if (fused_cta_idle<T>(p, tile)) return;  // (malformed cu_seqlens: the outputs NaN)
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 3 * 128);
    }
    for (int b = 0; b < 6; ++b) mbar_init(dsn_ready + b, 128);
    mbar_init(s_full, 1);
    mbar_init(s_empty, 2 * 128);
    mbar_init(u_ready, 128);
    mbar_init(qg_free, 128);
    mbar_init(du_free, 128);
    mbar_init(dsn_free, 2 * 128);
    mbar_init(tm_full, 1);
    mbar_init(da_ready, 128);
    mbar_init(vkb_ready, 128);
    mbar_init(mb_ready, 128);
    mbar_init(tail_ready, 96);
    mbar_init(tb_ready, 128);
    mbar_init(prep_ready, 2 * 128);
    mbar_init(tu_free, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __shared__ int sflags[2];
  reverse_path_flags(p, tile, sflags, tid);
  __syncthreads();
  const PieceRole role = reverse_role(p, tile, 1, sflags[0], sflags[1]);
  if (!role.run) return;
  const int nch = role.nch;
  auto chunk_of = [&](int c) { return role.c0 + nch - 1 - c; };  // loop step c: chunks last to first
  auto stage = [&](int c) { return sm + (c % kStages) * Cfg::kStageBytes; };
  auto sparity = [&](int c) { return static_cast<uint32_t>((c / kStages) & 1); };
  auto chunk_len = [&](int c) { return static_cast<int>(min<int64_t>(kC, tile.slen - static_cast<int64_t>(chunk_of(c)) * kC)); };
  // Whether loop step c forms the chunk's gradients (dq; dv is stored by the same rule).
  auto step_grads = [&](int c) { return role.out && c >= role.nwarm && p.dq && p.grad_simg; };
  // Whether it forms dk and dbeta too (their outputs, T' images and beta all set: launch_fused_step).
  auto step_dk = [&](int c) { return step_grads(c) && p.dk; };
  // A, K and S at the stage of loop step c: a partial chunk (only the first step can be one) waits
  // for role Z's zeros past the end.
  auto wait_stage = [&](int c, int len) {
    mbar_wait(&full[c % kStages], sparity(c));
    if (len < kC) mbar_wait(tail_ready, 0);
  };

  if (wg == 0) {
    // ---------------- P: the loads ----------------
    set_role_registers<Cfg::kRegs[0], Cfg::kEntryRegs>();
    if (wt >= 32) {
      // ---------------- Z: the partial chunk's rows past the end, zeroed ----------------
      const int len = chunk_len(0);
      if (len < kC) {
        mbar_wait(&full[0], sparity(0));
        // Rows len .. 63 of each 64-column box of q, k, v, dO: 128-byte rows, so one contiguous run a box.
        static_assert(Cfg::kQ == 0 && Cfg::kK == kQKBytes && Cfg::kV == 2 * kQKBytes && Cfg::kO == 3 * kQKBytes, "the stage's input tiles out of order");
        const uint32_t base = smem_u32(stage(0)), run = static_cast<uint32_t>(kC - len) * 128u;
        for (uint32_t i = 16u * (wt - 32); i < 8u * run; i += 16u * 96u) {
          const uint32_t box = i / run, off = i % run;  // boxes: q, q, k, k, v, v, dO, dO
          sts128(base + box * (kQKBytes / 2) + static_cast<uint32_t>(len) * 128u + off, make_uint4(0u, 0u, 0u, 0u));
        }
        fence_async_smem();  // (the zeros before the products read the tiles)
        mbar_arrive(tail_ready);
      }
      return;
    }
    if (wt != 0) return;
    const int hq = tile.hv / (p.HV / p.H), bb = static_cast<int>(tile.b);
    for (int c = 0; c < nch; ++c) {
      const int st = c % kStages, cc = chunk_of(c);
      const int tok = static_cast<int>(tile.t0) + cc * kC;
      const size_t region = static_cast<size_t>(tile.ci0 + cc) * p.HV + tile.hv;
      const uint8_t* reg = static_cast<const uint8_t*>(p.regions) + region * kInvRegionBytes;
      uint8_t* dst = stage(c);
      // The S' image and the stage, in the order their tiles are released: without dk A releases
      // S''s tile before the stage; with dk K's tail holds it (dMb'', X'', dg's sums) past the stage.
      const bool simg = step_grads(c), simg_first = !(c > 0 && step_dk(c - 1));
      auto load_simg = [&] {
        mbar_wait(s_empty, ((c - role.nwarm) & 1) ^ 1);
        mbar_expect_tx(s_full, kSImgBytes);
        bulk_g2s(sm + Cfg::kS, static_cast<const uint8_t*>(p.grad_simg) + region * kSImgBytes, kSImgBytes, s_full);
      };
      if (simg && simg_first) load_simg();
      mbar_wait(&empty[st], sparity(c) ^ 1);
      mbar_expect_tx(&full[st], Cfg::kTx);
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        tma_load_4d(dst + Cfg::kQ + h * (kQKBytes / 2), &p.tmq, h * 64, hq, tok, bb, &full[st]);
        tma_load_4d(dst + Cfg::kK + h * (kQKBytes / 2), &p.tmk, h * 64, hq, tok, bb, &full[st]);
        tma_load_4d(dst + Cfg::kV + h * (kQKBytes / 2), &p.tmv, h * 64, tile.hv, tok, bb, &full[st]);
        tma_load_4d(dst + Cfg::kO + h * (kQKBytes / 2), &p.tmdo, h * 64, tile.hv, tok, bb, &full[st]);
      }
      bulk_g2s(dst + Cfg::kTu, reg + kInvImg, kImgTokTok * 2, &full[st]);
      bulk_g2s(dst + Cfg::kGates, reg + kInvGam, kInvGateCopy, &full[st]);
      if (simg && !simg_first) load_simg();
      if (c + 1 < nch) {  // the next chunk's inputs into L2 while this one runs (its loads wait for the stage)
        const int tn = tok - kC;
        const uint8_t* rn = reg - static_cast<size_t>(p.HV) * kInvRegionBytes;
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          tma_prefetch_4d(&p.tmq, h * 64, hq, tn, bb);
          tma_prefetch_4d(&p.tmk, h * 64, hq, tn, bb);
          tma_prefetch_4d(&p.tmv, h * 64, tile.hv, tn, bb);
          tma_prefetch_4d(&p.tmdo, h * 64, tile.hv, tn, bb);
        }
        bulk_prefetch_l2(rn + kInvImg, kImgTokTok * 2);
        bulk_prefetch_l2(rn + kInvGam, kInvGateCopy);
        if (step_grads(c + 1))
          bulk_prefetch_l2(static_cast<const uint8_t*>(p.grad_simg) + (region - p.HV) * kSImgBytes, kSImgBytes);
      }
      if (step_dk(c)) {  // the region's T' image into D''s tile once A's dP and S's product have read D'
        mbar_wait(d_free, c & 1);
        mbar_wait(qg_free, c & 1);
        mbar_expect_tx(tm_full, kImgTokTok * 2);
        bulk_g2s(sm + Cfg::kD, static_cast<const uint8_t*>(p.grad_tm) + region * (kImgTokTok * 2), kImgTokTok * 2, tm_full);
      }
    }
    return;
  }

  if (wg == 1) {
    // ---------------- A: Pg'' and W' for the chain; dP, dA and dq ----------------
    set_role_registers<Cfg::kRegs[1], Cfg::kEntryRegs>();
    auto mmaP = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto mmaW = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
    auto mmaDP = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto mmaQ = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
    // With dk, K's X block (after dq): X (two products of 64 x 64), dL, K K^T again.
    auto mmaX = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto mmaL = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto thrX = mmaX.get_thread_slice(wt);
    auto thrL = mmaL.get_thread_slice(wt);
    Tensor cX = thrX.partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (i, j)
    const float* sBeta = reinterpret_cast<const float*>(sm + Cfg::kBeta);  // (K writes it before vkb_ready)
    auto stageT = [&](const uint8_t* base, uint32_t off, auto layout) { return make_tensor(make_smem_ptr(reinterpret_cast<const T*>(base + off)), layout); };
    auto thrP = mmaP.get_thread_slice(wt);
    auto thrW = mmaW.get_thread_slice(wt);
    auto thrDP = mmaDP.get_thread_slice(wt);
    auto thrQ = mmaQ.get_thread_slice(wt);
    Tensor cP = thrP.partition_C(make_identity_tensor(Shape<_64, _64>{}));   // (i, j)
    Tensor cY = thrQ.partition_C(make_identity_tensor(Shape<_64, _128>{}));  // (tok, d)
    T* dq = static_cast<T*>(p.dq);
    int flip = 0;  // A's reductions
    QLA_PHASES_SMEM(8, reinterpret_cast<unsigned long long*>(sm + Cfg::kMisc + 256));
    for (int c = 0; c < nch; ++c) {
      uint8_t* stb = stage(c);
      const StepGates gt(stb);
      const int len = chunk_len(c);
      const bool grads = step_grads(c);  // (the gradients of this chunk)
      const bool sdot = grads && p.dg && p.dk;  // A reads dSn' for dg's e^Gamma <dSn, S>
      wait_stage(c, len);
      QLA_PHASE(0);
      // P = Q K^T (raw inputs), under the bound of the unit of Pg''.
      Tensor accP = partition_fragment_C(mmaP, Shape<_64, _64>{});
      {
        Tensor rQ = thrP.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kQ)), typename LT::TokD_K{}));
        Tensor rK = thrP.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kK)), typename LT::TokD_K{}));
        warpgroup_fence_operand(accP);
        warpgroup_arrive();
        gemm_k(mmaP, rQ, rK, accP, GMMA::ScaleOut::Zero);
        warpgroup_commit_batch();
      }
      // |2^ek_j scale e^(gamma_i - gamma_j) q_i.k_j| <= |scale| 2^(1 - eq_i) x 1.1025 (|2^ek k|, |2^eq q| < 2^(1/2) x 1.05).
      const int ep = step_unit(fabsf(p.scale) * 2.25f * pow2c(-min_qexp(gt.qexp(), len, wt & 31)));
      warpgroup_wait<0>();
      warpgroup_fence_operand(accP);
      // The image of Pg''^T (i, j): 2^(ep + ek_j) scale e^(gamma_i - gamma_j) P_ij for j <= i < len, else 0.
      QLA_PHASE(1);
      if (c > 0) mbar_wait(du_ready, (c - 1) & 1);  // K's last product has read the previous Pg''
      QLA_PHASE(2);
      {
        const GateFactors gf(gt, cP, len, ep, p.scale);
        stmatrix_tokd<64, T>(smem_u32(sm) + Cfg::kPg, fresh(wt), [&](int e) { return gf.scaled(e, accP(e)); });
      }
      if (wt == 0) misc[kMiscEp] = ep;
      fence_async_smem();
      mbar_arrive(pg_ready);
      if (!grads) {  // Qg' for S (form_qg) once S's last D'^T Qg' has read the tile
        if (c > 0) mbar_wait(qg_free, (c - 1) & 1);
        form_qg<T>(stb, sm, gt, p.scale, qg_unit(gt, p.scale, len, wt), wt);
        fence_async_smem();
        mbar_arrive(prep_ready);
      }
      QLA_PHASE(3);
      // W' = -2^-et Tu' Kw, Kw = diag(e^gamma) K (raw K) in the tile of W', once the previous
      // chunk's readers of that tile are done: S's last product (du_free), or with dk K's tail as
      // well (dv's store, dW'''; K frees dSn' after them, so dSn' of this chunk being ready says it).
      // Not waiting for dSn' takes W' off the chain's path where nothing reads the tile late.
      if (c > 0) {
        if (step_dk(c - 1)) mbar_wait(dsn_ready, c & 1);
        else mbar_wait(du_free, (c - 1) & 1);
      }
      QLA_PHASE(4);
      {
        const float* eg = gt.eg();
        scale_rows<T, H>(smem_u32(stb + Cfg::kK), smem_u32(sm + Cfg::kW), wt, [&](int row) { return eg[row]; });
      }
      fence_async_smem();  // (Kw) before the product reads it
      wg_bar(kBarStepA);   // Kw written by every thread before the product reads it
      Tensor accW = partition_fragment_C(mmaW, Shape<_64, _128>{});
      {
        Tensor rTu = thrW.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(stb + Cfg::kTu)), typename LH::TokTok_K{}));
        Tensor rKw = thrW.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kW)), typename LH::DTok_MN{}));
        gemm_sync(mmaW, rTu, rKw, accW, GMMA::ScaleOut::Zero);
      }
      const int et = gt.et();
      wg_bar(kBarStepA);  // every warp's product has read Kw
      {
        const float wsc = -pow2c(-et);
        stmatrix_tokd<128, H>(smem_u32(sm) + Cfg::kW, fresh(wt), [&](int e) { return wsc * accW(e); });
      }
      fence_async_smem();
      mbar_arrive(w_ready);
      if (!sdot) mbar_arrive(dsn_free);
      QLA_PHASE(5);
      if (grads) {
        // dq = scale diag(e^gamma) dO S^T + dA K: accQ = dO S^T first (it waits for S' alone), its
        // rows x scale e^gamma 2^ea once dA's unit ea is known, + dA'' K, x 2^-ea at the store.
        const int gi = c - role.nwarm;
        mbar_wait(s_full, gi & 1);
        Tensor accQ = partition_fragment_C(mmaQ, Shape<_64, _128>{});
        {
          Tensor rO = thrQ.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kO)), typename LT::TokD_K{}));
          Tensor rSt = thrQ.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(sm + Cfg::kS)), QK_MN{}));
          gemm_sync(mmaQ, rO, rSt, accQ, GMMA::ScaleOut::Zero);
        }
        if (sdot) {
          // dg: e^Gamma <dSn, S> (B33) = e^Gamma 2^-en <dSn', S'>: dSn' (fp16) and the S' image have the
          // same (v, d) layout, so the pairs are the same bytes of both; four warp partials for K.
          mbar_wait(dsn_ready, c & 1);  // (W' may not have waited for it)
          const uint32_t sa = smem_u32(sm + Cfg::kDSn) + 16u * fresh(wt), sb = smem_u32(sm + Cfg::kS) + 16u * wt;
          float sum = 0.f;
          #pragma unroll 2  // (rolled: the roles' hot code must fit the instruction cache)
          for (int r = 0; r < 16; ++r) {
            const uint4 x = lds_u128(sa + 2048u * r), y = lds_u128(sb + 2048u * r);
            const uint32_t *px = &x.x, *py = &y.x;
            CUTE_UNROLL
            for (int q = 0; q < 4; ++q) {
              const float2 fx = unpack2<H>(px[q]), fy = unpack2<T>(py[q]);
              sum += fx.x * fy.x + fx.y * fy.y;
            }
          }
          CUTE_UNROLL
          for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
          if ((wt & 31) == 0) fmisc[kMiscSdot + (wt >> 5)] = sum * gt.eG() * pow2c(-misc[kMiscEn]);  // (K reads them after da_ready)
          mbar_arrive(dsn_free);
        }
        mbar_arrive(s_empty);  // A's reads of S' are done
        float2 t1 = make_float2(0.f, 0.f);  // dg: <scale e^gamma_i (dO S^T)_i, Q_i> (B31)
        if (p.dg && p.dk) {
          const int r0 = get<0>(cY(0));
          t1 = row_dot<T>(accQ, smem_u32(stb + Cfg::kQ), wt);
          t1.x = r0 < len ? t1.x * p.scale * gt.eg()[r0] : 0.f;
          t1.y = r0 + 8 < len ? t1.y * p.scale * gt.eg()[r0 + 8] : 0.f;
        }
        QLA_PHASE(6);
        // dP'' = D' U''^T = 2^(ed + eut) dO U^T diag(2^-ek), with U'' = 2^eut diag(2^-ek) U from K.
        mbar_wait(u_ready, gi & 1);
        mbar_wait(d_ready, c & 1);
        const int eut = misc[kMiscEut], ed = misc[kMiscEd];
        Tensor accD = partition_fragment_C(mmaDP, Shape<_64, _64>{});
        {
          Tensor rD = thrDP.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kD)), typename LH::TokD_K{}));
          Tensor rU = thrDP.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kU)), typename LH::TokD_K{}));
          gemm_sync(mmaDP, rD, rU, accD, GMMA::ScaleOut::Zero);
        }
        mbar_arrive(d_free);  // (D' for S, U'' for K)
        // dA = scale e^(gamma_i - gamma_j) dP (j <= i < len); dA'' = 2^ea dA in the input type (ea
        // = 0 for bf16), into the tile of Pg'' once K's product has read it (du_ready); K reads
        // dA'' for dk before it releases the stage, so the next Pg'' cannot overwrite it early.
        AbsMax4 m;
        const GateFactors gf(gt, cP, len, -ed - eut, p.scale);
        CUTE_UNROLL
        for (int e = 0; e < size(accD); ++e) {
          accD(e) = gf.scaled(e, accD(e));
          m.add(e, accD(e));
        }
        const int ea = kTileUnits<T> ? step_unit(wg_max(m.get(), fmisc + kMiscRedA, wt, kBarStepA, flip++)) : 0;
        const float fa = pow2c(ea);
        mbar_wait(du_ready, c & 1);
        stmatrix_tokd<64, T>(smem_u32(sm) + Cfg::kPg, fresh(wt), [&](int e) { return accD(e) * fa; });
        if (wt == 0) misc[kMiscEa] = ea;
        fence_async_smem();
        wg_bar(kBarStepA);  // dA'' written by every thread
        {
          const float* eg = gt.eg();
          const int r0 = get<0>(cY(0));
          const float f0 = r0 < len ? p.scale * eg[r0] * fa : 0.f, f1 = r0 + 8 < len ? p.scale * eg[r0 + 8] * fa : 0.f;
          CUTE_UNROLL
          for (int e = 0; e < size(accQ); ++e) accQ(e) *= acc_half(e) ? f1 : f0;
        }
        {
          Tensor rA = thrQ.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(sm + Cfg::kPg)), typename LT::TokTok_K{}));
          Tensor rKt = thrQ.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kK)), typename LT::DTok_MN{}));
          gemm_sync(mmaQ, rA, rKt, accQ, GMMA::ScaleOut::One);
        }
        const int64_t t0 = tile.t0 + static_cast<int64_t>(chunk_of(c)) * kC;
        const float inv = pow2c(-ea);
        // dq into the tile of Qg' once S's product has read it; a full chunk then goes out by two
        // bulk tensor stores, whose reads of the tile end before the stage is released (S writes the
        // next Qg' there), a partial one by generic stores (store_tile_rows).
        mbar_wait(qg_free, c & 1);
        stmatrix_tokd<128, T>(smem_u32(sm) + Cfg::kQg, fresh(wt), [&](int e) { return accQ(e) * inv; });
        if (p.dq_tma && len == kC) {
          fence_async_smem();
          wg_bar(kBarStepA);
          if (wt == 0) {
            store_tile_boxes(&p.tmdq, sm + Cfg::kQg, tile.hv >> p.dqk_add, static_cast<int>(t0), static_cast<int>(tile.b),
                             p.dqk_add);
            bulk_wait_read();
          }
        } else {
          wg_bar(kBarStepA);
          store_tile_rows<T>(smem_u32(sm + Cfg::kQg),
                             dq + tile.b * p.sdq[0] + t0 * p.sdq[1] + static_cast<int64_t>(tile.hv >> p.dqk_add) * p.sdq[2],
                             p.sdq[1], len, wt, p.dqk_add);
        }
        if (p.dg && p.dk) {
          // R_P = strict(dP o P) = strict(dA o Q K^T) (B30; Q K^T again, raw; after dq, whose
          // registers it needs): its row sums with the term above, less its column sums, A's part of
          // a_i (B31), into D''s tile after T' once S's product has read D' (qg_free; A's dP has
          // too): [a 64 | rows 64 | columns 4 x 64].
          Tensor accP2 = partition_fragment_C(mmaP, Shape<_64, _64>{});
          {
            Tensor rQ = thrP.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kQ)), typename LT::TokD_K{}));
            Tensor rK = thrP.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(stb + Cfg::kK)), typename LT::TokD_K{}));
            gemm_sync(mmaP, rQ, rK, accP2, GMMA::ScaleOut::Zero);
          }
          // dA o Q K^T with its diagonal: dA is 0 above the diagonal and at rows past the end (Q K^T
          // finite), and a diagonal term enters row i's sum and column i's alike, so a_i = rows - columns
          // cancels it (to rounding) without a compare per element (docs/design.md bwd-61).
          CUTE_UNROLL
          for (int e = 0; e < size(accP2); ++e) accP2(e) *= accD(e);
          mbar_wait(qg_free, c & 1);
          float* sdA = reinterpret_cast<float*>(sm + Cfg::kD + kImgTokTok * 2);
          const float2 rs = rows_and_cols(accP2, sdA + 128, wt);
          if ((wt & 3) == 0) {
            const int r0 = get<0>(cP(0));
            sdA[64 + r0] = t1.x + rs.x;
            sdA[64 + r0 + 8] = t1.y + rs.y;
          }
          wg_bar(kBarStepA);
          if (wt < kC) sdA[wt] = sdA[64 + wt] - (sdA[128 + wt] + sdA[192 + wt] + sdA[256 + wt] + sdA[320 + wt]);
        }
        mbar_arrive(da_ready);             // dA'' (and A's part of dg) for K
        if (p.dk) {
          // K's dk, its X block (docs/backward.md (B25)-(B30)), beside K's Tb'', dK_d and dK_b: X = dVb
          // V^T + dKb K^T diag(e^gamma) from K's dVb'' (S''s tile) and dKb'' (dU''s); X''_ik = 2^ex X_ik
          // beta_k 2^-ek_k (i, k < len, fp16) after dVb''; dL, dM; dMb'' over dVb'' once every X product
          // has read it; dbeta's <dM K, K> rows and dg's R_L rows and columns into sdK; then K's dM products.
          mbar_wait(vkb_ready, gi & 1);
          mbar_wait(tm_full, gi & 1);  // T' in D''s tile
          const uint32_t kX = Cfg::kS + kQKBytes, kMb = Cfg::kS;
          float* sdK = reinterpret_cast<float*>(sm + Cfg::kS + kSdK);
          const int evb = misc[kMiscEvb], ekb = misc[kMiscEkb];
          const float* eg = gt.eg();
          const int8_t* kexp = gt.kexp();
          const int r0 = get<0>(cX(0));
          int em;
          {
            Tensor accX = partition_fragment_C(mmaX, Shape<_64, _64>{});
            Tensor accX2 = partition_fragment_C(mmaX, Shape<_64, _64>{});
            {
              Tensor rA = thrX.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(sm + Cfg::kS)), typename LT::TokD_K{}));
              Tensor rB = thrX.partition_fragment_B(stageT(stb, Cfg::kV, typename LT::TokD_K{}));
              Tensor rA2 = thrX.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const T*>(sm + Cfg::kDU)), typename LT::TokD_K{}));
              Tensor rB2 = thrX.partition_fragment_B(stageT(stb, Cfg::kK, typename LT::TokD_K{}));
              gemm_pair_sync(mmaX, rA, rB, accX, rA2, rB2, accX2, GMMA::ScaleOut::Zero);
            }
            {
              // Per column k of the thread (the accumulator's order, as GateFactors): 2^-ekb e^gamma_k
              // and beta_k 2^-ek_k (0 past the end), formed once. X is finite (the stage's zeros) and
              // 0 at rows past the end (dVb'' and dKb'' are), so the factors need no select.
              const float fv = pow2c(-evb), fk = pow2c(-ekb);
              float ck[16], cb[16];
              {
                const int c0 = get<1>(cX(0));
                CUTE_UNROLL
                for (int b = 0; b < 16; ++b) {
                  const int k = c0 + 8 * (b >> 1) + (b & 1);
                  ck[b] = fk * eg[k];
                  cb[b] = sBeta[k] * pow2c(-kexp[k]);  // (sBeta is 0 past the end)
                }
              }
              AbsMax4 m;
              CUTE_UNROLL
              for (int e = 0; e < size(accX); ++e) {
                const int b = 2 * (e >> 2) + (e & 1);
                const float x = accX(e) * fv + accX2(e) * ck[b];
                accX(e) = x * cb[b];
                m.add(e, accX(e));
              }
              const int ex = step_unit(wg_max(m.get(), fmisc + kMiscRedA, wt, kBarStepA, flip++));
              const float fx = pow2c(ex);
              stmatrix_tokd<64, H>(smem_u32(sm) + kX, fresh(wt), [&](int e) { return accX(e) * fx; });
              fence_async_smem();
              wg_bar(kBarStepA);  // X'' written
              // dL = -strict(2^-ex X'' T'^T) diag(2^ek); dM = E o dL (j < i < len).
              Tensor rA = thrL.partition_fragment_A(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + kX)), typename LH::TokTok_K{}));
              Tensor rB = thrL.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kD)), typename LH::TokTok_K{}));
              gemm_sync(mmaL, rA, rB, accX, GMMA::ScaleOut::Zero);
              const GateFactors gf(gt, cX, len, -ex, -1.f);
              CUTE_UNROLL
              for (int e = 0; e < size(accX); ++e) accX(e) = gf.scaled<true>(e, accX(e));
            }
            // K K^T (raw): dbeta's third row dot <(dM K)_i, K_i> = sum_j dM_ij (K K^T)_ij, and R's
            // second part dL o L = beta_i dM_ij (K K^T)_ij (B30) for dg.
            {
              Tensor rA = thrX.partition_fragment_A(stageT(stb, Cfg::kK, typename LT::TokD_K{}));
              Tensor rB = thrX.partition_fragment_B(stageT(stb, Cfg::kK, typename LT::TokD_K{}));
              gemm_sync(mmaX, rA, rB, accX2, GMMA::ScaleOut::Zero);
            }
            mbar_arrive(&empty[c % kStages]);  // A's last read of the stage (P loads the next chunk under the rest)
            AbsMax4 m;
            CUTE_UNROLL
            for (int e = 0; e < size(accX); ++e) {
              const int i = get<0>(cX(e));
              const float bi = sBeta[i];  // (0 past the end)
              accX2(e) *= accX(e);  // (dM is 0 where j >= i or i >= len)
              accX(e) *= bi;  // dMb = diag(beta) dM
              m.add(e, accX(e));
            }
            {
              float rr[2] = {0.f, 0.f};
              CUTE_UNROLL
              for (int e = 0; e < size(accX2); ++e) rr[(e >> 1) & 1] += accX2(e);
              CUTE_UNROLL
              for (int o = 1; o < 4; o <<= 1) {
                rr[0] += __shfl_xor_sync(0xffffffffu, rr[0], o);
                rr[1] += __shfl_xor_sync(0xffffffffu, rr[1], o);
              }
              if ((wt & 3) == 0) {
                sdK[kSdRr + r0] = rr[0];
                sdK[kSdRr + r0 + 8] = rr[1];
              }
            }
            if (p.dg) {  // R_L = beta_i dM_ij (K K^T)_ij: its row and column sums into sdK
              CUTE_UNROLL
              for (int e = 0; e < size(accX2); ++e) {
                const int i = get<0>(cX(e));
                accX2(e) *= sBeta[i];
              }
              const float2 rs = rows_and_cols(accX2, sdK + kSdCols, wt);
              if ((wt & 3) == 0) {
                sdK[kSdRows + r0] = rs.x;
                sdK[kSdRows + r0 + 8] = rs.y;
              }
            }
            em = kTileUnits<T> ? step_unit(wg_max(m.get(), fmisc + kMiscRedA, wt, kBarStepA, flip++)) : 0;  // (ex's barrier: every X product has read dVb'')
            const float fm = pow2c(em);
            stmatrix_tokd<64, T>(smem_u32(sm) + kMb, fresh(wt), [&](int e) { return accX(e) * fm; });
          }
          if (wt == 0) misc[kMiscEm] = em;
          fence_async_smem();
          mbar_arrive(mb_ready);
        } else {
          mbar_arrive(&empty[c % kStages]);  // A's reads of the stage are done
        }
      } else {
        mbar_wait(d_ready, c & 1);  // (the hand-over of D' still runs: its phases count chunks)
        mbar_arrive(d_free);
        mbar_arrive(&empty[c % kStages]);
      }
      QLA_PHASE(7);
    }
    QLA_PHASES_PRINT("step A (wait, P + ep, wait du(c-1), Pg'' store, wait dSn', W', wait S' + dO S^T, wait U'' + dP dA dq)", 8, nch);
    if (wt == 0 && p.dq_tma) bulk_wait_all();  // dq's bulk stores performed before the CTA ends
    return;
  }

  if (wg == 2) {
    // ---------------- K: U'' for A's dq; dU' and dv ----------------
    set_role_registers<Cfg::kRegs[2], Cfg::kEntryRegs>();
    auto mmaY = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto mmaW = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
    auto thrY = mmaY.get_thread_slice(wt);
    auto thrW = mmaW.get_thread_slice(wt);
    int flip = 0;  // K's reductions
    auto mmaD = make_tiled_mma(SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>{});  // Kd' dSn' (B (v, d))
    auto mmaG = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::MN, GMMA::Major::MN>());
    auto mmaV = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _128, _16>, GMMA::Major::MN, GMMA::Major::MN>());
    auto thrD = mmaD.get_thread_slice(wt);
    auto thrG = mmaG.get_thread_slice(wt);
    auto thrV = mmaV.get_thread_slice(wt);
    Tensor rKd = make_tensor<H>(Shape<Shape<_2, _2, _2>, _1, _8>{});  // Kd' (j, d), the accumulator's element order
    T* dv = static_cast<T*>(p.o);
    // dk and dbeta of a chunk with dk (after dv; the header's equations): every product but the
    // chain's, from the tiles the chain has left: dW''' in W''s once dv's stores have read it, T'
    // in D''s, dVb'' then dM'' and dMb'' in S''s, dKb'' in dU''s, X'' after dVb''; A's dA'' in
    // Pg''s; U'' and dSn' last (dK_d). gi: the chunk's index among those with gradients; en + eu:
    // dU''s units; beta_bits: beta of token wt.
    float* sBeta = reinterpret_cast<float*>(sm + Cfg::kBeta);
    auto mmaTW = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
    auto mmaX = make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto mmaL = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _64, _16>, GMMA::Major::K, GMMA::Major::K>());
    auto thrTW = mmaTW.get_thread_slice(wt);
    auto thrX = mmaX.get_thread_slice(wt);
    auto thrL = mmaL.get_thread_slice(wt);
    auto mmaRS = make_tiled_mma(GMMA::rs_op_selector<T, T, float, Shape<_64, _128, _16>, GMMA::Major::K, GMMA::Major::MN>());
    auto thrRS = mmaRS.get_thread_slice(wt);
    Tensor cX = thrX.partition_C(make_identity_tensor(Shape<_64, _64>{}));  // (i, j)
    // K's tiles (byte offset off from the CTA's or the stage's base), each from a fresh base (see
    // fresh): addresses and descriptors formed at their use.
    auto tileTT = [&](uint32_t off) { return make_tensor(make_smem_ptr(reinterpret_cast<T*>(fresh(sm) + off)), typename LT::TokTok_K{}); };
    auto tT = [&](const uint8_t* base, uint32_t off, auto layout) { return make_tensor(make_smem_ptr(reinterpret_cast<const T*>(fresh(base) + off)), layout); };
    auto tH = [&](const uint8_t* base, uint32_t off, auto layout) { return make_tensor(make_smem_ptr(reinterpret_cast<const H*>(fresh(base) + off)), layout); };
    QLA_PHASES_SMEM(16, reinterpret_cast<unsigned long long*>(sm + Cfg::kMisc + 336));  // (to + 464, S's from + 464)
    for (int c = 0; c < nch; ++c) {
      uint8_t* stb = stage(c);
      const StepGates gt(stb);
      const int len = chunk_len(c);
      uint32_t beta_bits = 0;  // beta of token wt (chunks with dk), loaded early: written to sBeta after dK_d
      if (step_dk(c) && wt < len)
        beta_bits = load_bits(p.beta, p.b_dt, tile.b * p.sb[0] + (tile.t0 + static_cast<int64_t>(chunk_of(c)) * kC + wt) * p.sb[1] + tile.hv);
      wait_stage(c, len);
      QLA_PHASE(0);
      if (!step_grads(c)) {  // D' and ed for S (form_d) once S's last D'^T Qg' has read the tile
        if (c > 0) mbar_wait(qg_free, (c - 1) & 1);
        const int ed = form_d<T>(stb, sm, fmisc + kMiscRedK, wt, kBarStepK, flip++);
        if (wt == 0) misc[kMiscEd] = ed;
        fence_async_smem();
        mbar_arrive(prep_ready);
      }
      QLA_PHASE(1);
      if (step_grads(c)) {
        // Z = V - diag(e^gamma) K S (rows past the end zero: v and k are), Z' = 2^ez Z (fp16) in the tile of U
        // once A's dP has read the last U''; U'' = 2^eu Tu' Z' = 2^(eu + et + ez) diag(2^-ek) U.
        const int gi = c - role.nwarm;
        mbar_wait(s_full, gi & 1);
        Tensor acc = partition_fragment_C(mmaY, Shape<_64, _128>{});
        // Z' then U'' into U''s tile, one rolled loop sharing the unit and the store (the instruction
        // cache, bwd-47).
        const TokDPairs pr(wt);
        const float egr[2] = {gt.eg()[pr.r0], gt.eg()[pr.r0 + 8]};
        int ez = 0, eu = 0;
        #pragma unroll 1
        for (int it = 0; it < 2; ++it) {
          AbsMax4 m;
          if (it == 0) {
            {
              Tensor rK = thrY.partition_fragment_A(tT(stb, Cfg::kK, typename LT::TokD_K{}));
              Tensor rS = thrY.partition_fragment_B(tT(sm, Cfg::kS, QK_K{}));
              gemm_sync(mmaY, rK, rS, acc, GMMA::ScaleOut::Zero);
            }
            if (!step_dk(c)) mbar_arrive(s_empty);  // K's read of S' is done (with dk: at the chunk's end)
            tokd_pairs(smem_u32(stb + Cfg::kV), wt, [&](int e, uint32_t bits) {
              const float egi = egr[acc_half(e)];
              const float2 v2 = unpack2<T>(bits);
              acc(e) = v2.x - egi * acc(e);
              acc(e + 1) = v2.y - egi * acc(e + 1);
              m.add2(e >> 1, acc(e), acc(e + 1));
            });
          } else {
            Tensor rTu = thrW.partition_fragment_A(tH(stb, Cfg::kTu, typename LH::TokTok_K{}));
            Tensor rZ = thrW.partition_fragment_B(tH(sm, Cfg::kU, typename LH::DTok_MN{}));
            gemm_sync(mmaW, rTu, rZ, acc, GMMA::ScaleOut::Zero);
            CUTE_UNROLL
            for (int e = 0; e < size(acc); ++e) m.add(e, acc(e));
          }
          const int eb = step_unit(wg_max(m.get(), fmisc + kMiscRedK, wt, kBarStepK, flip++));  // (U'': its barrier: every product has read Z')
          if (it == 0) {
            ez = eb;
            if (c > 0) mbar_wait(d_free, (c - 1) & 1);  // A's dP has read the last U''
          } else {
            eu = eb;
          }
          const float f = pow2c(eb);
          stmatrix_tokd<128, H>(smem_u32(fresh(sm)) + Cfg::kU, fresh(wt), [&](int e) { return acc(e) * f; });
          fence_async_smem();
          if (it == 0) wg_bar(kBarStepK);  // Z' written by every thread before the product reads it
        }
        if (wt == 0) misc[kMiscEut] = eu + gt.et() + ez;
        mbar_arrive(u_ready);
      }
      QLA_PHASE(2);
      {  // Kd' = diag(e^(Gamma - gamma_j) 2^ek_j) K (zero past the end: k is)
        const TokDPairs pr(wt);
        const uint32_t sK = smem_u32(stb + Cfg::kK);
        float f[2];
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int j = pr.r0 + 8 * h;
          f[h] = j < len ? gt.egk()[j] * pow2c(gt.kexp()[j]) : 0.f;
        }
        tokd_pairs(sK, wt, [&](int e, uint32_t bits) {
          const float2 k2 = unpack2<T>(bits);
          const float fh = f[acc_half(e)];
          rKd(e) = H(k2.x * fh);
          rKd(e + 1) = H(k2.y * fh);
        });
      }
      // Pg''^T dO first: it does not wait for the chain (A forms Pg'' while S ends the last chunk).
      Tensor accK = partition_fragment_C(mmaD, Shape<_64, _128>{});
      mbar_wait(pg_ready, c & 1);
      const int ep = misc[kMiscEp];
      QLA_PHASE(3);
      {
        Tensor rO = thrG.partition_fragment_B(tT(stb, Cfg::kO, typename LT::DTok_MN{}));
        gemm_sync(mmaG, thrG.partition_fragment_A(tT(sm, Cfg::kPg, typename LT::TokTok_MN{})), rO, accK, GMMA::ScaleOut::Zero);
      }
      // A chunk that stores no dv and forms no dk (pass 0, a warm-up) reads the stage no more: its
      // release here lets P load the next chunk under this one's chain (dU', S's dU'^T W').
      const bool dkc = step_dk(c);
      const bool dv_out = role.out && c >= role.nwarm && dv;
      const bool chain_only = !dv_out && !dkc;
      if (chain_only) mbar_arrive(&empty[c % kStages]);
      QLA_PHASE(4);
      mbar_wait(dsn_ready, c & 1);
      QLA_PHASE(5);
      const int en = misc[kMiscEn];
      {
        const float f = pow2c(en - ep);
        CUTE_UNROLL
        for (int e = 0; e < size(accK); ++e) accK(e) *= f;
      }
      warpgroup_fence_operand(rKd);
      gemm_sync(mmaD, rKd, thrD.partition_fragment_B(tH(sm, Cfg::kDSn, QK_K{})), accK, GMMA::ScaleOut::One);
      QLA_PHASE(6);
      // dU' = 2^eu accK in fp16; the previous dU' was read by S before dSn' of this chunk was ready,
      // and the last chunk's dk store reads that tile before eu's barrier.
      if (wt == 0 && p.dk_tma) bulk_wait_read();
      const int eu = step_unit(wg_max(abs_max(accK), fmisc + kMiscRedK, wt, kBarStepK, flip++));
      {
        const float f = pow2c(eu);
        stmatrix_tokd<128, H>(smem_u32(fresh(sm)) + Cfg::kDU, fresh(wt), [&](int e) { return accK(e) * f; });
      }
      if (wt == 0) misc[kMiscEu] = en + eu;  // dU''s units, for S
      fence_async_smem();
      wg_bar(kBarStepK);  // dU' written by every thread before the dv product reads it
      mbar_arrive(du_ready);
      QLA_PHASE(7);
      if (!dkc) mbar_arrive(dsn_free);  // K's reads of dSn' are done (with dk: dK_d, at the chunk's end)
      // With dk: beta for K's tail, A's X block and S's Tb'' (their reads of the last chunk's were
      // done before K's waits for mb_ready and tb_ready there; K's own after its next barriers).
      if (dkc && wt < kC) sBeta[wt] = wt < len ? bits_value(beta_bits, p.b_dt) : 0.f;
      // dv = 2^-(et + en + eu) Tu'^T dU' (rows i < len), only where it is stored. Then S may write
      // Tb'' over Tu' (tu_free): under K's dW, dVb and dKb rather than after them (bwd-62).
      if (dv_out) {
        Tensor accV = partition_fragment_C(mmaV, Shape<_64, _128>{});
        {
          Tensor rTuT = thrV.partition_fragment_A(tH(stb, Cfg::kTu, typename LH::TokTok_MN{}));
          gemm_sync(mmaV, rTuT, thrV.partition_fragment_B(tH(sm, Cfg::kDU, typename LH::DTok_MN{})), accV, GMMA::ScaleOut::Zero);
        }
        if (dkc) mbar_arrive(tu_free);
        const float dvsc = pow2c(-(gt.et() + en + eu));
        if (!dkc) mbar_arrive(&empty[c % kStages]);  // K's reads of the stage are done (dvsc read above)
        // dv into a tile once S's product and every K warp's have read it (dU''s, or with dk W''s:
        // dU' is read again); a full chunk then goes out by two bulk tensor stores, whose reads of
        // the tile end before the tile's next write, a partial one by generic stores.
        const uint32_t stg = dkc ? Cfg::kW : Cfg::kDU;
        mbar_wait(du_free, c & 1);
        wg_bar(kBarStepK);
        stmatrix_tokd<128, T>(smem_u32(sm) + stg, fresh(wt), [&](int e) { return accV(e) * dvsc; });
        const int64_t t0 = tile.t0 + static_cast<int64_t>(chunk_of(c)) * kC;
        if (p.dv_tma && len == kC) {
          fence_async_smem();
          wg_bar(kBarStepK);
          if (wt == 0) {
            store_tile_boxes(&p.tmdv, sm + stg, tile.hv, static_cast<int>(t0), static_cast<int>(tile.b));
            if (!dkc) bulk_wait_read();  // (with dk: before dW''' is written there)
          }
        } else {
          wg_bar(kBarStepK);
          store_tile_rows<T>(smem_u32(sm + stg), dv + tile.b * p.so[0] + t0 * p.so[1] + static_cast<int64_t>(tile.hv) * p.so[2], p.so[1],
                             len, wt);
        }
      } else if (dkc) {
        mbar_arrive(tu_free);  // (no dv product: nothing of K's reads Tu' in the chunk)
      }
      QLA_PHASE(8);
      if (dkc) {
        // dk and dbeta (and dg with p.dg): the header's equations, from the tiles the chain has left.
        // Rows past the end (a partial chunk) of dU', dW''', U'' and so of dVb, dKb and dK_d are exact
        // zeros: role Z has zeroed q, k, v and dO's rows there, and the inverse kernel's T' and Tu'
        // are finite there (it zeroes K's rows before K K^T); so their row factors (0 past the end)
        // drop them without a select.
        const int gi = c - role.nwarm, ap = en + eu, r0 = 16 * (wt >> 5) + ((wt & 31) >> 2);
        const int8_t* kexp = gt.kexp();
        const float* eg = gt.eg();
        // dW'' = dU' S'^T in the input type: dU' converted into a register operand (its fp16 tile
        // stays for dVb), once A's dO S^T has read S' and A's dP U'' (d_free).
        mbar_wait(d_free, c & 1);
        Tensor acc = partition_fragment_C(mmaTW, Shape<_64, _128>{});
        {
          Tensor rDUt = make_tensor<T>(Shape<Shape<_2, _2, _2>, _1, _8>{});  // (j, v), the accumulator's element order
          tokd_pairs(smem_u32(sm + Cfg::kDU), wt, [&](int e, uint32_t bits) {
            const float2 u2 = unpack2<H>(bits);
            rDUt(e) = T(u2.x);
            rDUt(e + 1) = T(u2.y);
          });
          Tensor rB = thrRS.partition_fragment_B(tT(sm, Cfg::kS, QK_MN{}));
          warpgroup_fence_operand(rDUt);
          gemm_sync(mmaRS, rDUt, rB, acc, GMMA::ScaleOut::Zero);
        }
        // dW''' goes where dv's bulk stores read (W''s tile): their reads are done (thread 0 issued
        // them) before the reduction's barrier.
        if (wt == 0 && p.dv_tma) bulk_wait_read();
        const int ew = step_unit(wg_max(abs_max(acc), fmisc + kMiscRedK, wt, kBarStepK, flip++));
        mbar_wait(du_free, c & 1);  // S's product has read W'
        {
          const float fw = pow2c(ew);
          stmatrix_tokd<128, H>(smem_u32(fresh(sm)) + Cfg::kW, fresh(wt), [&](int e) { return acc(e) * fw; });
        }
        fence_async_smem();
        wg_bar(kBarStepK);  // dW''' written by every thread before the dKb product reads it
        QLA_PHASE(9);
        // dVb = 2^-(ap + ek_i) T'^T dU' into dVb'' over S' (every K warp's dW has read it: the barrier
        // above), then dKb = -2^-(ew + ap + ek_i) T'^T dW''' into dKb'' over dU' (once every K warp's
        // dVb has read it), rows < len, in one rolled loop (the instruction cache, bwd-47). Their row
        // dots <dVb_i, V_i> and e^gamma_i <dKb_i, K_i> are dbeta's first two (B31); beta_i times the
        // second is a's.
        mbar_wait(tm_full, gi & 1);
        float2 db = make_float2(0.f, 0.f), kb = db;  // kb: <dK_b_i, K_i>
        int evb = 0, ekb = 0;
        #pragma unroll 1
        for (int it = 0; it < 2; ++it) {
          {
            Tensor rTt = thrV.partition_fragment_A(tH(sm, Cfg::kD, typename LH::TokTok_MN{}));
            gemm_sync(mmaV, rTt, thrV.partition_fragment_B(tH(sm, it ? Cfg::kW : Cfg::kDU, typename LH::DTok_MN{})), acc,
                      GMMA::ScaleOut::Zero);
          }
          const int eo = it ? -ew - ap : -ap;
          float fr[2];
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) fr[h] = r0 + 8 * h < len ? (it ? -1.f : 1.f) * pow2c(eo - kexp[r0 + 8 * h]) : 0.f;
          CUTE_UNROLL
          for (int e = 0; e < size(acc); ++e) acc(e) *= fr[acc_half(e)];  // (rows past the end: exact zeros, see dk's note)
          const float2 d2 = row_dot<T>(acc, smem_u32(stb + (it ? Cfg::kK : Cfg::kV)), wt);
          const float g0 = r0 < len ? (it ? eg[r0] : 1.f) * d2.x : 0.f, g1 = r0 + 8 < len ? (it ? eg[r0 + 8] : 1.f) * d2.y : 0.f;
          db.x += g0;
          db.y += g1;
          if (it) kb = make_float2(r0 < len ? sBeta[r0] * g0 : 0.f, r0 + 8 < len ? sBeta[r0 + 8] * g1 : 0.f);
          int eb = 0;
          if constexpr (kTileUnits<T>) eb = step_unit(wg_max(abs_max(acc), fmisc + kMiscRedK, wt, kBarStepK, flip++));
          else if (it) wg_bar(kBarStepK);  // (every K warp's dVb has read dU')
          if (it) ekb = eb; else evb = eb;
          const float fb = pow2c(eb);
          stmatrix_tokd<128, T>(smem_u32(fresh(sm)) + (it ? Cfg::kDU : Cfg::kS), fresh(wt), [&](int e) { return acc(e) * fb; });
        }
        // For A's X block (dL, dM and dMb''): dVb'' and dKb'', their units, beta (sBeta), and with dg
        // K's <dK_b, K> rows in sdK (kSdK's layout).
        const uint32_t kMb = Cfg::kS;  // A's dMb'' (over dVb'')
        float* sdK = reinterpret_cast<float*>(sm + Cfg::kS + kSdK);
        if (p.dg && (wt & 3) == 0) {
          sdK[kSdKb + r0] = kb.x;
          sdK[kSdKb + r0 + 8] = kb.y;
        }
        if (wt == 0) {
          misc[kMiscEvb] = evb;
          misc[kMiscEkb] = ekb;
        }
        fence_async_smem();
        mbar_arrive(vkb_ready);
        QLA_PHASE(10);
        QLA_PHASE(11);
        // Tb'' (S's, in its wait for the next dSn'; see form_tb) for dK_b below, and its unit ub.
        QLA_PHASE(12);
        // dk in one accumulator, changing units by powers of two between the terms:
        // dK_d = diag(e^(Gamma - gamma) 2^ek) 2^-(eut + en) U'' dSn'^T first (then dSn' is free
        // for S's next one; with dg its row dot x_i = <dK_d_i, K_i>), then -2^-u1 Tb''^T dW'''
        // (u1 = ew + ap + ub), 2^-ea dA''^T Q (A's dA'' in Pg''s tile), 2^-em (dMb'' K + dMb''^T K).
        Tensor accDK = partition_fragment_C(mmaW, Shape<_64, _128>{});
        {
          Tensor rU = thrW.partition_fragment_A(tH(sm, Cfg::kU, typename LH::TokD_K{}));
          Tensor rDSt = thrW.partition_fragment_B(tH(sm, Cfg::kDSn, QK_MN{}));
          gemm_sync(mmaW, rU, rDSt, accDK, GMMA::ScaleOut::Zero);
        }
        mbar_arrive(dsn_free);
        {
          const int eut = misc[kMiscEut];
          float fr[2];
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            const int j = r0 + 8 * h;
            fr[h] = j < len ? gt.egk()[j] * pow2c(kexp[j] - eut - en) : 0.f;
          }
          CUTE_UNROLL
          for (int e = 0; e < size(accDK); ++e) accDK(e) *= fr[acc_half(e)];  // (rows past the end: exact zeros)
        }
        if (p.dg) {
          const float2 x = row_dot<T>(accDK, smem_u32(stb + Cfg::kK), wt);
          if ((wt & 3) == 0) {
            sdK[kSdX + r0] = r0 < len ? x.x : 0.f;
            sdK[kSdX + r0 + 8] = r0 + 8 < len ? x.y : 0.f;
          }
        }
        mbar_wait(tb_ready, gi & 1);  // S's Tb'' and ub
        const int u1 = ew + ap + misc[kMiscUb];
        {
          const float f = -pow2c(u1);
          CUTE_UNROLL
          for (int e = 0; e < size(accDK); ++e) accDK(e) *= f;
        }
        {
          Tensor rTb = thrV.partition_fragment_A(tH(stb, Cfg::kTu, typename LH::TokTok_MN{}));
          gemm_sync(mmaV, rTb, thrV.partition_fragment_B(tH(sm, Cfg::kW, typename LH::DTok_MN{})), accDK, GMMA::ScaleOut::One);
        }
        QLA_PHASE(13);
        mbar_wait(da_ready, gi & 1);
        const int ea = misc[kMiscEa];
        {
          const float f = -pow2c(ea - u1);
          CUTE_UNROLL
          for (int e = 0; e < size(accDK); ++e) accDK(e) *= f;
        }
        // dA''^T Q, then dMb'' K + dMb''^T K once A's X block is done. dA^T Q's batch is waited for
        // before the mbarrier wait for every type: with a batch open across the wait (bf16, no units),
        // ptxas put a warpgroup.arrive in a divergent path and serialized every wgmma of the step (C7520).
        Tensor rQt = thrG.partition_fragment_B(tT(stb, Cfg::kQ, typename LT::DTok_MN{}));
        Tensor rA = thrTW.partition_fragment_A(tileTT(kMb));
        Tensor rA2 = thrG.partition_fragment_A(tT(sm, kMb, typename LT::TokTok_MN{}));
        Tensor rB = thrTW.partition_fragment_B(tT(stb, Cfg::kK, typename LT::DTok_MN{}));
        Tensor rB2 = thrG.partition_fragment_B(tT(stb, Cfg::kK, typename LT::DTok_MN{}));
        warpgroup_fence_operand(accDK);
        warpgroup_arrive();
        gemm_k(mmaG, thrG.partition_fragment_A(tT(sm, Cfg::kPg, typename LT::TokTok_MN{})), rQt, accDK, GMMA::ScaleOut::One);
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(accDK);
        mbar_wait(mb_ready, gi & 1);  // A's dMb'' (over dVb''), em and its rows
        const int em = misc[kMiscEm];
        db.x += sdK[kSdRr + r0];  // A's <dM K, K> rows
        db.y += sdK[kSdRr + r0 + 8];
        if constexpr (kTileUnits<T>) {
          const float f = pow2c(em - ea);
          CUTE_UNROLL
          for (int e = 0; e < size(accDK); ++e) accDK(e) *= f;
        }
        warpgroup_fence_operand(accDK);
        warpgroup_arrive();
        gemm_k(mmaTW, rA, rB, accDK, GMMA::ScaleOut::One);
        gemm_k(mmaG, rA2, rB2, accDK, GMMA::ScaleOut::One);
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(accDK);
        // A's part of dg lies in D''s tile, which S fills with the next chunk's D' once the stage is in:
        // read it before the stage goes.
        const float dg_a = p.dg && wt < kC ? reinterpret_cast<const float*>(sm + Cfg::kD + kImgTokTok * 2)[wt] : 0.f;
        mbar_arrive(&empty[c % kStages]);  // K's last read of the stage: P loads the next chunk under dk's stores and dg
        QLA_PHASE(14);
        // dk (per value head; rows < len) and dbeta out: dk into dU''s tile (its last reader, the X
        // product, is done); a full chunk then goes out by two bulk tensor stores, whose reads end
        // before K writes the next dU' there (bulk_wait_read before eu's barrier), a partial one by
        // generic stores.
        const int64_t t0 = tile.t0 + static_cast<int64_t>(chunk_of(c)) * kC;
        {
          const float f = pow2c(-em);
          stmatrix_tokd<128, T>(smem_u32(fresh(sm)) + Cfg::kDU, fresh(wt), [&](int e) { return accDK(e) * f; });
        }
        if (p.dk_tma && len == kC) {
          fence_async_smem();
          wg_bar(kBarStepK);
          if (wt == 0)
            store_tile_boxes(&p.tmdk, sm + Cfg::kDU, tile.hv >> p.dqk_add, static_cast<int>(t0), static_cast<int>(tile.b),
                             p.dqk_add);
        } else {
          wg_bar(kBarStepK);
          store_tile_rows<T>(smem_u32(sm + Cfg::kDU),
                             static_cast<T*>(p.dk) + tile.b * p.sdk[0] + t0 * p.sdk[1] +
                                 static_cast<int64_t>(tile.hv >> p.dqk_add) * p.sdk[2],
                             p.sdk[1], len, wt, p.dqk_add);
        }
        if ((wt & 3) == 0) {
          const int64_t bo = tile.b * p.sdb[0] + static_cast<int64_t>(tile.hv);
          if (r0 < len) store_f(p.dbeta, p.db_dt, bo + (t0 + r0) * p.sdb[1], db.x);
          if (r0 + 8 < len) store_f(p.dbeta, p.db_dt, bo + (t0 + r0 + 8) * p.sdb[1], db.y);
        }
        if (p.dg) {
          // dg (B33): a_i = A's part (dg_a, read before the stage's release) + K's rows - K's column sums, x_i as above;
          // dg_t = sum_{i >= t} a_i + sum_{i < t} x_i + e^Gamma <dSn, S> (A's four warp partials).
          wg_bar(kBarStepK);  // x and the partials of every K thread written (A's: da_ready, mb_ready)
          // Token t = wt (warps 0 and 1): the sums over i < t of x and over i >= t of a by warp scans,
          // the other warp's total through sdK's tail (x of warp 0 for warp 1, a of warp 1 for warp 0).
          const int lane = wt & 31;
          const float at = wt < len ? dg_a + sdK[kSdRows + wt] + sdK[kSdKb + wt] -
                                          (sdK[kSdCols + wt] + sdK[kSdCols + 64 + wt] + sdK[kSdCols + 128 + wt] + sdK[kSdCols + 192 + wt])
                                    : 0.f;
          const float xt = wt < kC ? sdK[kSdX + wt] : 0.f;
          const float xx = warp_inclusive_sum(xt);  // x from the warp's first lane up
          float ax = at;                             // a from its last lane down (a suffix scan: no cancellation)
          CUTE_UNROLL
          for (int o = 1; o < 32; o <<= 1) {
            const float a2 = __shfl_down_sync(0xffffffffu, ax, o);
            if (lane + o < 32) ax += a2;
          }
          if (wt == 32) sdK[kSdTot] = ax;      // warp 1's a
          if (wt == 31) sdK[kSdTot + 1] = xx;  // warp 0's x
          float xe = __shfl_up_sync(0xffffffffu, xx, 1);  // the exclusive sum (no cancellation)
          if (lane == 0) xe = 0.f;
          wg_bar(kBarStepK);
          if (wt < len) {
            float g = fmisc[kMiscSdot] + fmisc[kMiscSdot + 1] + fmisc[kMiscSdot + 2] + fmisc[kMiscSdot + 3];
            g += xe + ax + sdK[wt < 32 ? kSdTot : kSdTot + 1];
            store_f(p.dg, p.dg_dt, tile.b * p.sdg[0] + (t0 + wt) * p.sdg[1] + tile.hv, g);
          }
        }
        mbar_arrive(s_empty);  // K's reads of S''s tile (dMb'', X'', dg's sums) are done
      }
      QLA_PHASE(15);
    }
    QLA_PHASES_PRINT("step K (wait, -, S' + Z + U'', Kd' + wait Pg'', Pg''^T dO, wait dSn', Kd' dSn', dU' max + store, dv, dW, dVb dKb, -, -, dK_d + wait Tb'' + dK_b, wait dMb'' + dA^T Q dM K, out)", 16, nch);
    if (wt == 0 && (p.dv_tma || p.dk_tma)) bulk_wait_all();  // dv's and dk's bulk stores performed before the CTA ends
    return;
  }

  // ---------------- S: the state gradient ----------------
  set_role_registers<Cfg::kRegs[3], Cfg::kEntryRegs>();
  // Both products fp16 from shared memory: D'^T Qg' and dU'^T W' (A (v, tok) and B (d, tok) MN-major).
  auto mmaU = make_tiled_mma(GMMA::ss_op_selector<H, H, float, Shape<_64, _128, _16>, GMMA::Major::MN, GMMA::Major::MN>());
  auto thrU = mmaU.get_thread_slice(wt);
  Tensor accS0 = partition_fragment_C(mmaU, Shape<_64, _128>{});  // dS^T rows v 0 .. 63, units 2^a
  Tensor accS1 = partition_fragment_C(mmaU, Shape<_64, _128>{});  // rows v 64 .. 127
  Tensor cS = thrU.partition_C(make_identity_tensor(Shape<_64, _128>{}));
  Tensor tDUt = make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kDU)), typename LH::DTok_MN{});  // (v, j)
  Tensor rW = thrU.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kW)), typename LH::DTok_MN{}));
  Tensor rQg = thrU.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kQg)), typename LH::DTok_MN{}));
  Tensor tDt = make_tensor(make_smem_ptr(reinterpret_cast<const H*>(sm + Cfg::kD)), typename LH::DTok_MN{});  // (v, i)
  Tensor rD0 = thrU.partition_fragment_A(local_tile(tDt, Shape<_64, _64>{}, make_coord(0, 0)));
  Tensor rD1 = thrU.partition_fragment_A(local_tile(tDt, Shape<_64, _64>{}, make_coord(1, 0)));
  Tensor rDU0 = thrU.partition_fragment_A(local_tile(tDUt, Shape<_64, _64>{}, make_coord(0, 0)));
  Tensor rDU1 = thrU.partition_fragment_A(local_tile(tDUt, Shape<_64, _64>{}, make_coord(1, 0)));
  // accS x f (a change of units, with the decay at a chunk's start).
  auto scale_acc = [&](float f) {
    CUTE_UNROLL
    for (int e = 0; e < size(accS0); ++e) {
      accS0(e) *= f;
      accS1(e) *= f;
    }
  };
  // accS += A B for both halves of v (A's halves rA0, rA1; B shared), waited for.
  auto add_product = [&](auto& rA0, auto& rA1, auto& rB) {
    gemm_pair_sync(mmaU, rA0, rB, accS0, rA1, rB, accS1, GMMA::ScaleOut::One);
  };
  // d(final state), or the gradient leaving the piece (its map slot), or zero.
  {
    const float* maps = role.init == kInitMaps ? map_at(p, tile.map, tile.hv) : nullptr;
    load_entering_state(p, role.init, tile.n, tile.hv, 0, maps, nullptr, accS0, cS);
    load_entering_state(p, role.init, tile.n, tile.hv, 64, maps, nullptr, accS1, cS);
  }
  int a = 0;     // accS = 2^a dS^T
  int flip = 0;  // S's reductions (wg_max's alternating slots)
  // dSn''s unit relative to accS's (2^de max |accS| in [2^13, 2^14)): formed as soon as the chain's
  // products are in, before S waits for the readers of the last dSn' (publish_dsn).
  auto dsn_unit = [&]() {
    AbsMax4 m;
    CUTE_UNROLL
    for (int e = 0; e < size(accS0); ++e) m.add2(e, accS0(e), accS1(e));
    return step_unit(wg_max(m.get(), fmisc + kMiscRedS, wt, kBarStepS, flip++));
  };
  // dSn' = 2^en dSn (fp16) for the chunk about to run, and en = a + de.
  auto publish_dsn = [&](int de) {
    const float f = pow2c(de);
    // (QK_K: 16 KiB boxes of 128 rows; rows v 64 .. 127 start 8 KiB into each)
    stmatrix_tokd<128, H, 16384u>(smem_u32(sm) + Cfg::kDSn, fresh(wt), [&](int e) { return accS0(e) * f; });
    stmatrix_tokd<128, H, 16384u>(smem_u32(sm) + Cfg::kDSn + 8192u, fresh(wt), [&](int e) { return accS1(e) * f; });
    if (wt == 0) misc[kMiscEn] = a + de;
    fence_async_smem();
    mbar_arrive(dsn_ready);
  };
  publish_dsn(dsn_unit());
  QLA_PHASES_SMEM(6, reinterpret_cast<unsigned long long*>(sm + Cfg::kMisc + 464));
  for (int c = 0; c < nch; ++c) {
    uint8_t* stb = stage(c);
    const StepGates gt(stb);
    const int len = chunk_len(c);
    wait_stage(c, len);
    QLA_PHASE(0);
    // Qg' and D' (form_qg, form_d): S's own in a chunk with gradients, once A's dP has read the
    // last D'; else A's and K's (prep_ready), read here only. Their units eg and ed either way.
    const int eg = qg_unit(gt, p.scale, len, wt);
    int ed;
    if (step_grads(c)) {
      form_qg<T>(stb, sm, gt, p.scale, eg, wt);
      if (c > 0) mbar_wait(d_free, (c - 1) & 1);
      ed = form_d<T>(stb, sm, fmisc + kMiscRedS, wt, kBarStepS, flip++);
      if (wt == 0) misc[kMiscEd] = ed;
      fence_async_smem();
      wg_bar(kBarStepS);  // Qg' and D' written by every thread before the product reads them
    } else {
      mbar_wait(prep_ready, c & 1);  // (the chunks without gradients come first: c counts them)
      ed = misc[kMiscEd];
    }
    mbar_arrive(d_ready);
    scale_acc(gt.eG() * pow2c(eg + ed - a));
    mbar_arrive(&empty[c % kStages]);  // S's reads of the stage are done (D' and Qg' are S's own)
    QLA_PHASE(1);
    add_product(rD0, rD1, rQg);  // accS += D'^T Qg' (units eg + ed)
    mbar_arrive(qg_free);
    QLA_PHASE(2);
    // accS += dU'^T W' in dU''s units (en + eu).
    mbar_wait(du_ready, c & 1);
    mbar_wait(w_ready, c & 1);
    QLA_PHASE(3);
    const int au = misc[kMiscEu];
    scale_acc(pow2c(au - eg - ed));
    add_product(rDU0, rDU1, rW);
    mbar_arrive(du_free);
    a = au;
    QLA_PHASE(4);
    const int de = c + 1 < nch ? dsn_unit() : 0;  // (the next dSn''s unit, before any wait)
    if (step_dk(c)) {
      // K's Tb'', here while S waits for K's dK_d to free dSn' (K's tail is the step's longest
      // path): once K has written beta and its dv has read Tu' (tu_free) and T' is in (tm_full).
      const int gi = c - role.nwarm;
      mbar_wait(tu_free, gi & 1);
      mbar_wait(tm_full, gi & 1);
      form_tb(smem_u32(sm + Cfg::kD), smem_u32(stb + Cfg::kTu), reinterpret_cast<const float*>(sm + Cfg::kBeta), gt.eg(), gt.kexp(),
              fmisc + kMiscRedS, wt, flip++, misc + kMiscUb);
      fence_async_smem();
      mbar_arrive(tb_ready);
    }
    if (c + 1 < nch) {
      mbar_wait(dsn_free, c & 1);  // K's reads of this chunk's dSn' (Kd' dSn', dK_d) are done
      publish_dsn(de);
    }
    QLA_PHASE(5);
  }
  QLA_PHASES_PRINT("step S (wait, Qg' + D', D'^T Qg', wait dU' + W', dU'^T W', Tb'' + dSn' max + store)", 6, nch);
  // d(initial state), or (pass 0) the gradient entering the piece into the slot before its own.
  {
    float* maps = role.end == kEndMaps ? map_at(p, tile.map - 1, tile.hv) : nullptr;
    const int esc[2] = {a, a};
    store_leaving_state<false>(p, role.end, tile.n, tile.hv, 0, maps, accS0, cS, esc);
    store_leaving_state<false>(p, role.end, tile.n, tile.hv, 64, maps, accS1, cS, esc);
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
