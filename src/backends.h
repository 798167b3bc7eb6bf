// Internal: the backends behind the public API. The public entry points in
// src/core/api.cpp validate every argument first (src/core/validate.h), then call
// exactly one of these; a backend may assume its params are valid.
#pragma once

#include "qla/qla.h"

namespace qla {

namespace cpu {
Status forward(const GdnForwardParams& p);
Status backward(const GdnBackwardParams& p);
}  // namespace cpu

namespace sm90 {
// False when the library was built without CUDA (the stubs then return kNotSupported).
bool compiled();
// Checks the backend-specific limits (K = V = 128, 16-bit q/k/v, the current device is 9.x).
Status check_supported(const GdnForwardParams& p);
Status forward_workspace_size(const GdnForwardParams& p, size_t* bytes);
// Runs check_supported first, then the kernels on p.stream.
Status forward(const GdnForwardParams& p);
// The backward: checks its own limits (as check_supported, plus do/dq/dk/dv), then the kernels.
Status backward_workspace_size(const GdnBackwardParams& p, size_t* bytes);
Status backward(const GdnBackwardParams& p);
// The fused backward (gdn_fwd_sm90.cu, beside the forward kernels it runs), which backward()
// dispatches to: its own forward-side checks, then its workspace or its launches.
Status fused_backward_workspace_size(const GdnBackwardParams& p, size_t* bytes);
Status fused_backward(const GdnBackwardParams& p);
// The one-time work of a first call on the current device, for both dtypes: kernels loaded,
// shared-memory limits set. Optional (forward/backward do what is still missing).
Status prepare_forward();
Status prepare_backward();
// Initialises this library's CUDA runtime (it is linked statically: its own instance, whose
// first call registers the kernels with the driver) without creating a context.
Status init_runtime();
}  // namespace sm90

}  // namespace qla
