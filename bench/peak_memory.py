"""Peak extra device memory of one forward call (workspace and anything else the op allocates
beyond its outputs), and of forward + backward through autograd (beyond the inputs, the
upstream gradients and the input gradients), measured with the CUDA caching allocator's peak
counter.

    python3 bench/peak_memory.py        # the rows below, on the current GPU
"""
import torch

import grid
import qla

ROWS = [("397B/122B TP1 16/64 8192x4", (8192,) * 4, 16, 64), ("35B/9B/4B TP1 16/32 1x32768", (32768,), 16, 32),
        ("397B/122B TP8 2/8 1x32768", (32768,), 2, 8)]


def main():
    for label, lengths, h, hv in ROWS:
        inp = grid.make_inputs(lengths, h, hv, seed=0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            o, ht = qla.chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, initial_state=inp.h0,
                                               output_final_state=True, cu_seqlens=inp.cu_seqlens)
        torch.cuda.synchronize()
        outputs = o.numel() * o.element_size() + ht.numel() * ht.element_size()
        extra = torch.cuda.max_memory_allocated() - base - outputs
        print(f"{label}: peak extra device memory {extra / 2**30:.3f} GiB "
              f"(outputs {outputs / 2**30:.3f} GiB, inputs {base / 2**30:.3f} GiB)", flush=True)
        del inp, o, ht
        torch.cuda.empty_cache()


BWD_ROWS = [("35B/9B/4B TP1 16/32 1x32768", (32768,), 16, 32), ("35B/9B/4B TP1 16/32 8192x4", (8192,) * 4, 16, 32)]


def backward_rows():
    """Forward + backward through autograd: the forward saves only its inputs; the backward's
    workspace holds the recomputed per-chunk data (docs/backward.md section 3). Each row with the
    backward the dispatch picks, then with the fused backward forced (split=True)."""
    for (label, lengths, h, hv), opts in [(r, o) for r in BWD_ROWS for o in ({}, {"split": True})]:
        label += " (fused backward, split=True)" if opts else " (dispatched)"
        inp = grid.make_inputs(lengths, h, hv, seed=0)
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0)]
        do = torch.randn_like(inp.v)
        dht = torch.randn_like(inp.h0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # inputs, their clones, do, dht
        torch.cuda.reset_peak_memory_stats()
        o, ht = qla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=inp.cu_seqlens, **opts)
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.autograd.backward([o, ht], [do, dht])
        torch.cuda.synchronize()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
        outputs = o.numel() * o.element_size() + ht.numel() * ht.element_size()
        extra = torch.cuda.max_memory_allocated() - base - grads - outputs
        print(f"fwd+bwd {label}: peak extra device memory {extra / 2**30:.3f} GiB beyond inputs, outputs and "
              f"gradients (forward alone {fwd_peak / 2**30:.3f} GiB incl. outputs)", flush=True)
        del inp, leaves, o, ht, do, dht
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
    backward_rows()
