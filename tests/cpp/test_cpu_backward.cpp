// CPU backward against central finite differences of the fp64 forward.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "problem.h"

using namespace qla_test;

namespace {

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

// Loss L = <o, W> + <ht, Wh>, through the library forward in fp64.
double loss(const Problem& p, const std::vector<double>& W, const std::vector<double>& Wh) {
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat64, buf);
  qla::Status s = qla::gdn_forward(f);
  EXPECT_TRUE(s.ok()) << s.message();
  double L = 0;
  for (size_t i = 0; i < W.size(); ++i) L += decode(buf.o, qla::DType::kFloat64, i) * W[i];
  for (size_t i = 0; i < Wh.size(); ++i) L += decode(buf.ht, qla::DType::kFloat64, i) * Wh[i];
  return L;
}

// The library backward with do = W, dht = Wh, in dtype d (K x V state layout unless given).
Grads backward(const Problem& p, const std::vector<double>& W, const std::vector<double>& Wh, qla::DType d,
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

// Central differences of loss() over every element of one input.
std::vector<double> numeric(Problem p, std::vector<double> Problem::*field, const std::vector<double>& W,
                            const std::vector<double>& Wh) {
  const double eps = 1e-6;
  std::vector<double> grad((p.*field).size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const double x = (p.*field)[i];
    (p.*field)[i] = x + eps;
    const double lp = loss(p, W, Wh);
    (p.*field)[i] = x - eps;
    const double lm = loss(p, W, Wh);
    (p.*field)[i] = x;
    grad[i] = (lp - lm) / (2 * eps);
  }
  return grad;
}

std::vector<double> randn(uint32_t seed, size_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

void check_against_numeric(const Problem& p, uint32_t seed, const char* name) {
  const auto W = randn(seed, p.B * p.T * p.HV * p.V);
  const auto Wh = randn(seed + 1, p.N() * p.HV * p.K * p.V);
  const Grads a = backward(p, W, Wh, qla::DType::kFloat64);
  const double tol = 1e-6;
  EXPECT_LT(rel_l2(a.dq, numeric(p, &Problem::q, W, Wh)), tol) << name << " dq";
  EXPECT_LT(rel_l2(a.dk, numeric(p, &Problem::k, W, Wh)), tol) << name << " dk";
  EXPECT_LT(rel_l2(a.dv, numeric(p, &Problem::v, W, Wh)), tol) << name << " dv";
  EXPECT_LT(rel_l2(a.dg, numeric(p, &Problem::g, W, Wh)), tol) << name << " dg";
  EXPECT_LT(rel_l2(a.dbeta, numeric(p, &Problem::beta, W, Wh)), tol) << name << " dbeta";
  EXPECT_LT(rel_l2(a.dh0, numeric(p, &Problem::h0, W, Wh)), tol) << name << " dh0";
}

}  // namespace

TEST(CpuBackward, FiniteDifferencesBasic) { check_against_numeric(make_problem(1, 2, 7, 1, 1, 4, 3), 11, "basic"); }

TEST(CpuBackward, FiniteDifferencesGva) {
  check_against_numeric(make_problem(2, 1, 6, 2, 4, 4, 3), 12, "gva2");
  check_against_numeric(make_problem(3, 1, 5, 1, 4, 3, 2), 13, "gva4");
}

// Longer than one checkpoint block (64 tokens): exercises recomputation across blocks.
TEST(CpuBackward, FiniteDifferencesAcrossCheckpointBlocks) {
  check_against_numeric(make_problem(4, 1, 131, 1, 1, 2, 2), 14, "blocks");
}

TEST(CpuBackward, FiniteDifferencesVarlenWithEmptySequences) {
  check_against_numeric(make_problem(5, 1, 9, 1, 2, 3, 2, {0, 0, 4, 4, 9}), 15, "varlen");
}

TEST(CpuBackward, FiniteDifferencesStrongDecayAndGateZero) {
  check_against_numeric(make_problem(6, 1, 8, 1, 1, 3, 3, {}, Gate::kStrong), 16, "strong");
  check_against_numeric(make_problem(7, 1, 8, 1, 1, 3, 3, {}, Gate::kZero), 17, "gzero");
  check_against_numeric(make_problem(8, 1, 8, 1, 1, 3, 3, {}, Gate::kMild, Beta::kZero), 18, "beta0");
}

TEST(CpuBackward, StateVFirstEqualsTranspose) {
  const Problem p = make_problem(9, 1, 20, 1, 2, 4, 3);
  const auto W = randn(19, p.B * p.T * p.HV * p.V);
  const auto Wh = randn(20, p.N() * p.HV * p.K * p.V);
  const Grads a = backward(p, W, Wh, qla::DType::kFloat64, qla::StateLayout::kKV);
  const Grads b = backward(p, W, Wh, qla::DType::kFloat64, qla::StateLayout::kVK);
  EXPECT_LT(rel_l2(b.dq, a.dq), 1e-13);
  EXPECT_LT(rel_l2(b.dg, a.dg), 1e-13);
  EXPECT_LT(rel_l2(b.dh0, a.dh0), 1e-13);
}

// fp32 accumulation tracks the fp64 backward on a longer sequence of realistic size.
TEST(CpuBackward, Float32TracksFloat64) {
  Problem p = make_problem(10, 1, 200, 2, 4, 32, 32);
  round_inputs(p, qla::DType::kFloat32);
  const auto W = randn(21, p.B * p.T * p.HV * p.V);
  const auto Wh = randn(22, p.N() * p.HV * p.K * p.V);
  const Grads r = backward(p, W, Wh, qla::DType::kFloat64);
  const Grads a = backward(p, W, Wh, qla::DType::kFloat32);
  for (auto [x, y, n] : {std::tuple{&a.dq, &r.dq, "dq"}, {&a.dk, &r.dk, "dk"}, {&a.dv, &r.dv, "dv"},
                         {&a.dg, &r.dg, "dg"}, {&a.dbeta, &r.dbeta, "dbeta"}, {&a.dh0, &r.dh0, "dh0"}}) {
    for (double e : *x) ASSERT_FALSE(std::isnan(e)) << n << " has NaN or unwritten elements";
    EXPECT_LT(rel_l2(*x, *y), 1e-5) << n;
  }
}
