// Argument checks shared by every backend. Each failure names the argument,
// what was expected and what came.
#pragma once

#include <cstdint>

#include "qla/qla.h"

namespace qla {

Status validate_forward(const GdnForwardParams& p);
Status validate_backward(const GdnBackwardParams& p);

// The bytes [first, last] a state tensor of `count` states of HV heads spans (first > last: none).
struct ByteSpan {
  uintptr_t first = 1, last = 0;
};
inline ByteSpan state_bytes(const void* data, DType dtype, const int64_t* st, int64_t count, const GdnShape& s,
                            StateLayout layout) {
  if (!data || count <= 0) return {};
  const int64_t rows = layout == StateLayout::kKV ? s.head_dim_k : s.head_dim_v;
  const int64_t cols = layout == StateLayout::kKV ? s.head_dim_v : s.head_dim_k;
  int64_t lo = 0, hi = cols - 1;  // element offsets (strides may be negative)
  for (int64_t ext : {(count - 1) * st[0], (s.num_v_heads - 1) * st[1], (rows - 1) * st[2]}) (ext < 0 ? lo : hi) += ext;
  const int64_t size = dtype == DType::kFloat64 ? 8 : dtype == DType::kBFloat16 || dtype == DType::kFloat16 ? 2 : 4;
  const auto at = reinterpret_cast<uintptr_t>(data);
  return {at + static_cast<uintptr_t>(lo * size), at + static_cast<uintptr_t>(hi * size + size - 1)};
}

// Whether the forward's initial and final states (or pools) share any byte: the memory each
// spans, from its pointer, strides and state count (the pool's slots with indices, else N).
inline bool forward_states_overlap(const GdnForwardParams& p) {
  const int64_t n = p.cu_seqlens.data ? p.num_seqs : p.shape.batch;
  const ByteSpan a = state_bytes(p.initial_state.data, p.initial_state.dtype, p.initial_state.stride,
                                 p.initial_state_indices.data ? p.initial_state_slots : n, p.shape, p.state_layout);
  const ByteSpan b = state_bytes(p.final_state.data, p.final_state.dtype, p.final_state.stride,
                                 p.final_state_indices.data ? p.final_state_slots : n, p.shape, p.state_layout);
  return a.first <= a.last && b.first <= b.last && a.first <= b.last && b.first <= a.last;
}

// Sequence boundaries for (n): [begin, end) in the packed token axis of batch row `row`.
// `cu` is a host array of N + 1 entries or nullptr (then sequence n is batch row n).
struct SeqSpan {
  int64_t row, begin, end;
};
inline SeqSpan seq_span(const int64_t* cu, int64_t n, int64_t seqlen) {
  if (cu) return {0, cu[n], cu[n + 1]};
  return {n, 0, seqlen};
}

}  // namespace qla
