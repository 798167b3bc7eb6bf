// Built instead of src/sm90/*.cu when nvcc was not found: CUDA tensors get a clear error.
#include "backends.h"

namespace qla::sm90 {
namespace {
Status unavailable() {
  return Status::Error(StatusCode::kNotSupported,
                       "device: this build of qla has no CUDA backend (nvcc was not found at build time); "
                       "use CPU tensors or rebuild with the CUDA toolkit");
}
}  // namespace

bool compiled() { return false; }
Status check_supported(const GdnForwardParams&) { return unavailable(); }
Status forward_workspace_size(const GdnForwardParams&, size_t* bytes) {
  *bytes = 0;
  return unavailable();
}
Status forward(const GdnForwardParams&) { return unavailable(); }
Status backward_workspace_size(const GdnBackwardParams&, size_t* bytes) {
  *bytes = 0;
  return unavailable();
}
Status backward(const GdnBackwardParams&) { return unavailable(); }
Status prepare_forward() { return unavailable(); }
Status prepare_backward() { return unavailable(); }
Status init_runtime() { return unavailable(); }
}  // namespace qla::sm90
