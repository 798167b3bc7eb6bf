// Instruction-cache probe: how fast an SM issues straight-line code as the hot code grows, and
// as it is split between warp roles (the warp-specialized kernels' case: every warpgroup puts
// one warp on each of the SM's four schedulers, so each scheduler runs every role's code).
//
// Kernel <kBody, kRoles>: 512 threads per CTA, one CTA per SM; warps 4r .. 4r + 3 run role
// r % kRoles, a loop over kBody FFMA instructions of its own (8 independent chains, so issue,
// not latency, bounds a scheduler with four warps). The hot code is kRoles x kBody x 16 bytes.
// Prints, per configuration, the issue rate per scheduler (instructions per cycle): flat while
// the code fits the caches, falling once it does not.
//
// Build: nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/icache_probe.cu -o icache_probe
#include <cstdio>
#include <cuda_runtime.h>

template <int kRole, int kBody>
__device__ __forceinline__ void role_body(float (&a)[8], float b) {
#pragma unroll
  for (int i = 0; i < kBody; ++i) {
    // A per-role immediate: the roles' copies are different code, not one copy shared.
    asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(a[i & 7]) : "f"(b), "f"(1.0f + kRole * 1e-6f));
  }
}

template <int kBody, int kRoles>
__global__ void __launch_bounds__(512, 1) probe(float* out, int reps, long long* cycles) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = threadIdx.x * 1e-3f + i;
  const float b = 0.999f;
  const int role = (threadIdx.x >> 7) % kRoles;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 1
  for (int r = 0; r < reps; ++r) {
    switch (role) {
      case 0: role_body<0, kBody>(a, b); break;
      case 1: if constexpr (kRoles > 1) role_body<1, kBody>(a, b); break;
      case 2: if constexpr (kRoles > 2) role_body<2, kBody>(a, b); break;
      default: if constexpr (kRoles > 3) role_body<3, kBody>(a, b); break;
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int kBody, int kRoles>
void run(float* out, long long* dcyc, int sms) {
  const int reps = (1 << 21) / kBody;  // ~2 M instructions per warp
  cudaFuncSetAttribute(probe<kBody, kRoles>, cudaFuncAttributeMaxDynamicSharedMemorySize, 150 * 1024);
  for (int pass = 0; pass < 2; ++pass) probe<kBody, kRoles><<<sms, 512, 150 * 1024>>>(out, reps, dcyc);
  cudaDeviceSynchronize();
  long long cyc[1024];
  cudaMemcpy(cyc, dcyc, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  long long mx = 0, sum = 0;
  for (int i = 0; i < sms; ++i) { mx = cyc[i] > mx ? cyc[i] : mx; sum += cyc[i]; }
  // Per scheduler: four warps, each reps x kBody instructions (the loop's own few are left out).
  const double ipc = 4.0 * reps * kBody / (double(sum) / sms);
  std::printf("roles %d  body %5d instr  hot code %6.1f KiB  cycles/CTA %10.0f (max %lld)  issue/scheduler/cycle %.3f\n",
              kRoles, kBody, kRoles * kBody * 16 / 1024.0, double(sum) / sms, mx, ipc);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* dcyc;
  cudaMalloc(&out, sms * 512 * sizeof(float));
  cudaMalloc(&dcyc, sms * sizeof(long long));
  run<1024, 1>(out, dcyc, sms);
  run<2048, 1>(out, dcyc, sms);
  run<2176, 1>(out, dcyc, sms);
  run<2304, 1>(out, dcyc, sms);
  run<2432, 1>(out, dcyc, sms);
  run<2560, 1>(out, dcyc, sms);
  run<2816, 1>(out, dcyc, sms);
  run<3072, 1>(out, dcyc, sms);
  run<3584, 1>(out, dcyc, sms);
  run<4096, 1>(out, dcyc, sms);
  run<512, 4>(out, dcyc, sms);
  run<544, 4>(out, dcyc, sms);
  run<576, 4>(out, dcyc, sms);
  run<608, 4>(out, dcyc, sms);
  run<640, 4>(out, dcyc, sms);
  run<704, 4>(out, dcyc, sms);
  run<768, 4>(out, dcyc, sms);
  run<640, 3>(out, dcyc, sms);
  run<704, 3>(out, dcyc, sms);
  run<768, 3>(out, dcyc, sms);
  run<832, 3>(out, dcyc, sms);
  run<896, 3>(out, dcyc, sms);
  run<1024, 3>(out, dcyc, sms);
  run<2048, 4>(out, dcyc, sms);
  run<2560, 4>(out, dcyc, sms);
  run<3072, 4>(out, dcyc, sms);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) { std::printf("CUDA error: %s\n", cudaGetErrorString(e)); return 1; }
  return 0;
}
