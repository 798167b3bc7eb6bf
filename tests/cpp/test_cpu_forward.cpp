// CPU forward against the independent fp64 reference in problem.h.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "problem.h"

using namespace qla_test;

namespace {

struct Case {
  std::string name;
  int64_t B, T, H, HV, K, V;
  std::vector<int64_t> cu;
  Gate gate = Gate::kMild;
  Beta beta = Beta::kRandom;
  bool has_h0 = true;
};

// Runs one case in one dtype; checks every output element was written and the error.
void run_case(const Case& c, qla::DType d, qla::StateLayout layout, double tol, uint32_t seed) {
  Problem p = make_problem(seed, c.B, c.T, c.H, c.HV, c.K, c.V, c.cu, c.gate, c.beta, c.has_h0);
  round_inputs(p, d);
  std::vector<double> ro, rht;
  reference_forward(p, ro, rht);

  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, d, buf, true, layout);
  f.num_threads = 3;
  qla::Status s = qla::gdn_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();

  std::vector<double> o(ro.size()), ht(rht.size());
  for (size_t i = 0; i < o.size(); ++i) {
    o[i] = decode(buf.o, d, i);
    ASSERT_FALSE(std::isnan(o[i])) << c.name << ": o[" << i << "] not written or NaN";
  }
  const qla::DType side = d == qla::DType::kFloat64 ? qla::DType::kFloat64 : qla::DType::kFloat32;
  for (int64_t m = 0; m < p.N() * p.HV; ++m)
    for (int64_t i = 0; i < p.K; ++i)
      for (int64_t j = 0; j < p.V; ++j) {
        const size_t src = layout == qla::StateLayout::kKV ? m * p.K * p.V + i * p.V + j : m * p.K * p.V + j * p.K + i;
        const double x = decode(buf.ht, side, src);
        ASSERT_FALSE(std::isnan(x)) << c.name << ": final state not written";
        ht[m * p.K * p.V + i * p.V + j] = x;
      }
  EXPECT_LT(rel_l2(o, ro), tol) << c.name << " o, dtype " << qla::dtype_name(d);
  EXPECT_LT(rel_l2(ht, rht), tol) << c.name << " final state, dtype " << qla::dtype_name(d);
}

std::vector<Case> cases() {
  return {
      {"T1", 2, 1, 1, 1, 16, 8, {}},
      {"T_not_multiple_of_64", 2, 150, 2, 2, 16, 16, {}},
      {"gva2", 1, 80, 2, 4, 8, 12, {}},
      {"gva4", 1, 70, 1, 4, 12, 8, {}},
      {"varlen_zero_lengths", 1, 140, 2, 4, 8, 8, {0, 0, 1, 64, 64, 140, 140}},
      {"no_initial_state", 2, 65, 1, 2, 8, 8, {}, Gate::kMild, Beta::kRandom, false},
      {"strong_decay", 1, 100, 1, 2, 16, 8, {}, Gate::kStrong},
      {"g_zero", 1, 100, 1, 2, 16, 8, {}, Gate::kZero},
      {"beta_zero", 1, 40, 1, 1, 8, 8, {}, Gate::kMild, Beta::kZero},
      {"beta_one", 1, 40, 1, 1, 8, 8, {}, Gate::kMild, Beta::kOne},
      {"head_dim_256", 1, 9, 1, 1, 256, 256, {}},
  };
}

}  // namespace

TEST(CpuForward, Float64MatchesReference) {
  uint32_t seed = 100;
  for (const auto& c : cases()) run_case(c, qla::DType::kFloat64, qla::StateLayout::kKV, 1e-12, seed++);
}

TEST(CpuForward, Float32MatchesReference) {
  uint32_t seed = 200;
  for (const auto& c : cases()) run_case(c, qla::DType::kFloat32, qla::StateLayout::kKV, 1e-5, seed++);
}

// 16-bit inputs: the reference sees the same rounded inputs, so the error is the output
// rounding alone (bf16 has 8 mantissa bits: ~2e-3 relative per element).
TEST(CpuForward, BFloat16MatchesReference) {
  uint32_t seed = 300;
  for (const auto& c : cases()) run_case(c, qla::DType::kBFloat16, qla::StateLayout::kKV, 4e-3, seed++);
}

TEST(CpuForward, Float16MatchesReference) {
  uint32_t seed = 400;
  for (const auto& c : cases()) run_case(c, qla::DType::kFloat16, qla::StateLayout::kKV, 5e-4, seed++);
}

TEST(CpuForward, StateVFirstLayout) {
  uint32_t seed = 500;
  for (const auto& c : cases()) run_case(c, qla::DType::kFloat64, qla::StateLayout::kVK, 1e-12, seed++);
}

TEST(CpuForward, DoesNotModifyInputs) {
  Problem p = make_problem(7, 1, 50, 2, 4, 8, 8);
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  const Buffers before = buf;
  ASSERT_TRUE(qla::gdn_forward(f).ok());
  EXPECT_EQ(before.q, buf.q);
  EXPECT_EQ(before.k, buf.k);
  EXPECT_EQ(before.v, buf.v);
  EXPECT_EQ(before.g, buf.g);
  EXPECT_EQ(before.beta, buf.beta);
  EXPECT_EQ(before.h0, buf.h0);
}

TEST(CpuForward, ThreadCountDoesNotChangeResult) {
  Problem p = make_problem(8, 2, 90, 2, 4, 8, 8);
  Buffers b1, b2;
  qla::GdnForwardParams f1 = forward_params(p, qla::DType::kFloat32, b1);
  qla::GdnForwardParams f2 = forward_params(p, qla::DType::kFloat32, b2);
  f1.num_threads = 1;
  f2.num_threads = 5;
  ASSERT_TRUE(qla::gdn_forward(f1).ok());
  ASSERT_TRUE(qla::gdn_forward(f2).ok());
  EXPECT_EQ(b1.o, b2.o);
  EXPECT_EQ(b1.ht, b2.ht);
}

// A state pool read and written in place through slot indices (fp64): o and every written slot
// against the reference run on the gathered states, the other slots untouched, and the errors.
// An engine's bf16 / fp16 state cache: the call equals the one on an fp32 copy of the pool (every
// 16-bit value is exact in fp32 and the arithmetic is the same), the written slots rounded to
// nearest, bit for bit; the other slots keep their bits.
TEST(CpuForward, SixteenBitStatePool) {
  for (qla::DType sd : {qla::DType::kBFloat16, qla::DType::kFloat16}) {
    Problem p = make_problem(78, 1, 150, 2, 4, 8, 8, {0, 40, 40, 150});
    const int64_t S = 5, M = p.HV * p.K * p.V;
    const int32_t reads[3] = {4, -1, 1}, writes[3] = {4, 0, 2};
    std::vector<double> vals(S * M), exact(S * M);
    std::mt19937 rng(7);
    std::normal_distribution<double> normal;
    for (auto& x : vals) x = 4 * normal(rng);
    std::vector<uint8_t> pool16, pool32;
    encode(vals, sd, pool16);  // rounded to 16 bits
    for (size_t i = 0; i < exact.size(); ++i) exact[i] = decode(pool16, sd, i);
    encode(exact, qla::DType::kFloat32, pool32);  // the same values in fp32
    std::vector<double> o[2];
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<uint8_t>& pool = pass ? pool32 : pool16;
      const qla::DType dt = pass ? qla::DType::kFloat32 : sd;
      Buffers buf;
      qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf, false);
      f.initial_state = {pool.data(), dt, {M, p.K * p.V, p.V}};
      f.final_state = {pool.data(), dt, {M, p.K * p.V, p.V}};
      f.initial_state_indices = {reads, qla::DType::kInt32, {1, 0, 0}};
      f.final_state_indices = {writes, qla::DType::kInt32, {1, 0, 0}};
      f.initial_state_slots = f.final_state_slots = S;
      const qla::Status s = qla::gdn_forward(f);
      ASSERT_TRUE(s.ok()) << s.message();
      o[pass].resize(p.B * p.T * p.HV * p.V);
      for (size_t i = 0; i < o[pass].size(); ++i) o[pass][i] = decode(buf.o, qla::DType::kFloat32, i);
    }
    EXPECT_EQ(o[0], o[1]);
    std::vector<double> after32(S * M);
    for (size_t i = 0; i < after32.size(); ++i) after32[i] = decode(pool32, qla::DType::kFloat32, i);
    std::vector<uint8_t> want16;
    encode(after32, sd, want16);
    EXPECT_EQ(pool16, want16);
    int64_t changed = 0;  // (slot 4, 0 and 2 were written: the comparison sees the writes)
    for (int64_t i = 0; i < S * M; ++i) changed += decode(pool16, sd, i) != exact[i];
    EXPECT_GT(changed, M);
  }
}

TEST(CpuForward, StatePoolInPlace) {
  Problem p = make_problem(77, 1, 150, 2, 4, 8, 8, {0, 40, 40, 150});
  const int64_t N = p.N(), S = 5, M = p.HV * p.K * p.V;
  const int32_t reads[3] = {4, -1, 1}, writes[3] = {4, 0, 2};  // sequence 1 starts from zeros
  std::vector<double> pool(S * M);
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  for (auto& x : pool) x = normal(rng);
  const std::vector<double> before = pool;
  for (int64_t n = 0; n < N; ++n)  // the reference starts from the slots the call reads
    for (int64_t i = 0; i < M; ++i) p.h0[n * M + i] = reads[n] >= 0 ? pool[reads[n] * M + i] : 0.0;
  std::vector<double> ro, rht;
  reference_forward(p, ro, rht);

  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat64, buf, false);
  f.initial_state = {pool.data(), qla::DType::kFloat64, {M, p.K * p.V, p.V}};
  f.final_state = {pool.data(), qla::DType::kFloat64, {M, p.K * p.V, p.V}};
  f.initial_state_indices = {reads, qla::DType::kInt32, {1, 0, 0}};
  f.final_state_indices = {writes, qla::DType::kInt32, {1, 0, 0}};
  f.initial_state_slots = f.final_state_slots = S;
  qla::Status s = qla::gdn_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();
  std::vector<double> o(ro.size());
  for (size_t i = 0; i < o.size(); ++i) o[i] = decode(buf.o, qla::DType::kFloat64, i);
  EXPECT_LT(rel_l2(o, ro), 1e-12);
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<double> got(pool.begin() + writes[n] * M, pool.begin() + (writes[n] + 1) * M);
    const std::vector<double> want(rht.begin() + n * M, rht.begin() + (n + 1) * M);
    EXPECT_LT(rel_l2(got, want), 1e-12) << "slot " << writes[n];
  }
  for (int64_t i = 0; i < M; ++i) EXPECT_EQ(pool[3 * M + i], before[3 * M + i]) << "slot 3 is written by no one";

  const int32_t past[3] = {4, 5, 1}, twice[3] = {4, 4, 2}, crossed[3] = {1, 0, 2};
  f.initial_state_indices.data = past;
  s = qla::gdn_forward(f);
  EXPECT_EQ(s.code(), qla::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("initial_state_indices: expected entries below initial_state_slots=5"), std::string::npos)
      << s.message();
  f.initial_state_indices.data = reads;
  f.final_state_indices.data = twice;
  s = qla::gdn_forward(f);
  EXPECT_NE(s.message().find("final_state_indices: expected distinct slots"), std::string::npos) << s.message();
  f.final_state_indices.data = crossed;  // slot 1 written by sequence 0, read by sequence 2
  s = qla::gdn_forward(f);
  EXPECT_NE(s.message().find("written by another sequence"), std::string::npos) << s.message();
  f.final_state_indices = {writes, qla::DType::kFloat32, {1, 0, 0}};
  s = qla::gdn_forward(f);
  EXPECT_NE(s.message().find("final_state_indices: expected dtype int32 or int64"), std::string::npos) << s.message();
  const int32_t shifted[3] = {3, 0, 2};
  f.final_state_indices = {shifted, qla::DType::kInt32, {1, 0, 0}};
  f.final_state.data = pool.data() + M;  // the same memory seen from another slot: refused
  f.final_state_slots = S - 1;
  s = qla::gdn_forward(f);
  EXPECT_NE(s.message().find("final_state: expected memory apart from initial_state's"), std::string::npos)
      << s.message();
}
