// qla._C: a thin nanobind layer over the C++ core. It takes raw pointers and
// strides (no PyTorch headers), so one build works with any torch. Tensors are
// described by the Python side as (data_ptr, dtype_code, stride0, stride1, stride2).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>

#include "backends.h"
#include "qla/qla.h"

namespace nb = nanobind;

namespace {

using Desc = std::array<int64_t, 5>;  // data_ptr, dtype, stride0, stride1, stride2
using Shape = std::array<int64_t, 6>;  // B, T, H, HV, K, V
// State pools: initial-state indices (data_ptr, dtype), final-state indices (data_ptr, dtype),
// the initial and the final pool's slot counts; data_ptr 0: no indices.
using Pools = std::array<int64_t, 6>;

qla::TensorRef in(const Desc& d) {
  qla::TensorRef r;
  r.data = reinterpret_cast<const void*>(static_cast<uintptr_t>(d[0]));
  r.dtype = static_cast<qla::DType>(d[1]);
  r.stride[0] = d[2];
  r.stride[1] = d[3];
  r.stride[2] = d[4];
  return r;
}

qla::MutTensorRef out(const Desc& d) {
  qla::MutTensorRef r;
  r.data = reinterpret_cast<void*>(static_cast<uintptr_t>(d[0]));
  r.dtype = static_cast<qla::DType>(d[1]);
  r.stride[0] = d[2];
  r.stride[1] = d[3];
  r.stride[2] = d[4];
  return r;
}

void set_pools(qla::GdnForwardParams& p, const Pools& pools) {
  p.initial_state_indices = in({pools[0], pools[1], 1, 0, 0});
  p.final_state_indices = in({pools[2], pools[3], 1, 0, 0});
  p.initial_state_slots = pools[4];
  p.final_state_slots = pools[5];
}

qla::GdnShape shape_of(const Shape& s) { return {s[0], s[1], s[2], s[3], s[4], s[5]}; }

// Status -> Python exception: bad arguments are ValueError, the rest RuntimeError.
void raise_if_error(const qla::Status& s) {
  if (s.ok()) return;
  if (s.code() == qla::StatusCode::kInvalidArgument || s.code() == qla::StatusCode::kNotSupported)
    throw nb::value_error(s.message().c_str());
  throw std::runtime_error(s.message());
}

// Fields shared by the forward and backward params.
template <class Params>
void fill_common(Params& p, const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g,
                 const Desc& beta, const Desc& h0, const Desc& cu, int64_t num_seqs, double scale, int layout,
                 int device, uintptr_t stream) {
  p.shape = shape_of(shape);
  p.q = in(q);
  p.k = in(k);
  p.v = in(v);
  p.g = in(g);
  p.beta = in(beta);
  p.initial_state = in(h0);
  p.cu_seqlens = in(cu);
  p.num_seqs = num_seqs;
  p.scale = scale;
  p.state_layout = static_cast<qla::StateLayout>(layout);
  p.device = static_cast<qla::Device>(device);
  p.stream = reinterpret_cast<void*>(stream);
}

qla::GdnForwardParams forward_params(const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g,
                                     const Desc& beta, const Desc& h0, const Desc& cu, int64_t num_seqs,
                                     const Desc& o, const Desc& ht, double scale, int layout, int device,
                                     uintptr_t stream, uintptr_t workspace, size_t workspace_bytes) {
  qla::GdnForwardParams p;
  fill_common(p, shape, q, k, v, g, beta, h0, cu, num_seqs, scale, layout, device, stream);
  p.o = out(o);
  p.final_state = out(ht);
  p.workspace = reinterpret_cast<void*>(workspace);
  p.workspace_bytes = workspace_bytes;
  return p;
}

qla::GdnBackwardParams backward_params(const Shape& shape, const Desc& q, const Desc& k, const Desc& v,
                                       const Desc& g, const Desc& beta, const Desc& h0, const Desc& cu,
                                       int64_t num_seqs, const Desc& d_o, const Desc& dht, const Desc& dq,
                                       const Desc& dk, const Desc& dv, const Desc& dg, const Desc& dbeta,
                                       const Desc& dh0, double scale, int layout, int device, uintptr_t stream,
                                       uintptr_t workspace, size_t workspace_bytes) {
  qla::GdnBackwardParams p;
  fill_common(p, shape, q, k, v, g, beta, h0, cu, num_seqs, scale, layout, device, stream);
  p.d_o = in(d_o);
  p.d_final_state = in(dht);
  p.dq = out(dq);
  p.dk = out(dk);
  p.dv = out(dv);
  p.dg = out(dg);
  p.dbeta = out(dbeta);
  p.d_initial_state = out(dh0);
  p.workspace = reinterpret_cast<void*>(workspace);
  p.workspace_bytes = workspace_bytes;
  return p;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "QLA core binding (pointers and strides; see qla/_ops.py)";
  m.def("version", [] { return std::string(qla::version()); });
  m.def("cuda_compiled", [] { return qla::sm90::compiled(); });
  m.def("prepare_cuda_device", [] { raise_if_error(qla::prepare_cuda_device()); });
  m.def("init_cuda_runtime", [] { raise_if_error(qla::sm90::init_runtime()); });

  m.def(
      "forward_workspace_size",
      [](const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g, const Desc& beta,
         const Desc& h0, const Desc& cu, int64_t num_seqs, const Desc& o, const Desc& ht, double scale, int layout,
         int device, bool qk_l2_normalized, int split, int split_chunks, bool batch_invariant, uintptr_t cu_host,
         const Pools& pools) {
        // The options that choose the CUDA forward's path also set its workspace, and so do the
        // host lengths (cu_host: N + 1 int64 values on the host, or 0), which its plan reads.
        auto p = forward_params(shape, q, k, v, g, beta, h0, cu, num_seqs, o, ht, scale, layout, device, 0, 0, 0);
        set_pools(p, pools);
        p.cu_seqlens_host = reinterpret_cast<const int64_t*>(cu_host);
        p.qk_l2_normalized = qk_l2_normalized;
        p.split = static_cast<qla::SplitMode>(split);
        p.split_chunks = split_chunks;
        p.batch_invariant = batch_invariant;
        size_t bytes = 0;
        raise_if_error(qla::gdn_forward_workspace_size(p, &bytes));
        return bytes;
      });

  m.def(
      "forward",
      [](const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g, const Desc& beta,
         const Desc& h0, const Desc& cu, int64_t num_seqs, const Desc& o, const Desc& ht, double scale, int layout,
         int device, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes, int num_threads,
         bool qk_l2_normalized, int split, int split_chunks, bool batch_invariant, uintptr_t cu_host,
         const Pools& pools) {
        auto p = forward_params(shape, q, k, v, g, beta, h0, cu, num_seqs, o, ht, scale, layout, device, stream,
                                workspace, workspace_bytes);
        set_pools(p, pools);
        p.cu_seqlens_host = reinterpret_cast<const int64_t*>(cu_host);
        p.num_threads = num_threads;
        p.qk_l2_normalized = qk_l2_normalized;
        p.split = static_cast<qla::SplitMode>(split);  // SplitMode: 0 auto, 1 off, 2 on
        p.split_chunks = split_chunks;
        p.batch_invariant = batch_invariant;
        qla::Status s;
        {
          nb::gil_scoped_release release;  // the CPU backend runs for long; let other threads go
          s = qla::gdn_forward(p);
        }
        raise_if_error(s);
      });

  m.def(
      "backward_workspace_size",
      [](const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g, const Desc& beta,
         const Desc& h0, const Desc& cu, int64_t num_seqs, const Desc& d_o, const Desc& dht, const Desc& dq,
         const Desc& dk, const Desc& dv, const Desc& dg, const Desc& dbeta, const Desc& dh0, double scale, int layout,
         int device, int split, int split_chunks, bool batch_invariant, uintptr_t cu_host) {
        // The splitting options choose the CUDA backward's path and pieces, and so its workspace,
        // and so do the host lengths (cu_host, as the forward's), which its plan reads.
        auto p = backward_params(shape, q, k, v, g, beta, h0, cu, num_seqs, d_o, dht, dq, dk, dv, dg, dbeta, dh0,
                                 scale, layout, device, 0, 0, 0);
        p.cu_seqlens_host = reinterpret_cast<const int64_t*>(cu_host);
        p.split = static_cast<qla::SplitMode>(split);
        p.split_chunks = split_chunks;
        p.batch_invariant = batch_invariant;
        size_t bytes = 0;
        raise_if_error(qla::gdn_backward_workspace_size(p, &bytes));
        return bytes;
      });

  m.def(
      "backward",
      [](const Shape& shape, const Desc& q, const Desc& k, const Desc& v, const Desc& g, const Desc& beta,
         const Desc& h0, const Desc& cu, int64_t num_seqs, const Desc& d_o, const Desc& dht, const Desc& dq,
         const Desc& dk, const Desc& dv, const Desc& dg, const Desc& dbeta, const Desc& dh0, double scale, int layout,
         int device, uintptr_t stream, uintptr_t workspace, size_t workspace_bytes, int num_threads, int split,
         int split_chunks, bool batch_invariant, uintptr_t cu_host) {
        auto p = backward_params(shape, q, k, v, g, beta, h0, cu, num_seqs, d_o, dht, dq, dk, dv, dg, dbeta, dh0,
                                 scale, layout, device, stream, workspace, workspace_bytes);
        p.cu_seqlens_host = reinterpret_cast<const int64_t*>(cu_host);
        p.num_threads = num_threads;
        p.split = static_cast<qla::SplitMode>(split);  // SplitMode: 0 auto, 1 off, 2 on
        p.split_chunks = split_chunks;
        p.batch_invariant = batch_invariant;
        qla::Status s;
        {
          nb::gil_scoped_release release;
          s = qla::gdn_backward(p);
        }
        raise_if_error(s);
      });
}
