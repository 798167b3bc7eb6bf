#include "core/validate.h"

#include <cmath>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace qla {
namespace {

Status invalid(const std::string& msg) { return Status::Error(StatusCode::kInvalidArgument, msg); }

bool is_float(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32 || d == DType::kFloat64;
}

std::string dt(DType d) { return dtype_name(d); }

// Common shape rules.
Status check_shape(const GdnShape& s) {
  std::ostringstream os;
  if (s.batch < 0 || s.seqlen < 0 || s.num_qk_heads <= 0 || s.num_v_heads <= 0 || s.head_dim_k <= 0 ||
      s.head_dim_v <= 0) {
    os << "shape: expected B >= 0, T >= 0 and positive H, HV, K, V; got B=" << s.batch << " T=" << s.seqlen
       << " H=" << s.num_qk_heads << " HV=" << s.num_v_heads << " K=" << s.head_dim_k << " V=" << s.head_dim_v;
    return invalid(os.str());
  }
  if (s.num_v_heads % s.num_qk_heads != 0) {
    os << "v: expected the number of value heads (" << s.num_v_heads
       << ") to be a multiple of the number of q/k heads (" << s.num_qk_heads << ")";
    return invalid(os.str());
  }
  if (s.head_dim_k > 256 || s.head_dim_v > 256) {
    os << "shape: head dims up to 256 are supported; got K=" << s.head_dim_k << " V=" << s.head_dim_v;
    return Status::Error(StatusCode::kNotSupported, os.str());
  }
  return Status::Ok();
}

Status check_ptr(const char* name, const void* data, bool needed) {
  if (needed && data == nullptr) return invalid(std::string(name) + ": expected a data pointer, got null");
  return Status::Ok();
}

Status check_dtype(const char* name, DType got, DType expected) {
  if (got != expected)
    return invalid(std::string(name) + ": expected dtype " + dt(expected) + ", got " + dt(got));
  return Status::Ok();
}

Status check_float(const char* name, DType got) {
  if (!is_float(got))
    return invalid(std::string(name) + ": expected a float dtype (float16, bfloat16, float32, float64), got " + dt(got));
  return Status::Ok();
}

// Validates cu_seqlens when a host copy is available (always on the CPU backend).
Status check_cu_seqlens(const TensorRef& cu, int64_t num_seqs, const int64_t* host, const GdnShape& s, Device dev,
                        std::vector<int64_t>* out) {
  if (cu.data == nullptr) return Status::Ok();
  if (cu.dtype != DType::kInt32 && cu.dtype != DType::kInt64)
    return invalid("cu_seqlens: expected dtype int32 or int64, got " + dt(cu.dtype));
  if (s.batch != 1) {
    std::ostringstream os;
    os << "cu_seqlens: expected batch size 1 when cu_seqlens is given, got B=" << s.batch;
    return invalid(os.str());
  }
  if (num_seqs < 0) return invalid("cu_seqlens: expected num_seqs >= 0, got " + std::to_string(num_seqs));
  if (num_seqs == 0 && s.seqlen > 0) {  // [0] alone cannot end at T: known from the shapes, device values or not
    std::ostringstream os;
    os << "cu_seqlens: expected at least two entries (0, ..., T=" << s.seqlen << ") for " << s.seqlen
       << " tokens, got num_seqs=0";
    return invalid(os.str());
  }
  std::vector<int64_t> vals;
  if (host) {
    vals.assign(host, host + num_seqs + 1);
  } else if (dev == Device::kCpu) {
    vals.resize(num_seqs + 1);
    for (int64_t i = 0; i <= num_seqs; ++i)
      vals[i] = cu.dtype == DType::kInt32 ? static_cast<const int32_t*>(cu.data)[i]
                                          : static_cast<const int64_t*>(cu.data)[i];
  } else {
    return Status::Ok();  // device values without a host copy: checked by the caller or not at all
  }
  if (vals[0] != 0) return invalid("cu_seqlens: expected the first entry to be 0, got " + std::to_string(vals[0]));
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (vals[i + 1] < vals[i]) {
      std::ostringstream os;
      os << "cu_seqlens: expected non-decreasing values, got " << vals[i] << " then " << vals[i + 1] << " at index "
         << i + 1;
      return invalid(os.str());
    }
  }
  if (vals[num_seqs] != s.seqlen) {
    std::ostringstream os;
    os << "cu_seqlens: expected the last entry to equal the number of tokens T=" << s.seqlen << ", got "
       << vals[num_seqs];
    return invalid(os.str());
  }
  if (out) *out = std::move(vals);
  return Status::Ok();
}

#define QLA_TRY(expr)            \
  do {                           \
    Status _s = (expr);          \
    if (!_s.ok()) return _s;     \
  } while (0)

// States are fp32; with fp64 inputs (CPU) they may also be fp64. The forward's states may also
// be bf16 or fp16 (an inference engine's state cache, read and rounded to nearest once per call;
// the arithmetic stays fp32) with 16-bit or fp32 inputs; the backward's stay fp32.
Status check_state(const char* name, const void* data, DType dtype, DType qdtype, bool allow_16bit = false) {
  if (data == nullptr) return Status::Ok();
  if (dtype == DType::kFloat32 || (dtype == DType::kFloat64 && qdtype == DType::kFloat64)) return Status::Ok();
  const bool half = dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  if (allow_16bit && half && qdtype != DType::kFloat64) return Status::Ok();
  return invalid(std::string(name) + ": expected dtype float32 (or float64 with float64 inputs" +
                 (allow_16bit ? "; bfloat16 or float16 with 16-bit or float32 inputs" : "") + "), got " + dt(dtype));
}

// A state pool's indices (GdnForwardParams::initial_state_indices / final_state_indices): int32
// or int64 [N] beside a pool; on the CPU (host memory) each value, negative (none) or below the
// pool's slots, into *vals.
Status check_pool_indices(const char* name, const TensorRef& idx, const char* pool_name, const void* pool,
                          const char* slots_name, int64_t slots, int64_t n, Device dev, std::vector<int64_t>* vals) {
  if (idx.data == nullptr) return Status::Ok();
  if (idx.dtype != DType::kInt32 && idx.dtype != DType::kInt64)
    return invalid(std::string(name) + ": expected dtype int32 or int64, got " + dt(idx.dtype));
  if (pool == nullptr)
    return invalid(std::string(name) + ": expected " + pool_name + " (the pool its entries index) to be given, got null");
  if (slots < 0)
    return invalid(std::string(slots_name) + ": expected the pool's slot count (>= 0), got " + std::to_string(slots));
  if (dev != Device::kCpu) return Status::Ok();  // device values: checked on the device (NaN outputs)
  vals->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x = idx.dtype == DType::kInt32 ? static_cast<const int32_t*>(idx.data)[i]
                                                 : static_cast<const int64_t*>(idx.data)[i];
    if (x >= slots) {
      std::ostringstream os;
      os << name << ": expected entries below " << slots_name << "=" << slots << " (negative: no state), got " << x
         << " at index " << i;
      return invalid(os.str());
    }
    (*vals)[i] = x;
  }
  return Status::Ok();
}

template <typename P>
Status check_common(const P& p, bool states_16bit) {
  QLA_TRY(check_shape(p.shape));
  if (p.device != Device::kCpu && p.device != Device::kCuda)
    return invalid("device: expected kCpu or kCuda, got " + std::to_string(static_cast<int>(p.device)));
  if (p.state_layout != StateLayout::kKV && p.state_layout != StateLayout::kVK)
    return invalid("state_layout: expected kKV or kVK, got " + std::to_string(static_cast<int>(p.state_layout)));
  if (!std::isfinite(p.scale)) return invalid("scale: expected a finite number, got " + std::to_string(p.scale));
  if (p.q.dtype != DType::kFloat64 && std::fabs(p.scale) > 3.4028234663852886e38) {  // FLT_MAX
    std::ostringstream os;
    os << "scale: expected |scale| <= 3.4e38 (fp32, the precision of the computation for " << dt(p.q.dtype)
       << " inputs), got " << p.scale;
    return invalid(os.str());
  }
  const bool has_tokens = p.shape.batch * p.shape.seqlen > 0;
  QLA_TRY(check_ptr("q", p.q.data, has_tokens));
  QLA_TRY(check_ptr("k", p.k.data, has_tokens));
  QLA_TRY(check_ptr("v", p.v.data, has_tokens));
  QLA_TRY(check_ptr("g", p.g.data, has_tokens));
  QLA_TRY(check_ptr("beta", p.beta.data, has_tokens));
  QLA_TRY(check_float("q", p.q.dtype));
  QLA_TRY(check_dtype("k", p.k.dtype, p.q.dtype));
  QLA_TRY(check_dtype("v", p.v.dtype, p.q.dtype));
  QLA_TRY(check_float("g", p.g.dtype));
  QLA_TRY(check_float("beta", p.beta.dtype));
  QLA_TRY(check_state("initial_state", p.initial_state.data, p.initial_state.dtype, p.q.dtype, states_16bit));
  return check_cu_seqlens(p.cu_seqlens, p.num_seqs, p.cu_seqlens_host, p.shape, p.device, nullptr);
}

Status check_split(SplitMode split, int split_chunks) {
  const int sm = static_cast<int>(split);
  if (sm < 0 || sm > 2) return invalid("split: expected SplitMode kAuto, kOff or kOn, got " + std::to_string(sm));
  if (split_chunks < 0) return invalid("split_chunks: expected >= 0 (0: automatic), got " + std::to_string(split_chunks));
  return Status::Ok();
}

}  // namespace

Status validate_forward(const GdnForwardParams& p) {
  QLA_TRY(check_common(p, true));
  const bool has_tokens = p.shape.batch * p.shape.seqlen > 0;
  QLA_TRY(check_ptr("o", p.o.data, has_tokens));
  QLA_TRY(check_dtype("o", p.o.dtype, p.q.dtype));
  QLA_TRY(check_state("final_state", p.final_state.data, p.final_state.dtype, p.q.dtype, true));
  QLA_TRY(check_split(p.split, p.split_chunks));
  const int64_t n = p.cu_seqlens.data ? p.num_seqs : p.shape.batch;
  std::vector<int64_t> reads, writes;
  QLA_TRY(check_pool_indices("initial_state_indices", p.initial_state_indices, "initial_state", p.initial_state.data,
                             "initial_state_slots", p.initial_state_slots, n, p.device, &reads));
  QLA_TRY(check_pool_indices("final_state_indices", p.final_state_indices, "final_state", p.final_state.data,
                             "final_state_slots", p.final_state_slots, n, p.device, &writes));
  if (!writes.empty()) {  // no two sequences write one slot
    std::unordered_map<int64_t, int64_t> writer;
    for (int64_t i = 0; i < n; ++i) {
      if (writes[i] < 0) continue;
      auto it = writer.emplace(writes[i], i);
      if (!it.second) {
        std::ostringstream os;
        os << "final_state_indices: expected distinct slots, got " << writes[i] << " at indices " << it.first->second
           << " and " << i;
        return invalid(os.str());
      }
    }
  }
  if (p.initial_state.data && p.final_state.data && forward_states_overlap(p)) {
    // Shared memory must be one tensor (one pool: the same pointer, dtype and strides), in which
    // no sequence reads a slot another writes (the kernels read every state before any is written
    // only under that rule). Without indices sequence n's slot is n.
    const TensorRef& a = p.initial_state;
    const MutTensorRef& b = p.final_state;
    if (a.data != b.data || a.dtype != b.dtype || a.stride[0] != b.stride[0] || a.stride[1] != b.stride[1] ||
        a.stride[2] != b.stride[2])
      return invalid("final_state: expected memory apart from initial_state's, or the same tensor (one pool: the same "
                     "pointer, dtype and strides); got overlapping memory of another view");
    if (p.device == Device::kCpu || (!p.initial_state_indices.data && !p.final_state_indices.data)) {
      auto slot = [&](const std::vector<int64_t>& v, const TensorRef& idx, int64_t i) {
        return idx.data ? v[i] : i;
      };
      std::unordered_map<int64_t, int64_t> writer;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t w = slot(writes, p.final_state_indices, i);
        if (w >= 0) writer.emplace(w, i);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = slot(reads, p.initial_state_indices, i);
        auto it = r >= 0 ? writer.find(r) : writer.end();
        if (it != writer.end() && it->second != i) {
          std::ostringstream os;
          os << (p.initial_state_indices.data ? "initial_state_indices" : "final_state_indices") << ": slot " << r
             << " (read by sequence " << i
             << ") is written by another sequence (sequence " << it->second
             << ") in the same pool; expected a sequence to read only slots no other sequence writes";
          return invalid(os.str());
        }
      }
    }
  }
  return Status::Ok();
}

Status validate_backward(const GdnBackwardParams& p) {
  QLA_TRY(check_common(p, false));
  const bool has_tokens = p.shape.batch * p.shape.seqlen > 0;
  QLA_TRY(check_ptr("do", p.d_o.data, has_tokens));
  QLA_TRY(check_dtype("do", p.d_o.dtype, p.q.dtype));
  QLA_TRY(check_state("d_final_state", p.d_final_state.data, p.d_final_state.dtype, p.q.dtype));
  QLA_TRY(check_ptr("dq", p.dq.data, has_tokens));
  QLA_TRY(check_ptr("dk", p.dk.data, has_tokens));
  QLA_TRY(check_ptr("dv", p.dv.data, has_tokens));
  QLA_TRY(check_ptr("dg", p.dg.data, has_tokens));
  QLA_TRY(check_ptr("dbeta", p.dbeta.data, has_tokens));
  QLA_TRY(check_dtype("dq", p.dq.dtype, p.q.dtype));
  QLA_TRY(check_dtype("dk", p.dk.dtype, p.q.dtype));
  QLA_TRY(check_dtype("dv", p.dv.dtype, p.q.dtype));
  QLA_TRY(check_float("dg", p.dg.dtype));
  QLA_TRY(check_float("dbeta", p.dbeta.dtype));
  QLA_TRY(check_state("d_initial_state", p.d_initial_state.data, p.d_initial_state.dtype, p.q.dtype));
  QLA_TRY(check_split(p.split, p.split_chunks));
  return Status::Ok();
}

}  // namespace qla
