#!/usr/bin/env bash
# The test command: installs pinned dependencies, builds everything (the CUDA backend
# too when nvcc is present: compiled for sm_90a, run only where a Hopper GPU is), then
# runs the user-install check, the C++ tests (ctest) and the Python tests (pytest, last, so
# its summary closes the output). Fails on any failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install_deps.sh

# One CMake build serves the Python module, the C++ tests and the example.
build_dir=build/py
python3 -m pip install --no-build-isolation -q -e . \
  -Cbuild-dir="$build_dir" -Ccmake.define.QLA_BUILD_TESTS=ON -Cbuild.verbose=false

echo "== user install"
# As a user installs: isolated `pip install .` and `pip wheel .` from a clean copy into fresh
# environments, the wheel's kernels checked, import and one call (scripts/check_user_install.sh).
bash scripts/check_user_install.sh

echo "== ctest"
ctest --test-dir "$build_dir" --output-on-failure -j 2

echo "== pytest"
# Exit code 5 (no tests collected) is a failure here, as is any failed or erroring test.
python3 -m pytest tests/python -q -p no:cacheprovider
