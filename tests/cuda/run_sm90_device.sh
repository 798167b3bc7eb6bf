#!/bin/bash
# Device-machine driver for the sm90 forward test: runs the carried binary (.sm90_build),
# rebuilding there from source (CUTLASS headers carried in .cutlass_include) if it cannot start.
# Usage: tests/cuda/run_sm90_device.sh [test args...]; logs go to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/sm90_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/smi.txt"
B=.sm90_build/sm90_forward_test
build() {
  mkdir -p .sm90_build
  /usr/local/cuda/bin/nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DQLA_SM90_TEST_HOOKS \
    -Iinclude -I.cutlass_include src/sm90/gdn_fwd_sm90.cu tests/cuda/sm90_forward_test.cu -o $B 2>&1 | tee "$OUT/build.log"
}
[ "$REBUILD" = 1 ] && build
timeout ${TEST_TIMEOUT:-240} $B "$@" 2>&1 | tee "$OUT/run.log"; rc=$?
if [ $rc -eq 126 ] || [ $rc -eq 127 ]; then
  echo "carried binary did not start (rc=$rc): rebuilding here"; build
  timeout ${TEST_TIMEOUT:-240} $B "$@" 2>&1 | tee "$OUT/run.log"; rc=$?
fi
echo "rc=$rc"
exit $rc
