"""Summarise an Nsight Compute source page (SASS) exported as CSV.

On the device: ncu --clock-control none -k regex:KERNEL -c 1 --section WarpStateStats
--section SourceCounters -o rep ./binary ...; then ncu -i rep.ncu-rep --page source --csv
--print-source sass > k.csv (a few MB: summarise it there or here, commit the summary).

  python3 bench/ncu_source_summary.py k.csv            # stall reasons, then per-range table
  python3 bench/ncu_source_summary.py k.csv --top 40   # also the 40 most sampled instructions
  python3 bench/ncu_source_summary.py k.csv --lines 4147 4545   # one range, instruction by instruction

The ranges end at barriers, mbarrier waits, wgmma waits and bulk copies (--split REGEX to
change), so each row is a phase of a warp-specialized kernel: the share of the warp-state
samples spent there, the share of the instructions executed there, and the three commonest
stall reasons (of the range's samples).
"""
import argparse
import collections
import csv
import re
import signal


def load(path):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
    return data, ix, stalls


def num(r, ix, key):
    v = r[ix[key]]
    return int(v) if v and v.isdigit() else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--lines", type=int, nargs=2)
    ap.add_argument("--split", default=r"BAR\.SYNC|BAR\.ARV|WARPGROUP\.DEPBAR|SYNCS|UBLKCP|UTMALDG")
    a = ap.parse_args()
    data, ix, stalls = load(a.csv)
    S, I = "Warp Stall Sampling (All Samples)", "Instructions Executed"
    src = lambda r: r[ix["Source"]].strip()
    if a.lines:
        for i in range(a.lines[0], a.lines[1] + 1):
            r = data[i]
            print(f"{i:5d} {num(r, ix, I):>10d} {num(r, ix, S):>6d} {src(r)[:90]}")
        return
    ts = sum(num(r, ix, S) for r in data)
    ti = sum(num(r, ix, I) for r in data)
    tot = collections.Counter()
    for r in data:
        for h in stalls:
            tot[h] += num(r, ix, h)
    print(f"samples {ts}, warp instructions {ti}")
    for h, v in tot.most_common(10):
        print(f"  {h[6:]:22s} {100 * v / max(ts, 1):5.1f}%")
    print("range        samples  instructions  commonest stalls | range end")
    start, acc_s, acc_i, acc = 0, 0, 0, collections.Counter()
    for i, r in enumerate(data + [None]):
        end = r is None or re.search(a.split, src(r))
        if r is not None:
            acc_s += num(r, ix, S)
            acc_i += num(r, ix, I)
            for h in stalls:
                acc[h] += num(r, ix, h)
        if end:
            if acc_s > 0.003 * ts or acc_i > 0.003 * ti:
                dom = " ".join(f"{k[6:]}={100 * v / max(acc_s, 1):.0f}" for k, v in acc.most_common(3))
                label = src(r)[:60] if r is not None else "end"
                print(f"{start:5d}-{i:5d} {100 * acc_s / ts:6.1f}% {100 * acc_i / ti:9.1f}%   {dom} | {label}")
            start, acc_s, acc_i, acc = i + 1, 0, 0, collections.Counter()
    if a.top:
        order = sorted(range(len(data)), key=lambda k: -num(data[k], ix, S))[: a.top]
        for k in sorted(order):
            r = data[k]
            d = sorted(((h, num(r, ix, h)) for h in stalls), key=lambda t: -t[1])[:2]
            print(f"{k:5d} {num(r, ix, S):6d} {100 * num(r, ix, S) / ts:4.1f}% {src(r)[:60]:60s} "
                  + " ".join(f"{h[6:]}={v}" for h, v in d))


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    main()
