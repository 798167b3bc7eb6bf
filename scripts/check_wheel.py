"""Checks a built QLA wheel: it holds the package and its extension, and, where nvcc exists
(so the build compiled the sm90 backend), the extension carries ready machine code:

  - one sm_90a ELF for each sm90 translation unit (src/sm90/*.cu),
  - HGMMA (Hopper's wgmma, only in sm_90a code) in the SASS,
  - no PTX, so the driver has nothing to compile when the module loads,
  - no kernel whose wgmma ptxas serialized (an arrive before every HGMMA).

    python3 scripts/check_wheel.py dist/qla-*.whl

cuobjdump is looked up on PATH, beside nvcc, then in Triton's package (torch depends on
Triton on Linux, and Triton ships one). Exits non-zero with the reason on any failure.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
class WheelCheckError(Exception):
    """A check failed; the message says which and what was found."""


PACKAGE_FILES = ("qla/__init__.py", "qla/_ops.py", "qla/api.py", "qla/reference.py", "qla/bench.py")


def find_nvcc() -> str | None:
    return os.environ.get("CUDACXX") or shutil.which("nvcc")


def find_cuobjdump(nvcc: str) -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    beside = os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump")
    if os.path.isfile(beside):
        return beside
    try:
        import triton  # noqa: F401  (only for the path of its bundled cuobjdump)
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.isfile(bundled) else None


def cuobjdump(tool: str, flag: str, path: str) -> str:
    run = subprocess.run([tool, flag, path], capture_output=True, text=True)
    if run.returncode != 0 and flag == "--list-ptx" and "No PTX" in run.stderr:
        return ""  # some versions exit non-zero when there is nothing to list
    if run.returncode != 0:
        raise WheelCheckError(f"{tool} {flag} failed: {run.stderr.strip()}")
    return run.stdout


def check_kernels(so: str, tool: str) -> str:
    units = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "src", "sm90", "*.cu")))
    elfs = cuobjdump(tool, "--list-elf", so)
    for unit in units:
        if f"{unit}." not in elfs:
            raise WheelCheckError(f"no ELF for src/sm90/{unit}.cu in {os.path.basename(so)}; cuobjdump lists:\n{elfs}")
    ptx = cuobjdump(tool, "--list-ptx", so).strip()
    if ptx:
        raise WheelCheckError(f"the extension embeds PTX (the driver would compile it at load):\n{ptx}")
    sass = cuobjdump(tool, "--dump-sass", so)
    arches = set(re.findall(r"arch = (sm_\w+)", sass))
    if arches != {"sm_90a"}:
        raise WheelCheckError(f"expected machine code for sm_90a only, found {sorted(arches) or 'none'}")
    hgmma = sass.count("HGMMA")
    if hgmma == 0:
        raise WheelCheckError("no HGMMA in the SASS: the tensor-core kernels were not built for sm_90a")
    serialized = serialized_wgmma_kernels(sass)
    if serialized:
        raise WheelCheckError("ptxas serialized the wgmma of " + "; ".join(serialized) +
                              " (a warpgroup.arrive before every HGMMA: see ptxas's C7510-C7520 notes in a -Xptxas -v build)")
    return f"{len(units)} sm_90a ELF ({', '.join(units)}), {hgmma} HGMMA, no PTX"


def serialized_wgmma_kernels(sass: str) -> list[str]:
    """Kernels whose every HGMMA has its own WARPGROUP.ARRIVE: ptxas serialized their wgmma (it
    says so only in a -Xptxas -v build, e.g. C7520 when it had to put an arrive in a divergent
    path), so no product overlaps another or the code around it. A kernel that batches its
    products has a few arrives for many HGMMA (a batch of K steps is one arrive)."""
    out = []
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = part.split("\n", 1)
        n_mma, n_arrive = body.count("HGMMA"), body.count("WARPGROUP.ARRIVE")
        if n_mma >= 8 and n_arrive >= n_mma:
            out.append(f"{name.strip()} ({n_mma} HGMMA, {n_arrive} arrives)")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    wheel = argv[1]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        missing = [f for f in PACKAGE_FILES if f not in names]
        if missing:
            raise WheelCheckError(f"{os.path.basename(wheel)} lacks {missing}")
        ext = [n for n in names if re.fullmatch(r"qla/_C\..*\.so", n)]
        if len(ext) != 1:
            raise WheelCheckError(f"expected one qla/_C extension in the wheel, found {ext}")
        nvcc = find_nvcc()
        if nvcc is None:
            print(f"check_wheel: {os.path.basename(wheel)}: package and extension present; nvcc not found, "
                  "so the build is CPU-only and there are no kernels to check")
            return 0
        tool = find_cuobjdump(nvcc)
        if tool is None:
            raise WheelCheckError("nvcc exists but no cuobjdump was found (PATH, beside nvcc, Triton's package)")
        with tempfile.TemporaryDirectory() as tmp:
            so = zf.extract(ext[0], tmp)
            summary = check_kernels(so, tool)
    print(f"check_wheel: {os.path.basename(wheel)}: {summary}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except WheelCheckError as e:
        sys.exit(f"check_wheel: {e}")
