// GPU test of the sm90 forward backend against an fp64 CPU token-by-token reference.
//
// Build (until the CMake target exists), from the repository root:
//   CUTE=$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source','include'))")
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr [-DQLA_SM90_TEST_HOOKS] \
//        -Iinclude -I$CUTE src/sm90/gdn_fwd_sm90.cu [src/sm90/gdn_bwd_sm90.cu: with the hooks] tests/cuda/sm90_forward_test.cu \
//        -o sm90_forward_test
// (on the device machine CUTE=.cutlass_include). Run: ./sm90_forward_test [--bench]
// [--inverse] [--inverse-bench] [--profile ROW]. --inverse (hooks only) checks the fused forward's
// inverse kernel against an fp64 host reference on every case; --inverse-bench also times it
// beside table + prep on the bench rows. --bench times the grid rows of bench_rows() (inputs made on the device);
// with the hooks it also times table + prep alone. --profile runs one forward of a bench row and
// nothing else (for ncu). --bwd-one ROW (hooks) runs the forward and two library backwards of one
// backward-grid row (ncu's kernel durations); in a -DQLA_FUSED_PROFILE build it prints the first
// backward's phase timers, of the CTA blockIdx (0, Y) with --phase-cta Y (a split step's pass 0
// runs no piece 0: give Y = 1 to see it).
// Exit code 0 only when every case is under its error threshold and nothing is NaN.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../src/backends.h"

// Test hooks, compiled into gdn_fwd_sm90.cu with -DQLA_SM90_TEST_HOOKS (tests/cuda/run_sm90_device.sh).
#ifdef QLA_SM90_TEST_HOOKS
namespace qla { namespace sm90 {
void set_test_stages(int bits);
void set_test_overlap(int on);
int set_test_fused(int mode);  // returns the previous mode
size_t test_inverse_region_bytes();
void set_test_inverse_skip(int bits);
void set_test_inverse_group(int group);  // the inverse kernel's value heads per item (-1: all, 0: auto)
void set_test_fused_skip(int bits);  // the fused recurrence's timing variants (RecParams::skip)
void set_test_fused_overlap(int on);  // 1: the fused recurrence beside the inverse kernel (per-region flags)
void set_test_reverse_maps_ready(int on);  // 1: the reverse step reuses an earlier states pass's table, regions and maps
void set_test_pass1_vt(int vt);  // 64 / 128: a split call's pass-1 V tile, and the backward's states pass's (0: the plan's)
void set_test_backward_path(int path);  // qla::sm90::backward: 1 the chunked backward, 2 the fused one, 0 its rule
void set_test_step_min_piece(int chunks);  // the fused backward's shortest piece (0: its own; -1: the forward's plan)
void set_test_dqk_partials(int on);  // 1: pairs of value heads through the partials and the finish (not added in)
#ifdef QLA_FUSED_PROFILE
void test_print_phases();  // prints the phase timers' records (and clears them)
void test_set_phase_cta(int y);  // the phase timers record the CTA of blockIdx (0, y) (default 0)
#endif
// With tm set, also the backward's T' images (8 KiB per region).
qla::Status test_run_inverse(const qla::GdnForwardParams& p, void* regions, void* tm = nullptr);
// The fused backward's reverse step (fused_step.cuh): d_o and d(final state) in, d(initial
// state), dv and dq per value head out; simg: the states pass's S' images (test_run_states_pass);
// with dk, dbeta and tm (the T' images) set, dk per value head and dbeta too, and dg with dg set.
qla::Status test_run_fused_step(const qla::GdnForwardParams& p, const qla::TensorRef& d_o, const qla::TensorRef& dht,
                                const qla::MutTensorRef& dh0, const qla::MutTensorRef& dv, const void* simg,
                                const qla::MutTensorRef& dq, const qla::MutTensorRef* dk = nullptr,
                                const qla::MutTensorRef* dbeta = nullptr, const void* tm = nullptr,
                                const qla::MutTensorRef* dg = nullptr);
// The backward's states pass: each chunk's entering state into simg (the reverse step's S'
// images; may be null), the T' images into tm (may be null), the final state into p.final_state.
qla::Status test_run_states_pass(const qla::GdnForwardParams& p, void* tm = nullptr, void* simg = nullptr);
// The bytes of one region's S' image (test_run_states_pass's simg).
size_t test_state_image_bytes();
} }
#include "../../src/sm90/inverse.cuh"  // the inverse region's layout (host-side offsets and constants)
#endif

using qla::DType;
using qla::StateLayout;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__,         \
                   cudaGetErrorString(e_));                                                \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

static const int K = 128, V = 128;

struct Case {
  std::string name;
  int64_t B = 1, T = 0, H = 1, HV = 1;
  std::vector<int64_t> lens;  // non-empty: varlen (B = 1, T = sum)
  StateLayout layout = StateLayout::kKV;
  bool h0 = true;
  int gmode = 0;  // 0: logsigmoid(randn)/16, 1: logsigmoid(randn), 2: zero, 3: as 0 but zero on every 4th head
  DType qdt = DType::kBFloat16;
  DType gdt = DType::kFloat32;
  int64_t tpad = 0;  // extra elements per token in q/k/v (strided views)
  bool cu64 = false;
  float scale = 0.f;  // 0: K^-0.5
  float vmag = 1.f, hmag = 1.f;  // scale of v and h0 (the fused forward's fp16 range handling)
  float bmag = 1.f;  // scale of beta (tiny beta: the inverse image's exponent et large)
  // Norms of q and k (l2-normalised rows times these; spread: each token's times 2^U(-8, 8)),
  // with beta divided by max(1, |k|^2) so that the recurrence stays stable (beta |k|^2 <= 1).
  float qnorm = 1.f, knorm = 1.f;
  bool spread = false;
  bool bench_all_decay = false;  // bench inputs: no g = 0 heads (else every 4th head, as in the grid)
  bool host_lens = false;  // varlen: the host copy of cu_seqlens too (the plan's lengths, as the grid gives them)
};

static uint16_t to16(float x, DType dt) {
  if (dt == DType::kBFloat16) {
    __nv_bfloat16 b = __float2bfloat16(x);
    uint16_t r;
    std::memcpy(&r, &b, 2);
    return r;
  }
  __half h = __float2half(x);
  uint16_t r;
  std::memcpy(&r, &h, 2);
  return r;
}
static float from16(uint16_t u, DType dt) {
  if (dt == DType::kBFloat16) {
    __nv_bfloat16 b;
    std::memcpy(&b, &u, 2);
    return __bfloat162float(b);
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}
static float roundto(float x, DType dt) { return dt == DType::kFloat32 ? x : from16(to16(x, dt), dt); }

// Host-side problem: values already rounded to the device dtypes (the reference sees the same).
struct Problem {
  Case c;
  int64_t N = 0;
  std::vector<int64_t> cu;  // N + 1 token offsets (flattened b*T + t)
  int64_t sq_t = 0, sv_t = 0;  // token strides of q/k and v (elements)
  std::vector<float> q, k, v, g, beta, h0;  // q,k: [B,T,H,K] packed; v: [B,T,HV,V]; g,beta: [B,T,HV]; h0: [N,HV,K,V]
};

static void make_inputs(Problem& P, uint64_t seed) {
  const Case& c = P.c;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t BT = c.B * c.T;
  P.q.assign(BT * c.H * K, 0.f);
  P.k.assign(BT * c.H * K, 0.f);
  P.v.assign(BT * c.HV * V, 0.f);
  P.g.assign(BT * c.HV, 0.f);
  P.beta.assign(BT * c.HV, 0.f);
  std::uniform_real_distribution<float> ud(-8.f, 8.f);
  for (int64_t r = 0; r < BT * c.H; ++r) {
    for (std::vector<float>* x : {&P.q, &P.k}) {
      double nrm = 0;
      float* p = x->data() + r * K;
      for (int i = 0; i < K; ++i) { p[i] = nd(rng); nrm += double(p[i]) * p[i]; }
      const float to = (x == &P.q ? c.qnorm : c.knorm) * (c.spread ? std::exp2(ud(rng)) : 1.f);
      const float inv = float(to / std::sqrt(nrm));
      for (int i = 0; i < K; ++i) p[i] = roundto(p[i] * inv, c.qdt);
    }
  }
  for (auto& x : P.v) x = roundto(c.vmag * nd(rng), c.qdt);
  for (size_t i = 0; i < P.g.size(); ++i) {
    const float z = nd(rng);
    const float ls = -std::log1p(std::exp(-z));  // logsigmoid
    const bool zero_head = c.gmode == 3 && (i % c.HV) % 4 == 0;
    P.g[i] = roundto(c.gmode == 0 || (c.gmode == 3 && !zero_head) ? ls / 16.f : c.gmode == 1 ? ls : 0.f, c.gdt);
  }
  for (size_t i = 0; i < P.beta.size(); ++i) {
    const int64_t t = int64_t(i) / c.HV, hq = (int64_t(i) % c.HV) / (c.HV / c.H);
    double k2 = 0;
    for (int d = 0; d < K; ++d) k2 += double(P.k[(t * c.H + hq) * K + d]) * P.k[(t * c.H + hq) * K + d];
    const double div = c.knorm != 1.f || c.spread ? std::max(1.0, k2) : 1.0;  // the other cases: as before
    P.beta[i] = roundto(float(c.bmag / (1.0 + std::exp(-nd(rng))) / div), c.gdt);
  }
  P.h0.assign(c.h0 ? P.N * c.HV * K * V : 0, 0.f);
  for (auto& x : P.h0) x = c.hmag * nd(rng);
}

// fp64 token-by-token reference. o: [B*T, HV, V], hT: [N, HV, K, V] (always kKV here).
// With chunk_S set, also the state entering every chunk ([region][K][V]; region: the chunk's
// index in the chunk table (the sequence's first chunk the sum of the earlier sequences' chunk
// counts) times HV plus the value head).
// Chunks over all sequences (the chunk table's count).
static int64_t total_chunks(const Problem& P) {
  int64_t n = 0;
  for (int64_t s = 0; s < P.N; ++s) n += (P.cu[s + 1] - P.cu[s] + 63) / 64;
  return n;
}
static void reference(const Problem& P, std::vector<double>& o, std::vector<double>& hT,
                      std::vector<double>* chunk_S = nullptr) {
  const Case& c = P.c;
  const double scale = c.scale != 0.f ? c.scale : 1.0 / std::sqrt(double(K));
  o.assign(c.B * c.T * c.HV * V, 0.0);
  hT.assign(P.N * c.HV * K * V, 0.0);
  if (chunk_S) chunk_S->assign(total_chunks(P) * c.HV * K * V, 0.0);
  std::vector<double> S(K * V), ks(V);
  int64_t ci0 = 0;
  for (int64_t n = 0; n < P.N; ++n, ci0 += (P.cu[n] - P.cu[n - 1] + 63) / 64)
    for (int64_t hv = 0; hv < c.HV; ++hv) {
      const int64_t hq = hv / (c.HV / c.H);
      for (int i = 0; i < K * V; ++i) S[i] = c.h0 ? P.h0[(n * c.HV + hv) * K * V + i] : 0.0;
      for (int64_t t = P.cu[n]; t < P.cu[n + 1]; ++t) {
        if (chunk_S && (t - P.cu[n]) % 64 == 0)
          std::copy(S.begin(), S.end(), chunk_S->begin() + ((ci0 + (t - P.cu[n]) / 64) * c.HV + hv) * K * V);
        const float* q = &P.q[(t * c.H + hq) * K];
        const float* k = &P.k[(t * c.H + hq) * K];
        const float* v = &P.v[(t * c.HV + hv) * V];
        const double a = std::exp(double(P.g[t * c.HV + hv])), b = P.beta[t * c.HV + hv];
        for (int i = 0; i < K * V; ++i) S[i] *= a;
        std::fill(ks.begin(), ks.end(), 0.0);
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < V; ++j) ks[j] += k[d] * S[d * V + j];
        for (int j = 0; j < V; ++j) ks[j] = b * (v[j] - ks[j]);
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < V; ++j) S[d * V + j] += k[d] * ks[j];
        double* ot = &o[(t * c.HV + hv) * V];
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < V; ++j) ot[j] += scale * q[d] * S[d * V + j];
      }
      std::copy(S.begin(), S.end(), hT.begin() + (n * c.HV + hv) * K * V);
    }
}

// Device buffers for one problem.
struct Dev {
  void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *o = nullptr;
  float *h0 = nullptr, *hT = nullptr;
  void* cu = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  qla::GdnForwardParams p;
};

static size_t dsize(DType d) { return d == DType::kFloat32 ? 4 : 2; }

static void upload16(void* dst, const std::vector<float>& src, int64_t rows, int64_t cols, int64_t pitch,
                     DType dt) {
  std::vector<uint16_t> h(rows * pitch, to16(NAN, dt));  // padding holds NaN: must never be read
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) h[r * pitch + i] = to16(src[r * cols + i], dt);
  CK(cudaMemcpy(dst, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
}
static void upload_any(void* dst, const std::vector<float>& src, DType dt) {
  if (dt == DType::kFloat32) {
    CK(cudaMemcpy(dst, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
  } else {
    upload16(dst, src, (int64_t)src.size(), 1, 1, dt);
  }
}

// h0 (kKV on the host) to the requested device layout, with a padded row stride.
static int64_t state_row_pitch() { return 128 + 4; }
static void upload_state(float* dst, const std::vector<float>& h, int64_t NHV, StateLayout L) {
  const int64_t pitch = state_row_pitch(), mat = 128 * pitch;
  std::vector<float> d(NHV * mat, NAN);
  for (int64_t m = 0; m < NHV; ++m)
    for (int a = 0; a < K; ++a)
      for (int b = 0; b < V; ++b) {
        const float x = h[m * K * V + a * V + b];
        if (L == StateLayout::kKV) d[m * mat + a * pitch + b] = x;
        else d[m * mat + b * pitch + a] = x;
      }
  CK(cudaMemcpy(dst, d.data(), d.size() * 4, cudaMemcpyHostToDevice));
}

// --qk-normalized: pass the unit-norm hint (qk_l2_normalized) with every case whose q, k rows are
// l2-normalised (the bench rows' are).
static bool g_qk_hint = false;
// --split: sequence splitting forced on, into pieces of at most g_split_chunks chunks.
static qla::SplitMode g_split = qla::SplitMode::kAuto;
static int g_split_chunks = 0;

static void setup(Problem& P, Dev& D, cudaStream_t stream) {
  const Case& c = P.c;
  const int64_t BT = c.B * c.T;
  P.sq_t = c.H * K + c.tpad;
  P.sv_t = c.HV * V + c.tpad;
  CK(cudaMalloc(&D.q, BT * P.sq_t * 2));
  CK(cudaMalloc(&D.k, BT * P.sq_t * 2));
  CK(cudaMalloc(&D.v, BT * P.sv_t * 2));
  CK(cudaMalloc(&D.g, BT * c.HV * dsize(c.gdt)));
  CK(cudaMalloc(&D.beta, BT * c.HV * dsize(c.gdt)));
  CK(cudaMalloc(&D.o, BT * c.HV * V * 2));
  const int64_t smat = 128 * state_row_pitch();
  if (c.h0) CK(cudaMalloc(&D.h0, P.N * c.HV * smat * 4));
  CK(cudaMalloc(&D.hT, P.N * c.HV * smat * 4));
  auto& p = D.p;
  p = qla::GdnForwardParams{};
  p.shape = {c.B, c.T, c.H, c.HV, K, V};
  auto tref = [](const void* d, DType dt, int64_t s0, int64_t s1, int64_t s2) {
    qla::TensorRef r;
    r.data = d; r.dtype = dt; r.stride[0] = s0; r.stride[1] = s1; r.stride[2] = s2;
    return r;
  };
  p.q = tref(D.q, c.qdt, c.T * P.sq_t, P.sq_t, K);
  p.k = tref(D.k, c.qdt, c.T * P.sq_t, P.sq_t, K);
  p.v = tref(D.v, c.qdt, c.T * P.sv_t, P.sv_t, V);
  p.g = tref(D.g, c.gdt, c.T * c.HV, c.HV, 0);
  p.beta = tref(D.beta, c.gdt, c.T * c.HV, c.HV, 0);
  if (c.h0) p.initial_state = tref(D.h0, DType::kFloat32, c.HV * smat, smat, state_row_pitch());
  p.o.data = D.o; p.o.dtype = c.qdt; p.o.stride[0] = c.T * c.HV * V; p.o.stride[1] = c.HV * V; p.o.stride[2] = V;
  p.final_state.data = D.hT; p.final_state.dtype = DType::kFloat32;
  p.final_state.stride[0] = c.HV * smat; p.final_state.stride[1] = smat; p.final_state.stride[2] = state_row_pitch();
  if (!c.lens.empty()) {
    std::vector<int64_t> cu64(P.cu);
    std::vector<int32_t> cu32(P.cu.begin(), P.cu.end());
    CK(cudaMalloc(&D.cu, cu64.size() * 8));
    if (c.cu64) CK(cudaMemcpy(D.cu, cu64.data(), cu64.size() * 8, cudaMemcpyHostToDevice));
    else CK(cudaMemcpy(D.cu, cu32.data(), cu32.size() * 4, cudaMemcpyHostToDevice));
    p.cu_seqlens = tref(D.cu, c.cu64 ? DType::kInt64 : DType::kInt32, 0, 0, 0);
    p.num_seqs = P.N;
    if (c.host_lens) p.cu_seqlens_host = P.cu.data();
  }
  p.scale = c.scale != 0.f ? c.scale : 1.f / std::sqrt(float(K));
  p.qk_l2_normalized = g_qk_hint && c.qnorm == 1.f && c.knorm == 1.f && !c.spread;  // only where true
  p.state_layout = c.layout;
  p.split = g_split;
  p.split_chunks = g_split_chunks;
  p.device = qla::Device::kCuda;
  p.stream = stream;
  qla::Status s = qla::sm90::forward_workspace_size(p, &D.ws_bytes);
  if (!s.ok()) { std::fprintf(stderr, "workspace_size: %s\n", s.message().c_str()); std::exit(2); }
#ifdef QLA_SM90_TEST_HOOKS
  {  // room for either forward: the test hooks switch between them on one setup
    size_t two_pass = 0;
    const int was = qla::sm90::set_test_fused(-1);
    (void)qla::sm90::forward_workspace_size(p, &two_pass);
    qla::sm90::set_test_fused(was);
    D.ws_bytes = std::max(D.ws_bytes, two_pass);
  }
#endif
  CK(cudaMalloc(&D.ws, std::max<size_t>(D.ws_bytes, 16)));
  p.workspace = D.ws;
  p.workspace_bytes = D.ws_bytes;
}

static void upload_inputs(const Problem& P, Dev& D) {
  const Case& c = P.c;
  const int64_t BT = c.B * c.T;
  upload16(D.q, P.q, BT, c.H * K, P.sq_t, c.qdt);
  upload16(D.k, P.k, BT, c.H * K, P.sq_t, c.qdt);
  upload16(D.v, P.v, BT, c.HV * V, P.sv_t, c.qdt);
  upload_any(D.g, P.g, c.gdt);
  upload_any(D.beta, P.beta, c.gdt);
  if (c.h0) upload_state(D.h0, P.h0, P.N * c.HV, c.layout);
  // Poison the outputs: every element must be written.
  CK(cudaMemset(D.o, 0xFF, BT * c.HV * V * 2));
  CK(cudaMemset(D.hT, 0xFF, P.N * c.HV * 128 * state_row_pitch() * 4));
  CK(cudaMemset(D.ws, 0xFF, D.ws_bytes));  // NaN wherever a kernel would read what none wrote
}

static void free_dev(Dev& D) {
  for (void* x : {D.q, D.k, D.v, D.g, D.beta, D.o, (void*)D.h0, (void*)D.hT, D.cu, D.ws})
    if (x) cudaFree(x);
}

struct Err { double o = 0, h = 0, hT = 0; bool nan = false; };

// A device state buffer h (N x HV matrices of 128 x state_row_pitch(), in the case's layout)
// against ref ([N, HV, K, V], K x V): relative L2 into e.h, against the transposed reference into
// e.hT (a diagnostic of layout mix-ups), any non-finite element into e.nan.
static void state_errors(const Problem& P, const std::vector<float>& h, const std::vector<double>& ref, Err& e) {
  const Case& c = P.c;
  const int64_t pitch = state_row_pitch(), mat = 128 * pitch;
  double num = 0, den = 0, numT = 0;
  for (int64_t m = 0; m < P.N * c.HV; ++m)
    for (int a = 0; a < K; ++a)
      for (int b = 0; b < V; ++b) {
        const double x = c.layout == StateLayout::kKV ? h[m * mat + a * pitch + b] : h[m * mat + b * pitch + a];
        const double r = ref[m * K * V + a * V + b], rt = ref[m * K * V + b * V + a];
        if (!std::isfinite(x)) e.nan = true;
        num += (x - r) * (x - r);
        den += r * r;
        numT += (x - rt) * (x - rt);
      }
  e.h = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  e.hT = den > 0 ? std::sqrt(numT / den) : std::sqrt(numT);
}

static Err compare(const Problem& P, const Dev& D) {
  const Case& c = P.c;
  const int64_t BT = c.B * c.T;
  std::vector<double> ro, rh;
  reference(P, ro, rh);
  std::vector<uint16_t> o(BT * c.HV * V);
  CK(cudaMemcpy(o.data(), D.o, o.size() * 2, cudaMemcpyDeviceToHost));
  const int64_t pitch = state_row_pitch(), mat = 128 * pitch;
  std::vector<float> h(P.N * c.HV * mat);
  CK(cudaMemcpy(h.data(), D.hT, h.size() * 4, cudaMemcpyDeviceToHost));
  Err e;
  double num = 0, den = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const double x = from16(o[i], c.qdt);
    if (!std::isfinite(x)) e.nan = true;
    num += (x - ro[i]) * (x - ro[i]);
    den += ro[i] * ro[i];
  }
  e.o = std::sqrt(num / std::max(den, 1e-300));
  state_errors(P, h, rh, e);
  return e;
}

static Problem make_problem(const Case& c) {
  Problem P;
  P.c = c;
  if (!c.lens.empty()) {
    P.c.B = 1;
    P.c.T = 0;
    P.cu.push_back(0);
    for (int64_t l : c.lens) { P.c.T += l; P.cu.push_back(P.c.T); }
    P.N = (int64_t)c.lens.size();
  } else {
    P.N = c.B;
    for (int64_t b = 0; b <= c.B; ++b) P.cu.push_back(b * c.T);
  }
  return P;
}

static double g_max_o = 0, g_max_h = 0;  // worst errors since the last reset (precision sweep)

static bool run_case(const Case& c, uint64_t seed, cudaStream_t stream, bool graph) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);
  qla::Status s = qla::sm90::check_supported(D.p);
  if (!s.ok()) { std::printf("%-34s check_supported: %s\n", c.name.c_str(), s.message().c_str()); free_dev(D); return false; }
  s = qla::sm90::forward(D.p);
  if (!s.ok()) { std::printf("%-34s forward: %s\n", c.name.c_str(), s.message().c_str()); free_dev(D); return false; }
  CK(cudaStreamSynchronize(stream));
  Err e = compare(P, D);
  g_max_o = std::max(g_max_o, e.o);
  g_max_h = std::max(g_max_h, e.h);
  const double thr = 3e-3;
  bool ok = !e.nan && e.o <= thr && e.h <= thr;
  {  // bitwise deterministic: a second identical call gives the same o and final state
    const size_t ob = size_t(c.B) * c.T * c.HV * V * 2, hb = size_t(P.N) * c.HV * 128 * state_row_pitch() * 4;
    std::vector<uint8_t> o1(ob), h1(hb), o2(ob), h2(hb);
    CK(cudaMemcpy(o1.data(), D.o, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h1.data(), D.hT, hb, cudaMemcpyDeviceToHost));
    s = qla::sm90::forward(D.p);
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(o2.data(), D.o, ob, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2.data(), D.hT, hb, cudaMemcpyDeviceToHost));
    if (!s.ok() || o1 != o2 || h1 != h2) {
      std::printf("%-34s second identical call differs bitwise\n", c.name.c_str());
      ok = false;
    }
  }
  std::printf("%-34s N=%-3lld T=%-5lld H=%lld HV=%-2lld  o %.3e  state %.3e%s  %s", c.name.c_str(),
              (long long)P.N, (long long)P.c.T, (long long)c.H, (long long)c.HV, e.o, e.h, e.nan ? " NaN" : "",
              ok ? "ok" : "FAIL");
  if (!ok) std::printf("  (state vs transposed ref %.3e)", e.hT);
  std::printf("\n");
  if (graph) {
    // Capture once, then replay on fresh inputs written into the same buffers.
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    s = qla::sm90::forward(D.p);
    CK(cudaStreamEndCapture(stream, &gr));
    if (!s.ok()) { std::printf("graph capture: forward failed: %s\n", s.message().c_str()); return false; }
    CK(cudaGraphInstantiate(&ge, gr, 0));
    for (int rep = 0; rep < 2; ++rep) {
      make_inputs(P, seed + 1000 + rep);
      upload_inputs(P, D);
      CK(cudaGraphLaunch(ge, stream));
      CK(cudaStreamSynchronize(stream));
      Err eg = compare(P, D);
      const bool okg = !eg.nan && eg.o <= thr && eg.h <= thr;
      std::printf("%-34s graph replay %d: o %.3e  state %.3e%s  %s\n", c.name.c_str(), rep, eg.o, eg.h,
                  eg.nan ? " NaN" : "", okg ? "ok" : "FAIL");
      ok = ok && okg;
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(gr));
  }
  free_dev(D);
  return ok;
}

// Bench inputs generated on the device (host generation of ~10^8 normals takes seconds):
// the benchmark distribution of docs/benchmarks.md from a counter hash.
__device__ __forceinline__ float hash_normal(uint64_t i, uint64_t seed) {
  uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u1 = ((z >> 40) + 0.5f) * (1.f / 16777216.f), u2 = ((z & 0xFFFFFF) + 0.5f) * (1.f / 16777216.f);
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}
// rows of 128 16-bit values (optionally l2-normalised), one warp per row.
__global__ void fill_rows16(uint16_t* x, int64_t rows, int64_t pitch, uint64_t seed, int bf16, int normalize) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  float v[4], ss = 0.f;
  for (int j = 0; j < 4; ++j) { v[j] = hash_normal(r * 128 + lane * 4 + j, seed); ss += v[j] * v[j]; }
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float sc = normalize ? rsqrtf(ss) : 1.f;
  for (int j = 0; j < 4; ++j) {
    const float y = v[j] * sc;
    x[r * pitch + lane * 4 + j] = bf16 ? __bfloat16_as_ushort(__float2bfloat16(y)) : __half_as_ushort(__float2half(y));
  }
}
// g = logsigmoid(randn)/16 (0 on every 4th head), beta = sigmoid(randn), fp32; h0 = randn.
__global__ void fill_gates(float* g, float* beta, int64_t n, int HV, uint64_t seed, int zero_heads) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float z = hash_normal(i, seed), y = hash_normal(i, seed + 1);
  g[i] = zero_heads && (i % HV) % 4 == 0 ? 0.f : -log1pf(expf(-z)) / 16.f;
  beta[i] = 1.f / (1.f + expf(-y));
}
__global__ void fill_f32(float* x, int64_t n, uint64_t seed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = hash_normal(i, seed);
}

static void bench_inputs(const Problem& P, Dev& D) {
  const Case& c = P.c;
  const int64_t BT = c.B * c.T;
  const int bf = c.qdt == DType::kBFloat16;
  auto blocks = [](int64_t n) { return unsigned((n + 255) / 256); };
  fill_rows16<<<blocks(BT * c.H * 32), 256>>>((uint16_t*)D.q, BT * c.H, 128, 11, bf, 1);
  fill_rows16<<<blocks(BT * c.H * 32), 256>>>((uint16_t*)D.k, BT * c.H, 128, 12, bf, 1);
  fill_rows16<<<blocks(BT * c.HV * 32), 256>>>((uint16_t*)D.v, BT * c.HV, 128, 13, bf, 0);
  fill_gates<<<blocks(BT * c.HV), 256>>>((float*)D.g, (float*)D.beta, BT * c.HV, (int)c.HV, 14, !c.bench_all_decay);
  if (c.h0) fill_f32<<<blocks(P.N * c.HV * 128 * state_row_pitch()), 256>>>(D.h0, P.N * c.HV * 128 * state_row_pitch(), 15);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
}

// Median of `reps` runs of `run` on `stream`, CUDA events around each (milliseconds).
template <class Run>
static double median_ms(cudaStream_t stream, int reps, Run&& run) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, stream));
    run();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

static bool g_bench_lean = false;  // bench(): the dispatched forward only (no two-pass variants)
static double bench(const Case& c, cudaStream_t stream) {
  Problem P = make_problem(c);
  Dev D;
  setup(P, D, stream);
  bench_inputs(P, D);
  for (int i = 0; i < 3; ++i) {
    qla::Status s = qla::sm90::forward(D.p);
    if (!s.ok()) { std::printf("bench forward: %s\n", s.message().c_str()); return 0; }
  }
  CK(cudaStreamSynchronize(stream));
  // Median of `reps` forwards (seconds) under the current test settings.
  auto median_s = [&](int reps) { return median_ms(stream, reps, [&] { (void)qla::sm90::forward(D.p); }) * 1e-3; };
  const double t = median_s(20);
  double tprep = 0;  // table + prep alone (test builds with hooks)
#ifdef QLA_SM90_TEST_HOOKS
  if (!g_bench_lean) {
  qla::sm90::set_test_stages(1);
  tprep = median_s(10);
  qla::sm90::set_test_stages(3);
  auto time10 = [&]() { return median_s(10) * 1e6; };  // microseconds
  // The two-pass forward with the overlapped prep forced off / on.
  qla::sm90::set_test_overlap(0);
  const double tov0 = time10();
  qla::sm90::set_test_overlap(1);
  const double tov1 = time10();
  qla::sm90::set_test_overlap(-1);
  std::printf("bench %-28s two-pass, overlapped prep off %7.1f us, on %7.1f\n", c.name.c_str(), tov0, tov1);
  }
#endif
  const double tok = double(P.c.T) * P.c.B;
  const double flops = 163840.0 * tok * c.HV;
  const double bytes = tok * (2 * 2.0 * c.H * K + 2 * 2.0 * c.HV * V + 8.0 * c.HV) +
                       (c.h0 ? 2.0 : 1.0) * P.N * c.HV * K * V * 4;
  const double floor = std::max(flops / 790e12, bytes / 4.28e12);
  std::printf("bench %-28s N=%lld T=%lld H=%lld HV=%lld: %8.1f us (prep %7.1f)  floor %6.1f us  x%.1f  (ws %.0f MB)\n",
              c.name.c_str(), (long long)P.N, (long long)P.c.T, (long long)c.H, (long long)c.HV, t * 1e6,
              tprep * 1e6, floor * 1e6, t / floor, D.ws_bytes / 1e6);
  free_dev(D);
  return t;
}

static std::vector<Case> bench_rows() {
  std::vector<Case> r;
  auto row = [&](const char* name, int64_t B, int64_t T, int64_t H, int64_t HV) {
    Case c; c.name = name; c.B = B; c.T = T; c.H = H; c.HV = HV; r.push_back(c);
  };
  // Grid rows (K = V = 128, h0 and final state), FLA Triton on this H200 in brackets.
  row("35B TP1 1x32768 [FLA 2.37]", 1, 32768, 16, 32);
  row("35B TP1 8192x4", 4, 8192, 16, 32);
  row("397B TP8 1x32768 [FLA 2.10]", 1, 32768, 2, 8);
  row("397B TP1 8192x4 [FLA 3.88]", 4, 8192, 16, 64);
  row("2B TP1 1x32768 [FLA 2.12]", 1, 32768, 16, 16);
  row("2B TP1 1024x8", 8, 1024, 16, 16);
  row("397B TP4 4096x4", 4, 4096, 4, 16);
  row("35B TP1 28672+4096", 1, 32768, 16, 32);
  r.back().lens = {28672, 4096};
  // Where the V-tile choice is close (one sequence, many heads: V tile 32 takes 1.5-2 waves).
  row("27B TP1 1x8192", 1, 8192, 16, 48);
  row("397B TP1 1x8192", 1, 8192, 16, 64);
  row("397B TP1 1x32768", 1, 32768, 16, 64);
  row("27B TP2 8192x4", 4, 8192, 8, 24);
  row("35B TP1 6144+2048", 1, 8192, 16, 32);
  r.back().lens = {6144, 2048};
  row("397B TP1 1024+7168", 1, 8192, 16, 64);
  r.back().lens = {1024, 7168};
  // Varlen with the host lengths (as the grid passes them): sequences of one length at many
  // heads (V tile 128 fills the SMs as a batch does) and a ragged pair (V tile 64).
  row("397B TP1 16384+16384 host", 1, 32768, 16, 64);
  r.back().lens = {16384, 16384};
  r.back().host_lens = true;
  row("27B TP1 4096+4096 host", 1, 8192, 16, 48);
  r.back().lens = {4096, 4096};
  r.back().host_lens = true;
  row("397B TP1 24576+8192 host", 1, 32768, 16, 64);
  r.back().lens = {24576, 8192};
  r.back().host_lens = true;
  // Short rows, few pairs: the fixed costs (launches, the inverse kernel's latency) weigh most.
  row("397B TP8 1x2048", 1, 2048, 2, 8);
  row("397B TP8 1024x8", 8, 1024, 2, 8);
  row("35B TP1 1x2048", 1, 2048, 16, 32);
  row("27B TP2 1x4096", 1, 4096, 8, 24);
  return r;
}

#ifdef QLA_SM90_TEST_HOOKS
// The fused forward's inverse kernel (src/sm90/inverse.cuh) alone against an fp64 host reference
// of its region: Tu = (I + L)^-1 diag(beta) (fp16 image) and the gates; regions poisoned (NaN)
// first, so every element must be written. With `time_rows`, its time beside table + prep.
static double region_offset(int i, int j) {
  static void* base = std::aligned_alloc(1024, 1024);  // offsets only: the swizzle's address bits
  return qla::sm90::img_off<qla::sm90::Lay<cutlass::half_t>::TokTok_K>(static_cast<cutlass::half_t*>(base), i, j);
}

static bool check_inverse(const Case& c, uint64_t seed, cudaStream_t stream) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);
  const int64_t HV = P.c.HV, H = P.c.H;
  std::vector<int64_t> off(P.N + 1, 0);
  for (int64_t n = 0; n < P.N; ++n) off[n + 1] = off[n] + (P.cu[n + 1] - P.cu[n] + 63) / 64;
  const size_t rb = qla::sm90::test_inverse_region_bytes(), bytes = std::max<int64_t>(off[P.N], 1) * HV * rb;
  const size_t tm_bytes = std::max<int64_t>(off[P.N], 1) * HV * 64 * 64 * 2;  // the backward's T' images
  void *dreg = nullptr, *dtm = nullptr;
  CK(cudaMalloc(&dreg, bytes));
  CK(cudaMemset(dreg, 0xFF, bytes));
  CK(cudaMalloc(&dtm, tm_bytes));
  CK(cudaMemset(dtm, 0xFF, tm_bytes));
  qla::Status st = qla::sm90::test_run_inverse(D.p, dreg, dtm);
  CK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> reg(bytes), tmh(tm_bytes);
  CK(cudaMemcpy(reg.data(), dreg, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(tmh.data(), dtm, tm_bytes, cudaMemcpyDeviceToHost));
  CK(cudaFree(dreg));
  CK(cudaFree(dtm));
  double num = 0, den = 0, gnum = 0, gden = 0, tnum = 0, tden = 0;
  bool nan = !st.ok(), bad_et = false;
  for (int64_t n = 0; n < P.N; ++n) {
    for (int64_t ci = off[n]; ci < off[n + 1]; ++ci) {
      const int64_t t0 = P.cu[n] + (ci - off[n]) * 64, len = std::min<int64_t>(64, P.cu[n + 1] - t0);
      for (int64_t hv = 0; hv < HV; ++hv) {
        const int64_t hq = hv / (HV / H);
        const uint8_t* rg = reg.data() + (ci * HV + hv) * rb;
        std::vector<double> gam(len), bt(len), Lm(64 * 64, 0.0), Tm(64 * 64, 0.0);
        double acc = 0;
        for (int64_t i = 0; i < len; ++i) {
          acc += P.g[(t0 + i) * HV + hv];
          gam[i] = acc;
          bt[i] = P.beta[(t0 + i) * HV + hv];
        }
        for (int64_t i = 0; i < len; ++i)
          for (int64_t j = 0; j < i; ++j) {
            double kk = 0;
            for (int d = 0; d < K; ++d) kk += double(P.k[((t0 + i) * H + hq) * K + d]) * P.k[((t0 + j) * H + hq) * K + d];
            Lm[i * 64 + j] = bt[i] * std::exp(gam[i] - gam[j]) * kk;
          }
        for (int64_t j = 0; j < len; ++j) {  // column j of (I + L)^-1 by forward substitution
          for (int64_t i = j; i < len; ++i) {
            double x = i == j ? 1.0 : 0.0;
            for (int64_t m = j; m < i; ++m) x -= Lm[i * 64 + m] * Tm[m * 64 + j];
            Tm[i * 64 + j] = x;
          }
        }
        const uint16_t* img = reinterpret_cast<const uint16_t*>(rg + qla::sm90::kInvImg);
        // The image holds 2^et diag(2^-ek) Tu: 2^ek_i |k_i| in [2^-1/2, 2^1/2) (0 past the end),
        // max_i |beta_i| 2^(et - ek_i) in [1/2, 1), kn = max(1, max_i 2^-ek_i).
        int et = 0;
        float kn = 0.f;
        std::memcpy(&et, rg + qla::sm90::kInvTuExp, 4);
        std::memcpy(&kn, rg + qla::sm90::kInvKn, 4);
        const int8_t* ek = reinterpret_cast<const int8_t*>(rg + qla::sm90::kInvKexp);
        const int8_t* eq = reinterpret_cast<const int8_t*>(rg + qla::sm90::kInvQexp);
        double bmax = 0, knref = 1;
        for (int64_t i = 0; i < 64; ++i) {
          if (i >= len) {
            if (ek[i] != 0 || eq[i] != 0) bad_et = true;
            continue;
          }
          double q2 = 0;  // q's exponent comes from bf16 sums: a few percent of slack
          for (int d = 0; d < K; ++d) q2 += double(P.q[((t0 + i) * H + hq) * K + d]) * P.q[((t0 + i) * H + hq) * K + d];
          const double qn_i = std::sqrt(q2) * std::ldexp(1.0, eq[i]);
          if (q2 > 0 && !(qn_i > 0.7071 * 0.95 && qn_i < 1.4143 * 1.05)) bad_et = true;
          double k2 = 0;
          for (int d = 0; d < K; ++d) k2 += double(P.k[((t0 + i) * H + hq) * K + d]) * P.k[((t0 + i) * H + hq) * K + d];
          const double kn_i = std::sqrt(k2) * std::ldexp(1.0, ek[i]);
          if (k2 > 0 && !(kn_i > 0.7071 * (1 - 1e-4) && kn_i < 1.4143 * (1 + 1e-4))) bad_et = true;
          bmax = std::max(bmax, std::fabs(bt[i]) * std::ldexp(1.0, et - ek[i]));
          knref = std::max(knref, std::ldexp(1.0, -ek[i]));
        }
        if (bmax > 0 && !(bmax >= 0.5 && bmax < 1.0)) bad_et = true;
        if (kn != knref) bad_et = true;
        // T' = diag(2^-ek) Tm diag(2^ek), unscaled fp16 (the backward's image).
        const uint16_t* timg = reinterpret_cast<const uint16_t*>(tmh.data() + (ci * HV + hv) * 64 * 64 * 2);
        for (int64_t i = 0; i < len; ++i)
          for (int64_t j = 0; j < len; ++j) {
            const double ref = Tm[i * 64 + j] * std::ldexp(1.0, ek[j] - ek[i]);
            const double x = from16(timg[int(region_offset(int(i), int(j)))], DType::kFloat16);
            if (!std::isfinite(x)) nan = true;
            tnum += (x - ref) * (x - ref);
            tden += ref * ref;
          }
        for (int64_t i = 0; i < len; ++i)
          for (int64_t j = 0; j < len; ++j) {
            const double ref = Tm[i * 64 + j] * bt[j];
            const double x = std::ldexp(from16(img[int(region_offset(int(i), int(j)))], DType::kFloat16), ek[i] - et);
            if (!std::isfinite(x)) nan = true;
            num += (x - ref) * (x - ref);
            den += ref * ref;
          }
        const float* gf = reinterpret_cast<const float*>(rg + qla::sm90::kInvGam);
        for (int64_t i = 0; i < len; ++i) {
          const double refs[3] = {gam[i], std::exp(gam[i]), std::exp(gam[len - 1] - gam[i])};
          for (int a = 0; a < 3; ++a) {  // kInvGam, kInvEg, kInvEgk: consecutive 64-float rows
            const double x = gf[a * 64 + i];
            if (!std::isfinite(x)) nan = true;
            gnum += (x - refs[a]) * (x - refs[a]);
            gden += refs[a] * refs[a];
          }
        }
        const double eg = gf[3 * 64], refeg = std::exp(gam[len - 1]);
        gnum += (eg - refeg) * (eg - refeg);
        gden += refeg * refeg;
      }
    }
  }
  const double e = std::sqrt(num / std::max(den, 1e-300)), eg = std::sqrt(gnum / std::max(gden, 1e-300));
  const double et_ = std::sqrt(tnum / std::max(tden, 1e-300));
  // fp16 rounding of Tu and T' (2^-11 relative) plus the fp32 inverse; gates in fp32.
  const bool ok = !nan && !bad_et && e < 1e-3 && et_ < 1e-3 && eg < 1e-5;
  std::printf("inverse %-40s Tu rel-L2 %.2e  T' %.2e  gates %.2e  %s%s%s\n", c.name.c_str(), e, et_, eg,
              nan ? "NaN/unwritten " : "",
              bad_et ? "scale exponents out of their windows " : "",
              ok ? "ok" : (st.ok() ? "FAIL" : st.message().c_str()));
  free_dev(D);
  return ok;
}

// Inverse kernel alone against table + prep alone on a bench row (median of 20, microseconds).
static void bench_inverse(const Case& c, cudaStream_t stream) {
  Problem P = make_problem(c);
  Dev D;
  setup(P, D, stream);
  bench_inputs(P, D);
  const int64_t regions = (P.c.T * P.c.B / 64 + P.N) * P.c.HV;
  void* dreg = nullptr;
  CK(cudaMalloc(&dreg, regions * qla::sm90::test_inverse_region_bytes()));
  auto median_us = [&](auto&& run) {
    for (int i = 0; i < 3; ++i) run();
    return median_ms(stream, 20, run) * 1e3;
  };
  const double tinv = median_us([&] { (void)qla::sm90::test_run_inverse(D.p, dreg); });
  // Stages left out (timing by difference): phase 2, the whole inverse, then K K^T and L too,
  // then the image and its store too (loads, gates and the gate stores alone).
  double tskip[4];
  const int bits[4] = {1, 2, 2 | 4, 2 | 4 | 8};
  for (int i = 0; i < 4; ++i) {
    qla::sm90::set_test_inverse_skip(bits[i]);
    tskip[i] = median_us([&] { (void)qla::sm90::test_run_inverse(D.p, dreg); });
  }
  qla::sm90::set_test_inverse_skip(0);
  qla::sm90::set_test_stages(1);
  const double tprep = median_us([&] { (void)qla::sm90::forward(D.p); });
  qla::sm90::set_test_stages(3);
  std::printf("bench-inverse %-28s regions %lld: inverse %7.1f us (without phase 2 %7.1f, without the inverse %7.1f, "
              "also without K K^T %7.1f, loads and gates only %7.1f), table + prep %7.1f us\n", c.name.c_str(),
              (long long)regions, tinv, tskip[0], tskip[1], tskip[2], tskip[3], tprep);
  CK(cudaFree(dreg));
  free_dev(D);
}

// Relative L2 of an output against its reference, and whether any element is not finite (the
// outputs' buffers are poisoned with NaN before each call).
struct L2 {
  double num = 0, den = 0;
  bool nan = false;
  void add(double x, double ref) {
    nan = nan || !std::isfinite(x);
    num += (x - ref) * (x - ref);
    den += ref * ref;
  }
  double rel() const { return std::sqrt(num / std::max(den, 1e-300)); }
};

// The backward's states pass (the forward's launch with a StatesPass: the lean kernel's states
// role, split where the forward's plan splits): each chunk's entering state, the S' image (the
// input type, fused_chunks.cuh's store_state_image), against the fp64 forward's, and the final
// state; poisoned buffers, the images bitwise repeatable.
static bool check_states(const Case& c, uint64_t seed, cudaStream_t stream) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);
  const size_t nreg = static_cast<size_t>(total_chunks(P) * c.HV);
  const size_t img = qla::sm90::test_state_image_bytes(), img_bytes = std::max<size_t>(1, nreg) * img;
  void* simg = nullptr;
  CK(cudaMalloc(&simg, img_bytes));
  CK(cudaMemset(simg, 0xFF, img_bytes));  // (NaN in bf16 and fp16)
  std::vector<uint8_t> im(img_bytes), im2(img_bytes);
  qla::Status s = qla::sm90::test_run_states_pass(D.p, nullptr, simg);
  if (!s.ok()) { std::printf("%-34s states pass: %s\n", c.name.c_str(), s.message().c_str()); CK(cudaFree(simg)); free_dev(D); return false; }
  CK(cudaStreamSynchronize(stream));
  CK(cudaMemcpy(im.data(), simg, img_bytes, cudaMemcpyDeviceToHost));
  std::vector<float> h(P.N * c.HV * 128 * state_row_pitch());
  CK(cudaMemcpy(h.data(), D.hT, h.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemset(simg, 0xFF, img_bytes));
  s = qla::sm90::test_run_states_pass(D.p, nullptr, simg);
  CK(cudaStreamSynchronize(stream));
  CK(cudaMemcpy(im2.data(), simg, img_bytes, cudaMemcpyDeviceToHost));
  CK(cudaFree(simg));
  std::vector<double> o, hT, cs;
  reference(P, o, hT, &cs);
  Err err;
  state_errors(P, h, hT, err);
  // Region r's image holds S^T (v, d): two 64-column boxes of d, 128 rows of v of 128 bytes each,
  // the 16-byte run (d % 64) / 8 of row v at run ((d % 64) / 8) ^ (v % 8) (128-byte swizzle).
  L2 e;
  for (size_t r = 0; r < nreg; ++r)
    for (int v = 0; v < V; ++v)
      for (int d = 0; d < K; ++d) {
        uint16_t u;
        std::memcpy(&u, im.data() + r * img + 16384 * (d / 64) + 128 * v + 16 * (((d % 64) / 8) ^ (v % 8)) + 2 * (d % 8), 2);
        e.add(from16(u, c.qdt), cs[(r * K + d) * V + v]);
      }
  const bool same = s.ok() && im == im2;
  // The entering states of sequences without h0 start at zero: e.den may be 0 only if no chunk
  // has a non-zero state (then e.num must be too). S' is rounded to the input type (bf16: about
  // 1.5e-3 of relative L2 from the rounding alone).
  const double es = e.den > 0 ? e.rel() : std::sqrt(e.num);
  const bool ok = !err.nan && !e.nan && err.h <= 3e-3 && es <= 4e-3 && same;
  std::printf("states %-34s N=%-3lld T=%-5lld H=%lld HV=%-2lld  S' %.3e final %.3e%s%s  %s\n", c.name.c_str(),
              (long long)P.N, (long long)P.c.T, (long long)c.H, (long long)c.HV, es, err.h, err.nan || e.nan ? " NaN" : "",
              same ? "" : " (second call differs)", ok ? "ok" : "FAIL");
  free_dev(D);
  return ok;
}

// Every gradient of the recurrence in fp64, token by token (the backward's reference): per
// (sequence, value head) the forward keeps the state entering each chunk, and the reverse
// recomputes a chunk's states before walking its tokens back. With u_t = v_t - e^g S^T k_t and
// S_t = e^g S_{t-1} + beta k u^T, o_t = scale S_t^T q_t, and dS the gradient of S_t:
//   dS += scale q dO^T;  dq = scale S_t dO;  du = beta dS^T k;  dv = du;  dbeta = k^T dS u;
//   dk = beta dS u - e^g S_{t-1} du;  dg = e^g (<dS, S_{t-1}> - k^T S_{t-1} du);
//   dS_{t-1} = e^g (dS - k du^T).
// The initial state h0 also plays d(final state) (as the step's and the library's checks run them). dq and dk
// are summed over each group's value heads. Layouts: dq, dk [B T][H][K]; dv [B T][HV][V]; dg,
// dbeta [B T][HV]; dh0 [N][HV][K][V].
struct FullGrads { std::vector<double> dq, dk, dv, dg, dbeta, dh0; };
static void reference_backward(const Problem& P, const std::vector<float>& dO, FullGrads& G) {
  const Case& c = P.c;
  const double scale = c.scale != 0.f ? c.scale : 1.0 / std::sqrt(double(K));
  const int64_t BT = c.B * c.T;
  G.dq.assign(BT * c.H * K, 0.0);
  G.dk.assign(BT * c.H * K, 0.0);
  G.dv.assign(BT * c.HV * V, 0.0);
  G.dg.assign(BT * c.HV, 0.0);
  G.dbeta.assign(BT * c.HV, 0.0);
  G.dh0.assign(P.N * c.HV * K * V, 0.0);
  std::vector<double> dS(K * V), u(V), du(V), kS(V);
  for (int64_t n = 0; n < P.N; ++n)
    for (int64_t hv = 0; hv < c.HV; ++hv) {
      const int64_t hq = hv / (c.HV / c.H), t0 = P.cu[n], len = P.cu[n + 1] - P.cu[n];
      const int64_t nch = (len + 63) / 64;
      auto tok = [&](int64_t t, const std::vector<float>& x, int64_t heads, int64_t h, int64_t w) {
        return &x[((t0 + t) * heads + h) * w];
      };
      // The forward: the state entering each chunk.
      std::vector<std::vector<double>> Sc(nch + 1, std::vector<double>(K * V, 0.0));
      std::vector<double> S(K * V);
      for (int i = 0; i < K * V; ++i) S[i] = c.h0 ? P.h0[(n * c.HV + hv) * K * V + i] : 0.0;
      for (int64_t t = 0; t < len; ++t) {
        if (t % 64 == 0) Sc[t / 64] = S;
        const float* k = tok(t, P.k, c.H, hq, K);
        const float* v = tok(t, P.v, c.HV, hv, V);
        const double a = std::exp(double(P.g[(t0 + t) * c.HV + hv])), b = P.beta[(t0 + t) * c.HV + hv];
        std::fill(kS.begin(), kS.end(), 0.0);
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < V; ++j) kS[j] += k[d] * S[d * V + j];
        for (int j = 0; j < V; ++j) u[j] = v[j] - a * kS[j];
        for (int d = 0; d < K; ++d)
          for (int j = 0; j < V; ++j) S[d * V + j] = a * S[d * V + j] + b * k[d] * u[j];
      }
      // The reverse, chunk by chunk from the last.
      for (int i = 0; i < K * V; ++i) dS[i] = c.h0 ? P.h0[(n * c.HV + hv) * K * V + i] : 0.0;
      for (int64_t ch = nch - 1; ch >= 0; --ch) {
        const int64_t ta = 64 * ch, tb = std::min<int64_t>(len, ta + 64);
        std::vector<std::vector<double>> St(tb - ta + 1);  // St[m]: the state before token ta + m
        St[0] = Sc[ch];
        for (int64_t t = ta; t < tb; ++t) {
          const float* k = tok(t, P.k, c.H, hq, K);
          const float* v = tok(t, P.v, c.HV, hv, V);
          const double a = std::exp(double(P.g[(t0 + t) * c.HV + hv])), b = P.beta[(t0 + t) * c.HV + hv];
          const std::vector<double>& Sp = St[t - ta];
          std::vector<double> Sn(K * V);
          std::fill(kS.begin(), kS.end(), 0.0);
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) kS[j] += k[d] * Sp[d * V + j];
          for (int j = 0; j < V; ++j) u[j] = v[j] - a * kS[j];
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) Sn[d * V + j] = a * Sp[d * V + j] + b * k[d] * u[j];
          St[t - ta + 1] = std::move(Sn);
        }
        for (int64_t t = tb - 1; t >= ta; --t) {
          const float* q = tok(t, P.q, c.H, hq, K);
          const float* k = tok(t, P.k, c.H, hq, K);
          const float* v = tok(t, P.v, c.HV, hv, V);
          const float* o = tok(t, dO, c.HV, hv, V);
          const double a = std::exp(double(P.g[(t0 + t) * c.HV + hv])), b = P.beta[(t0 + t) * c.HV + hv];
          const std::vector<double>& Sp = St[t - ta];
          const std::vector<double>& Sn = St[t - ta + 1];
          double* dq = &G.dq[((t0 + t) * c.H + hq) * K];
          double* dk = &G.dk[((t0 + t) * c.H + hq) * K];
          for (int d = 0; d < K; ++d) {
            double x = 0;
            for (int j = 0; j < V; ++j) x += Sn[d * V + j] * o[j];
            dq[d] += scale * x;
          }
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) dS[d * V + j] += scale * q[d] * o[j];
          std::fill(kS.begin(), kS.end(), 0.0);
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) kS[j] += k[d] * Sp[d * V + j];
          for (int j = 0; j < V; ++j) u[j] = v[j] - a * kS[j];
          std::fill(du.begin(), du.end(), 0.0);
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) du[j] += k[d] * dS[d * V + j];
          double dbeta = 0;
          for (int j = 0; j < V; ++j) {
            dbeta += du[j] * u[j];  // k^T dS u
            du[j] *= b;
            G.dv[((t0 + t) * c.HV + hv) * V + j] = du[j];
          }
          G.dbeta[(t0 + t) * c.HV + hv] = dbeta;
          double dg = 0, kSdu = 0;
          for (int d = 0; d < K; ++d) {
            double dSu = 0, Spdu = 0;
            for (int j = 0; j < V; ++j) {
              dSu += dS[d * V + j] * u[j];
              Spdu += Sp[d * V + j] * du[j];
              dg += dS[d * V + j] * Sp[d * V + j];
            }
            dk[d] += b * dSu - a * Spdu;
            kSdu += k[d] * Spdu;
          }
          G.dg[(t0 + t) * c.HV + hv] = a * (dg - kSdu);
          for (int d = 0; d < K; ++d)
            for (int j = 0; j < V; ++j) dS[d * V + j] = a * (dS[d * V + j] - k[d] * du[j]);
        }
      }
      std::copy(dS.begin(), dS.end(), G.dh0.begin() + (n * c.HV + hv) * K * V);
    }
}

// The reverse step (src/sm90/fused_step.cuh) after the states pass: d(initial state), dv, dq and
// dk (per value head, summed over each group here) and dbeta against the fp64 references (v plays
// dO, the initial state's buffer d(final state)), into poisoned buffers (every element written),
// bitwise repeatable.
static bool check_step(const Case& c, uint64_t seed, cudaStream_t stream) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);  // (poisons the final state's buffer and the workspace)
  const Case& cc = P.c;  // (T filled in for varlen)
  const size_t n_v = static_cast<size_t>(cc.B * cc.T * cc.HV * V);
  void* dv = nullptr;
  CK(cudaMalloc(&dv, std::max<size_t>(1, n_v) * 2));
  qla::MutTensorRef dvr;
  dvr.data = dv;
  dvr.dtype = cc.qdt;
  dvr.stride[0] = cc.T * cc.HV * V;
  dvr.stride[1] = cc.HV * V;
  dvr.stride[2] = V;
  qla::MutTensorRef dh0;
  dh0.data = D.p.final_state.data;
  dh0.dtype = DType::kFloat32;
  for (int i = 0; i < 3; ++i) dh0.stride[i] = D.p.final_state.stride[i];
  // dq per value head (the host sums each group), and the states pass's S' images.
  const size_t n_dq = static_cast<size_t>(cc.B * cc.T * cc.HV * K), n_g = static_cast<size_t>(cc.B * cc.T * cc.HV);
  void *dq = nullptr, *dk = nullptr, *db = nullptr, *dgb = nullptr, *simg = nullptr, *tm = nullptr;
  CK(cudaMalloc(&dq, std::max<size_t>(1, n_dq) * 2));
  CK(cudaMalloc(&dk, std::max<size_t>(1, n_dq) * 2));
  CK(cudaMalloc(&db, std::max<size_t>(1, n_g) * 4));
  CK(cudaMalloc(&dgb, std::max<size_t>(1, n_g) * 4));
  const size_t regions = static_cast<size_t>(std::max<int64_t>(1, total_chunks(P) * cc.HV));
  const size_t img_bytes = regions * qla::sm90::test_state_image_bytes();
  CK(cudaMalloc(&simg, img_bytes));
  CK(cudaMalloc(&tm, regions * 64 * 64 * 2));
  qla::MutTensorRef dqr = dvr, dkr = dvr, dbr;
  dqr.data = dq;
  dkr.data = dk;
  dbr.data = db;
  dbr.dtype = DType::kFloat32;
  dbr.stride[0] = cc.T * cc.HV;
  dbr.stride[1] = cc.HV;
  dbr.stride[2] = 1;
  qla::MutTensorRef dgr = dbr;
  dgr.data = dgb;
  std::vector<float> h[2], hb[2], hg[2];
  std::vector<uint16_t> hv16[2], hq16[2], hk16[2];
  qla::Status s;
  for (int call = 0; call < 2; ++call) {
    CK(cudaMemset(dv, 0xFF, std::max<size_t>(1, n_v) * 2));
    CK(cudaMemset(dq, 0xFF, std::max<size_t>(1, n_dq) * 2));
    CK(cudaMemset(dk, 0xFF, std::max<size_t>(1, n_dq) * 2));
    CK(cudaMemset(db, 0xFF, std::max<size_t>(1, n_g) * 4));
    CK(cudaMemset(dgb, 0xFF, std::max<size_t>(1, n_g) * 4));
    CK(cudaMemset(simg, 0x7F, img_bytes));
    CK(cudaMemset(tm, 0xFF, regions * 64 * 64 * 2));
    s = qla::sm90::test_run_states_pass(D.p, tm, simg);  // (and the table, regions and maps the step reads)
    if (!s.ok()) break;
    CK(cudaMemset(D.hT, 0xFF, P.N * cc.HV * 128 * state_row_pitch() * 4));
    qla::sm90::set_test_reverse_maps_ready(1);
    s = qla::sm90::test_run_fused_step(D.p, D.p.v, D.p.initial_state, dh0, dvr, simg, dqr, &dkr, &dbr, tm, &dgr);
    qla::sm90::set_test_reverse_maps_ready(0);
    if (!s.ok()) break;
    CK(cudaStreamSynchronize(stream));
    h[call].resize(P.N * cc.HV * 128 * state_row_pitch());
    hv16[call].resize(n_v);
    hq16[call].resize(n_dq);
    hk16[call].resize(n_dq);
    hb[call].resize(n_g);
    hg[call].resize(n_g);
    CK(cudaMemcpy(h[call].data(), D.hT, h[call].size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hv16[call].data(), dv, n_v * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hq16[call].data(), dq, n_dq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hk16[call].data(), dk, n_dq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb[call].data(), db, n_g * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hg[call].data(), dgb, n_g * 4, cudaMemcpyDeviceToHost));
  }
  for (void* x : {dv, dq, dk, db, dgb, simg, tm}) CK(cudaFree(x));
  if (!s.ok()) { std::printf("%-34s reverse step: %s\n", c.name.c_str(), s.message().c_str()); free_dev(D); return false; }
  FullGrads G;  // (v plays dO)
  reference_backward(P, P.v, G);
  Err err;
  state_errors(P, h[0], G.dh0, err);
  L2 ev, eq, ek, eb, eg;
  for (size_t i = 0; i < n_v; ++i) ev.add(from16(hv16[0][i], cc.qdt), G.dv[i]);
  {  // dq, dk: each group's value heads summed here
    const int64_t grp = cc.HV / cc.H;
    for (int64_t t = 0; t < cc.B * cc.T; ++t)
      for (int64_t hq = 0; hq < cc.H; ++hq)
        for (int d = 0; d < K; ++d) {
          double x = 0, y = 0;
          for (int64_t g2 = 0; g2 < grp; ++g2) {
            x += from16(hq16[0][(t * cc.HV + hq * grp + g2) * K + d], cc.qdt);
            y += from16(hk16[0][(t * cc.HV + hq * grp + g2) * K + d], cc.qdt);
          }
          eq.add(x, G.dq[(t * cc.H + hq) * K + d]);
          ek.add(y, G.dk[(t * cc.H + hq) * K + d]);
        }
    for (size_t i = 0; i < n_g; ++i) {
      eb.add(hb[0][i], G.dbeta[i]);
      eg.add(hg[0][i], G.dg[i]);
    }
  }
  const bool same = std::memcmp(h[0].data(), h[1].data(), h[0].size() * 4) == 0 && hv16[0] == hv16[1] &&
                    hq16[0] == hq16[1] && hk16[0] == hk16[1] && std::memcmp(hb[0].data(), hb[1].data(), n_g * 4) == 0 &&
                    std::memcmp(hg[0].data(), hg[1].data(), n_g * 4) == 0;
  const bool nan = err.nan || ev.nan || eq.nan || ek.nan || eb.nan || eg.nan;
  const bool ok = !nan && same && err.h <= 3e-3 && ev.rel() <= 4e-3 && eq.rel() <= 4e-3 && ek.rel() <= 4e-3 &&
                  eb.rel() <= 4e-3 && eg.rel() <= 4e-3;
  std::printf("step %-34s N=%-3lld T=%-5lld H=%lld HV=%-2lld  dh0 %.2e dv %.2e dq %.2e dk %.2e dg %.2e dbeta %.2e%s%s  %s\n",
              c.name.c_str(), (long long)P.N, (long long)cc.T, (long long)cc.H, (long long)cc.HV, err.h, ev.rel(),
              eq.rel(), ek.rel(), eg.rel(), eb.rel(), nan ? " NaN" : "", same ? "" : " (second call differs)", ok ? "ok" : "FAIL");
  free_dev(D);
  return ok;
}

// The library's backward (qla::sm90::backward, the path forced by set_test_backward_path) on the
// case's inputs, v playing dO and the initial state's buffer d(final state): every gradient
// (dq, dk summed over each group by the library) into poisoned buffers against the fp64
// reference, and a second call bitwise identical.
struct LibBwdBuffers {
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg = nullptr, *db = nullptr, *ws = nullptr;
  size_t n_q = 0, n_v = 0, n_g = 0, ws_bytes = 0;
  qla::GdnBackwardParams bp;
  LibBwdBuffers(const Problem& P, const Dev& D, cudaStream_t stream) {
    const Case& c = P.c;
    n_q = static_cast<size_t>(c.B * c.T * c.H * K), n_v = static_cast<size_t>(c.B * c.T * c.HV * V);
    n_g = static_cast<size_t>(c.B * c.T * c.HV);
    CK(cudaMalloc(&dq, std::max<size_t>(1, n_q) * 2));
    CK(cudaMalloc(&dk, std::max<size_t>(1, n_q) * 2));
    CK(cudaMalloc(&dv, std::max<size_t>(1, n_v) * 2));
    CK(cudaMalloc(&dg, std::max<size_t>(1, n_g) * 4));
    CK(cudaMalloc(&db, std::max<size_t>(1, n_g) * 4));
    auto mref = [](void* d, DType dt, int64_t s0, int64_t s1, int64_t s2) {
      qla::MutTensorRef r;
      r.data = d, r.dtype = dt, r.stride[0] = s0, r.stride[1] = s1, r.stride[2] = s2;
      return r;
    };
    bp.shape = D.p.shape;
    bp.q = D.p.q, bp.k = D.p.k, bp.v = D.p.v, bp.g = D.p.g, bp.beta = D.p.beta;
    bp.initial_state = D.p.initial_state;
    bp.cu_seqlens = D.p.cu_seqlens, bp.num_seqs = D.p.num_seqs, bp.cu_seqlens_host = D.p.cu_seqlens_host;
    bp.d_o = D.p.v;
    bp.d_final_state = D.p.initial_state;
    bp.dq = mref(dq, c.qdt, c.T * c.H * K, c.H * K, K);
    bp.dk = mref(dk, c.qdt, c.T * c.H * K, c.H * K, K);
    bp.dv = mref(dv, c.qdt, c.T * c.HV * V, c.HV * V, V);
    bp.dg = mref(dg, DType::kFloat32, c.T * c.HV, c.HV, 1);
    bp.dbeta = mref(db, DType::kFloat32, c.T * c.HV, c.HV, 1);
    bp.d_initial_state = mref(D.p.final_state.data, DType::kFloat32, D.p.final_state.stride[0], D.p.final_state.stride[1],
                              D.p.final_state.stride[2]);
    bp.scale = D.p.scale, bp.state_layout = D.p.state_layout;
    bp.split = D.p.split, bp.split_chunks = D.p.split_chunks;
    bp.device = qla::Device::kCuda, bp.stream = stream;
    qla::Status s = qla::sm90::backward_workspace_size(bp, &ws_bytes);
    if (s.ok()) CK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 16)));
    bp.workspace = ws, bp.workspace_bytes = ws_bytes;
  }
  LibBwdBuffers(const LibBwdBuffers&) = delete;
  LibBwdBuffers& operator=(const LibBwdBuffers&) = delete;
  ~LibBwdBuffers() {
    for (void* x : {dq, dk, dv, dg, db, ws})
      if (x) CK(cudaFree(x));
  }
  void poison(const Problem& P, const Dev& D) const {
    CK(cudaMemset(dq, 0xFF, std::max<size_t>(1, n_q) * 2));
    CK(cudaMemset(dk, 0xFF, std::max<size_t>(1, n_q) * 2));
    CK(cudaMemset(dv, 0xFF, std::max<size_t>(1, n_v) * 2));
    CK(cudaMemset(dg, 0xFF, std::max<size_t>(1, n_g) * 4));
    CK(cudaMemset(db, 0xFF, std::max<size_t>(1, n_g) * 4));
    CK(cudaMemset(D.hT, 0xFF, P.N * P.c.HV * 128 * state_row_pitch() * 4));
    if (ws) CK(cudaMemset(ws, 0xFF, ws_bytes));
  }
};

static bool check_library_backward(const Case& c, uint64_t seed, cudaStream_t stream, int path) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);
  const Case& cc = P.c;
  qla::sm90::set_test_backward_path(path);
  qla::Status s;
  std::vector<float> h[2], hg[2], hb[2];
  std::vector<uint16_t> hq[2], hk[2], hv[2];
  {
    LibBwdBuffers b(P, D, stream);
    for (int call = 0; call < 2 && s.ok(); ++call) {
      b.poison(P, D);
      s = qla::sm90::backward(b.bp);
      if (!s.ok()) break;
      CK(cudaStreamSynchronize(stream));
      h[call].resize(P.N * cc.HV * 128 * state_row_pitch());
      hq[call].resize(b.n_q), hk[call].resize(b.n_q), hv[call].resize(b.n_v), hg[call].resize(b.n_g), hb[call].resize(b.n_g);
      CK(cudaMemcpy(h[call].data(), D.hT, h[call].size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hq[call].data(), b.dq, b.n_q * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hk[call].data(), b.dk, b.n_q * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hv[call].data(), b.dv, b.n_v * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hg[call].data(), b.dg, b.n_g * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hb[call].data(), b.db, b.n_g * 4, cudaMemcpyDeviceToHost));
    }
  }
  qla::sm90::set_test_backward_path(0);
  if (!s.ok()) { std::printf("%-34s library backward: %s\n", c.name.c_str(), s.message().c_str()); free_dev(D); return false; }
  FullGrads G;
  reference_backward(P, P.v, G);
  Err err;
  state_errors(P, h[0], G.dh0, err);
  L2 eq, ek, ev, eg, eb;
  for (size_t i = 0; i < hq[0].size(); ++i) {
    eq.add(from16(hq[0][i], cc.qdt), G.dq[i]);
    ek.add(from16(hk[0][i], cc.qdt), G.dk[i]);
  }
  for (size_t i = 0; i < hv[0].size(); ++i) ev.add(from16(hv[0][i], cc.qdt), G.dv[i]);
  for (size_t i = 0; i < hg[0].size(); ++i) {
    eg.add(hg[0][i], G.dg[i]);
    eb.add(hb[0][i], G.dbeta[i]);
  }
  const bool same = std::memcmp(h[0].data(), h[1].data(), h[0].size() * 4) == 0 && hq[0] == hq[1] && hk[0] == hk[1] && hv[0] == hv[1] &&
                    std::memcmp(hg[0].data(), hg[1].data(), hg[0].size() * 4) == 0 &&
                    std::memcmp(hb[0].data(), hb[1].data(), hb[0].size() * 4) == 0;
  // (state_errors flags NaN in every state, also those with no sequence: N x HV are all written)
  const bool nan = err.nan || eq.nan || ek.nan || ev.nan || eg.nan || eb.nan;
  const bool ok = !nan && same && err.h <= 4e-3 && eq.rel() <= 4e-3 && ek.rel() <= 4e-3 && ev.rel() <= 4e-3 &&
                  eg.rel() <= 4e-3 && eb.rel() <= 4e-3;
  std::printf("library bwd (%s) %-34s N=%-3lld T=%-5lld H=%lld HV=%-2lld  dh0 %.2e dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e%s%s  %s\n",
              path == 2 ? "fused" : "chunked", c.name.c_str(), (long long)P.N, (long long)cc.T, (long long)cc.H,
              (long long)cc.HV, err.h, eq.rel(), ek.rel(), ev.rel(), eg.rel(), eb.rel(), nan ? " NaN" : "",
              same ? "" : " (second call differs)", ok ? "ok" : "FAIL");
  free_dev(D);
  return ok;
}

// The fused backward's dq, dk where two value heads share a key head: added into the zeroed
// tensors by the step (RecParams::dqk_add) against the partials summed by the finish, bitwise
// (both round the sum of the same two 16-bit values once), on two calls each.
static bool check_dqk_add_bits(const Case& c, uint64_t seed, cudaStream_t stream) {
  Problem P = make_problem(c);
  make_inputs(P, seed);
  Dev D;
  setup(P, D, stream);
  upload_inputs(P, D);
  qla::sm90::set_test_backward_path(2);
  std::vector<uint16_t> hq[4], hk[4], hv[4];
  qla::Status s;
  for (int run = 0; run < 4 && s.ok(); ++run) {
    qla::sm90::set_test_dqk_partials(run >= 2);
    LibBwdBuffers b(P, D, stream);
    b.poison(P, D);
    s = qla::sm90::backward(b.bp);
    CK(cudaStreamSynchronize(stream));
    hq[run].resize(b.n_q), hk[run].resize(b.n_q), hv[run].resize(b.n_v);
    CK(cudaMemcpy(hq[run].data(), b.dq, b.n_q * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hk[run].data(), b.dk, b.n_q * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hv[run].data(), b.dv, b.n_v * 2, cudaMemcpyDeviceToHost));
  }
  qla::sm90::set_test_dqk_partials(0);
  qla::sm90::set_test_backward_path(0);
  free_dev(D);
  bool same = s.ok();
  for (int run = 1; run < 4 && same; ++run) same = hq[run] == hq[0] && hk[run] == hk[0] && hv[run] == hv[0];
  std::printf("dq, dk added in against the finish's sums %-34s N=%-3lld HV=%-2lld  %s\n", c.name.c_str(), (long long)P.N,
              (long long)c.HV, !s.ok() ? s.message().c_str() : same ? "bitwise equal, ok" : "differ, FAIL");
  return same;
}

// The library's backward on the backward grid's shapes (benchmarks.md: 8192 or 32768 tokens cut
// into 1, 2, 4, 8 sequences, heads 16/32, 8/16, 4/8, 2/4; own cut points), bench inputs, each path
// forced, alternated twice: eager event medians of qla::sm90::backward.
static std::vector<Case> backward_grid_cases() {
  std::vector<Case> rows;
  uint64_t lcg = 42;
  for (int64_t total : {8192, 32768})
    for (int nseq : {1, 2, 4, 8})
      for (int64_t h : {16, 8, 4, 2}) {
        Case c;
        c.H = h, c.HV = 2 * h;
        if (nseq == 1) {
          c.B = 1, c.T = total;
        } else {
          std::vector<int64_t> cuts;
          while ((int)cuts.size() < nseq - 1) {
            lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
            const int64_t x = 1 + static_cast<int64_t>((lcg >> 33) % static_cast<uint64_t>(total - 1));
            if (std::find(cuts.begin(), cuts.end(), x) == cuts.end()) cuts.push_back(x);
          }
          std::sort(cuts.begin(), cuts.end());
          int64_t prev = 0;
          for (int64_t x : cuts) c.lens.push_back(x - prev), prev = x;
          c.lens.push_back(total - prev);
        }
        c.name = std::to_string(h) + "/" + std::to_string(2 * h) + " " + std::to_string(total) + "/" + std::to_string(nseq);
        rows.push_back(c);
      }
  return rows;
}

// The library's forward and then two backwards (the rule's path) of backward_grid_cases()[row]:
// the launch sequence for a profiler (ncu's per-kernel durations).
static void run_backward_once(int row, cudaStream_t stream) {
  const Case c = backward_grid_cases().at(row);
  Problem P = make_problem(c);
  Dev D;
  setup(P, D, stream);
  bench_inputs(P, D);
  {
    LibBwdBuffers b(P, D, stream);
    qla::Status s = qla::sm90::forward(D.p);  // (the forward of the same row, for reference)
#ifdef QLA_FUSED_PROFILE
    CK(cudaStreamSynchronize(stream));
    qla::sm90::test_print_phases();  // (the forward's records, cleared)
#endif
    if (s.ok()) s = qla::sm90::backward(b.bp);
#ifdef QLA_FUSED_PROFILE
    CK(cudaStreamSynchronize(stream));
    qla::sm90::test_print_phases();  // the first backward's kernels, in launch order (pass 0, then pass 1)
#endif
    if (s.ok()) s = qla::sm90::backward(b.bp);
    CK(cudaStreamSynchronize(stream));
    std::printf("bwd-one %s: %s\n", c.name.c_str(), s.ok() ? "ok" : s.message().c_str());
  }
  free_dev(D);
}

static void bench_backward_paths(cudaStream_t stream) {
  // QLA_BWD_PATHS_PAIRS="32,64": only the rows of those pair counts.
  const char* only = std::getenv("QLA_BWD_PATHS_PAIRS");
  for (const Case& c : backward_grid_cases()) {
    const int64_t total = c.B * c.T > 0 ? c.B * c.T : std::accumulate(c.lens.begin(), c.lens.end(), int64_t(0));
    const int64_t n_pairs = (c.lens.empty() ? c.B : static_cast<int64_t>(c.lens.size())) * c.HV;
    if (only && ("," + std::string(only) + ",").find("," + std::to_string(n_pairs) + ",") == std::string::npos) continue;
    Problem P = make_problem(c);
    Dev D;
    setup(P, D, stream);
    bench_inputs(P, D);
    // Variants: the chunked backward; the fused one with the forward's plan, with its own
    // (the shortest piece 8 chunks, the default) and its own with the shortest piece 16.
    const int nvar = 4;
    const int var_path[nvar] = {1, 2, 2, 2}, var_piece[nvar] = {0, -1, 0, 16};
    double t[2][nvar] = {};
    qla::Status s;
    for (int r = 0; r < 2 && s.ok(); ++r)
      for (int v = 0; v < nvar && s.ok(); ++v) {
        qla::sm90::set_test_backward_path(var_path[v]);
        qla::sm90::set_test_step_min_piece(var_piece[v]);
        LibBwdBuffers b(P, D, stream);
        s = qla::sm90::backward(b.bp);
        CK(cudaStreamSynchronize(stream));
        if (!s.ok()) break;
        t[r][v] = median_ms(stream, 10, [&] { (void)qla::sm90::backward(b.bp); });
      }
    qla::sm90::set_test_backward_path(0);
    qla::sm90::set_test_step_min_piece(0);
    double lib = 0;  // the library's own choice (fused_backward_chosen)
    if (s.ok()) {
      LibBwdBuffers b(P, D, stream);
      s = qla::sm90::backward(b.bp);
      CK(cudaStreamSynchronize(stream));
      if (s.ok()) lib = median_ms(stream, 10, [&] { (void)qla::sm90::backward(b.bp); });
    }
    if (!s.ok()) {
      std::printf("bench-bwd %s: %s\n", c.name.c_str(), s.message().c_str());
    } else {
      const double ch = t[0][0] + t[1][0];
      std::printf("bench-bwd %-14s pairs %4lld chunks %4lld: chunked %8.1f us; fused/chunked: fwd plan %.3f, own %.3f, "
                  "own min 16 %.3f; library %8.1f us (%.3f)  (rounds: chunked %.1f %.1f, own %.1f %.1f)\n",
                  c.name.c_str(), (long long)(P.N * c.HV), (long long)((total + 63) / 64), 0.5e3 * ch,
                  (t[0][1] + t[1][1]) / ch, (t[0][2] + t[1][2]) / ch, (t[0][3] + t[1][3]) / ch, lib * 1e3, 2 * lib / ch,
                  t[0][0] * 1e3, t[1][0] * 1e3, t[0][2] * 1e3, t[1][2] * 1e3);
    }
    free_dev(D);
  }
}

static std::vector<Case> reverse_cases() {
  std::vector<Case> r;
  auto add = [&](const char* name, int64_t B, int64_t T, int64_t H, int64_t HV) -> Case& {
    Case c; c.name = name; c.B = B; c.T = T; c.H = H; c.HV = HV; r.push_back(c); return r.back();
  };
  // Small cases first: which part of a chunk step is wrong, if one is (dO alone: D A'', D Qg',
  // W'; d(final state) alone: Kd', W').
  add("one chunk, dO only", 1, 64, 1, 2).h0 = false;
  add("one chunk, dht only, g=0", 1, 64, 1, 2).vmag = 0.f;
  r.back().gmode = 2;
  add("two chunks, dht only", 1, 128, 1, 2).vmag = 0.f;
  add("bench gates GVA4 T4096", 1, 4096, 2, 8).gmode = 3;
  add("strong decay B2 T1000 kVK", 2, 1000, 2, 4).gmode = 1;
  r.back().layout = StateLayout::kVK;
  add("g=0 T2048", 1, 2048, 1, 2).gmode = 2;
  { Case& c = add("varlen ragged, zero-length", 1, 0, 2, 4); c.lens = {0, 1, 63, 64, 65, 1000, 0, 130}; }
  { Case& c = add("varlen no dht kVK cu64", 1, 0, 1, 4); c.lens = {300, 0, 129}; c.h0 = false;
    c.layout = StateLayout::kVK; c.cu64 = true; }
  { Case& c = add("fp16, bf16 g/beta, strided, scale", 1, 333, 2, 4); c.qdt = DType::kFloat16;
    c.gdt = DType::kBFloat16; c.tpad = 16; c.scale = 0.3f; }
  add("large dO (1e5), no dht", 1, 1024, 1, 2).vmag = 1e5f;
  r.back().h0 = false;
  { Case& c = add("tiny dO (1e-6), large dht (1e6)", 1, 1024, 1, 2); c.vmag = 1e-6f; c.hmag = 1e6f; }
  { Case& c = add("q, k norms spread 2^+-8", 1, 777, 2, 4); c.spread = true; }
  { Case& c = add("large q, k (2^10)", 1, 640, 1, 2); c.qnorm = c.knorm = 1024.f; }
  { Case& c = add("small q, k (2^-12)", 1, 640, 1, 2); c.qnorm = c.knorm = 1.f / 4096.f; }
  add("tiny beta (1e-7)", 1, 500, 1, 2).bmag = 1e-7f;
  add("scale 1e4", 1, 500, 1, 2).scale = 1e4f;
  add("scale 1e-4", 1, 500, 1, 2).scale = 1e-4f;
  return r;
}

// The reverse step's outputs (dv, dq, dk per value head, dbeta, d(initial state) into
// final_state's memory) and the states pass's S' and T' images for a bench row; freed with it.
struct StepBuffers {
  void *dv = nullptr, *dq = nullptr, *dk = nullptr, *db = nullptr, *dg = nullptr, *simg = nullptr, *tm = nullptr;
  qla::MutTensorRef dvr, dqr, dkr, dbr, dgr, dh0;
  StepBuffers(const Problem& P, const Case& c, const Dev& D) {
    const int64_t chunks = (P.c.T + 63) / 64, regions = std::max<int64_t>(1, P.c.B * chunks + P.N) * c.HV;
    CK(cudaMalloc(&dv, std::max<int64_t>(1, P.c.B * P.c.T * c.HV * V) * 2));
    CK(cudaMalloc(&dq, std::max<int64_t>(1, P.c.B * P.c.T * c.HV * K) * 2));
    CK(cudaMalloc(&dk, std::max<int64_t>(1, P.c.B * P.c.T * c.HV * K) * 2));
    CK(cudaMalloc(&db, std::max<int64_t>(1, P.c.B * P.c.T * c.HV) * 4));
    CK(cudaMalloc(&dg, std::max<int64_t>(1, P.c.B * P.c.T * c.HV) * 4));
    CK(cudaMalloc(&simg, regions * qla::sm90::test_state_image_bytes()));
    CK(cudaMalloc(&tm, regions * 64 * 64 * 2));
    dvr.data = dv;
    dvr.dtype = P.c.qdt;
    dvr.stride[0] = P.c.T * c.HV * V, dvr.stride[1] = c.HV * V, dvr.stride[2] = V;
    dqr = dvr;
    dqr.data = dq;
    dkr = dvr;
    dkr.data = dk;
    dbr.data = db;
    dbr.dtype = DType::kFloat32;
    dbr.stride[0] = P.c.T * c.HV, dbr.stride[1] = c.HV, dbr.stride[2] = 1;
    dgr = dbr;
    dgr.data = dg;
    dh0.data = D.p.final_state.data;
    dh0.dtype = DType::kFloat32;
    for (int i = 0; i < 3; ++i) dh0.stride[i] = D.p.final_state.stride[i];
  }
  StepBuffers(const StepBuffers&) = delete;
  StepBuffers& operator=(const StepBuffers&) = delete;
  ~StepBuffers() {
    for (void* x : {dv, dq, dk, db, dg, simg, tm}) CK(cudaFree(x));
  }
  qla::Status run(const Dev& D) const {
    return qla::sm90::test_run_fused_step(D.p, D.p.v, D.p.initial_state, dh0, dvr, simg, dqr, &dkr, &dbr, tm, &dgr);
  }
  qla::Status states(const Dev& D) const {  // the states pass that leaves the images (and the table, regions, maps)
    return qla::sm90::test_run_states_pass(D.p, tm, simg);
  }
};

// The fused backward's parts timed apart on bench inputs (v plays dO, h0 d(final state)): the
// reverse step alone after a states pass (chain, dv, dq; then with every gradient), the states
// pass, and the library's backward.
static void bench_reverse(const Case& c, cudaStream_t stream) {
  Problem P = make_problem(c);
  Dev D;
  setup(P, D, stream);
  bench_inputs(P, D);
  const int64_t chunks = (P.c.T + 63) / 64;
  double tstep = 0, tstep_dk = 0, tstates = 0;  // the reverse step alone (fused_step.cuh), after a states pass: chain, dv, dq; + dk, dbeta
  {
    StepBuffers b(P, c, D);
    qla::Status s = b.states(D);
    if (s.ok()) {
      CK(cudaStreamSynchronize(stream));
      tstates = median_ms(stream, 20, [&] { (void)b.states(D); });  // (table, inverse with T', states pass: the step's inputs)
    }
    qla::sm90::set_test_reverse_maps_ready(1);
    auto step = [&] { return qla::sm90::test_run_fused_step(D.p, D.p.v, D.p.initial_state, b.dh0, b.dvr, b.simg, b.dqr); };
    auto step_dk = [&] { return b.run(D); };
    if (s.ok()) s = step();
    if (s.ok()) s = step_dk();
    CK(cudaStreamSynchronize(stream));
    if (s.ok()) {
      tstep = median_ms(stream, 20, [&] { (void)step(); });
      tstep_dk = median_ms(stream, 20, [&] { (void)step_dk(); });
    } else {
      std::printf("bench reverse step %s: %s\n", c.name.c_str(), s.message().c_str());
    }
    qla::sm90::set_test_reverse_maps_ready(0);
  }
  // The library's backward (qla::sm90::backward, what a user's call runs after validation) on the
  // same inputs and incoming gradients (dO = v, d(final state) = h0, as the step's rows).
  double tlib = 0;
  {
    LibBwdBuffers lb(P, D, stream);
    lb.bp.d_initial_state = qla::MutTensorRef{};  // (d(initial state) not asked for, as before)
    qla::Status s = lb.ws ? qla::sm90::backward(lb.bp) : qla::Status::Error(qla::StatusCode::kInvalidArgument, "no workspace");
    CK(cudaStreamSynchronize(stream));
    if (s.ok()) tlib = median_ms(stream, 20, [&] { (void)qla::sm90::backward(lb.bp); });
    else std::printf("bench reverse library backward %s: %s\n", c.name.c_str(), s.message().c_str());
  }
  std::printf("bench-reverse %-30s N=%lld T=%lld H=%lld HV=%lld: step (chain, dv, dq; alone) %8.1f us, %.2f per chunk; "
              "step with dk, dg, dbeta %8.1f us; states pass %8.1f us; library backward %8.1f us\n",
              c.name.c_str(), (long long)P.N, (long long)P.c.T, (long long)c.H, (long long)c.HV, tstep * 1e3,
              tstep * 1e3 / double(chunks), tstep_dk * 1e3, tstates * 1e3, tlib * 1e3);
  free_dev(D);
}
#endif

int main(int argc, char** argv) {
  bool do_bench = false, do_inverse = false, do_inverse_bench = false, do_fused = false;
  bool do_split = false, do_fused_skip = false, do_short = false, do_reverse_bench = false;
  bool do_bwd_lib = false, do_bwd_paths = false;
  int bwd_one_row = -1;
  bool do_step = false;  // --step: the reverse step (fused_step.cuh) on the backward's cases
  bool do_states = false;  // --states: the backward's states pass on the backward's cases
  int profile_row = -1;  // --profile R: one forward of bench row R, nothing else (for ncu)
  int reverse_profile_row = -1;  // --reverse-profile R: one reverse step of bench row R (phase timers, ncu)
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--bench") do_bench = true;
    if (std::string(argv[i]) == "--inverse") do_inverse = true;
    if (std::string(argv[i]) == "--fused") do_fused = true;
    if (std::string(argv[i]) == "--split") do_split = true;
    if (std::string(argv[i]) == "--fused-skip-bench") do_fused_skip = true;
    if (std::string(argv[i]) == "--short-bench") do_short = true;
    if (std::string(argv[i]) == "--qk-normalized") g_qk_hint = true;
    if (std::string(argv[i]) == "--inverse-bench") do_inverse = do_inverse_bench = true;
    if (std::string(argv[i]) == "--profile" && i + 1 < argc) profile_row = std::atoi(argv[++i]);
    if (std::string(argv[i]) == "--step") do_step = true;
    if (std::string(argv[i]) == "--states") do_states = true;
    if (std::string(argv[i]) == "--reverse-bench") do_reverse_bench = true;
    if (std::string(argv[i]) == "--bwd-lib") do_bwd_lib = true;
#ifdef QLA_FUSED_PROFILE
    if (std::string(argv[i]) == "--phase-cta" && i + 1 < argc) qla::sm90::test_set_phase_cta(std::atoi(argv[++i]));
#endif
    if (std::string(argv[i]) == "--bwd-paths") do_bwd_paths = true;
    if (std::string(argv[i]) == "--bwd-one" && i + 1 < argc) bwd_one_row = std::atoi(argv[++i]);
    if (std::string(argv[i]) == "--reverse-profile" && i + 1 < argc) reverse_profile_row = std::atoi(argv[++i]);
  }
#ifdef QLA_SM90_TEST_HOOKS
  // The overlapped variant of the fused forward (its suites and bench rows with it on).
  if (std::getenv("QLA_TEST_FUSED_OVERLAP")) qla::sm90::set_test_fused_overlap(1);
  // Timing variants for --profile runs (RecParams::skip: results wrong).
  if (const char* e = std::getenv("QLA_TEST_FUSED_SKIP")) qla::sm90::set_test_fused_skip(std::atoi(e));
#endif
  if (std::getenv("QLA_TEST_NO_SPLIT")) g_split = qla::SplitMode::kOff;  // --profile runs of the unsplit chain
  if (const char* e = std::getenv("QLA_TEST_SPLIT_CHUNKS")) {  // --profile runs of a given piece length
    g_split = qla::SplitMode::kOn;
    g_split_chunks = std::atoi(e);
  }
  int ndev = 0;
  // 77: skipped (ctest SKIP_RETURN_CODE) on machines without a GPU, such as CI.
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) { std::printf("no CUDA device: skipped\n"); return 77; }
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  bool ok = true;
  if (profile_row >= 0) {
#ifdef QLA_SM90_TEST_HOOKS
    if (std::getenv("QLA_TEST_FUSED")) qla::sm90::set_test_fused(std::atoi(std::getenv("QLA_TEST_FUSED")));  // the fused forward at V tile 64 / 128
#endif
    const Case c = bench_rows().at(profile_row);
    Problem P = make_problem(c);
    Dev D;
    setup(P, D, stream);
    bench_inputs(P, D);
    qla::Status s = qla::sm90::forward(D.p);
    CK(cudaStreamSynchronize(stream));
#if defined(QLA_SM90_TEST_HOOKS) && defined(QLA_FUSED_PROFILE)
    qla::sm90::test_print_phases();
#endif
    std::printf("profile %s: %s\n", c.name.c_str(), s.ok() ? "ok" : s.message().c_str());
    free_dev(D);
    return s.ok() ? 0 : 1;
  }

#ifdef QLA_SM90_TEST_HOOKS
  if (reverse_profile_row >= 0) {  // the reverse step (every gradient) after a states pass, its own phase records
    const Case c = bench_rows().at(reverse_profile_row);
    Problem P = make_problem(c);
    Dev D;
    setup(P, D, stream);
    bench_inputs(P, D);
    qla::Status s;
    {
      StepBuffers b(P, c, D);
      s = b.states(D);
      CK(cudaStreamSynchronize(stream));
#ifdef QLA_FUSED_PROFILE
      qla::sm90::test_print_phases();  // (the states pass's records, cleared)
#endif
      qla::sm90::set_test_reverse_maps_ready(1);
      if (s.ok()) s = b.run(D);
      CK(cudaStreamSynchronize(stream));
      qla::sm90::set_test_reverse_maps_ready(0);
#ifdef QLA_FUSED_PROFILE
      qla::sm90::test_print_phases();
#endif
      std::printf("step profile %s: %s\n", c.name.c_str(), s.ok() ? "ok" : s.message().c_str());
    }
    free_dev(D);
    return s.ok() ? 0 : 1;
  }
#endif
  if (do_bwd_lib || do_bwd_paths || bwd_one_row >= 0 || do_reverse_bench || do_states || do_step) {
    // The backward's test modes: the library's backward with each path forced, and the fused
    // backward's parts (the reverse step, the states pass) run alone.
#ifdef QLA_SM90_TEST_HOOKS
    if (bwd_one_row >= 0) run_backward_once(bwd_one_row, stream);
    const std::vector<Case> rc = do_bwd_lib || do_states || do_step ? reverse_cases() : std::vector<Case>{};
    for (size_t i = 0; i < rc.size() && do_bwd_lib; ++i) ok = check_library_backward(rc[i], 5771 + i, stream, 2) && ok;
    if (do_bwd_lib) {
      // The chunked backward on the cases of the ordinary input range (its finish kernel is shared).
      for (size_t i : {3, 4, 5, 6, 8})
        if (i < rc.size()) ok = check_library_backward(rc[i], 5771 + i, stream, 1) && ok;
      // The fused backward's own plan where it is not the bound's (step_choice): 64 pairs of
      // uneven sequences (32, 24, 11 and 1 chunks; pieces of 11 chunks fill 128 of the SMs), from
      // the device lengths (gdn_chunk_table's fill rule) and from the host's.
      for (bool host : {false, true}) {
        Case c;
        c.name = host ? "fill plan, host lengths" : "fill plan, device lengths";
        c.B = 1, c.T = 0, c.H = 4, c.HV = 16, c.gmode = 3;
        c.lens = {2000, 1500, 700, 64};
        c.host_lens = host;
        ok = check_library_backward(c, 2771 + host, stream, 2) && ok;
      }
      // dq, dk added in (two value heads a key head) against the partials and the finish: full
      // chunks by bulk reductions, partial ones by generic pair additions, fp16 and bf16.
      for (size_t i : {4, 6, 8}) ok = check_dqk_add_bits(rc[i], 1771 + i, stream) && ok;
      // Forced pieces: the fused backward's split passes (the exact path and the mirror).
      g_split = qla::SplitMode::kOn;
      for (int chunks : {3, 8}) {
        g_split_chunks = chunks;
        for (size_t i : {3, 4, 5, 6}) {
          Case c = rc[i];
          c.name = "split " + std::to_string(chunks) + ": " + c.name;
          ok = check_library_backward(c, 4771 + i, stream, 2) && ok;
        }
      }
      // The states pass's chunks at V tile 128 (the lean kernel's two-warpgroup form, which the
      // plan takes where V tile 64 would need a second wave: many pairs, not these cases).
      qla::sm90::set_test_pass1_vt(128);
      for (int chunks : {0, 3}) {
        g_split = chunks ? qla::SplitMode::kOn : qla::SplitMode::kAuto;
        g_split_chunks = chunks;
        for (size_t i : {3, 4, 5, 6}) {
          Case c = rc[i];
          c.name = "states vt128, split " + std::to_string(chunks) + ": " + c.name;
          ok = check_library_backward(c, 3771 + i, stream, 2) && ok;
        }
      }
      qla::sm90::set_test_pass1_vt(0);
      g_split = qla::SplitMode::kAuto;
      g_split_chunks = 0;
    }
    if (do_bwd_paths) bench_backward_paths(stream);
    for (size_t i = 0; i < rc.size() && do_step; ++i) ok = check_step(rc[i], 6771 + i, stream) && ok;
    for (size_t i = 0; i < rc.size() && do_states; ++i) ok = check_states(rc[i], 9771 + i, stream) && ok;
    if (do_states) {  // again with the chunks at V tile 128 (the plan's choice on many pairs)
      qla::sm90::set_test_pass1_vt(128);
      for (size_t i = 0; i < rc.size(); ++i) {
        Case c = rc[i];
        c.name = "vt128: " + c.name;
        ok = check_states(c, 8771 + i, stream) && ok;
      }
      qla::sm90::set_test_pass1_vt(0);
    }
    if (do_reverse_bench) {
      const std::vector<Case> rows = bench_rows();
      for (int r : {0, 1, 2, 4, 6, 8}) bench_reverse(rows[r], stream);
    }
#else
    std::printf("--bwd-lib, --bwd-paths, --bwd-one, --step, --states and --reverse-bench need a build with -DQLA_SM90_TEST_HOOKS\n");
    ok = false;
#endif
    CK(cudaStreamDestroy(stream));
    std::printf("%s\n", ok ? "ALL PASSED" : "SOME CASES FAILED");
    return ok ? 0 : 1;
  }

  // check_supported must refuse K != 128.
  {
    qla::GdnForwardParams p;
    p.shape = {1, 64, 1, 1, 64, 128};
    p.q.dtype = p.k.dtype = p.v.dtype = p.o.dtype = DType::kBFloat16;
    qla::Status s = qla::sm90::check_supported(p);
    const bool r = s.code() == qla::StatusCode::kNotSupported;
    std::printf("check_supported(K=64): %s (%s)\n", r ? "kNotSupported ok" : "FAIL", s.message().c_str());
    ok = ok && r;
  }

  std::vector<Case> cases;
  { Case c; c.name = "B2 T300 kKV h0"; c.B = 2; c.T = 300; c.H = 2; c.HV = 2; cases.push_back(c); }
  { Case c; c.name = "varlen GVA2 kVK h0"; c.lens = {0, 1, 63, 64, 65, 1000, 0, 130}; c.H = 2; c.HV = 4;
    c.layout = StateLayout::kVK; cases.push_back(c); }
  { Case c; c.name = "varlen GVA4 kKV no-h0 cu64"; c.lens = {0, 1, 63, 64, 65, 1000, 0, 130}; c.H = 1; c.HV = 4;
    c.h0 = false; c.cu64 = true; cases.push_back(c); }
  { Case c; c.name = "strong decay GVA2 kVK"; c.B = 2; c.T = 257; c.H = 2; c.HV = 4; c.gmode = 1;
    c.layout = StateLayout::kVK; cases.push_back(c); }
  { Case c; c.name = "g=0 varlen kKV h0"; c.lens = {100, 257, 64}; c.H = 2; c.HV = 2; c.gmode = 2; cases.push_back(c); }
  { Case c; c.name = "fp16 qkv, bf16 g/beta, strided"; c.B = 1; c.T = 333; c.H = 2; c.HV = 4; c.qdt = DType::kFloat16;
    c.gdt = DType::kBFloat16; c.tpad = 16; c.scale = 0.3f; cases.push_back(c); }
  { Case c; c.name = "bf16 fp16-g strided no-h0 kVK"; c.B = 3; c.T = 64; c.H = 1; c.HV = 1; c.gdt = DType::kFloat16;
    c.tpad = 8; c.h0 = false; c.layout = StateLayout::kVK; cases.push_back(c); }
  { Case c; c.name = "long g=0 T2048"; c.B = 1; c.T = 2048; c.H = 1; c.HV = 2; c.gmode = 2; cases.push_back(c); }
  { Case c; c.name = "bench dist T1536 GVA4 (g=0 head 0)"; c.B = 1; c.T = 1536; c.H = 1; c.HV = 4; c.gmode = 3;
    cases.push_back(c); }

  { Case c; c.name = "large v, h0 (fp16 range)"; c.lens = {200, 64, 0, 129}; c.H = 2; c.HV = 4; c.vmag = 1e5f;
    c.hmag = 1e6f; cases.push_back(c); }
  { Case c; c.name = "tiny v, h0"; c.B = 1; c.T = 300; c.H = 1; c.HV = 2; c.vmag = 1e-6f; c.hmag = 1e-6f;
    c.layout = StateLayout::kVK; cases.push_back(c); }
  // Keys and queries far from unit norm (use_qk_l2norm_in_kernel=False): the fused forward's
  // per-chunk power-of-two scales of q, k and Tu.
  { Case c; c.name = "large q, k (|k| 2^10, beta/|k|^2)"; c.lens = {300, 64, 129}; c.H = 1; c.HV = 2; c.qnorm = 1024.f;
    c.knorm = 1024.f; cases.push_back(c); }
  { Case c; c.name = "large q, k fp16 (|k| 2^9)"; c.B = 1; c.T = 257; c.H = 2; c.HV = 2; c.qdt = DType::kFloat16;
    c.qnorm = 512.f; c.knorm = 512.f; c.layout = StateLayout::kVK; cases.push_back(c); }
  { Case c; c.name = "small q, k (|k| 2^-12)"; c.B = 1; c.T = 300; c.H = 1; c.HV = 2; c.qnorm = 1.f / 4096;
    c.knorm = 1.f / 4096; cases.push_back(c); }
  { Case c; c.name = "spread q, k norms (2^+-8)"; c.B = 2; c.T = 200; c.H = 1; c.HV = 2; c.spread = true;
    cases.push_back(c); }
  // Tiny beta (et ~ 23): with no h0, S ~ beta V, which the units window must keep out of fp16's
  // subnormals (chunk_units' wsh; without it o 3.85e-3, state 5.83e-3 on the H200).
  { Case c; c.name = "tiny beta (1e-7), no h0"; c.lens = {300, 64}; c.H = 1; c.HV = 2; c.bmag = 1e-7f; c.h0 = false;
    cases.push_back(c); }
  { Case c; c.name = "tiny beta (1e-7), h0"; c.B = 1; c.T = 257; c.H = 1; c.HV = 2; c.bmag = 1e-7f; c.gmode = 2;
    cases.push_back(c); }
  { Case c; c.name = "300 short seqs, every 9th empty";  // the inverse kernel's sequence search over many sequences
    for (int i = 0; i < 300; ++i) c.lens.push_back(i % 9 == 0 ? 0 : (i * 37) % 200 + 1);
    c.H = 1; c.HV = 2; cases.push_back(c); }

  for (size_t i = 0; i < cases.size(); ++i) ok = run_case(cases[i], 1234 + i, stream, i == 1 || i == 4) && ok;

  if (do_bench && !do_fused)
    for (const Case& c : bench_rows()) bench(c, stream);

#ifdef QLA_SM90_TEST_HOOKS
  if (do_fused) {
    // The fused forward (inverse kernel + fused recurrence) at both V tiles on every case, then
    // the bench rows beside the current path.
    for (int vt : {64, 128}) {
      qla::sm90::set_test_fused(vt);
      std::printf("--- fused forward, V tile %d\n", vt);
      g_max_o = g_max_h = 0;
      for (size_t i = 0; i < cases.size(); ++i) ok = run_case(cases[i], 2468 + i, stream, i == 1 || i == 4) && ok;
      std::printf("fused V tile %d: max o %.2e  max state %.2e\n", vt, g_max_o, g_max_h);
    }
    // The inverse kernel's items forced to a key head's whole group and to pairs of value heads
    // (the automatic choice takes single value heads on these small cases).
    for (int group : {-1, 2}) {
      qla::sm90::set_test_fused(64);
      qla::sm90::set_test_inverse_group(group);
      std::printf("--- fused forward, V tile 64, inverse items of %s value heads\n", group < 0 ? "all of a key head's" : "2");
      g_max_o = g_max_h = 0;
      for (size_t i = 0; i < cases.size(); ++i) ok = run_case(cases[i], 1357 + i, stream, false) && ok;
      std::printf("fused inverse group %d: max o %.2e  max state %.2e\n", group, g_max_o, g_max_h);
      qla::sm90::set_test_inverse_group(0);
    }
    if (do_bench) {
      std::vector<Case> rows = bench_rows();
      std::vector<double> t64(rows.size()), t128(rows.size());
      qla::sm90::set_test_fused(64);
      for (size_t i = 0; i < rows.size(); ++i) t64[i] = bench(rows[i], stream);
      qla::sm90::set_test_fused(128);
      for (size_t i = 0; i < rows.size(); ++i) t128[i] = bench(rows[i], stream);
      std::vector<double> tauto(rows.size());
      qla::sm90::set_test_fused(0);
      for (size_t i = 0; i < rows.size(); ++i) tauto[i] = bench(rows[i], stream);
      qla::sm90::set_test_fused(-1);
      for (size_t i = 0; i < rows.size(); ++i) {
        const double t = bench(rows[i], stream);
        std::printf("bench-fused %-30s V tile 64 %.3f ms  128 %.3f ms  two-pass %.3f ms  dispatched %.3f ms (%.2fx two-pass)\n",
                    rows[i].name.c_str(), t64[i] * 1e3, t128[i] * 1e3, t * 1e3, tauto[i] * 1e3, t / tauto[i]);
      }
    }
    qla::sm90::set_test_fused(0);
  }
  if (do_split) {
    // Sequence splitting forced on (the fused forward at both V tiles), pieces of 1, 3 and 8
    // chunks: the exact path (scan of the transfer maps) wherever the gates do not decay by
    // e^-10 within 8 chunks before every boundary (g = 0, and the benchmark gates with short
    // pieces), the warm-up path elsewhere (strong decay; benchmark gates with 8-chunk pieces).
    std::vector<Case> sc = cases;
    { Case c; c.name = "split: bench dist T4096 GVA4"; c.B = 1; c.T = 4096; c.H = 1; c.HV = 4; c.gmode = 3; sc.push_back(c); }
    { Case c; c.name = "split: strong decay varlen kVK"; c.lens = {3000, 0, 700, 64, 1300}; c.H = 1; c.HV = 2; c.gmode = 1;
      c.layout = StateLayout::kVK; sc.push_back(c); }
    { Case c; c.name = "split: g=0 T4096 no-h0"; c.B = 2; c.T = 4096; c.H = 1; c.HV = 1; c.gmode = 2; c.h0 = false; sc.push_back(c); }
    // V tiles of passes 0 and 1: pass 0 runs the lean kernel at 64, pass 1 at 64 or 128 (the
    // maps hold true units by state column, whatever tile wrote them).
    const int vts[][2] = {{64, 64}, {64, 128}};
    for (const auto& vt : vts) {
      qla::sm90::set_test_fused(vt[0]);
      qla::sm90::set_test_pass1_vt(vt[1]);
      for (int chunks : {1, 3, 8}) {
        g_split = qla::SplitMode::kOn;
        g_split_chunks = chunks;
        std::printf("--- split into pieces of <= %d chunks, V tiles %d / %d\n", chunks, vt[0], vt[1]);
        g_max_o = g_max_h = 0;
        for (size_t i = 0; i < sc.size(); ++i) ok = run_case(sc[i], 3579 + i, stream, i == 1 || i == 4) && ok;
        std::printf("split %d, V tiles %d / %d: max o %.2e  max state %.2e\n", chunks, vt[0], vt[1], g_max_o, g_max_h);
      }
    }
    g_split = qla::SplitMode::kAuto;
    g_split_chunks = 0;
    qla::sm90::set_test_fused(0);
    qla::sm90::set_test_pass1_vt(0);
    {
      // The automatic plan of few-pair varlen calls without host lengths (the dispatch's own
      // choice, refined on the device from the lengths: split-10).
      std::vector<Case> ac;
      { Case c; c.name = "auto: varlen 8000+6000 bench dist"; c.lens = {8000, 6000}; c.H = 1; c.HV = 2; c.gmode = 3; ac.push_back(c); }
      { Case c; c.name = "auto: varlen 9000+300 g=0"; c.lens = {9000, 300}; c.H = 1; c.HV = 1; c.gmode = 2; ac.push_back(c); }
      { Case c; c.name = "auto: varlen 7000+0+7000 strong decay kVK"; c.lens = {7000, 0, 7000}; c.H = 1; c.HV = 2; c.gmode = 1;
        c.layout = StateLayout::kVK; ac.push_back(c); }
      g_max_o = g_max_h = 0;
      for (size_t i = 0; i < ac.size(); ++i) ok = run_case(ac[i], 4680 + i, stream, i == 0) && ok;
      std::printf("auto split, device-only lengths: max o %.2e  max state %.2e\n", g_max_o, g_max_h);
    }
    if (do_bench) {
      // Few-pair rows: the two-pass forward, the fused one unsplit, split automatically, and
      // split into pieces of 4 to 128 chunks (the cost model's calibration, also below 128
      // chunks, where the dispatch keeps the two-pass forward).
      std::vector<Case> rows;
      auto row = [&](const char* name, int64_t B, int64_t T, int64_t H, int64_t HV, bool all_decay) {
        Case c; c.name = name; c.B = B; c.T = T; c.H = H; c.HV = HV; c.bench_all_decay = all_decay; rows.push_back(c);
      };
      row("2/8 1x32768", 1, 32768, 2, 8, false);
      row("2/8 1x32768 all decay", 1, 32768, 2, 8, true);
      row("2/8 1x8192", 1, 8192, 2, 8, false);
      row("2/8 1x4096", 1, 4096, 2, 8, false);
      row("16/16 1x32768", 1, 32768, 16, 16, false);
      row("16/16 1x32768 all decay", 1, 32768, 16, 16, true);
      row("8/32 1x32768", 1, 32768, 8, 32, false);
      row("16/32 1x32768", 1, 32768, 16, 32, false);
      row("4/16 4096x2", 2, 4096, 4, 16, false);
      row("2/8 1x2048", 1, 2048, 2, 8, false);
      row("16/32 1x2048", 1, 2048, 16, 32, false);
      row("8/24 1x4096", 1, 4096, 8, 24, false);
      row("16/16 1x8192", 1, 8192, 16, 16, false);
      g_bench_lean = true;
      for (const Case& c : rows) {
        qla::sm90::set_test_fused(-1);
        const double t2 = bench(c, stream);
        qla::sm90::set_test_fused(64);
        g_split = qla::SplitMode::kOff;
        const double toff = bench(c, stream);
        g_split = qla::SplitMode::kAuto;
        const double tauto = bench(c, stream);
        // Times with pieces of at most 4 .. 128 chunks (split forced on), as " len: ms" pairs.
        auto forced_pieces = [&]() {
          std::string out;
          g_split = qla::SplitMode::kOn;
          for (int len : {4, 8, 16, 32, 64, 128}) {
            g_split_chunks = len;
            char buf[32];
            std::snprintf(buf, sizeof buf, " %d: %.3f", len, bench(c, stream) * 1e3);
            out += buf;
          }
          g_split = qla::SplitMode::kAuto;
          g_split_chunks = 0;
          return out;
        };
        // The forced pieces with pass 1 at V tile 64, then at 128 (half its CTAs, a longer
        // step); pass 0 runs the lean kernel at 64 (the model's kStep128Scale and kLeanStepScale).
        qla::sm90::set_test_pass1_vt(64);
        const std::string forced = forced_pieces();
        qla::sm90::set_test_pass1_vt(128);
        const std::string alt = forced_pieces();
        qla::sm90::set_test_pass1_vt(0);
        std::printf("bench-split %-24s two-pass %.3f  fused %.3f  auto %.3f  | pieces%s ms\n", c.name.c_str(), t2 * 1e3,
                    toff * 1e3, tauto * 1e3, forced.c_str());
        std::printf("bench-split-vt %-21s V tiles  64 / 128 | pieces%s ms\n", c.name.c_str(), alt.c_str());
      }
      g_bench_lean = false;
      qla::sm90::set_test_fused(0);
    }
  }
  if (do_short) {
    // The grid's few-pair short rows (under 128 chunks, around the dispatch's pair threshold
    // between the fused and the two-pass forward): the fused forward at V tile 64 in stream
    // order and beside the inverse kernel, the two-pass forward, and the dispatched one.
    std::vector<Case> rows;
    auto row = [&](const char* name, int64_t H, int64_t HV, std::vector<int64_t> lens) {
      Case c; c.name = name; c.B = 1; c.H = H; c.HV = HV; c.lens = lens;
      // Varlen with the host lengths, as the grid passes them (QLA_TEST_NO_HOST_LENS: without,
      // as a caller with device-only cu_seqlens).
      c.host_lens = lens.size() > 1 && !std::getenv("QLA_TEST_NO_HOST_LENS");
      c.T = 0;
      for (int64_t l : lens) c.T += l;
      rows.push_back(c);
    };
    row("2/8 1x2048", 2, 8, {2048});
    row("2/8 1x4096", 2, 8, {4096});
    row("2/8 4096+4096", 2, 8, {4096, 4096});
    row("2/8 1024+7168", 2, 8, {1024, 7168});
    row("2/8 6144+2048", 2, 8, {6144, 2048});
    row("4/16 1x2048", 4, 16, {2048});
    row("4/16 1x4096", 4, 16, {4096});
    row("16/16 1x2048", 16, 16, {2048});
    row("16/16 1x4096", 16, 16, {4096});
    row("8/24 1x2048", 8, 24, {2048});
    row("8/24 1x4096", 8, 24, {4096});
    row("8/32 1x2048", 8, 32, {2048});
    // and the rows of 32-chunk or shorter sequences with more pairs, where the inverse kernel
    // and the launches are a larger share
    row("16/32 1x2048", 16, 32, {2048});
    row("32/32 1x2048", 32, 32, {2048});
    row("2/8 1024x8", 2, 8, std::vector<int64_t>(8, 1024));
    row("2/8 2048x4", 2, 8, std::vector<int64_t>(4, 2048));
    row("4/16 1024x8", 4, 16, std::vector<int64_t>(8, 1024));
    row("16/16 1024x8", 16, 16, std::vector<int64_t>(8, 1024));
    row("16/16 2048x4", 16, 16, std::vector<int64_t>(4, 2048));
    row("32/32 1024x8", 32, 32, std::vector<int64_t>(8, 1024));
    row("32/32 2048x4", 32, 32, std::vector<int64_t>(4, 2048));
    g_bench_lean = true;
    for (const Case& c : rows) {
      double t[4];
      qla::sm90::set_test_fused(64);
      qla::sm90::set_test_fused_overlap(0);
      t[0] = bench(c, stream);
      qla::sm90::set_test_fused_overlap(1);
      t[1] = bench(c, stream);
      qla::sm90::set_test_fused_overlap(0);
      qla::sm90::set_test_fused(-1);
      t[2] = bench(c, stream);
      qla::sm90::set_test_fused(0);
      t[3] = bench(c, stream);
      // and split (forced) into pieces of 4 and of 8 chunks, pass 1's tile by the plan
      double ts[2];
      qla::sm90::set_test_fused(64);
      g_split = qla::SplitMode::kOn;
      for (int i = 0; i < 2; ++i) {
        g_split_chunks = 4 << i;
        ts[i] = bench(c, stream);
      }
      g_split = qla::SplitMode::kAuto;
      g_split_chunks = 0;
      qla::sm90::set_test_fused(0);
      std::printf("bench-short %-16s fused %.3f ms  fused beside K1 %.3f ms  two-pass %.3f ms  dispatched %.3f ms"
                  "  pieces of 4 / 8 chunks %.3f / %.3f ms\n",
                  c.name.c_str(), t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3, ts[0] * 1e3, ts[1] * 1e3);
    }
    g_bench_lean = false;
  }
  if (do_fused_skip) {
    // Which of a chunk's bytes set the fused recurrence's step when every SM is busy: the
    // forward timed with K and Q's loads (1), V's (2), the regions' (4) or o's stores (8) left
    // out (results wrong), on rows that fill the GPU and on one that leaves most SMs idle.
    const std::vector<Case> rows = bench_rows();
    const int bits[] = {0, 1, 2, 4, 8, 15};
    g_bench_lean = true;
    for (int r : {3, 1, 0, 5}) {
      for (int vt : {0, 64}) {
        qla::sm90::set_test_fused(vt);
        std::string line;
        for (int b : bits) {
          qla::sm90::set_test_fused_skip(b);
          char buf[48];
          std::snprintf(buf, sizeof buf, "  skip %2d: %.3f", b, bench(rows[r], stream) * 1e3);
          line += buf;
        }
        std::printf("bench-fused-skip %-30s %s%s ms\n", rows[r].name.c_str(), vt ? "V tile 64 " : "dispatched", line.c_str());
      }
    }
    qla::sm90::set_test_fused_skip(0);
    qla::sm90::set_test_fused(0);
    g_bench_lean = false;
  }
  if (do_inverse) {
    for (size_t i = 0; i < cases.size(); ++i) ok = check_inverse(cases[i], 4321 + i, stream) && ok;
    if (do_inverse_bench)
      for (const Case& c : bench_rows()) bench_inverse(c, stream);
  }
#else
  if (do_inverse) std::printf("--inverse(-bench) needs a build with -DQLA_SM90_TEST_HOOKS\n");
#endif
  CK(cudaStreamDestroy(stream));
  std::printf("%s\n", ok ? "ALL PASSED" : "SOME CASES FAILED");
  return ok ? 0 : 1;
}
