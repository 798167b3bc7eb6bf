// The last launch of both sm90 backwards: dq and dk summed over each value-head group from the
// per-value-head partials (fp32 from the chunked backward's gradients kernel, the input type from
// the fused backward's reverse step; none where every group has one value head and the step
// wrote dq, dk in place, or two and it added them in, after gdn_bwd_zero_dqk), and NaN in every
// output when the device cu_seqlens are malformed (off[N + 1] set by the chunk table).
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
  bool dq_vec16, dk_vec16;  // 16-byte aligned data and strides: 16-byte stores
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

// Eight consecutive partials from element i (fp32 or the 16-bit type T): 16-byte loads.
template <class T>
__device__ __forceinline__ void load_partials8(const void* base, int bytes, int64_t i, float (&x)[8]) {
  if (bytes == 4) {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    return;
  }
  const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const T*>(base) + i);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  CUTE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack2<T>(w[j]);
    x[2 * j] = f.x, x[2 * j + 1] = f.y;
  }
}

// Eight values to dst (the 16-bit type T): one 16-byte store where the row is 16-byte aligned
// (vec16), else two 8-byte ones (the gradients' 8-byte alignment, checked on the host).
template <class T>
__device__ __forceinline__ void store8(T* dst, const float (&x)[8], bool vec16) {
  const uint4 u = make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
  if (vec16) {
    *reinterpret_cast<uint4*>(dst) = u;
  } else {
    reinterpret_cast<uint2*>(dst)[0] = make_uint2(u.x, u.y);
    reinterpret_cast<uint2*>(dst)[1] = make_uint2(u.z, u.w);
  }
}

// Row (token, key head) i of dq, dk: its flat token bt = b T + t and key head h. 32-bit
// arithmetic where the rows fit (64-bit division costs more than the memory traffic it
// addresses).
struct FinishRow {
  int64_t bt, h, b, t;
};
__device__ __forceinline__ FinishRow finish_row(const FinishParams& p, int64_t row, bool idx32) {
  if (idx32) {
    const uint32_t r = static_cast<uint32_t>(row), q = r / static_cast<uint32_t>(p.H);
    const uint32_t b = q / static_cast<uint32_t>(p.T);
    return {q, r - q * static_cast<uint32_t>(p.H), b, q - b * static_cast<uint32_t>(p.T)};
  }
  return {row / p.H, row % p.H, row / p.H / p.T, row / p.H % p.T};
}

// Before the fused backward's reverse step where it adds each value head's dq, dk into the
// caller's tensors (two value heads a key head, RecParams::dqk_add): both zeroed, 8 elements a
// thread.
template <class T>
__global__ void __launch_bounds__(256) gdn_bwd_zero_dqk(const __grid_constant__ FinishParams p) {
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t rows = p.B * p.T * p.H, n8 = rows * (kDK / 8);
  const bool idx32 = rows <= INT32_MAX;
  const float zero[8] = {};
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8; i += nthreads) {
    const int d8 = static_cast<int>(i % (kDK / 8)) * 8;
    const FinishRow w = finish_row(p, i / (kDK / 8), idx32);
    store8(static_cast<T*>(p.dq) + w.b * p.sdq[0] + w.t * p.sdq[1] + w.h * p.sdq[2] + d8, zero, p.dq_vec16);
    store8(static_cast<T*>(p.dk) + w.b * p.sdk[0] + w.t * p.sdk[1] + w.h * p.sdk[2] + d8, zero, p.dk_vec16);
  }
}

template <class T>
__global__ void __launch_bounds__(256) gdn_bwd_finish(const __grid_constant__ FinishParams p) {
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int G = p.HV / p.H;
  const bool bad = p.chunk_off[p.N + 1] != 0;
  if (!bad && p.partial_bytes == 0) return;
  const float nan = __int_as_float(0x7fc00000);
  // dq, dk: 8 consecutive d per thread, each group's partials summed in fp32 in a fixed order.
  const int64_t rows = p.B * p.T * p.H, n8 = rows * (kDK / 8);
  const bool idx32 = rows <= INT32_MAX;
  for (int64_t i = first; i < n8; i += nthreads) {
    const int d8 = static_cast<int>(i % (kDK / 8)) * 8;
    const FinishRow w = finish_row(p, i / (kDK / 8), idx32);
    const int64_t bt = w.bt, h = w.h, bb = w.b, t = w.t;
    float sq[8] = {}, sk[8] = {};
    for (int gi = 0; gi < G && p.partial_bytes; ++gi) {
      const int64_t src = (bt * p.HV + h * G + gi) * kDK + d8;
      float a[8], c[8];
      load_partials8<T>(p.dqp, p.partial_bytes, src, a);
      load_partials8<T>(p.dkp, p.partial_bytes, src, c);
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) sq[j] += a[j], sk[j] += c[j];
    }
    if (bad)
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) sq[j] = sk[j] = nan;
    store8(static_cast<T*>(p.dq) + bb * p.sdq[0] + t * p.sdq[1] + h * p.sdq[2] + d8, sq, p.dq_vec16);
    store8(static_cast<T*>(p.dk) + bb * p.sdk[0] + t * p.sdk[1] + h * p.sdk[2] + d8, sk, p.dk_vec16);
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
