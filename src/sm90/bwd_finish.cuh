// The last launch of both sm90 backwards: dq and dk summed over each value-head group from the
// per-value-head partials (fp32 from the chunked backward's gradients kernel, the input type from
// the fused backward's reverse step; none where every group has one value head and the step
// wrote dq, dk in place), and NaN in every output when the device cu_seqlens are malformed
// (off[N + 1] set by the chunk table).
#pragma once

#include "common.cuh"

namespace qla {
namespace sm90 {
// Anonymous: these headers are included by one translation unit each (internal linkage).
namespace {

struct FinishParams {
  const void *dqp, *dkp;  // [B * T][HV][K] partials, contiguous
  int partial_bytes;      // 4: fp32 partials; 2: partials in the type of q; 0: none (dq, dk written)
  void *dq, *dk;
  int64_t sdq[3], sdk[3];
  int64_t B, T;
  int H, HV, N;
  const int* chunk_off;
  // NaN fill targets
  void* dv;
  int64_t sdv[3];
  void* dg;
  int64_t sdg[2];
  int dg_dt;
  void* dbeta;
  int64_t sdb[2];
  int db_dt;
  float* dh0;
  int64_t sdh0[3];
};

// Four consecutive partials from element i (fp32 or the 16-bit type T).
template <class T>
__device__ __forceinline__ float4 load_partials4(const void* base, int bytes, int64_t i) {
  if (bytes == 4) return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
  const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const T*>(base) + i);
  const float2 a = unpack2<T>(u.x), b = unpack2<T>(u.y);
  return make_float4(a.x, a.y, b.x, b.y);
}

template <class T>
__global__ void __launch_bounds__(256) gdn_bwd_finish(const __grid_constant__ FinishParams p) {
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int G = p.HV / p.H;
  const bool bad = p.chunk_off[p.N + 1] != 0;
  if (!bad && p.partial_bytes == 0) return;
  const float nan = __int_as_float(0x7fc00000);
  // dq, dk: 4 consecutive d per thread, each group's partials summed in fp32 in a fixed order.
  const int64_t nq = p.B * p.T * p.H * (kDK / 4);
  for (int64_t i = first; i < nq; i += nthreads) {
    const int64_t d4 = (i % (kDK / 4)) * 4, h = (i / (kDK / 4)) % p.H, bt = i / (kDK / 4) / p.H;
    const int64_t bb = bt / p.T, t = bt % p.T;
    float4 sq = make_float4(0.f, 0.f, 0.f, 0.f), sk = sq;
    for (int gi = 0; gi < G && p.partial_bytes; ++gi) {
      const int64_t src = (bt * p.HV + h * G + gi) * kDK + d4;
      const float4 a = load_partials4<T>(p.dqp, p.partial_bytes, src);
      const float4 c = load_partials4<T>(p.dkp, p.partial_bytes, src);
      sq.x += a.x; sq.y += a.y; sq.z += a.z; sq.w += a.w;
      sk.x += c.x; sk.y += c.y; sk.z += c.z; sk.w += c.w;
    }
    if (bad) sq = sk = make_float4(nan, nan, nan, nan);
    T* q = static_cast<T*>(p.dq) + bb * p.sdq[0] + t * p.sdq[1] + h * p.sdq[2] + d4;
    T* k = static_cast<T*>(p.dk) + bb * p.sdk[0] + t * p.sdk[1] + h * p.sdk[2] + d4;
    *reinterpret_cast<uint2*>(q) = make_uint2(pack2<T>(sq.x, sq.y), pack2<T>(sq.z, sq.w));
    *reinterpret_cast<uint2*>(k) = make_uint2(pack2<T>(sk.x, sk.y), pack2<T>(sk.z, sk.w));
  }
  if (!bad) return;
  const int64_t nv = p.B * p.T * p.HV * kDV;
  for (int64_t i = first; i < nv; i += nthreads) {
    const int64_t v = i % kDV, h = (i / kDV) % p.HV, bt = i / kDV / p.HV;
    static_cast<T*>(p.dv)[(bt / p.T) * p.sdv[0] + (bt % p.T) * p.sdv[1] + h * p.sdv[2] + v] = T(nan);
  }
  const int64_t ng = p.B * p.T * p.HV;
  for (int64_t i = first; i < ng; i += nthreads) {
    const int64_t h = i % p.HV, bt = i / p.HV;
    store_f(p.dg, p.dg_dt, (bt / p.T) * p.sdg[0] + (bt % p.T) * p.sdg[1] + h, nan);
    store_f(p.dbeta, p.db_dt, (bt / p.T) * p.sdb[0] + (bt % p.T) * p.sdb[1] + h, nan);
  }
  if (p.dh0) {
    const int64_t nh = static_cast<int64_t>(p.N) * p.HV * kDK * kDV;
    for (int64_t i = first; i < nh; i += nthreads) {
      const int64_t j = i % (kDK * kDV), h = (i / (kDK * kDV)) % p.HV, n = i / (kDK * kDV * p.HV);
      p.dh0[n * p.sdh0[0] + h * p.sdh0[1] + (j / kDV) * p.sdh0[2] + j % kDV] = nan;
    }
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
