// QLA: Gated DeltaNet (GDN) chunked-prefill forward and backward.
//
// The C++ core is framework-free. Callers pass raw pointers, element strides,
// shapes, dtypes and (for CUDA) a stream. The core never allocates device memory
// behind the caller's back: query the workspace size, allocate it, pass it in.
// Every entry point returns a Status; nothing aborts the process.
//
// The operator (one sequence, one value head; see docs/design.md):
//   S'_t = exp(g_t) S_{t-1}
//   u_t  = beta_t (v_t - S'_t^T k_t)
//   S_t  = S'_t + k_t u_t^T
//   o_t  = scale S_t^T q_t
// with S a K x V matrix, S_0 the initial state (zeros if none), S_T the final state.
//
// Tensor conventions (FLA-compatible):
//   q, k            [B, T, H,  K]
//   v, o            [B, T, HV, V]     HV a multiple of H; value head i reads q/k head i / (HV/H)
//   g, beta         [B, T, HV]
//   initial/final   [N, HV, K, V]     (or [N, HV, V, K] with StateLayout::kVK), fp32
//                   (or pools [slots, HV, ..] read and written through per-sequence indices)
//   cu_seqlens      [N + 1]           int32 or int64, requires B == 1
// N = B without cu_seqlens, N = num_seqs with it.
// Strides are in elements. The last dimension of every tensor must be contiguous
// (stride 1); every other stride is free (so slices of a fused projection work).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace qla {

// ---------------------------------------------------------------------------
// Status: ok, or an error code with a message naming the argument at fault.
// ---------------------------------------------------------------------------
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a shape, stride, dtype or pointer is wrong
  kNotSupported = 2,     // valid, but this backend cannot run it (e.g. K != 128 on sm90)
  kCudaError = 3,        // a CUDA runtime call failed
  kInternal = 4,
};

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(StatusCode code, std::string message) {
    Status s;
    s.code_ = code;
    s.message_ = std::move(message);
    return s;
  }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Element types. Values are stable (the Python binding passes them as ints).
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3, kInt32 = 4, kInt64 = 5 };
const char* dtype_name(DType d);

// Layout of the K x V state matrix of one (sequence, value head).
enum class StateLayout : int {
  kKV = 0,  // [.., K, V]: FLA's default
  kVK = 1,  // [.., V, K]: state_v_first
};

// Sequence splitting in the CUDA forward (GdnForwardParams::split).
enum class SplitMode : int {
  kAuto = 0,  // split when a cost model of the kernels says it pays (few, long sequences)
  kOff = 1,   // never: one chain of chunks per (sequence, value head)
  kOn = 2,    // always, into pieces of about split_chunks chunks (0: the automatic length)
};

// Where the tensors live. kCuda picks the sm90 backend (compute capability 9.x).
enum class Device : int { kCpu = 0, kCuda = 1 };

// A strided view of one tensor. Strides are in elements; the last dimension is
// contiguous (stride 1) and is not stored. Unused trailing entries are ignored.
struct TensorRef {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t stride[3] = {0, 0, 0};  // strides of the leading dimensions, outermost first
};

// A writable strided view (outputs).
struct MutTensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t stride[3] = {0, 0, 0};
};

// Shapes and options common to forward and backward.
struct GdnShape {
  int64_t batch = 0;         // B
  int64_t seqlen = 0;        // T (per batch row; the packed length with cu_seqlens)
  int64_t num_qk_heads = 0;  // H
  int64_t num_v_heads = 0;   // HV, a multiple of H
  int64_t head_dim_k = 0;    // K
  int64_t head_dim_v = 0;    // V
};

struct GdnForwardParams {
  GdnShape shape;

  // Inputs. q, k: 4-D [B, T, H, K] (stride = {b, t, h}); v: [B, T, HV, V];
  // g, beta: 3-D [B, T, HV] (stride = {b, t}, last dim contiguous).
  TensorRef q, k, v, g, beta;

  // Optional initial state (data == nullptr: zeros). fp32 (fp64 allowed with fp64 inputs; bf16 or
  // fp16 with 16-bit or fp32 inputs, e.g. an engine's state cache: read once, the arithmetic stays
  // fp32, the final state rounded to nearest where it is 16-bit; the cpu backend only for now),
  // 4-D [N, HV, K, V] or [N, HV, V, K]; stride = {n, hv, row} (the innermost dimension contiguous).
  TensorRef initial_state;

  // Optional varlen boundaries (data == nullptr: none). int32 or int64, [num_seqs + 1],
  // contiguous. Requires batch == 1. For Device::kCuda the pointer is a device pointer;
  // the CPU copy (cu_seqlens_host) is optional and only used for validation/planning if given.
  // Without it the CUDA forward checks the device values itself: if they are malformed (first
  // entry not 0, a decreasing step, last entry not seqlen) it writes NaN to every element of o
  // and final_state and reads nothing else; the returned Status cannot report it (no sync).
  TensorRef cu_seqlens;
  int64_t num_seqs = 0;                     // N when cu_seqlens is given
  const int64_t* cu_seqlens_host = nullptr; // optional host copy (N + 1 entries)

  // Outputs. o: [B, T, HV, V], dtype of q. final_state (optional, data == nullptr: not
  // written): dtypes and layout rules as initial_state.
  MutTensorRef o;
  MutTensorRef final_state;

  // Optional state pools (an inference engine keeps each request's state in a slot of one tensor
  // and reads and writes it in place). initial_state_indices (data == nullptr: none): int32 or
  // int64 [N], contiguous (device memory for kCuda); initial_state is then a pool of
  // initial_state_slots states, [slots, HV, K, V] (or [slots, HV, V, K]), and sequence n starts
  // from slot initial_state_indices[n], or from zeros where that index is negative.
  // final_state_indices likewise: sequence n's final state goes to slot final_state_indices[n] of
  // final_state, a pool of final_state_slots states, and nowhere where the index is negative.
  // initial_state and final_state may be one pool (the same pointer, dtype and strides; other
  // overlapping memory is refused): a slot may be written by one sequence only and read by no
  // other (without indices, sequence n's slot is n). The CPU backend checks every index and
  // returns an error naming it; the CUDA forward cannot report (no sync): an index at or past its
  // pool's slots makes it write NaN to every element of o and of the final slots in range, as for
  // malformed cu_seqlens, and the other rules are the caller's to keep.
  TensorRef initial_state_indices;
  TensorRef final_state_indices;
  int64_t initial_state_slots = 0;
  int64_t final_state_slots = 0;

  double scale = 0.0;  // multiplies the read; callers usually pass K^-0.5
  StateLayout state_layout = StateLayout::kKV;
  // Hint: every row of q (and of k) has unit l2 norm, up to the rounding of its dtype (as after
  // an l2norm). The CUDA forward then skips measuring q's row norms (a pass over q); keys are
  // measured either way. Leave it false for anything else: with it false, q and k rows of any
  // norm from 2^-30 to 2^30 keep full accuracy; set wrongly, queries far from unit norm (below
  // ~2^-10 or above ~2^10) lose accuracy. fp16 calls without it always take the fused forward.
  bool qk_l2_normalized = false;
  // Sequence splitting (CUDA forward): a long sequence runs as pieces of whole 64-token chunks in
  // parallel. Each piece's entering state comes from exact transfer maps and a scan, or, for a
  // (sequence, value head) whose gates decay by at least e^-16 within 8 chunks before every
  // piece boundary, from those chunks rerun from zero (the dropped part is below e^-16 of the
  // state where they start; heads with g = 0 always take the exact path). Decided on the
  // device, no sync.
  // split_chunks (kOn only, >= 0): the pieces' length in chunks of 64 tokens (a sequence of n
  // chunks runs as ceil(n / split_chunks) equal pieces, at most 64; 0: automatic).
  SplitMode split = SplitMode::kAuto;
  int split_chunks = 0;
  // Batch invariance (CUDA forward): a sequence's o and final state are bitwise the same
  // whatever else the call holds (other sequences, other heads: a tensor-parallel shard against
  // the full head set). The path, the V tile and the pieces (split_chunks, or 64 chunks when 0)
  // then depend on that sequence's length and its own gates only, at some cost in speed for
  // many-sequence calls. split = kOff is honoured (no pieces).
  bool batch_invariant = false;

  Device device = Device::kCpu;
  void* stream = nullptr;       // cudaStream_t for Device::kCuda
  void* workspace = nullptr;    // gdn_forward_workspace_size() bytes, device memory for kCuda
  size_t workspace_bytes = 0;
  int num_threads = 0;          // CPU backend: 0 = all hardware threads
};

struct GdnBackwardParams {
  GdnShape shape;

  // Forward inputs (as in GdnForwardParams) and the incoming gradients.
  TensorRef q, k, v, g, beta;
  TensorRef initial_state;   // optional
  TensorRef cu_seqlens;      // optional
  int64_t num_seqs = 0;
  const int64_t* cu_seqlens_host = nullptr;
  TensorRef d_o;             // [B, T, HV, V], dtype of q
  TensorRef d_final_state;   // optional (nullptr: zero), fp32, layout of the state

  // Outputs. dq, dk: [B, T, H, K] (summed over each value-head group), dtype of q;
  // dv: [B, T, HV, V], dtype of q; dg, dbeta: [B, T, HV], any float dtype;
  // d_initial_state: optional (nullptr: not written), fp32, layout of the state.
  MutTensorRef dq, dk, dv, dg, dbeta;
  MutTensorRef d_initial_state;

  double scale = 0.0;
  StateLayout state_layout = StateLayout::kKV;

  // Sequence splitting (CUDA backward), as the forward's fields: the fused backward runs the
  // forward's pieces (exact transfer maps, transposed for the state gradient). It is taken for
  // calls of few (sequence, value head) pairs, and always with split = kOn or batch_invariant
  // (the chunked backward, which does not split, elsewhere for now). batch_invariant: a
  // sequence's gradients are bitwise the same whatever else the call holds (other sequences,
  // other heads), as the forward's. The CPU backend ignores them.
  SplitMode split = SplitMode::kAuto;
  int split_chunks = 0;
  bool batch_invariant = false;

  Device device = Device::kCpu;
  void* stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int num_threads = 0;
};

// Checks every argument and returns the workspace the call needs (0 on the CPU backend). The
// size depends on the shapes, dtypes, options, the device, on whether the initial and final
// states share memory (a split forward then copies h0), for fp16 on the scale (it may choose the
// forward's path) and, when cu_seqlens_host is given, on its values (the CUDA forward plans its
// path and pieces from the true lengths): query with the params of the call itself. A call whose
// workspace_bytes is smaller returns an error.
Status gdn_forward_workspace_size(const GdnForwardParams& p, size_t* bytes);
Status gdn_backward_workspace_size(const GdnBackwardParams& p, size_t* bytes);

// Runs the operator. On Device::kCuda the call is asynchronous on p.stream and does not
// synchronise the host (it can be captured in a CUDA graph).
Status gdn_forward(const GdnForwardParams& p);
Status gdn_backward(const GdnBackwardParams& p);

// Optional: does on the current CUDA device the one-time work of a first call (loads the
// sm90 kernels, sets their shared-memory limits), so that the first gdn_forward /
// gdn_backward there costs what the next one does. Call it once the device's context exists
// (an engine's start-up, say); the calls do whatever is still missing themselves.
// kNotSupported without a CUDA backend or on a device that is not compute capability 9.x.
Status prepare_cuda_device();

// Library version string.
const char* version();

}  // namespace qla
