// sm90 host helpers shared by the forward and backward translation units: CUDA error statuses,
// the per-device facts cached once per process, and the q/k/v/dO tensor maps.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>

#include "qla/qla.h"
#include "common.cuh"

namespace qla {
namespace sm90 {
// Anonymous: each translation unit keeps its own cache (its kernels' shared-memory opt-ins).
namespace {

// The scales whose fp16 score images (scale e^(gamma_i - gamma_j) q_i.k_j as hi/lo pairs, in the
// two-pass forward's and the backward's prep) stay normal and finite for unit rows: above, fp16
// overflows (65504); below, the images' typical entries (~0.09 scale at d = 128) fall to
// subnormals, whose spacing 2^-24 is then more than 1e-4 of them.
constexpr double kFp16ScaleMin = 1.0 / 64, kFp16ScaleMax = 16384.0;
inline bool fp16_scale_in_window(double scale) {
  return std::fabs(scale) >= kFp16ScaleMin && std::fabs(scale) <= kFp16ScaleMax;
}

Status cuda_err(cudaError_t e, const char* what) {
  return Status::Error(StatusCode::kCudaError, std::string("sm90: ") + what + ": " + cudaGetErrorString(e));
}
#define QLA_CUDA_TRY(expr, what)                      \
  do {                                                \
    cudaError_t e_ = (expr);                          \
    if (e_ != cudaSuccess) return cuda_err(e_, what); \
  } while (0)

// Per-device facts queried once (the eager path calls the op every few microseconds):
// compute capability major, SM count, and whether the kernels' shared-memory opt-in is set.
struct DeviceInfo {
  int major = 0, sms = 0;
  bool smem_ready[2] = {false, false};  // [bf16, fp16]
};
constexpr int kMaxDevices = 64;
DeviceInfo g_devices[kMaxDevices];
std::mutex g_devices_mu;

Status device_info(DeviceInfo** out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess)
    return Status::Error(StatusCode::kNotSupported, std::string("sm90: no CUDA device: ") + cudaGetErrorString(e));
  if (dev < 0 || dev >= kMaxDevices) return Status::Error(StatusCode::kNotSupported, "sm90: device index out of range");
  // The driver calls (cuTensorMapEncodeTiled) need a context current on the calling thread, which
  // the runtime binds at its first call there that needs one. A thread may reach a launch before
  // any such call (autograd's backward thread, once another thread has prepared the kernels):
  // once per thread and device, where no context is current, bind the device's primary one (a
  // caller's own current context is left alone; without the driver's answer, nothing is bound
  // and a later driver call reports its own error).
  thread_local int t_checked = -1;
  if (t_checked != dev) {
    static PFN_cuCtxGetCurrent_v4000 get_current = nullptr;  // benign race: same value
    if (!get_current) {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 4000, cudaEnableDefault, &q) == cudaSuccess &&
          q == cudaDriverEntryPointSuccess)
        get_current = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(fn);
    }
    CUcontext ctx = nullptr;
    if (get_current && get_current(&ctx) == CUDA_SUCCESS && ctx == nullptr) {
      e = cudaSetDevice(dev);
      if (e != cudaSuccess) return cuda_err(e, "cudaSetDevice");
    }
    t_checked = dev;
  }
  DeviceInfo& d = g_devices[dev];
  if (__atomic_load_n(&d.sms, __ATOMIC_ACQUIRE) == 0) {
    std::lock_guard<std::mutex> lock(g_devices_mu);
    if (d.sms == 0) {
      int major = 0, sms = 0;
      e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      if (e != cudaSuccess)
        return Status::Error(StatusCode::kNotSupported,
                             std::string("sm90: cannot query the CUDA device: ") + cudaGetErrorString(e));
      d.major = major;
      __atomic_store_n(&d.sms, sms, __ATOMIC_RELEASE);
    }
  }
  *out = &d;
  return Status::Ok();
}

// device_info, and a kNotSupported error unless the current device is compute capability 9.x.
Status hopper_device_info(DeviceInfo** out) {
  Status s = device_info(out);
  if (s.ok() && (*out)->major != 9)
    s = Status::Error(StatusCode::kNotSupported, "sm90: device is compute capability " +
                                                     std::to_string((*out)->major) + ".x, the sm90 backend needs 9.x");
  return s;
}

// Sequences, and an upper bound on the total chunk count from shapes only (forward or backward params).
template <class P>
int64_t num_seqs(const P& p) { return p.cu_seqlens.data ? p.num_seqs : p.shape.batch; }
template <class P>
int64_t max_chunks(const P& p) {
  const int64_t T = p.shape.seqlen;
  if (p.cu_seqlens.data) return T / kC + p.num_seqs;  // sum ceil(l/64) <= floor(T/64) + N
  return p.shape.batch * ((T + kC - 1) / kC);
}

const char* dt_name(DType d) {
  switch (d) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "fp32";
    case DType::kFloat64: return "fp64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

bool aligned(const void* ptr, size_t a) { return (reinterpret_cast<uintptr_t>(ptr) % a) == 0; }

// A [B][T][H][K] 16-bit tensor whose every row start is 16-byte aligned (16-byte stores).
bool rows_vec16(const MutTensorRef& t) {
  return aligned(t.data, 16) && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0;
}

// The caller's workspace: at least `need` bytes (non-null when need > 0), 16-byte aligned.
Status check_workspace(const char* who, const void* ws, size_t have, size_t need) {
  if (have < need || (need > 0 && ws == nullptr))
    return Status::Error(StatusCode::kInvalidArgument, std::string(who) + ": workspace too small (" +
                                                            std::to_string(have) + " < " + std::to_string(need) + " bytes)");
  if (!aligned(ws, 16))
    return Status::Error(StatusCode::kInvalidArgument, std::string(who) + ": workspace must be 16-byte aligned");
  return Status::Ok();
}

// Tensor map of a 16-bit [B, T, heads, 128] tensor (q, k, v or dO) as (d, head, token, batch)
// with a (64, 1, 64, 1) box and 128-byte swizzle: one box is one K-block (64 tokens x 64 d) of a
// GMMA tile. box_cols = 32: a (32, 1, 64, 1) box with 64-byte swizzle (a V tile of 32 as the
// MN-major (v, tok) operand). The driver entry point comes through the runtime (no libcuda link).
Status make_tile_map(CUtensorMap* map, const TensorRef& t, int64_t heads, const GdnShape& shape, int box_cols = 64) {
  *map = CUtensorMap{};
  if (shape.seqlen == 0 || shape.batch == 0) return Status::Ok();  // never read
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;    // benign race: same value
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
      return cuda_err(e != cudaSuccess ? e : cudaErrorNotSupported, "cuTensorMapEncodeTiled entry point");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(kDK), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(shape.seqlen), static_cast<cuuint64_t>(shape.batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(t.stride[2]) * 2, static_cast<cuuint64_t>(t.stride[1]) * 2,
                                 static_cast<cuuint64_t>(t.stride[0]) * 2};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), 1, kC, 1};
  const cuuint32_t estride[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, t.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            4, const_cast<void*>(t.data), dims, strides, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status::Error(StatusCode::kInvalidArgument,
                         "sm90: cuTensorMapEncodeTiled failed for a 16-bit input (error " + std::to_string(int(r)) + ")");
  return Status::Ok();
}

}  // namespace
}  // namespace sm90
}  // namespace qla
