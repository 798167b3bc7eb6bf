// CPU backward against central finite differences of the fp64 forward.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "problem.h"

using namespace qla_test;

namespace {

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
