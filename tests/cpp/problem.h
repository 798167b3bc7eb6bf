// Test helpers: random GDN problems, an independent fp64 reference of the recurrence,
// and the glue that turns a problem into qla params in any input dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "qla/qla.h"

namespace qla_test {

struct Problem {
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 8, V = 8;
  std::vector<int64_t> cu;  // empty: no varlen
  bool has_h0 = true;
  double scale = 0.3;
  // fp64 master copies, dense [B,T,H,K] etc.
  std::vector<double> q, k, v, g, beta, h0;  // h0: [N,HV,K,V]
  int64_t N() const { return cu.empty() ? B : static_cast<int64_t>(cu.size()) - 1; }
};

enum class Gate { kMild, kStrong, kZero };
enum class Beta { kRandom, kZero, kOne };

inline Problem make_problem(uint32_t seed, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                            std::vector<int64_t> cu = {}, Gate gate = Gate::kMild, Beta beta = Beta::kRandom,
                            bool has_h0 = true) {
  Problem p;
  p.B = B, p.T = T, p.H = H, p.HV = HV, p.K = K, p.V = V, p.cu = std::move(cu), p.has_h0 = has_h0;
  p.scale = 1.0 / std::sqrt(static_cast<double>(K));
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  auto fill = [&](std::vector<double>& x, size_t n) {
    x.resize(n);
    for (auto& e : x) e = normal(rng);
  };
  fill(p.q, B * T * H * K);
  fill(p.k, B * T * H * K);
  for (int64_t r = 0; r < B * T * H; ++r) {  // l2-normalised keys keep the recurrence contractive
    double n2 = 0;
    for (int64_t i = 0; i < K; ++i) n2 += p.k[r * K + i] * p.k[r * K + i];
    for (int64_t i = 0; i < K; ++i) p.k[r * K + i] /= std::sqrt(n2);
  }
  fill(p.v, B * T * HV * V);
  p.g.resize(B * T * HV);
  p.beta.resize(B * T * HV);
  for (auto& e : p.g) {
    const double x = normal(rng);
    const double logsig = -std::log1p(std::exp(-x));
    e = gate == Gate::kZero ? 0.0 : gate == Gate::kStrong ? -5.0 + 0.5 * x : logsig / 16.0;
  }
  for (auto& e : p.beta) e = beta == Beta::kZero ? 0.0 : beta == Beta::kOne ? 1.0 : unif(rng);
  fill(p.h0, p.N() * HV * K * V);
  return p;
}

// Independent fp64 reference: the definition, token by token, on full matrices.
// o: [B,T,HV,V]; ht: [N,HV,K,V].
inline void reference_forward(const Problem& p, std::vector<double>& o, std::vector<double>& ht) {
  const int64_t N = p.N(), K = p.K, V = p.V, G = p.HV / p.H;
  o.assign(p.B * p.T * p.HV * V, 0.0);
  ht.assign(N * p.HV * K * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = p.cu.empty() ? n : 0;
    const int64_t t0 = p.cu.empty() ? 0 : p.cu[n], t1 = p.cu.empty() ? p.T : p.cu[n + 1];
    for (int64_t hv = 0; hv < p.HV; ++hv) {
      const int64_t h = hv / G;
      std::vector<double> S(K * V, 0.0);
      if (p.has_h0) std::memcpy(S.data(), &p.h0[(n * p.HV + hv) * K * V], K * V * sizeof(double));
      for (int64_t t = t0; t < t1; ++t) {
        const double* q = &p.q[((b * p.T + t) * p.H + h) * K];
        const double* k = &p.k[((b * p.T + t) * p.H + h) * K];
        const double* v = &p.v[((b * p.T + t) * p.HV + hv) * V];
        const double a = std::exp(p.g[(b * p.T + t) * p.HV + hv]);
        const double bt = p.beta[(b * p.T + t) * p.HV + hv];
        for (auto& s : S) s *= a;
        for (int64_t j = 0; j < V; ++j) {
          double ks = 0;
          for (int64_t i = 0; i < K; ++i) ks += S[i * V + j] * k[i];
          const double u = bt * (v[j] - ks);
          for (int64_t i = 0; i < K; ++i) S[i * V + j] += k[i] * u;
        }
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += S[i * V + j] * q[i];
          o[((b * p.T + t) * p.HV + hv) * V + j] = p.scale * acc;
        }
      }
      std::memcpy(&ht[(n * p.HV + hv) * K * V], S.data(), K * V * sizeof(double));
    }
  }
}

// Storage of a problem's tensors in one dtype, plus the qla params pointing at it.
struct Buffers {
  qla::DType dtype;
  std::vector<uint8_t> q, k, v, g, beta, h0, o, ht, cu;

  static size_t elem_size(qla::DType d) {
    return d == qla::DType::kFloat64 ? 8 : d == qla::DType::kFloat32 ? 4 : 2;
  }
};

inline uint16_t to_half_bits(double x, qla::DType d);  // defined below

inline void encode(const std::vector<double>& src, qla::DType d, std::vector<uint8_t>& dst) {
  dst.resize(src.size() * Buffers::elem_size(d));
  for (size_t i = 0; i < src.size(); ++i) {
    if (d == qla::DType::kFloat64) {
      std::memcpy(&dst[i * 8], &src[i], 8);
    } else if (d == qla::DType::kFloat32) {
      const float f = static_cast<float>(src[i]);
      std::memcpy(&dst[i * 4], &f, 4);
    } else {
      const uint16_t h = to_half_bits(src[i], d);
      std::memcpy(&dst[i * 2], &h, 2);
    }
  }
}

// Round-to-nearest conversions for test inputs (independent of the library's).
inline uint16_t to_half_bits(double x, qla::DType d) {
  const float f = static_cast<float>(x);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (d == qla::DType::kBFloat16) {
    const uint32_t lsb = (bits >> 16) & 1u;
    return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
  }
  // fp16 via frexp (test inputs are far below the fp16 maximum).
  const uint16_t sgn = x < 0 ? 0x8000u : 0;
  if (std::fabs(x) < std::ldexp(1.0, -14))  // subnormal: multiples of 2^-24
    return sgn | static_cast<uint16_t>(std::nearbyint(std::fabs(x) * std::ldexp(1.0, 24)));
  int e;
  const double m = std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  const uint16_t sign = x < 0 ? 0x8000u : 0;
  const int exp16 = e - 1 + 15;
  double mant = (m * 2.0 - 1.0) * 1024.0;
  double r = std::nearbyint(mant);
  int ex = exp16;
  if (r >= 1024.0) {
    r = 0;
    ++ex;
  }
  return sign | static_cast<uint16_t>(ex << 10) | static_cast<uint16_t>(r);
}

inline double decode(const std::vector<uint8_t>& src, qla::DType d, size_t i) {
  if (d == qla::DType::kFloat64) {
    double x;
    std::memcpy(&x, &src[i * 8], 8);
    return x;
  }
  if (d == qla::DType::kFloat32) {
    float x;
    std::memcpy(&x, &src[i * 4], 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, &src[i * 2], 2);
  if (d == qla::DType::kBFloat16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  }
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0) return s * std::ldexp(mant, -24);
  if (exp == 31) return mant ? NAN : s * INFINITY;
  return s * std::ldexp(1024 + mant, exp - 25);
}

inline double rel_l2(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

// Rounds a problem's inputs to `d` in place, so the fp64 reference sees what the kernel sees.
inline void round_inputs(Problem& p, qla::DType d) {
  std::vector<uint8_t> tmp;
  for (auto* x : {&p.q, &p.k, &p.v}) {
    encode(*x, d, tmp);
    for (size_t i = 0; i < x->size(); ++i) (*x)[i] = decode(tmp, d, i);
  }
  if (d != qla::DType::kFloat64) {  // g, beta, h0 travel as fp32
    for (auto* x : {&p.g, &p.beta, &p.h0})
      for (auto& e : *x) e = static_cast<float>(e);
  }
}

// Builds forward params over contiguous buffers of dtype `d` (g, beta, states: fp32, or fp64 for fp64).
inline qla::GdnForwardParams forward_params(const Problem& p, qla::DType d, Buffers& buf, bool want_final = true,
                                            qla::StateLayout layout = qla::StateLayout::kKV) {
  const qla::DType side = d == qla::DType::kFloat64 ? qla::DType::kFloat64 : qla::DType::kFloat32;
  buf.dtype = d;
  encode(p.q, d, buf.q);
  encode(p.k, d, buf.k);
  encode(p.v, d, buf.v);
  encode(p.g, side, buf.g);
  encode(p.beta, side, buf.beta);
  std::vector<double> h0 = p.h0;
  if (layout == qla::StateLayout::kVK) {  // transpose each K x V matrix to V x K
    for (int64_t m = 0; m < p.N() * p.HV; ++m)
      for (int64_t i = 0; i < p.K; ++i)
        for (int64_t j = 0; j < p.V; ++j) h0[m * p.K * p.V + j * p.K + i] = p.h0[m * p.K * p.V + i * p.V + j];
  }
  encode(h0, side, buf.h0);
  buf.o.assign(p.B * p.T * p.HV * p.V * Buffers::elem_size(d), 0xff);  // poison: NaN in every dtype
  buf.ht.assign(p.N() * p.HV * p.K * p.V * Buffers::elem_size(side), 0xff);
  buf.cu.resize(p.cu.size() * 8);
  if (!p.cu.empty()) std::memcpy(buf.cu.data(), p.cu.data(), p.cu.size() * 8);

  qla::GdnForwardParams f;
  f.shape = {p.B, p.T, p.H, p.HV, p.K, p.V};
  f.q = {buf.q.data(), d, {p.T * p.H * p.K, p.H * p.K, p.K}};
  f.k = {buf.k.data(), d, {p.T * p.H * p.K, p.H * p.K, p.K}};
  f.v = {buf.v.data(), d, {p.T * p.HV * p.V, p.HV * p.V, p.V}};
  f.g = {buf.g.data(), side, {p.T * p.HV, p.HV, 0}};
  f.beta = {buf.beta.data(), side, {p.T * p.HV, p.HV, 0}};
  const int64_t row = layout == qla::StateLayout::kKV ? p.V : p.K;
  if (p.has_h0) f.initial_state = {buf.h0.data(), side, {p.HV * p.K * p.V, p.K * p.V, row}};
  if (!p.cu.empty()) {
    f.cu_seqlens = {buf.cu.data(), qla::DType::kInt64, {1, 0, 0}};
    f.num_seqs = p.N();
  }
  f.o = {buf.o.data(), d, {p.T * p.HV * p.V, p.HV * p.V, p.V}};
  if (want_final) f.final_state = {buf.ht.data(), side, {p.HV * p.K * p.V, p.K * p.V, row}};
  f.scale = p.scale;
  f.state_layout = layout;
  f.device = qla::Device::kCpu;
  return f;
}

// Gradients of a problem's inputs (dq, dk as [B,T,H,K]; dh0 in K x V layout).
struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

// The library backward with do = W, dht = Wh, in dtype d (K x V state layout unless given).
inline Grads backward(const Problem& p, const std::vector<double>& W, const std::vector<double>& Wh, qla::DType d,
                      qla::StateLayout layout = qla::StateLayout::kKV) {
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, d, buf, false, layout);
  const qla::DType side = d == qla::DType::kFloat64 ? qla::DType::kFloat64 : qla::DType::kFloat32;
  std::vector<double> wh = Wh;
  if (layout == qla::StateLayout::kVK)
    for (int64_t m = 0; m < p.N() * p.HV; ++m)
      for (int64_t i = 0; i < p.K; ++i)
        for (int64_t j = 0; j < p.V; ++j) wh[m * p.K * p.V + j * p.K + i] = Wh[m * p.K * p.V + i * p.V + j];
  std::vector<uint8_t> d_o, dht, dq, dk, dv, dg, dbeta, dh0;
  encode(W, d, d_o);
  encode(wh, side, dht);
  const size_t es = Buffers::elem_size(d), ss = Buffers::elem_size(side);
  dq.assign(p.q.size() * es, 0xff);
  dk.assign(p.k.size() * es, 0xff);
  dv.assign(p.v.size() * es, 0xff);
  dg.assign(p.g.size() * ss, 0xff);
  dbeta.assign(p.beta.size() * ss, 0xff);
  dh0.assign(p.h0.size() * ss, 0xff);

  qla::GdnBackwardParams b;
  b.shape = f.shape;
  b.q = f.q, b.k = f.k, b.v = f.v, b.g = f.g, b.beta = f.beta;
  b.initial_state = f.initial_state;
  b.cu_seqlens = f.cu_seqlens;
  b.num_seqs = f.num_seqs;
  b.d_o = {d_o.data(), d, {f.v.stride[0], f.v.stride[1], f.v.stride[2]}};
  const int64_t row = layout == qla::StateLayout::kKV ? p.V : p.K;
  b.d_final_state = {dht.data(), side, {p.HV * p.K * p.V, p.K * p.V, row}};
  b.dq = {dq.data(), d, {f.q.stride[0], f.q.stride[1], f.q.stride[2]}};
  b.dk = {dk.data(), d, {f.k.stride[0], f.k.stride[1], f.k.stride[2]}};
  b.dv = {dv.data(), d, {f.v.stride[0], f.v.stride[1], f.v.stride[2]}};
  b.dg = {dg.data(), side, {f.g.stride[0], f.g.stride[1], 0}};
  b.dbeta = {dbeta.data(), side, {f.beta.stride[0], f.beta.stride[1], 0}};
  b.d_initial_state = {dh0.data(), side, {p.HV * p.K * p.V, p.K * p.V, row}};
  b.scale = f.scale;
  b.state_layout = layout;
  b.num_threads = 2;
  qla::Status s = qla::gdn_backward(b);
  EXPECT_TRUE(s.ok()) << s.message();

  Grads out;
  auto dec = [](const std::vector<uint8_t>& x, qla::DType dt, size_t n, std::vector<double>& o) {
    o.resize(n);
    for (size_t i = 0; i < n; ++i) o[i] = decode(x, dt, i);
  };
  dec(dq, d, p.q.size(), out.dq);
  dec(dk, d, p.k.size(), out.dk);
  dec(dv, d, p.v.size(), out.dv);
  dec(dg, side, p.g.size(), out.dg);
  dec(dbeta, side, p.beta.size(), out.dbeta);
  std::vector<double> h;
  dec(dh0, side, p.h0.size(), h);
  out.dh0 = h;
  if (layout == qla::StateLayout::kVK)
    for (int64_t m = 0; m < p.N() * p.HV; ++m)
      for (int64_t i = 0; i < p.K; ++i)
        for (int64_t j = 0; j < p.V; ++j) out.dh0[m * p.K * p.V + i * p.V + j] = h[m * p.K * p.V + j * p.K + i];
  return out;
}

// n standard normal values (weights of a test loss).
inline std::vector<double> randn(uint32_t seed, size_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

}  // namespace qla_test
