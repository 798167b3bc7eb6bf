// sm90 (Hopper, sm_90a) backward of the Gated DeltaNet chunked prefill: the dispatch between
// the fused backward (gdn_fwd_sm90.cu; fused_backward_chosen below) and the chunked one here.
// The chunked backward: six launches on p.stream, no host synchronisation (graph-capturable);
// docs/backward.md has the algebra.
//   1. gdn_chunk_table:  chunk offsets and the cu_seqlens check (as in the forward).
//   2. gdn_prep<T>:      the forward's prep, also storing Tm = (I+L)^-1 (hi/lo images).
//   3. gdn_recur_ws:     the forward's V-tile-32 recurrence in its kStates role, storing the state
//                        entering every chunk (16-bit image blocks); no output.
//   4. gdn_bwd_reverse:  the state-gradient chain in reverse, storing dSn and dU per chunk; dh0.
//   5. gdn_bwd_grads:    chunk-parallel dv, dbeta, dg and per-value-head dq, dk partials.
//   6. gdn_bwd_finish:   dq, dk summed over each value-head group (NaN outputs on bad cu_seqlens).
// Nothing is kept from the forward: everything is recomputed from q, k, v, g, beta and dO.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../backends.h"
#include "backward.cuh"
#include "common.cuh"
#include "host_util.cuh"
#include "prep.cuh"
#include "recurrence.cuh"

namespace qla {
namespace sm90 {
namespace {

using namespace cute;

constexpr size_t kTmBytes = 2 * kImgTokTok * 2;           // Tm hi|lo images per region
constexpr size_t kStateBytes = size_t(kDK) * kDV * 2;     // 16-bit K x V image per region (S, dSn)
constexpr size_t kDuBytes = size_t(kC) * kDV * 2;         // 16-bit C x V image per region (-dU)

struct BwdWs {
  size_t table = 0, regions = 0, tm = 0, states = 0, dsn = 0, du = 0, dqp = 0, dkp = 0, total = 0;
};
BwdWs bwd_ws_layout(const GdnBackwardParams& p) {
  auto up = [](size_t x) { return (x + 1023) & ~size_t(1023); };
  const size_t N = static_cast<size_t>(num_seqs(p));
  const size_t nreg = static_cast<size_t>(max_chunks(p)) * static_cast<size_t>(p.shape.num_v_heads);
  const size_t ntok = static_cast<size_t>(p.shape.batch) * static_cast<size_t>(p.shape.seqlen);
  const size_t part = up(ntok * static_cast<size_t>(p.shape.num_v_heads) * kDK * 4);
  BwdWs w;
  w.regions = up(4 * chunk_table_ints(N));
  w.tm = w.regions + nreg * kRegionBytes;
  w.states = w.tm + nreg * kTmBytes;
  w.dsn = w.states + nreg * kStateBytes;
  w.du = w.dsn + nreg * kStateBytes;
  w.dqp = w.du + nreg * kDuBytes;
  w.dkp = w.dqp + part;
  w.total = w.dkp + part;
  return w;
}

Status bwd_check_supported(const GdnBackwardParams& p) {
  auto ns = [](std::string m) { return Status::Error(StatusCode::kNotSupported, "sm90 backward: " + m); };
  if (p.shape.head_dim_k != kDK || p.shape.head_dim_v != kDV)
    return ns("only K = V = 128 is supported (got K = " + std::to_string(p.shape.head_dim_k) +
              ", V = " + std::to_string(p.shape.head_dim_v) + ")");
  const DType dq = p.q.dtype;
  if (dq != DType::kBFloat16 && dq != DType::kFloat16)
    return ns(std::string("q/k/v must be bf16 or fp16 (got ") + dt_name(dq) + ")");
  for (DType d : {p.k.dtype, p.v.dtype, p.d_o.dtype, p.dq.dtype, p.dk.dtype, p.dv.dtype})
    if (d != dq) return ns("q, k, v, do, dq, dk and dv must share one dtype");
  // The prep's score images fold scale in, as hi/lo pairs of the input dtype: outside the window
  // of host_util.cuh fp16 overflows or falls to subnormals. Refused rather than wrong.
  if (dq == DType::kFloat16 && !fp16_scale_in_window(p.scale))
    return ns("scale: with fp16 inputs |scale| must lie in [1/64, 16384] (its score images are fp16), got " +
              std::to_string(p.scale) + "; bf16 inputs take any scale");
  for (DType d : {p.g.dtype, p.beta.dtype, p.dg.dtype, p.dbeta.dtype})
    if (d != DType::kFloat32 && d != DType::kBFloat16 && d != DType::kFloat16)
      return ns(std::string("g, beta, dg and dbeta must be fp32, bf16 or fp16 (got ") + dt_name(d) + ")");
  if ((p.initial_state.data && p.initial_state.dtype != DType::kFloat32) ||
      (p.d_final_state.data && p.d_final_state.dtype != DType::kFloat32) ||
      (p.d_initial_state.data && p.d_initial_state.dtype != DType::kFloat32))
    return ns("initial state, d_final_state and d_initial_state must be fp32");
  for (const TensorRef* t : {&p.q, &p.k, &p.v, &p.d_o})
    if (!aligned(t->data, 16) || t->stride[0] % 8 || t->stride[1] % 8 || t->stride[2] % 8)
      return ns("q, k, v, do need 16-byte aligned data and strides that are multiples of 8 elements");
  for (const MutTensorRef* t : {&p.dq, &p.dk})
    if (!aligned(t->data, 8) || t->stride[0] % 4 || t->stride[1] % 4 || t->stride[2] % 4)
      return ns("dq, dk need 8-byte aligned data and strides that are multiples of 4 elements");
  if (!aligned(p.dv.data, 4) || p.dv.stride[0] % 2 || p.dv.stride[1] % 2 || p.dv.stride[2] % 2)
    return ns("dv needs 4-byte aligned data and even strides");
  // Flat grids of N * HV * 4 CTAs (sequential passes) and of chunks * HV regions.
  if (num_seqs(p) * p.shape.num_v_heads > 2147483647LL / 4 || max_chunks(p) * p.shape.num_v_heads > 2147483647LL)
    return ns("too many sequences, chunks or value heads for the sm90 grid");
  if (p.shape.seqlen > 2147483647LL)  // token coordinates (chunk places, TMA boxes) are ints
    return ns("T: at most 2^31 - 1 tokens per batch row (got " + std::to_string(p.shape.seqlen) + ")");
  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (!ds.ok()) return ds;
  if (dinfo->major != 9)
    return ns("device is compute capability " + std::to_string(dinfo->major) + ".x, the sm90 backend needs 9.x");
  return Status::Ok();
}

// The one-time work of a first call, per device and dtype (as the forward's prepare_kernels):
// the shared-memory opt-ins, which load those kernels, and a query that loads the others.
template <class T>
Status bwd_prepare_kernels(DeviceInfo* dinfo) {
  const int dt = std::is_same_v<T, cutlass::bfloat16_t> ? 0 : 1;
  if (__atomic_load_n(&dinfo->smem_ready[dt], __ATOMIC_ACQUIRE)) return Status::Ok();
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_prep<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kPrepSmem),
               "cudaFuncSetAttribute(gdn_prep)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_recur_ws<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RecWsCfg::kSmem),
               "cudaFuncSetAttribute(gdn_recur_ws)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_bwd_reverse<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)RevCfg::kSmem),
               "cudaFuncSetAttribute(gdn_bwd_reverse)");
  QLA_CUDA_TRY(cudaFuncSetAttribute(gdn_bwd_grads<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kGradSmem),
               "cudaFuncSetAttribute(gdn_bwd_grads)");
  cudaFuncAttributes attr;
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_chunk_table), "cudaFuncGetAttributes(gdn_chunk_table)");
  QLA_CUDA_TRY(cudaFuncGetAttributes(&attr, gdn_bwd_finish<T>), "cudaFuncGetAttributes(gdn_bwd_finish)");
  __atomic_store_n(&dinfo->smem_ready[dt], true, __ATOMIC_RELEASE);
  return Status::Ok();
}

template <class T>
Status bwd_launch(const GdnBackwardParams& p) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const BwdWs wl = bwd_ws_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(p.workspace);
  const int N = static_cast<int>(num_seqs(p));
  const int H = static_cast<int>(p.shape.num_qk_heads), HV = static_cast<int>(p.shape.num_v_heads);
  const int64_t mc = max_chunks(p);
  if (N == 0) return Status::Ok();

  DeviceInfo* dinfo = nullptr;
  Status ds = device_info(&dinfo);
  if (ds.ok()) ds = bwd_prepare_kernels<T>(dinfo);
  if (!ds.ok()) return ds;

  CUtensorMap tmq, tmk, tmv, tmdo, tmdo32;
  Status ms = make_tile_map(&tmq, p.q, H, p.shape);
  if (ms.ok()) ms = make_tile_map(&tmk, p.k, H, p.shape);
  if (ms.ok()) ms = make_tile_map(&tmv, p.v, HV, p.shape);
  if (ms.ok()) ms = make_tile_map(&tmdo, p.d_o, HV, p.shape);
  if (ms.ok()) ms = make_tile_map(&tmdo32, p.d_o, HV, p.shape, 32);
  if (!ms.ok()) return ms;

  const SeqDesc sd = seq_desc(p);
  int* table = reinterpret_cast<int*>(ws);
  const int64_t nregions = mc * HV;

  gdn_chunk_table<<<1, 1024, 0, stream>>>(sd, N, table, nullptr, 0);
  QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_chunk_table");

  if (mc > 0) {  // 2. prep with Tm
    PrepParams pp = chunk_params(p, sd, N, table);
    pp.tmq = tmq;
    pp.tmk = tmk;
    pp.tmv = tmv;
    pp.regions = ws + wl.regions;
    pp.tm = ws + wl.tm;
    const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(dinfo->sms, (nregions + 1) / 2)));
    gdn_prep<T><<<grid, 256, kPrepSmem, stream>>>(pp);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_prep");
  }

  // The two sequential passes run the warp-specialized V-tile-32 kernels on every shape: measured
  // faster than the V-tile-64 pair even at 16/32 8192x4 (512 CTAs; docs/design.md, bwd-5).
  {  // 3. states entering every chunk
    RecParams rp{};
    rp.tmq = tmq;
    rp.tmk = tmk;
    rp.sd = sd;
    rp.chunk_off = table;
    rp.regions = ws + wl.regions;
    rp.h0 = static_cast<const float*>(p.initial_state.data);
    for (int i = 0; i < 3; ++i) rp.sh0[i] = p.initial_state.stride[i];
    rp.vk = p.state_layout == StateLayout::kVK;
    rp.N = N;
    rp.H = H;
    rp.HV = HV;
    rp.states = ws + wl.states;
    // No output; o = dv only takes the NaN fill on malformed cu_seqlens (launch 6 fills them all).
    rp.o = p.dv.data;
    for (int i = 0; i < 3; ++i) rp.so[i] = p.dv.stride[i];
    gdn_recur_ws<T, true><<<seq_grid(N, HV, kDV / kWsVT), 288, RecWsCfg::kSmem, stream>>>(rp);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_recur (states)");
  }

  {  // 4. reverse chain
    RevParams rv{};
    rv.tmq = tmq;
    rv.tmk = tmk;
    rv.tmdo32 = tmdo32;
    rv.sd = sd;
    rv.chunk_off = table;
    rv.regions = ws + wl.regions;
    rv.dht = static_cast<const float*>(p.d_final_state.data);
    rv.dh0 = static_cast<float*>(p.d_initial_state.data);
    for (int i = 0; i < 3; ++i) { rv.sdht[i] = p.d_final_state.stride[i]; rv.sdh0[i] = p.d_initial_state.stride[i]; }
    rv.vk = p.state_layout == StateLayout::kVK;
    rv.dsn = ws + wl.dsn;
    rv.du = ws + wl.du;
    rv.N = N;
    rv.H = H;
    rv.HV = HV;
    gdn_bwd_reverse<T><<<seq_grid(N, HV, kDV / kRevVT), 288, RevCfg::kSmem, stream>>>(rv);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_reverse");
  }

  if (nregions > 0) {  // 5. chunk-local gradients
    GradParams gp{};
    gp.tmq = tmq; gp.tmk = tmk; gp.tmv = tmv; gp.tmdo = tmdo;
    for (int i = 0; i < 3; ++i) gp.sdv[i] = p.dv.stride[i];
    gp.g = p.g.data; gp.beta = p.beta.data;
    for (int i = 0; i < 2; ++i) {
      gp.sg[i] = p.g.stride[i]; gp.sb[i] = p.beta.stride[i]; gp.sdg[i] = p.dg.stride[i]; gp.sdb[i] = p.dbeta.stride[i];
    }
    gp.g_dt = static_cast<int>(p.g.dtype);
    gp.b_dt = static_cast<int>(p.beta.dtype);
    gp.sd = sd;
    gp.N = N; gp.H = H; gp.HV = HV;
    gp.T = p.shape.seqlen;
    gp.chunk_off = table;
    gp.regions = ws + wl.regions;
    gp.tm = ws + wl.tm;
    gp.states = ws + wl.states;
    gp.dsn = ws + wl.dsn;
    gp.du = ws + wl.du;
    gp.dqp = reinterpret_cast<float*>(ws + wl.dqp);
    gp.dkp = reinterpret_cast<float*>(ws + wl.dkp);
    gp.dv = p.dv.data;
    gp.dg = p.dg.data;
    gp.dg_dt = static_cast<int>(p.dg.dtype);
    gp.dbeta = p.dbeta.data;
    gp.db_dt = static_cast<int>(p.dbeta.dtype);
    gp.scale = static_cast<float>(p.scale);
    gdn_bwd_grads<T><<<static_cast<unsigned>(nregions), 256, kGradSmem, stream>>>(gp);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_grads");
  }

  {  // 6. dq, dk group sums
    FinishParams fp{};
    fp.dqp = ws + wl.dqp;
    fp.dkp = ws + wl.dkp;
    fp.partial_bytes = 4;
    fp.dq = p.dq.data;
    fp.dk = p.dk.data;
    fp.dq_vec16 = rows_vec16(p.dq);
    fp.dk_vec16 = rows_vec16(p.dk);
    for (int i = 0; i < 3; ++i) {
      fp.sdq[i] = p.dq.stride[i]; fp.sdk[i] = p.dk.stride[i]; fp.sdv[i] = p.dv.stride[i]; fp.sdh0[i] = p.d_initial_state.stride[i];
    }
    fp.B = p.shape.batch;
    fp.T = p.shape.seqlen;
    fp.H = H; fp.HV = HV; fp.N = N;
    fp.chunk_off = table;
    fp.dv = p.dv.data;
    fp.dg = p.dg.data;
    fp.dbeta = p.dbeta.data;
    for (int i = 0; i < 2; ++i) { fp.sdg[i] = p.dg.stride[i]; fp.sdb[i] = p.dbeta.stride[i]; }
    fp.dg_dt = static_cast<int>(p.dg.dtype);
    fp.db_dt = static_cast<int>(p.dbeta.dtype);
    fp.dh0 = static_cast<float*>(p.d_initial_state.data);
    const int64_t work = std::max<int64_t>(p.shape.batch * p.shape.seqlen * H * (kDK / 8), 1);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>((work + 255) / 256, int64_t(dinfo->sms) * 8));
    gdn_bwd_finish<T><<<grid, 256, 0, stream>>>(fp);
    QLA_CUDA_TRY(cudaGetLastError(), "launch gdn_bwd_finish");
  }
  return Status::Ok();
}

// Which backward runs (the one place that decides): the fused backward (gdn_fwd_sm90.cu: states
// pass, reverse step, finish) or the chunked one, by the call's (sequence, value head) pairs and
// the sequences' mean length in chunks, from the host's shape (cu_seqlens may be on the device
// alone). Fused / chunked time on the backward grid's 32 shapes (H100, fiftieth session, with
// the step's fill plan; bench/results/h200.md):
// - at most 16 pairs: 0.38-0.87 on every row;
// - 32 and 64 pairs: 0.72-0.98 where the (ragged) sequences average 32 chunks or more (16/32 in
//   two sequences of 8192 tokens 1.01), 1.12-1.17 where they average 16: the pieces are then
//   at most 8 chunks of ~17 us on one SM, each with a CTA's fixed ~60 us, and the chunked
//   backward's chunk-parallel kernels fill the SMs better;
// - 128 and 256 pairs (one piece a pair): 0.68-0.93 at 32 value heads, 1.16-1.18 at 16 (more
//   pairs are not measured).
// And always when the caller asks for pieces (split = kOn: only it splits) or for batch
// invariance (a choice by the call's shape would let the rest of the batch pick the path).
constexpr int64_t kFusedBwdAnyPairs = 16;
constexpr int64_t kFusedBwdMaxPairs = 64;
constexpr int64_t kFusedBwdMinChunks = 32;
constexpr int64_t kFusedBwdWideHeads = 32;      // value heads from which more pairs stay fused,
constexpr int64_t kFusedBwdWideMaxPairs = 256;  // up to the grid's largest pair count
#ifdef QLA_SM90_TEST_HOOKS
int g_test_bwd_path = 0;  // test builds: 1 the chunked backward, 2 the fused one, 0 the rule below
#endif
bool fused_backward_chosen(const GdnBackwardParams& p) {
#ifdef QLA_SM90_TEST_HOOKS
  if (g_test_bwd_path) return g_test_bwd_path == 2;
#endif
  if (p.split == SplitMode::kOn || p.batch_invariant) return true;
  const int64_t seqs = num_seqs(p), pairs = seqs * p.shape.num_v_heads;
  if (pairs <= kFusedBwdAnyPairs) return true;
  if (pairs > kFusedBwdMaxPairs) return p.shape.num_v_heads >= kFusedBwdWideHeads && pairs <= kFusedBwdWideMaxPairs;
  const int64_t tokens = p.cu_seqlens.data ? p.shape.seqlen : p.shape.batch * p.shape.seqlen;
  return tokens >= seqs * kFusedBwdMinChunks * kC;
}

}  // namespace

#ifdef QLA_SM90_TEST_HOOKS
void set_test_backward_path(int path) { g_test_bwd_path = path; }
#endif

Status prepare_backward() {
  DeviceInfo* dinfo = nullptr;
  Status s = hopper_device_info(&dinfo);
  if (s.ok()) s = bwd_prepare_kernels<cutlass::bfloat16_t>(dinfo);
  if (s.ok()) s = bwd_prepare_kernels<cutlass::half_t>(dinfo);
  return s;
}

Status backward_workspace_size(const GdnBackwardParams& p, size_t* bytes) {
  if (!bytes) return Status::Error(StatusCode::kInvalidArgument, "sm90 backward: bytes is null");
  *bytes = 0;
  Status s = bwd_check_supported(p);
  if (!s.ok()) return s;
  if (fused_backward_chosen(p)) return fused_backward_workspace_size(p, bytes);
  *bytes = bwd_ws_layout(p).total;
  return Status::Ok();
}

Status backward(const GdnBackwardParams& p) {
  Status s = bwd_check_supported(p);
  if (!s.ok()) return s;
  if (fused_backward_chosen(p)) return fused_backward(p);
  s = check_workspace("sm90 backward", p.workspace, p.workspace_bytes, bwd_ws_layout(p).total);
  if (!s.ok()) return s;
  if (p.q.dtype == DType::kBFloat16) return bwd_launch<cutlass::bfloat16_t>(p);
  return bwd_launch<cutlass::half_t>(p);
}

}  // namespace sm90
}  // namespace qla
