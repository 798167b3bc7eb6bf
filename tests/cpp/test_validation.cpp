// Bad arguments come back as a Status naming the argument; nothing crashes.
#include <algorithm>
#include <cmath>
#include <gtest/gtest.h>

#include "problem.h"

using namespace qla_test;

namespace {

// Expects an error whose message contains `needle`.
void expect_error(const qla::GdnForwardParams& f, const std::string& needle) {
  qla::Status s = qla::gdn_forward(f);
  ASSERT_FALSE(s.ok()) << "expected an error mentioning '" << needle << "'";
  EXPECT_NE(s.message().find(needle), std::string::npos) << "message was: " << s.message();
  size_t ws = 0;
  EXPECT_FALSE(qla::gdn_forward_workspace_size(f, &ws).ok());
}

}  // namespace

TEST(Validation, ForwardRejectsBadArguments) {
  Problem p = make_problem(1, 1, 20, 2, 4, 8, 8, {0, 5, 20});
  Buffers buf;
  const qla::GdnForwardParams good = forward_params(p, qla::DType::kFloat32, buf);
  ASSERT_TRUE(qla::gdn_forward(good).ok());

  auto f = good;
  f.shape.num_v_heads = 3;
  expect_error(f, "multiple");
  f = good;
  f.k.dtype = qla::DType::kBFloat16;
  expect_error(f, "k: expected dtype float32");
  f = good;
  f.q.dtype = qla::DType::kInt32;
  expect_error(f, "q: expected a float dtype");
  f = good;
  f.v.data = nullptr;
  expect_error(f, "v: expected a data pointer");
  f = good;
  f.initial_state.dtype = qla::DType::kInt32;
  expect_error(f, "initial_state: expected dtype float32");
  f = good;
  f.final_state.dtype = qla::DType::kFloat64;  // fp64 states need fp64 inputs
  expect_error(f, "final_state: expected dtype float32 (or float64 with float64 inputs; bfloat16 or float16");
  f = good;
  f.shape.batch = 2;
  expect_error(f, "cu_seqlens: expected batch size 1");
  f = good;
  f.cu_seqlens.dtype = qla::DType::kFloat32;
  expect_error(f, "cu_seqlens: expected dtype int32 or int64");
  f = good;
  f.shape.head_dim_k = 512;
  expect_error(f, "head dims up to 256");
  f = good;
  f.shape.seqlen = -1;
  expect_error(f, "shape");
  f = good;
  f.split = static_cast<qla::SplitMode>(7);
  expect_error(f, "split: expected SplitMode kAuto, kOff or kOn, got 7");
  f = good;
  f.split = qla::SplitMode::kOn;
  f.split_chunks = -2;
  expect_error(f, "split_chunks: expected >= 0");
  f = good;  // no sequences but 20 tokens: malformed whatever the values (device cu_seqlens too)
  f.num_seqs = 0;
  expect_error(f, "cu_seqlens: expected at least two entries (0, ..., T=20) for 20 tokens, got num_seqs=0");
  f = good;
  f.scale = std::nan("");
  expect_error(f, "scale: expected a finite number, got nan");
  f = good;
  f.scale = -HUGE_VAL;
  expect_error(f, "scale: expected a finite number, got -inf");
  f = good;  // the CPU backend accepts and ignores splitting
  f.split = qla::SplitMode::kOn;
  f.split_chunks = 1;
  EXPECT_TRUE(qla::gdn_forward(f).ok());
}

TEST(Validation, SixteenBitStatesEndingWhereFp32StatesBeginDoNotOverlap) {
  // The overlap check spans each state tensor at its own element size. Counted at 4 bytes, a bf16
  // initial state seemed to reach into an fp32 final state placed right after it: a read-only
  // 16-bit pool with fresh fp32 final states was refused whenever the allocator put them there.
  Problem p = make_problem(3, 1, 20, 1, 2, 8, 8, {0, 5, 20});
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  const int64_t n16 = p.N() * p.HV * p.K * p.V;  // elements of the bf16 initial state
  std::vector<uint8_t> mem(n16 * 2 + n16 * 4, 0);  // (zero bits: 0 in bf16 and fp32)
  f.initial_state.data = mem.data();
  f.initial_state.dtype = qla::DType::kBFloat16;
  f.final_state.data = mem.data() + n16 * 2;
  const qla::Status s = qla::gdn_forward(f);
  EXPECT_TRUE(s.ok()) << s.message();
  f.final_state.data = mem.data() + n16 * 2 - 4;  // its first element over the bf16 state's last two
  expect_error(f, "final_state: expected memory apart from initial_state's");
}

TEST(Validation, ForwardRejectsBadCuSeqlensValues) {
  Problem p = make_problem(2, 1, 20, 1, 1, 4, 4, {0, 5, 20});
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  int64_t* cu = reinterpret_cast<int64_t*>(buf.cu.data());
  cu[0] = 1;
  expect_error(f, "first entry to be 0");
  cu[0] = 0, cu[1] = 25;
  expect_error(f, "non-decreasing");
  cu[1] = 5, cu[2] = 19;
  expect_error(f, "last entry to equal the number of tokens T=20");
}

TEST(Validation, BackwardRejectsMissingOutputs) {
  Problem p = make_problem(3, 1, 10, 1, 1, 4, 4);
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  qla::GdnBackwardParams b;
  b.shape = f.shape;
  b.q = f.q, b.k = f.k, b.v = f.v, b.g = f.g, b.beta = f.beta;
  b.d_o = f.v;
  qla::Status s = qla::gdn_backward(b);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("dq"), std::string::npos) << s.message();
  // The backward's states stay fp32 (the forward's may be 16-bit: an engine's state cache).
  b.initial_state = {f.q.data, qla::DType::kBFloat16, {p.HV * p.K * p.V, p.K * p.V, p.V}};
  s = qla::gdn_backward(b);
  EXPECT_NE(s.message().find("initial_state: expected dtype float32 (or float64 with float64 inputs), got"),
            std::string::npos)
      << s.message();
}

TEST(Validation, EmptyProblemIsFine) {
  Problem p = make_problem(4, 1, 0, 1, 1, 4, 4, {0, 0});
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  qla::Status s = qla::gdn_forward(f);
  ASSERT_TRUE(s.ok()) << s.message();
  // An empty sequence passes the initial state through.
  for (size_t i = 0; i < p.h0.size(); ++i)
    EXPECT_EQ(decode(buf.ht, qla::DType::kFloat32, i), static_cast<float>(p.h0[i]));
}

TEST(Validation, CudaDeviceWithoutGpuReportsError) {
  Problem p = make_problem(5, 1, 10, 1, 1, 4, 4);
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  f.device = qla::Device::kCuda;  // host pointers, and K = 4: must be refused, never run
  qla::Status s = qla::gdn_forward(f);
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(s.message().empty());
}

TEST(Validation, CudaForwardRefusesBatchRowsPastItsPlaceField) {
  // 2^24 batch rows without cu_seqlens: the sm90 forward's chunk places hold a row in 24 bits,
  // so the call is refused by name before any device work (the buffers are never read).
  std::vector<uint16_t> x(16 * 128, 0), out(16 * 128, 0);
  std::vector<float> gb(16, 0.f);
  const int64_t B = int64_t(1) << 24;
  qla::GdnForwardParams f;
  f.shape = {B, 1, 1, 1, 128, 128};
  f.q = {x.data(), qla::DType::kBFloat16, {128, 128, 128}};
  f.k = f.q;
  f.v = f.q;
  f.g = {gb.data(), qla::DType::kFloat32, {1, 1, 0}};
  f.beta = f.g;
  f.o = {out.data(), qla::DType::kBFloat16, {128, 128, 128}};
  f.scale = 0.088;
  f.device = qla::Device::kCuda;
  size_t bytes = 123;
  const qla::Status s = qla::gdn_forward_workspace_size(f, &bytes);
  EXPECT_EQ(s.code(), qla::StatusCode::kNotSupported) << s.message();
  EXPECT_TRUE(s.message().find("batch: at most 16777215 rows") != std::string::npos ||
              s.message().find("no CUDA backend") != std::string::npos)
      << s.message();
  f.shape.batch = B - 1;  // one row fewer passes this check (and fails later only for want of a GPU)
  const qla::Status t = qla::gdn_forward_workspace_size(f, &bytes);
  EXPECT_EQ(t.message().find("batch: at most"), std::string::npos) << t.message();
  // 2^31 tokens in a row: token coordinates are ints in the sm90 kernels, refused by name.
  f.shape.batch = 1;
  f.shape.seqlen = int64_t(1) << 31;
  const qla::Status u = qla::gdn_forward_workspace_size(f, &bytes);
  EXPECT_TRUE(u.message().find("T: at most 2^31 - 1 tokens per batch row") != std::string::npos ||
              u.message().find("no CUDA backend") != std::string::npos)
      << u.message();
}

TEST(Validation, CudaBackwardRefusesWhatTheSm90BackendCannotRun) {
  // Valid arguments on host memory with K = V = 4 and device = kCuda: refused before any device
  // work, with kNotSupported naming the limit (or the missing CUDA backend of a CPU-only build).
  Problem p = make_problem(6, 1, 10, 1, 1, 4, 4);
  Buffers buf;
  qla::GdnForwardParams f = forward_params(p, qla::DType::kFloat32, buf);
  std::vector<float> d_o(p.v.size(), 1.f), dq(p.q.size(), 7.f), dk(p.k.size()), dv(p.v.size()), dg(p.g.size()),
      dbeta(p.beta.size());
  qla::GdnBackwardParams b;
  b.shape = f.shape;
  b.q = f.q, b.k = f.k, b.v = f.v, b.g = f.g, b.beta = f.beta;
  b.d_o = {d_o.data(), qla::DType::kFloat32, {f.v.stride[0], f.v.stride[1], f.v.stride[2]}};
  b.dq = {dq.data(), qla::DType::kFloat32, {f.q.stride[0], f.q.stride[1], f.q.stride[2]}};
  b.dk = {dk.data(), qla::DType::kFloat32, {f.k.stride[0], f.k.stride[1], f.k.stride[2]}};
  b.dv = {dv.data(), qla::DType::kFloat32, {f.v.stride[0], f.v.stride[1], f.v.stride[2]}};
  b.dg = {dg.data(), qla::DType::kFloat32, {f.g.stride[0], f.g.stride[1], 0}};
  b.dbeta = {dbeta.data(), qla::DType::kFloat32, {f.beta.stride[0], f.beta.stride[1], 0}};
  b.scale = 0.5;
  ASSERT_TRUE(qla::gdn_backward(b).ok());  // the same call on the CPU backend runs
  std::fill(dq.begin(), dq.end(), 7.f);
  b.device = qla::Device::kCuda;
  size_t bytes = 123;
  for (const qla::Status& s : {qla::gdn_backward_workspace_size(b, &bytes), qla::gdn_backward(b)}) {
    EXPECT_EQ(s.code(), qla::StatusCode::kNotSupported) << s.message();
    EXPECT_TRUE(s.message().find("K = V = 128") != std::string::npos ||
                s.message().find("no CUDA backend") != std::string::npos)
        << s.message();
  }
  EXPECT_EQ(bytes, 0u);
  for (float x : dq) EXPECT_EQ(x, 7.f);  // nothing written
  // The backward's splitting options are checked on every backend, by name.
  b.device = qla::Device::kCpu;
  b.split = static_cast<qla::SplitMode>(5);
  const qla::Status bad_split = qla::gdn_backward(b);
  EXPECT_EQ(bad_split.code(), qla::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_split.message().find("split: expected SplitMode kAuto, kOff or kOn, got 5"), std::string::npos)
      << bad_split.message();
  b.split = qla::SplitMode::kOn;
  b.split_chunks = -1;
  const qla::Status bad_chunks = qla::gdn_backward(b);
  EXPECT_EQ(bad_chunks.code(), qla::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_chunks.message().find("split_chunks: expected >= 0"), std::string::npos) << bad_chunks.message();
  for (float x : dq) EXPECT_EQ(x, 7.f);  // nothing written
  b.split_chunks = 2;
  b.batch_invariant = true;
  EXPECT_TRUE(qla::gdn_backward(b).ok());  // the CPU backend accepts and ignores them
}
