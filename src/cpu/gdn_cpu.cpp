// CPU backend: the exact token-by-token recurrence, forward and backward.
//
// Accumulation is fp32 (fp64 for fp64 inputs). Work is split over (sequence, head)
// tasks on a pool of threads. The backward keeps one state checkpoint every
// kBlock tokens and recomputes the states inside a block, so its memory is
// O(T / kBlock * K * V) per task, never one state per token.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends.h"
#include "core/half_convert.h"
#include "core/validate.h"

namespace qla::cpu {
namespace {

constexpr int64_t kBlock = 64;  // tokens between backward checkpoints

// Hot loops: built twice on x86-64 (baseline and AVX2+FMA), picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define QLA_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define QLA_VECTOR_CLONES
#endif

// ---------------------------------------------------------------------------
// Element access
// ---------------------------------------------------------------------------
template <typename Acc>
inline Acc load_elem(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat16: return static_cast<Acc>(fp16_to_float(static_cast<const uint16_t*>(base)[i]));
    case DType::kBFloat16: return static_cast<Acc>(bf16_to_float(static_cast<const uint16_t*>(base)[i]));
    case DType::kFloat32: return static_cast<Acc>(static_cast<const float*>(base)[i]);
    case DType::kFloat64: return static_cast<Acc>(static_cast<const double*>(base)[i]);
    default: return Acc(0);
  }
}

template <typename Acc>
inline void store_elem(void* base, DType dt, int64_t i, Acc x) {
  switch (dt) {
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_fp16(static_cast<float>(x)); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(static_cast<float>(x)); break;
    case DType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(x); break;
    case DType::kFloat64: static_cast<double*>(base)[i] = static_cast<double>(x); break;
    default: break;
  }
}

// Offset of element (b, t, h, 0) of a 4-D tensor, and (b, t, h) of a 3-D one.
inline int64_t off4(const int64_t* st, int64_t b, int64_t t, int64_t h) { return b * st[0] + t * st[1] + h * st[2]; }
inline int64_t off3(const int64_t* st, int64_t b, int64_t t, int64_t h) { return b * st[0] + t * st[1] + h; }

template <typename Acc>
void load_row(const TensorRef& r, int64_t offset, int64_t n, Acc* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_elem<Acc>(r.data, r.dtype, offset + i);
}

template <typename Acc>
void store_row(const MutTensorRef& r, int64_t offset, int64_t n, const Acc* src) {
  for (int64_t i = 0; i < n; ++i) store_elem<Acc>(r.data, r.dtype, offset + i, src[i]);
}

// State matrices are K x V row-major in Acc internally; in memory they are fp32 (or
// fp64 with fp64 inputs), [N, HV, K, V] or [N, HV, V, K] with strides {n, hv, row}.
template <typename Acc>
void load_state(const TensorRef& r, StateLayout layout, int64_t n, int64_t hv, int64_t K, int64_t V, Acc* S) {
  const int64_t base = n * r.stride[0] + hv * r.stride[1];
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j)
      S[i * V + j] = load_elem<Acc>(r.data, r.dtype,
                                    base + (layout == StateLayout::kKV ? i * r.stride[2] + j : j * r.stride[2] + i));
}

template <typename Acc>
void store_state(const MutTensorRef& r, StateLayout layout, int64_t n, int64_t hv, int64_t K, int64_t V,
                 const Acc* S) {
  const int64_t base = n * r.stride[0] + hv * r.stride[1];
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j)
      store_elem<Acc>(r.data, r.dtype,
                      base + (layout == StateLayout::kKV ? i * r.stride[2] + j : j * r.stride[2] + i), S[i * V + j]);
}

// Sequence n's state slot: n without a pool's indices, else its entry (negative: none).
inline int64_t pool_slot(const TensorRef& idx, int64_t n) {
  if (idx.data == nullptr) return n;
  return idx.dtype == DType::kInt32 ? static_cast<const int32_t*>(idx.data)[n] : static_cast<const int64_t*>(idx.data)[n];
}

// ---------------------------------------------------------------------------
// Thread pool: dynamic scheduling of task indices over num_threads threads.
// ---------------------------------------------------------------------------
template <typename Fn>
Status parallel_for(int64_t num_tasks, int num_threads, Fn&& fn) {
  if (num_tasks <= 0) return Status::Ok();
  int64_t threads = num_threads > 0 ? num_threads : static_cast<int64_t>(std::thread::hardware_concurrency());
  threads = std::max<int64_t>(1, std::min(threads, num_tasks));
  std::atomic<int64_t> next{0};
  std::mutex err_mu;
  std::string err;
  auto worker = [&] {
    try {
      for (int64_t i = next++; i < num_tasks; i = next++) fn(i);
    } catch (const std::exception& e) {  // e.g. bad_alloc for a huge state; never abort
      std::lock_guard<std::mutex> lock(err_mu);
      err = e.what();
      next = num_tasks;
    }
  };
  std::vector<std::thread> pool;
  try {
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  } catch (const std::exception& e) {
    // Could not start all threads: the ones that started plus this one still finish the work.
  }
  worker();
  for (auto& th : pool) th.join();
  if (!err.empty()) return Status::Error(StatusCode::kInternal, "cpu backend: " + err);
  return Status::Ok();
}

std::vector<SeqSpan> sequences(const TensorRef& cu, int64_t num_seqs, const int64_t* host, const GdnShape& s) {
  std::vector<SeqSpan> out;
  if (cu.data == nullptr) {
    for (int64_t b = 0; b < s.batch; ++b) out.push_back(seq_span(nullptr, b, s.seqlen));
    return out;
  }
  std::vector<int64_t> vals(num_seqs + 1);
  for (int64_t i = 0; i <= num_seqs; ++i)
    vals[i] = host                         ? host[i]
              : cu.dtype == DType::kInt32 ? static_cast<const int32_t*>(cu.data)[i]
                                          : static_cast<const int64_t*>(cu.data)[i];
  for (int64_t n = 0; n < num_seqs; ++n) out.push_back(seq_span(vals.data(), n, s.seqlen));
  return out;
}

// ---------------------------------------------------------------------------
// Row kernels (the inner loops over V)
// ---------------------------------------------------------------------------
// y += a * x
template <typename Acc>
QLA_VECTOR_CLONES void axpy(int64_t n, Acc a, const Acc* __restrict x, Acc* __restrict y) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// dst = alpha * src + k_i * u (dst may alias src).
template <typename Acc>
QLA_VECTOR_CLONES void update_row(int64_t n, Acc alpha, Acc k_i, const Acc* u, const Acc* src, Acc* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = alpha * src[j] + k_i * u[j];
}

// Forward token update of one state row: s = alpha*s + k_i*u; o += q_i*s.
template <typename Acc>
QLA_VECTOR_CLONES void forward_row(int64_t n, Acc alpha, Acc k_i, Acc q_i, const Acc* __restrict u, Acc* __restrict s,
                                   Acc* __restrict o) {
  for (int64_t j = 0; j < n; ++j) {
    const Acc x = alpha * s[j] + k_i * u[j];
    s[j] = x;
    o[j] += q_i * x;
  }
}

// ---------------------------------------------------------------------------
// Forward: one task per (sequence, value head).
// ---------------------------------------------------------------------------
template <typename Acc>
void forward_task(const GdnForwardParams& p, const SeqSpan& seq, int64_t n, int64_t hv) {
  const int64_t K = p.shape.head_dim_k, V = p.shape.head_dim_v;
  const int64_t group = p.shape.num_v_heads / p.shape.num_qk_heads;
  const int64_t h = hv / group;
  std::vector<Acc> S(K * V, Acc(0)), q(K), k(K), v(V), u(V), o(V);
  const int64_t read_slot = pool_slot(p.initial_state_indices, n), write_slot = pool_slot(p.final_state_indices, n);
  if (p.initial_state.data && read_slot >= 0) load_state(p.initial_state, p.state_layout, read_slot, hv, K, V, S.data());
  const Acc scale = static_cast<Acc>(p.scale);
  for (int64_t t = seq.begin; t < seq.end; ++t) {
    load_row(p.q, off4(p.q.stride, seq.row, t, h), K, q.data());
    load_row(p.k, off4(p.k.stride, seq.row, t, h), K, k.data());
    load_row(p.v, off4(p.v.stride, seq.row, t, hv), V, v.data());
    const Acc alpha = std::exp(load_elem<Acc>(p.g.data, p.g.dtype, off3(p.g.stride, seq.row, t, hv)));
    const Acc beta = load_elem<Acc>(p.beta.data, p.beta.dtype, off3(p.beta.stride, seq.row, t, hv));
    // u = beta * (v - alpha * S^T k)
    std::fill(u.begin(), u.end(), Acc(0));
    for (int64_t i = 0; i < K; ++i) axpy(V, k[i], &S[i * V], u.data());
    for (int64_t j = 0; j < V; ++j) u[j] = beta * (v[j] - alpha * u[j]);
    // S = alpha * S + k u^T ; o = scale * S^T q
    std::fill(o.begin(), o.end(), Acc(0));
    for (int64_t i = 0; i < K; ++i) forward_row(V, alpha, k[i], q[i], u.data(), &S[i * V], o.data());
    for (int64_t j = 0; j < V; ++j) o[j] *= scale;
    store_row(p.o, off4(p.o.stride, seq.row, t, hv), V, o.data());
  }
  if (p.final_state.data && write_slot >= 0) store_state(p.final_state, p.state_layout, write_slot, hv, K, V, S.data());
}

// ---------------------------------------------------------------------------
// Backward: one task per (sequence, q/k head); the value heads of its group run in
// turn so that dq and dk sum over the group without races.
// ---------------------------------------------------------------------------
template <typename Acc>
struct BackwardScratch {
  std::vector<Acc> ckpt;    // state entering each block: [num_blocks, K, V]
  std::vector<Acc> states;  // S_t for the tokens of one block: [kBlock, K, V]
  std::vector<Acc> dS;      // gradient of the state: [K, V]
  std::vector<Acc> dq, dk;  // [len, K], summed over the group
};

// Pass A over the rows of one token (see backward_token).
template <typename Acc>
QLA_VECTOR_CLONES void backward_row_a(int64_t n, Acc k_i, Acc sq_i, const Acc* __restrict s_prev,
                                      const Acc* __restrict s_cur, const Acc* __restrict d_o, Acc* __restrict ds,
                                      Acc* __restrict kSp, Acc* __restrict du, Acc* dq_i) {
  Acc dq = 0;
  for (int64_t j = 0; j < n; ++j) {
    kSp[j] += k_i * s_prev[j];
    dq += s_cur[j] * d_o[j];
    const Acc d = ds[j] + sq_i * d_o[j];
    ds[j] = d;
    du[j] += k_i * d;
  }
  *dq_i = dq;
}

// Pass B over the rows of one token.
template <typename Acc>
QLA_VECTOR_CLONES void backward_row_b(int64_t n, Acc k_i, Acc alpha, const Acc* __restrict s_prev,
                                      const Acc* __restrict u, const Acc* __restrict w, Acc* __restrict ds,
                                      Acc* dk_i, Acc* dg_sum) {
  Acc dk_u = 0, dk_w = 0, dg = 0;
  for (int64_t j = 0; j < n; ++j) {
    const Acc d = ds[j];
    dk_u += d * u[j];
    dk_w += s_prev[j] * w[j];
    const Acc dprime = d - k_i * w[j];  // gradient w.r.t. the decayed state S'
    dg += dprime * s_prev[j];
    ds[j] = alpha * dprime;
  }
  *dk_i = dk_u - alpha * dk_w;
  *dg_sum += dg;
}

template <typename Acc>
void backward_head(const GdnBackwardParams& p, const SeqSpan& seq, int64_t n, int64_t hv, BackwardScratch<Acc>& sc) {
  const int64_t K = p.shape.head_dim_k, V = p.shape.head_dim_v, KV = K * V;
  const int64_t group = p.shape.num_v_heads / p.shape.num_qk_heads;
  const int64_t h = hv / group;
  const int64_t len = seq.end - seq.begin;
  const int64_t num_blocks = (len + kBlock - 1) / kBlock;
  const Acc scale = static_cast<Acc>(p.scale);
  std::vector<Acc> q(K), k(K), v(V), u(V), kSp(V), du(V), w(V), d_o(V), dv(V), dqi(K), dki(K);

  auto load_token = [&](int64_t t, Acc* alpha, Acc* beta) {
    load_row(p.q, off4(p.q.stride, seq.row, t, h), K, q.data());
    load_row(p.k, off4(p.k.stride, seq.row, t, h), K, k.data());
    load_row(p.v, off4(p.v.stride, seq.row, t, hv), V, v.data());
    *alpha = std::exp(load_elem<Acc>(p.g.data, p.g.dtype, off3(p.g.stride, seq.row, t, hv)));
    *beta = load_elem<Acc>(p.beta.data, p.beta.dtype, off3(p.beta.stride, seq.row, t, hv));
  };
  // One forward step dst = alpha src + k u^T (q unused here); dst may equal src.
  auto step = [&](const Acc* src, Acc* dst, Acc alpha, Acc beta) {
    std::fill(u.begin(), u.end(), Acc(0));
    for (int64_t i = 0; i < K; ++i) axpy(V, k[i], src + i * V, u.data());
    for (int64_t j = 0; j < V; ++j) u[j] = beta * (v[j] - alpha * u[j]);
    for (int64_t i = 0; i < K; ++i) update_row(V, alpha, k[i], u.data(), src + i * V, dst + i * V);
  };

  // 1. Forward pass keeping the state at the start of each block.
  sc.ckpt.assign(std::max<int64_t>(num_blocks, 1) * KV, Acc(0));
  std::vector<Acc> S(KV, Acc(0));
  if (p.initial_state.data) load_state(p.initial_state, p.state_layout, n, hv, K, V, S.data());
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    std::copy(S.begin(), S.end(), sc.ckpt.begin() + blk * KV);
    const int64_t t_end = std::min(len, (blk + 1) * kBlock);
    for (int64_t t = blk * kBlock; t < t_end; ++t) {
      Acc alpha, beta;
      load_token(seq.begin + t, &alpha, &beta);
      step(S.data(), S.data(), alpha, beta);
    }
  }

  // 2. Backward pass, block by block from the end, recomputing the block's states.
  sc.dS.assign(KV, Acc(0));
  if (p.d_final_state.data) load_state(p.d_final_state, p.state_layout, n, hv, K, V, sc.dS.data());
  sc.states.resize(kBlock * KV);
  for (int64_t blk = num_blocks - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * kBlock, t_end = std::min(len, t0 + kBlock);
    for (int64_t t = t0; t < t_end; ++t) {
      Acc alpha, beta;
      load_token(seq.begin + t, &alpha, &beta);
      const Acc* src = t == t0 ? &sc.ckpt[blk * KV] : &sc.states[(t - 1 - t0) * KV];
      step(src, &sc.states[(t - t0) * KV], alpha, beta);
    }
    for (int64_t t = t_end - 1; t >= t0; --t) {
      Acc alpha, beta;
      load_token(seq.begin + t, &alpha, &beta);
      load_row(p.d_o, off4(p.d_o.stride, seq.row, seq.begin + t, hv), V, d_o.data());
      const Acc* s_prev = t == t0 ? &sc.ckpt[blk * KV] : &sc.states[(t - 1 - t0) * KV];
      const Acc* s_cur = &sc.states[(t - t0) * KV];
      // Pass A: kSp = S_{t-1}^T k; dq = scale S_t do; dS += scale q do^T; du = dS^T k.
      std::fill(kSp.begin(), kSp.end(), Acc(0));
      std::fill(du.begin(), du.end(), Acc(0));
      for (int64_t i = 0; i < K; ++i)
        backward_row_a(V, k[i], scale * q[i], s_prev + i * V, s_cur + i * V, d_o.data(), &sc.dS[i * V], kSp.data(),
                       du.data(), &dqi[i]);
      // r = v - alpha kSp; u = beta r; dv = beta du; dbeta = du . r
      Acc dbeta = 0;
      for (int64_t j = 0; j < V; ++j) {
        const Acc r = v[j] - alpha * kSp[j];
        u[j] = beta * r;
        w[j] = beta * du[j];
        dbeta += du[j] * r;
      }
      // Pass B: dk = dS u - alpha S_{t-1} w; dS' = dS - k w^T; dg = <dS', S'>; dS = alpha dS'.
      Acc dg_sum = 0;
      for (int64_t i = 0; i < K; ++i)
        backward_row_b(V, k[i], alpha, s_prev + i * V, u.data(), w.data(), &sc.dS[i * V], &dki[i], &dg_sum);
      Acc* dq_row = &sc.dq[t * K];
      Acc* dk_row = &sc.dk[t * K];
      for (int64_t i = 0; i < K; ++i) {
        dq_row[i] += scale * dqi[i];
        dk_row[i] += dki[i];
      }
      const int64_t tt = seq.begin + t;
      store_row(p.dv, off4(p.dv.stride, seq.row, tt, hv), V, w.data());
      store_elem<Acc>(p.dg.data, p.dg.dtype, off3(p.dg.stride, seq.row, tt, hv), alpha * dg_sum);
      store_elem<Acc>(p.dbeta.data, p.dbeta.dtype, off3(p.dbeta.stride, seq.row, tt, hv), dbeta);
    }
  }
  if (p.d_initial_state.data) store_state(p.d_initial_state, p.state_layout, n, hv, K, V, sc.dS.data());
}

template <typename Acc>
Status forward_impl(const GdnForwardParams& p) {
  const auto seqs = sequences(p.cu_seqlens, p.num_seqs, p.cu_seqlens_host, p.shape);
  const int64_t HV = p.shape.num_v_heads;
  return parallel_for(static_cast<int64_t>(seqs.size()) * HV, p.num_threads, [&](int64_t task) {
    const int64_t n = task / HV, hv = task % HV;
    forward_task<Acc>(p, seqs[n], n, hv);
  });
}

template <typename Acc>
Status backward_impl(const GdnBackwardParams& p) {
  const auto seqs = sequences(p.cu_seqlens, p.num_seqs, p.cu_seqlens_host, p.shape);
  const int64_t H = p.shape.num_qk_heads, K = p.shape.head_dim_k;
  const int64_t group = p.shape.num_v_heads / H;
  return parallel_for(static_cast<int64_t>(seqs.size()) * H, p.num_threads, [&](int64_t task) {
    const int64_t n = task / H, h = task % H;
    const SeqSpan& seq = seqs[n];
    const int64_t len = seq.end - seq.begin;
    BackwardScratch<Acc> sc;
    sc.dq.assign(len * K, Acc(0));
    sc.dk.assign(len * K, Acc(0));
    for (int64_t hv = h * group; hv < (h + 1) * group; ++hv) backward_head<Acc>(p, seq, n, hv, sc);
    for (int64_t t = 0; t < len; ++t) {
      store_row(p.dq, off4(p.dq.stride, seq.row, seq.begin + t, h), K, &sc.dq[t * K]);
      store_row(p.dk, off4(p.dk.stride, seq.row, seq.begin + t, h), K, &sc.dk[t * K]);
    }
  });
}

}  // namespace

Status forward(const GdnForwardParams& p) {
  return p.q.dtype == DType::kFloat64 ? forward_impl<double>(p) : forward_impl<float>(p);
}

Status backward(const GdnBackwardParams& p) {
  return p.q.dtype == DType::kFloat64 ? backward_impl<double>(p) : backward_impl<float>(p);
}

}  // namespace qla::cpu
