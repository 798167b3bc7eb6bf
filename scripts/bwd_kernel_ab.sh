#!/usr/bin/env bash
# The library's backward, kernel by kernel, for test binaries built on the development machine
# (sm90_forward_test with -DQLA_SM90_TEST_HOOKS; carry their folder). Run on the device from the
# repository root:
#   BINS=".ab/x/main .ab/x/new" bash scripts/bwd_kernel_ab.sh
# For each binary: `--bwd-lib` and `--step` (the checks; skip with CHECKS=0), then for each row of
# ROWS (indices into backward_grid_cases(): t * 16 + s * 4 + h over tokens {8192, 32768},
# sequences {1, 2, 4, 8}, heads {16/32, 8/16, 4/8, 2/4}; default the 12 rows of <= 16 pairs, the
# fused backward's) the binaries alternated, ROUNDS times: ncu's gpu__time_duration of every
# kernel of `--bwd-one ROW` (a forward, then two library backwards). Prints, per row and binary,
# the second backward's total and its reverse step's passes (us). PROF_BINS (profile builds, with
# -DQLA_FUSED_PROFILE) print the first backward's phase timers for PROF_ROW (default 17), of the
# CTA blockIdx (0, PHASE_CTA) (default 1: piece 1, which a split step's pass 0 runs too).
# The ncu CSVs go to $OUT/bwd_kernel_ab.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/qla_out}
mkdir -p "$OUT"
bins=(${BINS:?BINS: the test binaries to compare})
rows=${ROWS:-1 2 3 6 7 11 17 18 19 22 23 27}
work=$(mktemp -d)
if [[ ${CHECKS:-1} == 1 ]]; then
  for b in "${bins[@]}"; do
    for m in --bwd-lib --step; do
      timeout 200 "$b" $m > "$work/check.txt" 2>&1
      echo "$b $m: rc=$? $(grep -c FAIL "$work/check.txt") FAIL; $(tail -n 1 "$work/check.txt")"
    done
  done
fi
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for r in $rows; do
    for i in "${!bins[@]}"; do
      timeout 90 ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        "${bins[$i]}" --bwd-one "$r" > "$work/b${i}_r${r}_${round}.csv" 2> /dev/null || echo "ncu ${bins[$i]} row $r: rc=$?"
    done
  done
done
tar -czf "$OUT/bwd_kernel_ab.tgz" -C "$work" .
python3 - "$work" "${bins[@]}" <<'PY'
import csv, glob, os, re, sys
work, bins = sys.argv[1], sys.argv[2:]
res = {}
for path in glob.glob(os.path.join(work, "b*_r*_*.csv")):
    i, r, rd = re.match(r"b(\d+)_r(\d+)_(\d+)\.csv", os.path.basename(path)).groups()
    rows = [x for x in csv.reader(open(path)) if len(x) > 10 and "gpu__time_duration" in ",".join(x)]
    ks = [((re.search(r"gdn_\w+", x[4]) or re.search(r"\w+", x[4])).group(0), float(x[-1].replace(",", ""))) for x in rows]
    starts = [j for j, (n, _) in enumerate(ks) if n == "gdn_chunk_table"]
    if not starts:
        continue
    bw = ks[starts[-1]:]  # the second backward: from its chunk table on
    steps = [v / 1e3 for n, v in bw if n == "gdn_bwd_fused_step"]
    res.setdefault(int(r), {}).setdefault(int(i), []).append((int(rd), sum(v for _, v in bw) / 1e3, steps))
print("row  binary                          backward us (rounds)        reverse step passes us (first round)")
for r in sorted(res):
    for i in sorted(res[r]):
        v = sorted(res[r][i])
        print(f"{r:<4} {bins[i][-30:]:<31} {' / '.join(f'{x[1]:.0f}' for x in v):<27} {' + '.join(f'{s:.0f}' for s in v[0][2])}")
PY
for b in ${PROF_BINS:-}; do
  echo "== $b --bwd-one ${PROF_ROW:-17} --phase-cta ${PHASE_CTA:-1}: the first backward's phase timers (cycles per chunk)"
  timeout 90 "$b" --bwd-one "${PROF_ROW:-17}" --phase-cta "${PHASE_CTA:-1}" 2>&1 | grep -E "cycles per chunk|bwd-one" | cut -c1-400
done
rm -rf "$work"
