#!/usr/bin/env bash
# Installs everything a fresh machine needs to build and test QLA (Debian + PyPI, pinned).
# Idempotent: re-running on a provisioned machine is quick.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# --- Debian packages (compiler, CMake, ninja, GoogleTest), pinned to Debian 12 (bookworm) ---
declare -A apt_pins=(
  [g++]=4:12.2.0-3
  [cmake]=3.25.1-1
  [ninja-build]=1.11.1-2~deb12u1
  [libgtest-dev]=1.12.1-0.2
)
need_apt=()
for pkg in "${!apt_pins[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg=${apt_pins[$pkg]}")
done
if ((${#need_apt[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}"
fi

# --- Python packages: pinned in requirements-dev.txt ---
python3 -m pip install -q --disable-pip-version-check -r "$here/../requirements-dev.txt"
