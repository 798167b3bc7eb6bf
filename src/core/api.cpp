// Public entry points: validate, then dispatch to exactly one backend. This is the
// only place that chooses a backend.
#include "backends.h"
#include "core/validate.h"

namespace qla {

const char* version() { return QLA_VERSION_STRING; }

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

Status gdn_forward_workspace_size(const GdnForwardParams& p, size_t* bytes) {
  if (bytes == nullptr) return Status::Error(StatusCode::kInvalidArgument, "bytes: expected a pointer, got null");
  *bytes = 0;
  Status s = validate_forward(p);
  if (!s.ok() || p.device == Device::kCpu) return s;
  s = sm90::check_supported(p);
  if (!s.ok()) return s;
  return sm90::forward_workspace_size(p, bytes);
}

Status gdn_forward(const GdnForwardParams& p) {
  Status s = validate_forward(p);
  if (!s.ok()) return s;
  if (p.device == Device::kCpu) return cpu::forward(p);
  return sm90::forward(p);  // runs sm90::check_supported itself
}

Status gdn_backward_workspace_size(const GdnBackwardParams& p, size_t* bytes) {
  if (bytes == nullptr) return Status::Error(StatusCode::kInvalidArgument, "bytes: expected a pointer, got null");
  *bytes = 0;
  Status s = validate_backward(p);
  if (!s.ok() || p.device == Device::kCpu) return s;
  return sm90::backward_workspace_size(p, bytes);
}

Status gdn_backward(const GdnBackwardParams& p) {
  Status s = validate_backward(p);
  if (!s.ok()) return s;
  if (p.device == Device::kCpu) return cpu::backward(p);
  return sm90::backward(p);
}

Status prepare_cuda_device() {
  Status s = sm90::prepare_forward();
  return s.ok() ? sm90::prepare_backward() : s;
}

}  // namespace qla
