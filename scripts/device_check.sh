#!/usr/bin/env bash
# One device call: build on the GPU machine, run the GPU tests, the memory checker and the
# benchmarks, and leave the results in $OUT. Usage (from the repo root, on the device):
#   bash scripts/device_check.sh [fi-bg] [tests] [bwd] [memcheck] [bench] [profile] [grid] [grid-par]
#                                [grid-bwd] [grid-bwd-par] [grid-step] [grid-iso] [ab] [fi-wait] [wheel] [cold-peers]
#                                [warm-peers] [split-check] [scan-ab] [stalls] [step-prof]
#                                [pytest-gdb]
#   (default: tests memcheck bench grid)
# wheel: a QLA wheel built on the development machine (dist/qla-*-cp312-*.whl, carry "dist")
#   installed into a fresh environment with no compiler on PATH, checked (scripts/check_wheel.py),
#   its first and second calls timed (bench/first_call.py), qla.bench and the GPU pytest suites
#   run against it. No build on the device for this stage alone. WHEEL_TIMINGS=0 leaves out the
#   first-call timing and qla.bench (the suites alone); WHEEL_TESTS picks the suites.
# cold-peers: FlashQLA's and FlashInfer's first call from empty JIT caches (carry ".whl").
# warm-peers: fill the peers' JIT caches (FLA's Triton, FlashQLA's TileLang; carry ".whl") with
#   one process per kind, head configuration and peer, waited for in the same call (up to
#   WARM_WAIT_S, default 540 s; logs in /tmp/qla_warm). WARM_KIND (default fwd): for the backward
#   and training-step grids warm `bwd`, whose backward runs on the calling thread. Compiling
#   from autograd's worker thread (the `step` kind) crashed on 2026-12-06 (FLA: a segfault in
#   dlopen; FlashQLA: the process gone mid-compile, no message), and in a second attempt the
#   processes left running past the call (setsid) were gone, silently, by the next call; waited
#   for inside one call, 8 processes (4 head configurations x 2 peers) took 97 s. The caches then
#   serve every kind: GRID_KIND=bwd bash scripts/device_check.sh grid-iso, then GRID_KIND=step.
# Wheels for packages the device lacks (nvidia-cutlass, the peers) travel in .whl/
# (scripts/fetch_peer_wheels.sh); pass `carry: [".whl"]` to the device call. They are importable
# only inside this script (PYTHONPATH=/tmp/site below): time a peer subset through a stage, e.g.
#   GRID_ARGS="--heads 16/32 --layouts 1x8192 --backends qla,flashqla" bash scripts/device_check.sh grid-bwd
# Only eight files under $OUT come back from a call (the first eight by name): the logs go to
# $LOGS, and $OUT/0_logs.tgz (sorted first) is refreshed after every stage, so a call killed at
# its limit still returns them beside the JSON/Markdown results (`tar -xzf 0_logs.tgz`).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/qla_out}
LOGS=${LOGS:-/tmp/qla_logs}
mkdir -p "$OUT" "$LOGS"
rm -f "$LOGS"/*.log  # a warm machine keeps the previous call's
snap() { tar -czf "$OUT/0_logs.tgz" -C "$LOGS" . 2>/dev/null; }
trap snap EXIT
export PYTHONUNBUFFERED=1
stages=${*:-tests memcheck bench grid}
want() { [[ " $stages " == *" $1 "* ]]; }
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  nvcc --version | tail -1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOGS/env.log"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -3
  [[ -f .whl/tilelang_z3.tar.xz ]] && python3 -c "import tarfile; tarfile.open('.whl/tilelang_z3.tar.xz').extractall('/tmp/site')"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# fi-bg: FlashInfer's JIT build (about 64 nvcc jobs) in the background at low priority while the
# other stages run; fi-wait waits for it at the end, up to FI_WAIT_S seconds (the next call on the
# warm machine resumes an unfinished build). Log: $LOGS/fi_build.log.
fi_pid=
if want fi-bg; then
  MAX_JOBS=${FI_JOBS:-24} nice -n 19 python3 bench/fi_build.py > "$LOGS/fi_build.log" 2>&1 &
  fi_pid=$!
fi
snap

# The wheel stage: before anything compiles or warms a cache on this machine.
if want wheel; then
  echo "== wheel: install into a fresh environment (no compiler on PATH)" | tee "$LOGS/wheel.log"
  wheel=$(ls dist/qla-*-cp312-*.whl 2>/dev/null | head -1)
  if [[ -z $wheel ]]; then echo "no dist/qla-*-cp312-*.whl (build it with Python 3.12, carry dist)"; exit 1; fi
  uv=/tmp/qla_user_env
  rm -rf "$uv"
  torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  python3 -m venv "$uv" 2>>"$LOGS/wheel.log" || python3 -m venv --without-pip "$uv"
  echo "$torch_site" > "$("$uv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/reuse_installed_torch.pth"
  if [[ -x $uv/bin/pip ]]; then inst=("$uv/bin/python" -m pip); else inst=(python3 -m pip --python "$uv/bin/python"); fi
  env -i HOME=/tmp PATH="$uv/bin:/usr/bin:/bin" "${inst[@]}" install -q --no-index --disable-pip-version-check "$wheel" \
    2>&1 | tee -a "$LOGS/wheel.log"
  python3 scripts/check_wheel.py "$wheel" 2>&1 | tee -a "$LOGS/wheel.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  user_path="$uv/bin:/usr/bin:/bin"  # no nvcc: nothing can be compiled at import or at the first call
  if PATH=$user_path command -v nvcc >/dev/null; then echo "warning: nvcc is on $user_path"; fi
  # WHEEL_TIMINGS=0: the GPU suites only (the first-call timing starts a fresh process per row
  # and variant; on a machine with a cold disk it took the whole 330 s of a stage, 2026-12-07).
  if [[ ${WHEEL_TIMINGS:-1} == 1 ]]; then
    echo "== wheel: first and second call (fresh process per row)"
    PATH=$user_path "$uv/bin/python" bench/first_call.py --backends qla ${FIRST_CALL_ARGS:-} --json "$OUT/first_call_qla.json" 2>&1 \
      | tee "$LOGS/first_call_qla.log" | tail -n 14
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    echo "== wheel: qla.bench"
    (cd /tmp && PATH=$user_path timeout 120 "$uv/bin/python" -m qla.bench) 2>&1 | tee "$LOGS/wheel_qla_bench.log" | tail -n 6
  fi
  echo "== wheel: GPU pytest suites against the installed wheel"
  # From a copy of tests/ only, so that nothing of the source tree is importable as qla.
  rm -rf /tmp/qla_wheel_tests && cp -r tests /tmp/qla_wheel_tests
  (cd /tmp/qla_wheel_tests && PATH=$user_path "$uv/bin/python" -m pytest ${WHEEL_TESTS:-python/test_cuda_forward.py python/test_cuda_backward.py python/test_training.py python/test_prepare.py} \
     -q -p no:cacheprovider -rs) 2>&1 | tee "$LOGS/wheel_pytest.log" | tail -n 8
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
snap
if want warm-peers; then
  echo "== peers' JIT caches: one process per kind, head configuration and peer"
  mkdir -p /tmp/qla_warm
  # (FLA's backward and FlashQLA in one process segfaulted at an import on 2026-12-06.)
  pids=()
  for kk in ${WARM_KIND:-fwd}; do
    for hh in ${WARM_HEADS:-2/8 4/16 8/32 16/64 16/32 8/24 16/48 16/16 32/32}; do
      for bk in ${WARM_BACKENDS:-fla flashqla}; do
        tag=${kk}_${bk}_${hh/\//_}
        timeout "${WARM_WAIT_S:-540}" python3 bench/run_grid.py --kind "$kk" --heads "$hh" \
          --backends "$bk" --no-graph --warmup 0 --iters 1 --target-ms 1 \
          --json "/tmp/qla_warm/$tag.json" > "/tmp/qla_warm/$tag.log" 2>&1 < /dev/null &
        pids+=($!)
      done
    done
  done
  t0=$(date +%s)
  for p in "${pids[@]}"; do wait "$p"; echo "warm-up process $p: rc=$? at $(( $(date +%s) - t0 )) s"; done
  tail -n 2 /tmp/qla_warm/*.log
fi
snap
if want cold-peers; then
  echo "== cold start of the peers (empty JIT caches, one after the other)"
  # The parent process reads the rows from qla.bench: the wheel stage's environment (earlier in
  # this call or in an earlier call on this warm machine) has qla; the children import only the peer.
  py_cold=/tmp/qla_user_env/bin/python
  [[ -x $py_cold ]] || { echo "cold-peers needs the wheel stage first"; exit 1; }
  timeout 590 "$py_cold" bench/first_call.py --backends ${COLD_BACKENDS:-flashqla,flashinfer} --timeout ${COLD_TIMEOUT_S:-420} \
    --json "$OUT/first_call_peers.json" 2>&1 | tee "$LOGS/first_call_peers.log" | tail -n 6
fi
snap
# The build serves every other stage.
build_stages=" tests pytest-gdb bwd memcheck bench profile grid grid-par grid-bwd grid-bwd-par grid-step grid-iso ab "
need_build=0
for st in $stages; do [[ $build_stages == *" $st "* ]] && need_build=1; done
# Stages that run binaries built on the development machine (split-check) need no build.
if [[ $need_build -eq 1 ]]; then

  cutlass_inc=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
  echo "== build" | tee "$LOGS/build.log"
  start=$(date +%s)
  if ! CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -q -e . \
      -Cbuild-dir=build/device -Ccmake.define.QLA_BUILD_TESTS=ON -Ccmake.define.QLA_CUTLASS_INCLUDE_DIR="$cutlass_inc" \
      >>"$LOGS/build.log" 2>&1; then
    tail -40 "$LOGS/build.log"
    exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s" | tee -a "$LOGS/build.log"
  grep -E "registers|spill" "$LOGS/build.log" | sort | uniq -c | head -8
  snap
fi

if want tests; then
  echo "== sm90 standalone test (C++, poisoned outputs, graph replay)"
  build/device/tests/cpp/qla_sm90_forward_test 2>&1 | tee "$LOGS/sm90_test.log" | tail -14
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  echo "== pytest (GPU and CPU suites)"
  # PYTEST_TARGETS narrows the suites (the CPU suites also run in CI), e.g. tests/python/test_cuda_forward.py
  python3 -m pytest ${PYTEST_TARGETS:-tests/python} -q -p no:cacheprovider -rs 2>&1 | tee "$LOGS/pytest.log" | tail -15
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
snap

if want pytest-gdb; then
  # The pytest suites under gdb, stopping at the first failure: a crash prints the native stack
  # of every thread (PYTEST_TARGETS narrows the suites). Without gdb, faulthandler's Python stacks.
  {
    echo "== pytest under gdb"
    if command -v gdb >/dev/null; then
      timeout ${PYTEST_GDB_S:-420} gdb -q -batch -ex "set pagination off" -ex "set print thread-events off" -ex run -ex bt \
        -ex "thread apply all bt 12" --args python3 -X faulthandler -m pytest ${PYTEST_TARGETS:-tests/python} -q -x \
        -p no:cacheprovider -rs 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited" | tail -150
    else
      echo "no gdb on this machine"
      python3 -X faulthandler -m pytest ${PYTEST_TARGETS:-tests/python} -q -x -p no:cacheprovider -rs 2>&1 | tail -40
    fi
  } 2>&1 | tee "$LOGS/pytest_gdb.log"
fi
snap

if want bwd; then
  echo "== sm90 backward: per-gradient check against the CPU backend, then its pytest suites"
  timeout 300 python3 bench/backward_check.py 2>&1 | tee "$LOGS/backward_check.log" | tail -10
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  python3 -m pytest tests/python/test_cuda_backward.py tests/python/test_training.py -q -p no:cacheprovider -rs 2>&1 \
    | tee "$LOGS/pytest_bwd.log" | tail -15
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
snap

if want memcheck; then
  echo "== compute-sanitizer memcheck (small case)"
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/memcheck_case.py 2>&1 \
    | tee "$LOGS/memcheck.log" | tail -4
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
snap

if want bench; then
  echo "== qla.bench"
  timeout 120 python3 -m qla.bench 2>&1 | tee "$LOGS/qla_bench.log" | tail -8
  python3 bench/host_overhead.py 2>&1 | tee "$LOGS/host_overhead.log" | tail -8
  python3 bench/peak_memory.py 2>&1 | tee "$LOGS/peak_memory.log" | tail -4
fi
snap

if want profile; then
  echo "== backward: device time per kernel (torch.profiler)"
  for h in ${PROFILE_HEADS:-16/32 8/16 4/8 2/4}; do
    python3 bench/profile_backward.py --heads "$h" --layouts ${PROFILE_LAYOUTS:-1x32768,1x8192,8192x4} 2>&1 | grep -v -i warn
  done | tee "$LOGS/profile_bwd.log"
fi
snap

if want grid; then
  echo "== forward grid"
  # GRID_ARGS narrows the rows or backends, e.g. "--layouts 1x32768,8192x4 --backends qla,fla".
  timeout ${GRID_TIMEOUT:-3000} python3 bench/run_grid.py --kind fwd ${GRID_ARGS:-} --json "$OUT/grid_fwd.json" --out "$OUT/grid_fwd.md" 2>&1 \
    | tee "$LOGS/grid_fwd.log" | tail -45
fi
snap
# A grid (kind fwd or bwd) split by head configurations over the GPUs of the machine, one
# process per GPU (each row still times QLA and its peers side by side in one process), then
# merged. GRID_GROUPS: head lists separated by ';', one per GPU (default: the second argument).
grid_par() {
  local kind=$1 groups jsons=() i
  IFS=';' read -ra groups <<< "${GRID_GROUPS:-$2}"
  for i in "${!groups[@]}"; do
    CUDA_VISIBLE_DEVICES=$i timeout ${GRID_TIMEOUT:-3000} python3 bench/run_grid.py --kind "$kind" --heads "${groups[$i]}" \
      ${GRID_ARGS:-} --json "$OUT/grid_${kind}_$i.json" > "$LOGS/grid_${kind}_$i.log" 2>&1 &
    jsons+=("$OUT/grid_${kind}_$i.json")
  done
  wait
  tail -n 3 "$LOGS"/grid_"${kind}"_*.log
  python3 bench/run_grid.py --merge "${jsons[@]}" --out "$OUT/grid_${kind}.md" 2>&1 | tail -n 3
  grep -E "geometric|faster on" "$OUT/grid_${kind}.md"
}
if want grid-par; then
  echo "== forward grid, parallel over GPUs"
  grid_par fwd "2/8,4/16,8/32,16/64,16/32;8/24,16/48,16/16,32/32"
fi
snap
if want grid-bwd-par; then
  echo "== backward grid, parallel over GPUs"
  grid_par bwd "16/32,2/4;8/16,4/8"
fi
snap
if want ab; then
  # A/B of two standalone forward test binaries with test hooks, built with nvcc on the
  # development machine from two commits (.ab/fwd_old, .ab/fwd_new; carry .ab): the same bench
  # rows, their V tile 32/64 and overlap variants, alternating on one GPU.
  for b in old new old new; do echo "== ab $b"; timeout 120 .ab/fwd_$b --bench 2>&1 | grep "^bench"; done | tee "$LOGS/ab.log"
fi
snap

if want split-check; then
  # The split forward from a harness built on the development machine (.ab/fwd_new: this tree
  # with -DQLA_SM90_TEST_HOOKS; carry .ab): the suites, the few-pair short rows with and without
  # host lengths (without: the plan refined on the device, split-10), the split bench (pieces
  # forced, pass 1 at V tile 64 and 128: the cost model's data), and ncu of the split passes of
  # 2/8 1x32768 (bench row 2) and 16/16 1x32768 (row 4). About 150 s.
  b=.ab/fwd_new
  {
    for m in "" --split --fused; do echo "== suite ${m:-default}"; timeout 150 $b $m 2>&1 | grep -E "FAIL|PASSED|max o" | tail -16; done
    echo "== short-bench"; timeout 90 $b --short-bench 2>&1 | grep "^bench-short"
    echo "== short-bench without host lengths"; QLA_TEST_NO_HOST_LENS=1 timeout 90 $b --short-bench 2>&1 | grep "^bench-short"
    for row in 2 4; do for c in auto 16; do
      envs=(X=1)
      [[ $c != auto ]] && envs+=("QLA_TEST_SPLIT_CHUNKS=$c")
      echo "== ncu --profile $row, pieces of $c chunks (us: K1, pass 0, scan, pass 1)"
      env "${envs[@]}" ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gdn_fwd $b --profile $row 2>&1 \
        | grep gpu__time_duration | awk '{print $NF}' | tr '\n' ' '
      echo
    done; done
    echo "== split-bench"; timeout 200 $b --split --bench 2>&1 | grep "^bench-split"
  } 2>&1 | tee "$LOGS/split_check.log"
fi
snap

if want scan-ab; then
  # A scan against another (split-11): .ab/fwd_old and .ab/fwd_new, test builds from two trees
  # (carry .ab); SCAN_OLD_ENV, SCAN_NEW_ENV: each binary's environment (for a build with a
  # test hook choosing between scans, one binary as both).
  # The new binary's --split and default suites, the scan's ncu time
  # at 2/8 1x32768 (bench row 2) at the plan's pieces and at pieces of 16 and 8 chunks (31 and
  # 63 steps) for both, the new scan's step without its copies or products (timing variants),
  # then the new split bench. About 220 s.
  {
    echo "== new: suite --split"
    env X=1 ${SCAN_NEW_ENV:-} timeout 150 .ab/fwd_new --split 2>&1 | grep -E "FAIL|PASSED|max o" | tail -8
    echo "== new: default suite"
    env X=1 ${SCAN_NEW_ENV:-} timeout 150 .ab/fwd_new 2>&1 | grep -E "FAIL|PASSED" | tail -4
    for c in auto 16 8; do
      envs=(X=1)
      [[ $c != auto ]] && envs+=("QLA_TEST_SPLIT_CHUNKS=$c")
      for b in old new; do
        e=("${envs[@]}")
        [[ $b == old ]] && e+=(${SCAN_OLD_ENV:-})
        [[ $b == new ]] && e+=(${SCAN_NEW_ENV:-})
        echo "== $b: ncu --profile 2, pieces of $c chunks (us: K1, pass 0, scan, pass 1)"
        env "${e[@]}" ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gdn_fwd .ab/fwd_$b --profile 2 2>&1 \
          | grep gpu__time_duration | awk '{print $NF}' | tr '\n' ' '
        echo
      done
    done
    # What sets the scan's step (pieces of 8 chunks, 63 steps; results wrong): as is, without
    # M's loads (16), without the products (32), without both (48).
    for sk in 0 16 32 48; do
      echo "== new: scan without (skip $sk): us (K1, pass 0, scan, pass 1)"
      env ${SCAN_NEW_ENV:-} QLA_TEST_FUSED_SKIP=$sk QLA_TEST_SPLIT_CHUNKS=8 ncu --clock-control none --metrics gpu__time_duration.sum \
        -k regex:gdn_fwd .ab/fwd_new --profile 2 2>&1 | grep gpu__time_duration | awk '{print $NF}' | tr '\n' ' '
      echo
    done
    echo "== new: split-bench"
    env X=1 ${SCAN_NEW_ENV:-} timeout 200 .ab/fwd_new --split --bench 2>&1 | grep "^bench-split"
  } 2>&1 | tee "$LOGS/scan_ab.log"
fi
snap

if want step-prof; then
  # The library's fused backward, its reverse step's pass 1 (issue 14, test builds): `--bwd-lib`
  # and `--step` on the first binary of STEP_BINS (default .ab/step; build each with
  # -DQLA_SM90_TEST_HOOKS -lineinfo here and carry them), then ncu of the step's second launch
  # (pass 1 of a split step; the only launch of an unsplit one is the first, STEP_PROF_SKIP=0) in
  # `--bwd-one STEP_PROF_ROW` (default 17: 8/16 1x32768): scheduler and warp states, the stall
  # reasons per issued instruction, and the per-instruction stall table ($OUT/step_sass.csv.xz;
  # by source line and role: scripts/sass_stalls.py with the same binary). Kernel durations side
  # by side: scripts/bwd_kernel_ab.sh.
  bins=(${STEP_BINS:-.ab/step})
  {
    for m in --bwd-lib --step; do
      echo "== ${bins[0]} $m"
      timeout 150 "${bins[0]}" $m 2>&1 | tail -3
    done
    rm -f /tmp/qla_step.ncu-rep
    timeout 240 ncu --clock-control none --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --import-source no -k regex:gdn_bwd_fused_step --launch-skip "${STEP_PROF_SKIP:-1}" --launch-count 1 \
      -o /tmp/qla_step "${bins[0]}" --bwd-one "${STEP_PROF_ROW:-17}" > "$LOGS/step_ncu_run.txt" 2>&1
    ncu --import /tmp/qla_step.ncu-rep --print-details all > "$LOGS/step_ncu.txt" 2>&1
    grep -E "Issued Warp|Eligible Warps|Warp Cycles Per Issued|cycles being stalled|represents about" "$LOGS/step_ncu.txt" | head -12
    # The stall reasons, cycles per issued instruction (the section's metrics on the raw page).
    ncu --import /tmp/qla_step.ncu-rep --page raw --csv 2>/dev/null > "$LOGS/step_ncu_raw.csv"
    python3 - "$LOGS/step_ncu_raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:
    head, vals = rows[0], rows[-1]
    st = [(h, v) for h, v in zip(head, vals) if h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio")]
    for h, v in sorted(st, key=lambda x: -float(x[1].replace(",", "") or 0))[:14]:
        print(f"{h[len('smsp__average_warps_issue_stalled_'):-len('_per_issue_active.ratio')]:<24} {v}")
PY
    ncu --import /tmp/qla_step.ncu-rep --page source --csv --print-source sass 2>/dev/null | xz -9 > "$OUT/step_sass.csv.xz"
  } 2>&1 | tee "$LOGS/step_prof.log"
fi
snap

if want stalls; then
  # Where the loaded chunk step and the scan's step go (issue 12's open question, docs/design.md
  # split-9): ncu's warp-state, scheduler and memory sections for one launch of the fused
  # recurrence at 16/32 8192x4 (bench row 1, V tile 128, every SM busy) and at 2/8 1x32768's
  # pass 1 (row 2), and for the scan of row 2; the memory lines (DRAM and L2) say how far the
  # loaded step is from the bytes. Full reports in $LOGS/stalls_*.txt (the log tarball); the
  # stall lines here. Binary: .ab/fwd_new (carry .ab). About 20 s.
  b=.ab/fwd_new
  secs=(--section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats)
  run_ncu() {  # tag, kernel regex, launch skip, row, env...
    local tag=$1 k=$2 skip=$3 row=$4; shift 4
    env X=1 "$@" ncu --clock-control none "${secs[@]}" -k "regex:$k" --launch-skip "$skip" --launch-count 1 $b --profile "$row" \
      > "$LOGS/stalls_$tag.txt" 2>&1
    echo "== $tag"; grep -E "Stall|Issued|Eligible|Active Warps|Duration|L1/TEX Hit|L2 Hit|Mem Busy|Memory Throughput|DRAM Throughput|Max Bandwidth|Registers" \
      "$LOGS/stalls_$tag.txt" | head -28
  }
  {
    run_ncu k2_16_32_8192x4 gdn_fwd_chunks 0 1
    run_ncu k2_pass1_2_8_1x32768 gdn_fwd_chunks 1 2
    run_ncu scan_2_8_1x32768 gdn_fwd_scan 0 2
  } 2>&1 | tee "$LOGS/stalls.log"
fi
snap

# grid-bwd, grid-step: the backward grid, and its rows as training steps (autograd forward +
# backward), all backends in one process.
for kind in bwd step; do
  if want grid-$kind; then
    echo "== $kind grid"
    python3 bench/run_grid.py --kind $kind ${GRID_ARGS:-} --json "$OUT/grid_$kind.json" --out "$OUT/grid_$kind.md" 2>&1 \
      | tee "$LOGS/grid_$kind.log" | tail -25
  fi
done
snap
if want grid-iso; then
  # The grid of GRID_KIND (fwd, bwd or step) with each backend in its own process, one after
  # another (GRID_BACKENDS, default qla fla flashqla), merged by row: peers that crash beside
  # each other still land in one table. GRID_ARGS selects rows as for grid-bwd.
  kind=${GRID_KIND:-bwd}
  echo "== $kind grid, one process per backend"
  parts=()
  for bk in ${GRID_BACKENDS:-qla fla flashqla}; do
    python3 bench/run_grid.py --kind "$kind" --backends "$bk" ${GRID_ARGS:-} --json "$LOGS/iso_${kind}_$bk.json" \
      > "$LOGS/iso_${kind}_$bk.log" 2>&1
    echo "$bk: rc=$? $(grep -c '^\(fwd\|bwd\|step\) ' "$LOGS/iso_${kind}_$bk.log") rows"
    [[ -f $LOGS/iso_${kind}_$bk.json ]] && parts+=("$LOGS/iso_${kind}_$bk.json")
  done
  python3 bench/run_grid.py --merge "${parts[@]}" --json "$OUT/grid_${kind}.json" --out "$OUT/grid_${kind}.md" | tail -1
  grep -E "geomean|/ qla" "$OUT/grid_${kind}.md" | head -8
fi
snap
if [[ -n $fi_pid ]] && want fi-wait; then
  echo "== waiting for the FlashInfer build (up to ${FI_WAIT_S:-300} s)"
  for ((i = 0; i < ${FI_WAIT_S:-300}; i += 5)); do kill -0 "$fi_pid" 2>/dev/null || break; sleep 5; done
  grep -E "^\[[0-9]+/[0-9]+\]" "$LOGS/fi_build.log" | tail -n 2; grep "fi_build\]" "$LOGS/fi_build.log"
fi
snap
exit $status
