"""Predicted forward time of the fused design (docs/fused.md v2) on every grid row: a planning
tool that says on which rows the design meets issue 12's targets as it stands, and which need
a faster inverse kernel or the split of issue 13 (for balance, not only for few pairs).

    python3 bench/fused_cost_model.py [--step64 2.0] [--step128 2.9] [--k1-ns 12.4]

Model (no GPU; every number is an input):
  K1 (the inverse): regions x the measured GPU-wide cost per region (12.4 ns: 0.410 ms for
     33024 regions at 16/64 8192x4, 2026-12-01; 19.6 ns in the first version).
  K2 (the fused recurrence): one CTA per (sequence, value head, V tile) on 132 SMs, one CTA
     per SM, longest sequences first (list scheduling); a CTA takes its sequence's chunk count
     in steps of step64 / step128 us (measured 2026-12-01: ~2.0 and ~2.9 us; the first plan
     assumed 1.2 and 2.2 from the FLOP counts at ~65% tensor use).
  Calibration (2026-12-01): K1 + K2 with the measured constants and the dispatched V tile
  predicts the grid's measured device times of the fused forward within -6% / +58% (median
  +4%) over the 141 rows with >= 32 pairs; the worst are the 1024x8 rows, where per-launch
  costs the model leaves out dominate.
  serial = K1 + K2; overlapped = max(K1, K2), a bound that holds only where K2 leaves SMs to
  K1 (or K1's work moves into K2's aux warpgroup): K2 at >= 132 CTAs fills every SM.
  The best V tile is taken per row.
Measured columns come from bench/results/raw (eager times: the device times of the graph
harness exist only for three rows so far).
"""
from __future__ import annotations

import argparse
import glob
import heapq
import json
import math
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import grid  # noqa: E402

SMS = 132
CEILINGS = (805.0, 4.27)  # TFLOP/s, TB/s measured in the 2026-12-01 graph run


def k2_ms(lengths, hv: int, vt: int, step_us: float) -> float:
    """Makespan of the CTAs (chunks each) on SMS slots, longest first, in ms."""
    ctas = sorted((math.ceil(n / 64) for n in lengths for _ in range(hv * (128 // vt))), reverse=True)
    slots = [0.0] * min(SMS, len(ctas))
    heapq.heapify(slots)
    for c in ctas:
        heapq.heappush(slots, heapq.heappop(slots) + c)
    return max(slots) * step_us / 1e3 if slots else 0.0


def measured() -> dict:
    """row name -> {backend: eager ms}, the latest file first (later files do not overwrite)."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(_HERE, "results", "raw", "fwd_*.json")), reverse=True):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        for r in d.get("results", []):
            ms = r.get("eager_ms") or r.get("ms", {})
            for b, t in ms.items():
                out.setdefault(r["row"], {}).setdefault(b, t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step64", type=float, default=2.0, help="us per chunk step at V tile 64")
    ap.add_argument("--step128", type=float, default=2.9, help="us per chunk step at V tile 128")
    ap.add_argument("--k1-ns", type=float, default=410e3 / 33024, help="K1 ns per region, GPU-wide")
    ap.add_argument("--rows", action="store_true", help="print every row, not only the summary")
    args = ap.parse_args(argv)
    meas = measured()
    steps = {64: args.step64, 128: args.step128}
    stats = {"wide": [0, 0, 0], "mid": [0, 0, 0]}  # rows, meet 2x floor (serial), meet (overlapped)
    beats = {"flashqla": [0, 0], "flashinfer": [0, 0]}  # rows timed, rows the overlapped prediction beats
    if args.rows:
        print("| row | pairs | Vt | K1 | K2 | serial | overlapped | floor | x floor | QLA now | FlashQLA | FlashInfer |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in grid.fwd_rows():
        pairs = row.N * row.hv
        regions = sum(math.ceil(n / 64) for n in row.lengths) * row.hv
        k1 = regions * args.k1_ns / 1e6 + 0.01
        vt, k2 = min(((v, k2_ms(row.lengths, row.hv, v, steps[v])) for v in (64, 128)), key=lambda x: x[1])
        serial, over = k1 + k2, max(k1, k2)
        floor = grid.floor_ms("fwd", row.T, row.N, row.h, row.hv, *CEILINGS)
        m = meas.get(row.name, {})
        if pairs >= 132:
            s = stats["wide"]
        elif pairs >= 64:
            s = stats["mid"]
        else:
            s = None
        if s is not None:
            s[0] += 1
            s[1] += serial <= 2 * floor
            s[2] += over <= 2 * floor
            for b in beats:
                if b in m:
                    beats[b][0] += 1
                    beats[b][1] += over < m[b]
        if args.rows:
            f = lambda b: f"{m[b]:.3f}" if b in m else "-"
            print(f"| {row.name[4:]} | {pairs} | {vt} | {k1:.3f} | {k2:.3f} | {serial:.3f} | {over:.3f} | {floor:.3f} | "
                  f"{over / floor:.2f} | {f('qla')} | {f('flashqla')} | {f('flashinfer')} |")
    w, mid = stats["wide"], stats["mid"]
    print(f"rows with >= 132 pairs: {w[0]}; within 2x the floor: {w[1]} serial, {w[2]} with K1 overlapped")
    print(f"rows with 64-131 pairs: {mid[0]}; within 2x the floor: {mid[1]} serial, {mid[2]} overlapped")
    for b, (n, k) in beats.items():
        print(f"rows with >= 64 pairs and a measured {b} time (eager): {n}; the overlapped prediction beats it on {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
