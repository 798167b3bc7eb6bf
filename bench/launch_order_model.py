"""Critical path of the sequential passes (forward recurrence, backward states pass and reverse
chain) under a launch order: the model behind the longest-first order (docs/design.md, sm90-7).

One CTA per (sequence, value head, V tile) runs its sequence's chunks one after another; the
hardware hands CTAs to free slots in launch order (list scheduling). With every chunk step
costing one unit, the makespan in chunk steps is what the order changes. A V-tile-32 CTA takes
most of an SM's shared memory, so there is one slot per SM (132 on the H200).

    python3 bench/launch_order_model.py [--slots 132] [--heads 8/32,16/64] [--kind fwd|bwd]

Prints, per grid row where more CTAs than slots exist, the chunk steps of the old order
(value head slowest, sequences interleaved within a head) and of the longest-first order.
"""
import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grid  # noqa: E402  (imports torch; no GPU needed)

V_TILES = 4  # V tile 32 of 128 columns


def makespan(durations, slots):
    """Greedy list scheduling: each CTA, in launch order, starts on the first free slot."""
    free = [0] * slots
    heapq.heapify(free)
    end = 0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def chunk_steps(lengths):
    return [(n + 63) // 64 for n in lengths]


def head_major(lengths, hv):
    return [c for _ in range(hv) for c in chunk_steps(lengths) for _ in range(V_TILES)]


def longest_first(lengths, hv):
    return [c for c in sorted(chunk_steps(lengths), reverse=True) for _ in range(hv) for _ in range(V_TILES)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=132, help="concurrent CTAs (one per SM)")
    ap.add_argument("--kind", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--heads", help="comma list of h/hv to keep, e.g. 8/32,16/64")
    args = ap.parse_args()
    keep = set(args.heads.split(",")) if args.heads else None
    rows = grid.fwd_rows() if args.kind == "fwd" else grid.bwd_rows()
    for r in rows:
        if keep and f"{r.h}/{r.hv}" not in keep:
            continue
        ctas = len(r.lengths) * r.hv * V_TILES
        if ctas <= args.slots:
            continue  # one wave: the order cannot change the critical path
        old = makespan(head_major(r.lengths, r.hv), args.slots)
        new = makespan(longest_first(r.lengths, r.hv), args.slots)
        print(f"{r.name:60s} CTAs {ctas:5d}  chunk steps {old:5d} -> {new:5d}  ({new / old:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
