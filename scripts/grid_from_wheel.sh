#!/bin/bash
# Forward grid rows beside the peers, in one device call without building QLA on the device: QLA
# from the wheel in dist/ (built on the development machine with Python 3.12), the peers from
# .whl/ (scripts/fetch_peer_wheels.sh). The peers' JIT caches are filled first, one background
# process per head configuration (up to WARM_S seconds), then one run_grid.py process times every
# backend on every row. Run on the device from the repo root with carry ["dist", ".whl"]:
#   HEADS=2/8,16/16 TARGET_MS=50 bash scripts/grid_from_wheel.sh
# HEADS defaults to every head configuration of the grid; SHARD=i/n times every n-th row from the
# i-th. The whole grid takes three calls on one warm machine (the JIT caches stay while it is
# warm, 30 s after a call): WARM_S=480 GRID_S=0 (the nine configurations' caches), then
# WARM_S=0 GRID_S=540 SHARD=1/2, then the same with SHARD=2/2. Results in
# $OUT/grid_few.{md,json,log}; run_grid.py rewrites them after every row, so a call cut short
# keeps what it timed. Shards merge with `bench/run_grid.py --merge`.
# FI=1 adds FlashInfer 0.6.13 (its wheel in .whl/ too): its JIT build (bench/fi_build.py, about
# 64 nvcc jobs, several minutes) runs as one more warm-up process and the grid times it beside
# the others. With QLA from dist/ the device builds nothing of ours, so .whl/ can leave out the
# build-only wheels (nvidia_cutlass, nanobind, scikit_build_core) to make room for it: the peers,
# apache-tvm-ffi, tilelang_z3.tar.xz and flashinfer_python come to about 53 MiB, under the 64 MiB
# carry with the tree and dist/. The build takes longer than the other caches: give the warm-up
# call WARM_S=600 and GRID_S=0, and check "still running: 0" before timing.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
[[ -f .whl/tilelang_z3.tar.xz ]] && python3 -c "import tarfile; tarfile.open('.whl/tilelang_z3.tar.xz').extractall('/tmp/site')"
export PYTHONPATH=/tmp/site
uv=/tmp/qla_quick_env
if [[ ! -x $uv/bin/python ]]; then
  torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  python3 -m venv "$uv"
  echo "$torch_site" > "$("$uv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/reuse_installed_torch.pth"
fi
"$uv/bin/python" -m pip install -q --no-index --no-deps --force-reinstall dist/qla-*-cp312-*.whl 2>&1 | grep -v WARNING | tail -2
HEADS=${HEADS:-2/8,4/16,8/32,16/64,16/32,8/24,16/48,16/16,32/32}
if (( ${WARM_S:-260} > 0 )); then  # never beside the timing: the grid starts once these are done
  mkdir -p /tmp/qla_warm
  pids=()
  for hh in ${HEADS//,/ }; do
    setsid nohup timeout 400 "$uv/bin/python" bench/run_grid.py --kind fwd --heads "$hh" --backends fla,flashqla --no-graph \
      --warmup 0 --iters 1 --target-ms 1 --json /tmp/qla_warm/${hh/\//_}.json > /tmp/qla_warm/${hh/\//_}.log 2>&1 < /dev/null &
    pids+=($!)
  done
  if [[ ${FI:-0} == 1 ]]; then  # FlashInfer's module, built into the cache run_grid.py reads
    MAX_JOBS=${FI_JOBS:-8} setsid nohup timeout 900 "$uv/bin/python" bench/fi_build.py > /tmp/qla_warm/fi_build.log 2>&1 \
      < /dev/null &
    pids+=($!)
  fi
  # Waits on these processes by pid (a pattern would also match the caller's own command line
  # when it names /tmp/qla_warm, and then wait the whole WARM_S).
  alive() { local n=0 q; for q in "${pids[@]}"; do kill -0 "$q" 2>/dev/null && n=$((n + 1)); done; echo $n; }
  t0=$(date +%s); sleep 5
  while (( $(alive) > 0 )) && (( $(date +%s) - t0 < ${WARM_S:-260} )); do sleep 5; done
  echo "warm: $(( $(date +%s) - t0 )) s, still running: $(alive)"
fi
(( ${GRID_S:-200} > 0 )) || exit 0  # warm-up only
backends=qla,fla,flashqla
[[ ${FI:-0} == 1 ]] && backends+=,flashinfer
timeout ${GRID_S:-200} "$uv/bin/python" bench/run_grid.py --kind fwd --heads "$HEADS" --backends $backends \
  ${SHARD:+--shard $SHARD} --target-ms ${TARGET_MS:-50} --json $OUT/grid_few.json --out $OUT/grid_few.md \
  > $OUT/grid_few.log 2>&1
echo "grid rc=$?"; tail -30 $OUT/grid_few.log
