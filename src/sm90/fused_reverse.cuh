// The fused backward's reverse passes (docs/backward.md section 10): each CTA's role in the reverse
// step's passes (fused_step.cuh; sequences run last chunk first, split as the forward's plan
// splits them: split.cuh), reverse_role and reverse_path_flags, and two helpers of the step's
// warpgroups (set_role_registers, scaled_run).
#pragma once

#include "fused_chunks.cuh"

namespace qla {
namespace sm90 {
namespace {

// This warpgroup's registers to n (setmaxnreg: up or down from the entry count).
template <int n, int kEntry>
__device__ __forceinline__ void set_role_registers() {
  if constexpr (n > kEntry) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(n) : "memory");
  else if constexpr (n < kEntry) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(n) : "memory");
}

// Eight 16-bit values (type T) times sc, in type E.
template <class T, class E>
__device__ __forceinline__ uint4 scaled_run(uint4 u, float sc) {
  uint32_t* pu = &u.x;
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(pu[i]);
    pu[i] = pack2<E>(f.x * sc, f.y * sc);
  }
  return u;
}

// A reverse-step CTA's role (docs/backward.md "Build step 4, second half" and "The warm-up
// mirror"). Unsplit calls (no pieces): one pass, each sequence from d(final state) to d(initial
// state). Split calls (the forward's plan) take one of two paths per (sequence, value head),
// chosen from the gates (warm_path with kWarmAfter, split.cuh):
//   warm-up mirror (warm; wj: the warm-up of the boundary after this piece): pass 1 only, every
//           piece at once, the last from d(final state), the others from zero at the wj-th chunk
//           after their end, run back through those chunks without gradients (the dropped part
//           is scaled by their decay), then through the piece with them;
//   exact (the states pass's maps M_j of pieces 0 .. np - 2 in `maps`):
//     pass 0: pieces 1 .. np - 1 alone, the last from d(final state), the others from zero; each
//             writes the gradient entering it into the R columns of the map slot before its own
//             (the last one's is the gradient leaving piece np - 2, the others' D_j);
//     gdn_bwd_scan turns the D_j into the gradients leaving pieces np - 3 .. 0;
//     pass 1: every piece from the gradient leaving it (its slot; d(final state) for the last),
//             with the gradients.
// Piece 0 writes d(initial state). Whole sequences run in pass 1 (or the one pass, unsplit).
// Loop step c takes chunk c0 + nch - 1 - c; the first nwarm steps form no gradients.
__device__ __forceinline__ PieceRole reverse_role(const RecParams& p, const PieceCta& c, int nr, bool warm, int wj) {
  PieceRole r{true, 0, 0, 0, kInitH0, kEndFinal, true};
  const int nch = static_cast<int>((c.slen + kC - 1) / kC);
  r.c0 = c.j * c.sp.len;
  r.nch = min(c.sp.len, nch - r.c0);
  const bool last = c.j == c.sp.np - 1;
  r.run = c.vt < nr;
  if (!p.pieces) return r;
  if (p.pass == 0) {
    r.run = r.run && c.j > 0 && !warm;
    r.init = last ? kInitH0 : kInitZero;
    r.end = kEndMaps;
    r.out = false;
    return r;
  }
  r.end = c.j == 0 ? kEndFinal : kEndNone;
  if (warm) {
    r.init = last ? kInitH0 : kInitZero;
    r.nwarm = last ? 0 : wj;
    r.nch += r.nwarm;
    return r;
  }
  r.init = last ? kInitH0 : kInitMaps;
  return r;
}
// The piece's path, by warp 1 into sflags: [0] the warm-up mirror, [1] the warm-up of the
// boundary after the piece.
__device__ __forceinline__ void reverse_path_flags(const RecParams& p, const PieceCta& tile, int* sflags, int tid) {
  if (tid >= 32 && tid < 64) {
    const int nch = static_cast<int>((tile.slen + kC - 1) / kC);
    const bool warm = p.pieces && tile.sp.np > 1 && warm_path(p, tile.ci0, tile.hv, tile.sp, nch, tid - 32);
    if (tid == 32) {
      sflags[0] = warm;
      sflags[1] = warm && tile.j < tile.sp.np - 1 ? warm_chunks_after(p, tile.ci0, tile.hv, (tile.j + 1) * tile.sp.len, nch) : 0;
    }
  }
}

}  // namespace
}  // namespace sm90
}  // namespace qla
