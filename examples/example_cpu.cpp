// Using QLA from C++ with no Python: one forward call on the CPU backend.
//   B = 1, T = 100 tokens, H = 2 q/k heads, HV = 4 value heads, K = V = 32, fp32.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "qla/qla.h"

int main() {
  const int64_t B = 1, T = 100, H = 2, HV = 4, K = 32, V = 32;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  auto randn = [&](size_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  };
  std::vector<float> q = randn(B * T * H * K), k = randn(B * T * H * K), v = randn(B * T * HV * V);
  for (int64_t r = 0; r < B * T * H; ++r) {  // L2-normalise keys, as GDN layers do
    float n2 = 0;
    for (int64_t i = 0; i < K; ++i) n2 += k[r * K + i] * k[r * K + i];
    for (int64_t i = 0; i < K; ++i) k[r * K + i] /= std::sqrt(n2);
  }
  std::vector<float> g(B * T * HV, -0.05f), beta(B * T * HV, 0.5f);
  std::vector<float> o(B * T * HV * V), final_state(B * HV * K * V);

  qla::GdnForwardParams p;
  p.shape = {B, T, H, HV, K, V};
  p.q = {q.data(), qla::DType::kFloat32, {T * H * K, H * K, K}};
  p.k = {k.data(), qla::DType::kFloat32, {T * H * K, H * K, K}};
  p.v = {v.data(), qla::DType::kFloat32, {T * HV * V, HV * V, V}};
  p.g = {g.data(), qla::DType::kFloat32, {T * HV, HV, 0}};
  p.beta = {beta.data(), qla::DType::kFloat32, {T * HV, HV, 0}};
  p.o = {o.data(), qla::DType::kFloat32, {T * HV * V, HV * V, V}};
  p.final_state = {final_state.data(), qla::DType::kFloat32, {HV * K * V, K * V, V}};
  p.scale = 1.0 / std::sqrt(static_cast<double>(K));
  p.device = qla::Device::kCpu;

  qla::Status s = qla::gdn_forward(p);
  if (!s.ok()) {
    std::printf("example: error: %s\n", s.message().c_str());
    return 1;
  }
  double norm = 0;
  for (float x : o) norm += double(x) * x;
  std::printf("qla %s: |o| = %.4f, final_state[0] = %.4f\n", qla::version(), std::sqrt(norm), final_state[0]);

  p.shape.num_v_heads = 3;  // not a multiple of H: the call reports which argument is wrong
  s = qla::gdn_forward(p);
  std::printf("bad call -> %s\n", s.message().c_str());
  if (s.ok()) return 1;
  std::printf("example: ok\n");
  return 0;
}
