"""Packaging: the build requirements are pinned and agree with the development pins, the
extension this build produced carries ready sm_90a machine code wherever nvcc exists (the
same check scripts/check_user_install.sh runs on a wheel built as a user builds it), and it
exports nothing but its entry point and nanobind's exception types."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

import qla

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _check_wheel():
    spec = importlib.util.spec_from_file_location("check_wheel", os.path.join(ROOT, "scripts", "check_wheel.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins(lines):
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+)", line)
            assert m, f"not an exact pin: {line!r}"
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_build_requirements_are_pinned_and_match_the_dev_pins():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        build = _pins(tomllib.load(f)["build-system"]["requires"])
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        dev = _pins(f)
    # What the extension is built from: the backend, the binding library, the CUDA headers.
    assert set(build) == {"scikit-build-core", "nanobind", "nvidia-cutlass"}
    for name, version in build.items():
        assert dev.get(name) == version, f"{name}: pyproject.toml pins {version}, requirements-dev.txt {dev.get(name)}"


def test_extension_carries_sm90a_machine_code_where_nvcc_exists():
    cw = _check_wheel()
    nvcc = cw.find_nvcc()
    if nvcc is None:
        assert not qla.has_cuda_backend(), "no nvcc here, yet the extension reports a CUDA backend"
        pytest.skip("nvcc not found: a CPU-only build has no kernels to check")
    assert qla.has_cuda_backend(), f"nvcc exists ({nvcc}) but this build has no CUDA backend"
    tool = cw.find_cuobjdump(nvcc)
    assert tool is not None, "nvcc exists but no cuobjdump was found (PATH, beside nvcc, Triton's package)"
    summary = cw.check_kernels(qla._C.__file__, tool)
    assert "sm_90a ELF" in summary and "no PTX" in summary


def test_extension_exports_only_its_entry_point():
    """Symbols of the static archives the module links (qla_core; libstdc++ where a toolchain links
    it statically) must stay inside: exported, libstdc++'s bind to the copy torch loaded and the
    two copies' locale state mixes, so a number formatted into an error message came out empty
    (GCC 12) or crashed the process (GCC 13). Allowed: PyInit__C and nanobind's exception types,
    which nanobind exports on purpose."""
    nm = shutil.which("nm")
    if nm is None or not sys.platform.startswith("linux"):
        pytest.skip("needs nm on Linux")
    out = subprocess.run([nm, "-D", "--defined-only", qla._C.__file__], capture_output=True, text=True,
                         check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "PyInit__C" in names
    leaked = [n for n in names if n != "PyInit__C" and "nanobind" not in n]
    assert not leaked, f"{len(leaked)} symbols leave {qla._C.__file__}, e.g. {leaked[:5]}"
