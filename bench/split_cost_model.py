"""The sequence-splitting cost model of the sm90 forward (src/sm90/split_plan.cuh, split_cost)
against measured times: calibration and check, on any machine (no GPU).

Input: the lines that `sm90_forward_test --split --bench` prints on the device (one per row:
the two-pass, unsplit fused and automatic times, then the times with pieces of at most 16, 32,
64 and 128 chunks), e.g. bench/results/raw/fwd_split_bench_2026-12-01.txt. The model's
coefficients are read from the C++ source, so that this script and the kernels' plan cannot
disagree; --fit searches coefficients that rank the piece counts as measured and prints them
for the source.

    python3 bench/split_cost_model.py bench/results/raw/fwd_split_bench_2026-12-01.txt
    python3 bench/split_cost_model.py --fit bench/results/raw/fwd_split_bench_2026-12-01.txt
    python3 bench/split_cost_model.py --fit-vt <--split --bench output with bench-split-vt lines>
    python3 bench/split_cost_model.py --plan bench/results/raw/fwd_split_bench_2026-12-04b.txt
    python3 bench/split_cost_model.py bench/results/raw/split_check_scan_2026-12-04c.txt \
        --dispatch bench/results/raw/scan_fp16m_bench_h100_s25_2026-12-05.txt
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys

_SM90 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "sm90")
_SRC = (os.path.join(_SM90, "split_plan.cuh"), os.path.join(_SM90, "gdn_fwd_sm90.cu"))  # the model, the dispatch
_NAMES = ("kStepUs", "kStepLoadedUs", "kWaveSteps", "kScanStepUs", "kPassUs", "kExactShare")
_TERMS = ("kStep128Scale", "kLeanStepScale", "kSplitMinGain")  # since split-7 and split-8
SMS = 132


def source_coefficients(paths: tuple = _SRC) -> dict:
    """The model's constants as the C++ sources define them (constexpr double / int)."""
    text = "\n".join(open(p).read() for p in paths)
    co = {}
    for name in _NAMES + _TERMS + ("kWarmChunksTypical", "kMaxPiecesPerSeq", "kTwoPassShare", "kFusedMinChunks", "kFusedMinPairs"):
        m = re.search(r"\b" + name + r"\s*=\s*([0-9.]+)", text)
        if not m:
            raise SystemExit(f"{', '.join(paths)}: no constant {name}")
        co[name] = float(m.group(1))
    return co


def cost_us(co: dict, pairs: int, longest: int, np_: int, sms: int = SMS, vt: tuple = (64, 64),
            vt128_scale: float | None = None, lean: bool = False, lean_scale: float | None = None) -> float:
    """split_cost of split_plan.cuh: the fused recurrence's time on the longest sequence.
    vt: the V tiles of passes 0 and 1 (the unsplit pass: vt[0]). At 128 a (piece, head) takes
    half the CTAs and each step vt128_scale times as long (split-7 in docs/design.md; default
    the source's kStep128Scale, fitted with --fit-vt). lean: pass 0 on the lean step (split-8:
    no o, steps lean_scale times as long, default kLeanStepScale), piece 0 run again in pass 1.
    The kernels' plan since split-8: lean, pass 0 at 64, pass 1 at 64 or 128 (plan_cost). The
    defaults (64 / 64, not lean) model the kernels before them, as the older results ran."""
    vt128_scale = co["kStep128Scale"] if vt128_scale is None else vt128_scale
    lean_scale = co["kLeanStepScale"] if lean_scale is None else lean_scale
    tiles = {64: 2, 128: 1}  # CTAs per 128 state columns
    scale = {64: 1.0, 128: vt128_scale}

    def run(ctas: float, steps: int, fractional: bool, v: int, step_scale: float = 1.0) -> float:
        if ctas <= 0:
            return 0.0
        waves = max(1.0, ctas / sms) if fractional else math.ceil(ctas / sms)  # unsplit: a fraction
        active = min(ctas, sms) / sms
        return (waves * (steps + co["kWaveSteps"]) * scale[v] * step_scale
                * (co["kStepUs"] + co["kStepLoadedUs"] * active * active))

    t0, t1 = tiles[vt[0]], tiles[vt[1]]
    if np_ <= 1:
        return run(t0 * pairs, longest, True, vt[0])
    length = math.ceil(longest / np_)
    exact = co["kExactShare"] * pairs
    warm = pairs - exact
    # Pass 0: the exact path's piece 0 (V columns) and middle pieces (V + K columns); pass 1 its
    # other pieces (lean: piece 0 again, now with o) beside every piece of the warm-up path,
    # with their warm-ups.
    return (run(exact * (t0 + 2 * t0 * (np_ - 2)), length, False, vt[0], lean_scale if lean else 1.0)
            + run(exact * t1 * (np_ - (0 if lean else 1)) + warm * t1 * np_, length + int(co["kWarmChunksTypical"]),
                  False, vt[1])
            + (np_ - 2) * co["kScanStepUs"] + co["kPassUs"])


def plan_cost(co: dict, pairs: float, longest: int, np_: int, sms: int = SMS) -> tuple:
    """forward_choice's cost of np_ pieces since split-8 and the pass-1 V tile it takes: unsplit
    at V tile 64; split with pass 0 lean at 64 and pass 1 at 64 or 128, whichever costs less."""
    if np_ <= 1:  # the cheaper tile (fused_v_tile_128 takes 128 once 64 needs more than a wave)
        return min((cost_us(co, pairs, longest, 1, sms, vt=(v, v)), v) for v in (64, 128))
    return min((cost_us(co, pairs, longest, np_, sms, vt=(64, v), lean=True), v) for v in (64, 128))


def pieces_of(longest: int, piece_chunks: int, max_pieces: int) -> int:
    """piece_split's count for the longest sequence (common.cuh)."""
    if longest <= piece_chunks:
        return 1
    np_ = min(math.ceil(longest / piece_chunks), max_pieces)
    length = math.ceil(longest / np_)
    return math.ceil(longest / length)


def parse(path: str) -> list:
    """Rows of the harness output: shape and {piece count: ms} (1: the unsplit fused forward)."""
    rows = []
    pat = re.compile(r"bench-split (\d+)/(\d+) (\d+)x(\d+)( all decay)?\s+two-pass ([0-9.]+)\s+fused ([0-9.]+)\s+"
                     r"auto ([0-9.]+)\s+\|\s+pieces((?: \d+: [0-9.]+)+)")
    for line in open(path):
        m = pat.search(line)
        if not m:
            continue
        h, hv, a, b = (int(m.group(i)) for i in range(1, 5))
        nseq, T = min(a, b), max(a, b)  # layouts as in the grid: 1x32768, 4096x2 (sequences x length either way)
        longest = math.ceil(T / 64)
        times = {1: float(m.group(7))}
        # Forced piece lengths (split_chunks) in increasing order: the shortest pieces first.
        for length, t in re.findall(r"(\d+): ([0-9.]+)", m.group(9)):
            times.setdefault(pieces_of(longest, int(length), 64), float(t))
        rows.append(dict(name=line.split("two-pass")[0].replace("bench-split", "").strip(), pairs=nseq * hv,
                         longest=longest, all_decay=bool(m.group(5)), times=times, auto=float(m.group(8))))
    return rows


def parse_vt(path: str) -> list:
    """The `bench-split-vt` lines (the forced piece lengths with pass 1 at V tile 128, pass 0 at
    64 or 128), merged by row with its `bench-split` line (64 / 64): rows with times[(v0, v1)][P]."""
    rows = {r["name"]: dict(r, times={(64, 64): r["times"]}) for r in parse(path)}
    pat = re.compile(r"bench-split-vt (\d+/\d+ \d+x\d+(?: all decay)?)\s+V tiles\s+(\d+) / 128 \|"
                     r" pieces((?: \d+: [0-9.]+)+)")
    for line in open(path):
        m = pat.search(line)
        if not m or m.group(1) not in rows:
            continue
        r = rows[m.group(1)]
        times = r["times"].setdefault((int(m.group(2)), 128), {})
        for length, t in re.findall(r"(\d+): ([0-9.]+)", m.group(3)):
            times.setdefault(pieces_of(r["longest"], int(length), 64), float(t))
    return [r for r in rows.values() if len(r["times"]) > 1]


def vt_regret(co: dict, rows: list, vt128_scale: float) -> float:
    """regret over the (V tiles, piece count) choices of parse_vt's rows (the split ones: P > 1)."""
    logs = []
    for r in rows:
        if r["all_decay"]:
            continue
        c = _row_coefficients(co, r)
        opts = [(vt, p, t) for vt, ts in r["times"].items() for p, t in ts.items() if p > 1]
        if not opts:
            continue
        pick = min(opts, key=lambda o: cost_us(c, r["pairs"], r["longest"], o[1], vt=o[0], vt128_scale=vt128_scale))
        logs.append(math.log(pick[2] / min(o[2] for o in opts)))
    return math.exp(sum(logs) / max(1, len(logs)))


def plan_regret(co: dict, rows: list) -> float:
    """regret of forward_choice's plan (lean pass 0, pass 1 at 64 or 128, a split only when it
    gains kSplitMinGain) over parse_vt's rows measured since split-8: the measured time of the
    option it prefers among the measured ones (unsplit, and every piece count at either tile)
    over the best measured, geometric mean over the mixed-gate rows that the dispatch gives the
    fused forward (takes_fused)."""
    logs = []
    for r in rows:
        if r["all_decay"] or not takes_fused(co, r["pairs"], r["longest"]):
            continue
        c = _row_coefficients(co, r)
        opts = [(vt[1], p, t) for vt, ts in r["times"].items() for p, t in ts.items() if p > 1]
        cost = lambda o: cost_us(c, r["pairs"], r["longest"], o[1], vt=(64, o[0]), lean=True)
        pick = min(opts, key=cost)
        unsplit = r["times"][(64, 64)][1]
        t = pick[2] if cost(pick) < c["kSplitMinGain"] * plan_cost(c, r["pairs"], r["longest"], 1)[0] else unsplit
        logs.append(math.log(t / min([unsplit] + [o[2] for o in opts])))
    return math.exp(sum(logs) / max(1, len(logs)))


def _row_coefficients(co: dict, row: dict) -> dict:
    """The all-decay rows have no exact-path head."""
    return dict(co, kExactShare=0.0) if row["all_decay"] else co


def misfit_ms(co: dict, rows: list) -> float:
    """Root mean square, over rows and piece counts, of the error in the time differences
    t(P) - t(P') between the piece counts of one row (ms): the fixed costs (table, inverse kernel)
    cancel, what is left is what the plan chooses by."""
    errs = []
    for r in rows:
        c = _row_coefficients(co, r)
        ps = sorted(r["times"])
        for p in ps[1:]:
            d_meas = r["times"][p] - r["times"][ps[0]]
            d_pred = (cost_us(c, r["pairs"], r["longest"], p) - cost_us(c, r["pairs"], r["longest"], ps[0])) * 1e-3
            errs.append((d_pred - d_meas) ** 2)
    return math.sqrt(sum(errs) / max(1, len(errs)))


def best_pieces(co: dict, row: dict, plan: bool = False) -> int:
    """The model's piece count: for the kernels before split-8 (pass 0 full, both passes at V tile
    64: what the older results ran), or with plan=True forward_choice's (plan_cost)."""
    cands = [p for p in range(1, int(co["kMaxPiecesPerSeq"]) + 1) if p <= row["longest"]]
    if plan:  # a split must gain kSplitMinGain
        cost = lambda p: plan_cost(co, row["pairs"], row["longest"], p)[0]
        best = min(cands, key=cost)
        return best if cost(best) < co["kSplitMinGain"] * cost(1) else 1
    return min(cands, key=lambda p: cost_us(co, row["pairs"], row["longest"], p))


def takes_fused(co: dict, pairs: float, longest: int) -> bool:
    """forward_choice's path for an auto call of few pairs (below kFusedMinPairs): the fused
    forward when the sequences are long enough and the best split beats the two-pass estimate
    (kTwoPassShare of the unsplit fused time)."""
    if pairs >= co["kFusedMinPairs"]:
        return True
    if longest < co["kFusedMinChunks"]:
        return False
    p = best_pieces(co, dict(pairs=pairs, longest=longest), plan=True)
    return p > 1 and plan_cost(co, pairs, longest, p)[0] < co["kTwoPassShare"] * plan_cost(co, pairs, longest, 1)[0]


def regret(co: dict, rows: list) -> float:
    """Geometric mean over rows of (measured time at the model's choice among the measured piece
    counts) / (best measured time): 1.0 when the model picks the measured best everywhere."""
    logs = []
    for r in rows:
        if r["all_decay"]:
            continue  # the model assumes the benchmark's mix of exact and warm-up heads
        measured = r["times"]
        pick = min(measured, key=lambda p: cost_us(co, r["pairs"], r["longest"], p))
        logs.append(math.log(measured[pick] / min(measured.values())))
    return math.exp(sum(logs) / max(1, len(logs)))


def _two_pass_times(path: str) -> dict:
    """Each bench-split row's two-pass time (ms), by row name."""
    out = {}
    for line in open(path):
        m = re.search(r"bench-split (.+?)\s+two-pass ([0-9.]+)", line)
        if m:
            out.setdefault(m.group(1).strip(), float(m.group(2)))
    return out


def dispatch_regret(co: dict, path: str, verbose: bool = False) -> float:
    """Regret of the whole dispatch (path_rule and forward_choice) over the mixed-gate rows of
    one --split --bench output: the measured time of what it runs (the two-pass forward below
    kFusedMinPairs unless the sequences have kFusedMinChunks and a split beats kTwoPassShare of
    the unsplit fused time; else the plan's split when it gains kSplitMinGain, or the unsplit
    fused forward) over the best measured option (two-pass, unsplit, any forced piece count at
    either pass-1 tile). plan_regret leaves out the rows the dispatch gives the two-pass forward."""
    tp = _two_pass_times(path)
    logs = []
    for r in parse_vt(path):
        if r["all_decay"]:
            continue
        c = _row_coefficients(co, r)
        opts = [(vt[1], p, t) for vt, ts in r["times"].items() for p, t in ts.items() if p > 1]
        unsplit, two_pass = r["times"][(64, 64)][1], tp[r["name"]]
        cost = lambda o: cost_us(c, r["pairs"], r["longest"], o[1], vt=(64, o[0]), lean=True)
        pick = min(opts, key=cost)
        u = plan_cost(c, r["pairs"], r["longest"], 1)[0]
        if r["pairs"] >= co["kFusedMinPairs"]:
            t, path_ = (pick[2] if cost(pick) < co["kSplitMinGain"] * u else unsplit), "fused"
        elif r["longest"] < co["kFusedMinChunks"]:
            t, path_ = two_pass, "two-pass"
        else:
            t, path_ = (pick[2] if cost(pick) < co["kTwoPassShare"] * u else two_pass), "fused if split"
        best = min([unsplit, two_pass] + [o[2] for o in opts])
        if verbose:
            print(f"  {r['name']:<22} {path_:<15} runs {t:.3f} ms, best {best:.3f} (model: P{pick[1]} at pass-1 "
                  f"tile {pick[0]}, {cost(pick):.1f} us; unsplit {u:.1f})")
        logs.append(math.log(t / best))
    return math.exp(sum(logs) / max(1, len(logs)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="sm90_forward_test --split --bench output")
    ap.add_argument("--fit", action="store_true", help="search coefficients with the least regret")
    ap.add_argument("--fit-vt", action="store_true",
                    help="with bench-split-vt lines: the V tile 128 step scale with the least regret")
    ap.add_argument("--plan", action="store_true",
                    help="results since split-8 (lean pass 0): the plan's regret, and the scales that fit best")
    ap.add_argument("--dispatch", nargs="*", metavar="MORE",
                    help="the whole dispatch's regret (two-pass forward included) on these results and MORE "
                         "(other cards' or runs' outputs), and a small search of the fixed costs and the "
                         "two-pass threshold")
    args = ap.parse_args(argv)
    if args.dispatch is not None:
        paths = [args.results] + args.dispatch
        co = source_coefficients()
        for path in paths:
            print(f"{path}: dispatch regret {dispatch_regret(co, path, verbose=True):.4f}")
        grid = dict(kScanStepUs=[1.5, 2.0, 2.5], kPassUs=[4, 6, 8, 10], kWaveSteps=[1, 2, 3],
                    kWarmChunksTypical=[3, 4, 5], kFusedMinChunks=[32, 64])
        fits = []
        for vals in itertools.product(*grid.values()):
            c = dict(co, **dict(zip(grid, vals)))
            rs = [dispatch_regret(c, path) for path in paths]
            # ties to the source's values (the least change)
            moved = sum(v != co[n] for n, v in zip(grid, vals))
            fits.append((math.exp(sum(map(math.log, rs)) / len(rs)), moved, vals, rs))
        fits.sort(key=lambda f: (round(f[0], 4), f[1]))
        g, _, vals, rs = fits[0]
        print(f"least dispatch regret {g:.4f} (" + ", ".join(f"{r:.4f}" for r in rs) + ") with "
              + ", ".join(f"{n} {v:g}" for n, v in zip(grid, vals)))
        return 0
    rows = parse(args.results)
    if not rows:
        print(f"{args.results}: no bench-split lines")
        return 1
    co = source_coefficients()
    print("coefficients (src/sm90/split_plan.cuh): " + ", ".join(f"{n} {co[n]:g}" for n in _NAMES))
    for r in rows:
        ms = "  ".join(f"P{p}: {t:.3f}" for p, t in sorted(r["times"].items()))
        best = min(r["times"], key=r["times"].get)
        print(f"{r['name']:<26} measured {ms}  | best P{best}; model picks P{best_pieces(co, r)} "
              f"(auto ran {r['auto']:.3f} ms)")
    print(f"regret (measured time at the model's pick / best, geomean over the mixed-gate rows): {regret(co, rows):.3f}")
    print(f"misfit of the time differences between piece counts: {misfit_ms(co, rows) * 1e3:.1f} us rms")
    if args.fit:
        # The mixed-gate rows' exact share is the benchmark's (a quarter of the heads have g = 0).
        grid = dict(kStepUs=[1.5, 1.75, 2.0, 2.25, 2.5], kStepLoadedUs=[0.0, 0.5, 1.0, 1.5, 2.0],
                    kWaveSteps=[0, 3, 6], kScanStepUs=[2.0, 4.0, 8.0])
        best = None
        for vals in itertools.product(*grid.values()):
            c = dict(co, **dict(zip(grid, vals)))
            key = (misfit_ms(c, rows), -regret(c, rows))
            if regret(c, rows) <= regret(co, rows) + 1e-9 and (best is None or key < best[0]):
                best = (key, c)
        if best:
            print("least misfit {:.1f} us rms (regret {:.3f}) with ".format(best[0][0] * 1e3, -best[0][1])
                  + ", ".join(f"{n} {best[1][n]:g}" for n in _NAMES))
    if args.fit_vt:
        vrows = parse_vt(args.results)
        if not vrows:
            print(f"{args.results}: no bench-split-vt lines")
            return 1
        scales = [1.0 + 0.05 * i for i in range(21)]
        best_scale = min(scales, key=lambda x: (vt_regret(co, vrows, x), abs(x - 1.5)))
        print(f"V tile 128 step scale {best_scale:.2f}: regret {vt_regret(co, vrows, best_scale):.3f} over "
              f"{len(vrows)} rows (64 / 64 alone: {regret(co, [dict(r, times=r['times'][(64, 64)]) for r in vrows]):.3f})")
    if args.plan:
        vrows = parse_vt(args.results)
        grid = [(a, b) for a in (1.2, 1.25, 1.3, 1.35, 1.4, 1.45, 1.5) for b in (0.6, 0.7, 0.8, 0.9, 1.0)]
        fits = sorted((plan_regret(dict(co, kStep128Scale=a, kLeanStepScale=b), vrows), a, b) for a, b in grid)
        print(f"plan regret (lean pass 0, pass 1 at 64 or 128) over {len(vrows)} rows: {plan_regret(co, vrows):.3f}; "
              f"least {fits[0][0]:.3f} with kStep128Scale {fits[0][1]:g}, kLeanStepScale {fits[0][2]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
