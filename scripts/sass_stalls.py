#!/usr/bin/env python3
"""Warp-stall samples of one kernel by source line and by role, from ncu's per-instruction table.

ncu's source page (`ncu --import REP --page source --csv --print-source sass`, which
`scripts/device_check.sh step-prof` writes as step_sass.csv.xz) lists every SASS instruction by
address with its stall samples but without source lines. This script matches the addresses to the
lines of the same binary's disassembly (nvdisasm -gi, offsets from the kernel's first
instruction), charges each instruction to the outermost frame of its inlined call chain that lies
in --source, and sums the samples by line and by role (a role = the lines from its first line to
the next role's). In the reverse step of the thirty-eighth session it put 97% of the
long-scoreboard samples on mbarrier waits and 46% of A's samples on its wait for the stage
(docs/design.md bwd-42).

    python3 scripts/sass_stalls.py step_sass.csv.xz .ab/step --kernel 'fused_stepIN7cutlass10bfloat16' \\
        --source fused_step.cuh --roles P:375 A:432 K:771 S:1217 --top 20

With --hot N it also counts each role's hot code, the instructions executed at least N times (once a
chunk and warp): in the forty-fifth session A 3,420, K 3,506, S 1,454 (~133 KiB), over the second
instruction-cache level, with `no_instruction` 36% of A's samples (docs/design.md bwd-58).

Build the binary with -lineinfo; nvdisasm and cuobjdump as for scripts/sass_spills.py.
"""
import argparse
import collections
import csv
import io
import lzma
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_spills import instructions  # noqa: E402

REASONS = ["stall_long_sb", "stall_no_inst", "stall_barrier", "stall_wait", "stall_short_sb", "stall_selected"]


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", help="ncu source-page CSV (.csv or .csv.xz)")
    ap.add_argument("binary")
    ap.add_argument("--kernel", required=True, help="regular expression on the mangled name")
    ap.add_argument("--source", required=True, help="file name whose lines are reported")
    ap.add_argument("--roles", nargs="*", default=[], metavar="NAME:FIRST_LINE")
    ap.add_argument("--top", type=int, default=25, help="lines shown, by all samples")
    ap.add_argument("--hot", type=int, default=0, metavar="MIN_EXECUTIONS",
                    help="also count each role's hot code: the instructions executed at least this many times "
                         "(the warps of a role times the chunks, e.g. 30000 for pass 1 of --bwd-one 17)")
    args = ap.parse_args()

    opener = lzma.open if args.table.endswith(".xz") else open
    with opener(args.table, "rt") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    head = next(i for i, r in enumerate(rows) if "Address" in r)
    cols = {name: k for k, name in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    base = min(int(r[cols["Address"]], 16) for r in data)

    line_of = {off: line for off, line, _ in instructions(args.binary, args.kernel, args.source)}

    roles = sorted(((int(x.split(":")[1]), x.split(":")[0]) for x in args.roles))

    def role(ln):
        name = "-"
        for first, n in roles:
            if ln is not None and ln >= first:
                name = n
        return name

    hot = collections.Counter()  # (role) -> instructions executed at least args.hot times
    hot_line = collections.Counter()
    total_key = "Warp Stall Sampling (All Samples)"
    by_line, by_role = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    unmatched = 0
    for r in data:
        off = int(r[cols["Address"]], 16) - base
        if off not in line_of:
            unmatched += 1
        ln = line_of.get(off)
        for k in [total_key] + REASONS:
            v = int(r[cols[k]] or 0) if k in cols else 0
            by_line[ln][k] += v
            by_role[role(ln)][k] += v
        if args.hot and int(r[cols["Instructions Executed"]] or 0) >= args.hot:
            hot[role(ln)] += 1
            hot_line[ln] += 1
    print(f"{len(data)} instructions, {unmatched} not in the disassembly")
    hdr = ["all"] + [k.replace("stall_", "") for k in REASONS]
    print(f"{'role':>6} " + " ".join(f"{h:>10}" for h in hdr))
    for n, c in sorted(by_role.items()):
        print(f"{n:>6} " + " ".join(f"{c[k]:>10}" for k in [total_key] + REASONS))
    print(f"{'line':>6} {'role':>4} " + " ".join(f"{h:>10}" for h in hdr))
    for ln, c in sorted(by_line.items(), key=lambda kv: -kv[1][total_key])[: args.top]:
        print(f"{str(ln):>6} {role(ln):>4} " + " ".join(f"{c[k]:>10}" for k in [total_key] + REASONS))
    if args.hot:
        # Every scheduler runs a warp of each role, so the roles' hot code shares its instruction cache
        # (~34 KiB) and the SM's second level (~128 KiB; docs/design.md fused-35), 16 bytes an instruction.
        n = sum(hot.values())
        print(f"hot code (executed >= {args.hot} times): {n} instructions ({n * 16 / 1024:.1f} KiB); by role: " +
              ", ".join(f"{k} {v}" for k, v in sorted(hot.items())))
        print(f"{'line':>6} {'role':>4} {'hot':>6}")
        for ln, c in hot_line.most_common(args.top):
            print(f"{str(ln):>6} {role(ln):>4} {c:>6}")


if __name__ == "__main__":
    main()
