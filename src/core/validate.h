// Argument checks shared by every backend. Each failure names the argument,
// what was expected and what came.
#pragma once

#include "qla/qla.h"

namespace qla {

Status validate_forward(const GdnForwardParams& p);
Status validate_backward(const GdnBackwardParams& p);

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
