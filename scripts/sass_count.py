#!/usr/bin/env python3
"""SASS size and register use of each kernel in a binary, largest first.

A kernel whose hot path outgrows the SM's instruction cache waits on instruction fetch (ncu's
`no_instruction` stall): the former gradients kernel at ~10,100 instructions a value head spent
44% of its samples there (docs/design.md bwd-18), the fused forward's K2 at 8,816 with four roles
31% (fused-34). Check the count after every change to a kernel; it also names any kernel whose wgmma
ptxas serialized (an arrive before every HGMMA, C7520 in a -Xptxas -v build; bwd-50):

    python3 scripts/sass_count.py build/.../libqla_core.so --filter gdn_bwd_fused_step
    python3 scripts/sass_count.py .ab/test_binary --filter 'fwd_chunks|fused_step'

Counts are of the whole kernel (16 bytes an instruction); the hot loop is part of it. With
--source (a -lineinfo build, one kernel matched) the count is split by role and phase: roles start
at the source's `// ---------------- NAME:` lines, phases at its QLA_PHASE( lines, each instruction
charged to the outermost frame of its inlined call chain in that file (scripts/sass_spills.py):

    python3 scripts/sass_count.py .ab/step --filter 'fused_stepIN7cutlass10bfloat16' \
        --source src/sm90/fused_step.cuh

The reverse step's roles run their loops at once on every scheduler, so their hot code adds up
against the instruction cache (~128 KiB second level, docs/design.md fused-35, bwd-46).
cuobjdump is looked up as scripts/check_wheel.py does (PATH, beside nvcc, Triton's copy)."""
import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_wheel import find_cuobjdump, find_nvcc, serialized_wgmma_kernels  # noqa: E402


def by_kernel(text: str, header: str):
    """(kernel, line) for each line of cuobjdump's output after a header naming the kernel."""
    name = None
    for line in text.splitlines():
        m = re.match(header, line)
        if m:
            name = m.group(1)
        elif name:
            yield name, line


def dump(tool: str, flag: str, path: str) -> str:
    return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def kernels(tool: str, path: str, sass: str) -> dict:
    """{mangled name: [instructions, registers, stack frame bytes]} (sass: the binary's -sass dump)"""
    out = {}
    for name, line in by_kernel(sass, r"\s*Function : (\S+)"):
        out.setdefault(name, [0, 0, 0])
        out[name][0] += bool(re.match(r"\s+/\*[0-9a-f]+\*/\s+\S", line))
    for name, line in by_kernel(dump(tool, "-res-usage", path), r"\s*Function (\S+):"):
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", line)
        if name in out and m:
            out[name][1:] = [int(m.group(1)), int(m.group(2))]  # (spills live in the stack frame)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", help="an executable, shared library or cubin with sm_90a SASS")
    ap.add_argument("--filter", default="", help="regular expression on the mangled kernel name")
    ap.add_argument("--source", help="source file of the kernel: counts by role and phase (needs -lineinfo)")
    ap.add_argument("--check-serialized", action="store_true",
                    help="exit 1 if a matched kernel's wgmma are serialized (ctest sm90_wgmma_batched runs this)")
    args = ap.parse_args()
    tool = find_cuobjdump(find_nvcc() or "")
    if not tool:
        print("cuobjdump not found (PATH, beside nvcc, or Triton's package)", file=sys.stderr)
        return 2
    sass = dump(tool, "-sass", args.binary)
    rows = [(n, v) for n, v in kernels(tool, args.binary, sass).items() if re.search(args.filter, n)]
    rows.sort(key=lambda r: -r[1][0])
    print(f"{'instructions':>12} {'KiB':>6} {'regs':>5} {'stack B':>8}  kernel")
    for n, (ins, regs, stack) in rows:
        print(f"{ins:12d} {ins * 16 / 1024:6.1f} {regs:5d} {stack:8d}  {n}")
    serialized = [k for k in serialized_wgmma_kernels(sass) if re.search(args.filter, k)]
    for k in serialized:
        print(f"SERIALIZED wgmma (an arrive before every HGMMA): {k}")
    if args.check_serialized:
        if not any("HGMMA" in line for line in sass.splitlines()):
            print("no HGMMA in the binary: nothing to check (not an sm_90a build?)", file=sys.stderr)
            return 1
        return 1 if serialized else 0
    if args.source:
        if len(rows) != 1:
            print("--source needs --filter to match one kernel", file=sys.stderr)
            return 2
        by_role_and_phase(args.binary, re.escape(rows[0][0]), args.source)
    return 0


def by_role_and_phase(binary: str, kernel: str, source: str) -> None:
    """Static instructions by role and by phase of one kernel (see the module's text)."""
    from sass_spills import instructions  # noqa: E402 (same folder)
    lines = open(source).read().splitlines()
    roles = [(i + 1, m.group(1)) for i, t in enumerate(lines) if (m := re.search(r"// -{8,} (\w+):", t))]
    phases = [i + 1 for i, t in enumerate(lines) if "QLA_PHASE(" in t and "define" not in t]
    role_of = lambda ln: next((name for first, name in reversed(roles) if ln >= first), "-")
    phase_of = lambda ln: max((f for f in phases if f <= ln), default=0)
    by_role, by_phase = collections.Counter(), collections.Counter()
    for _, line, _ in instructions(binary, kernel, os.path.basename(source)):
        if line is None:
            continue
        by_role[role_of(line)] += 1
        by_phase[(role_of(line), phase_of(line))] += 1
    print(f"\n{'role':>6} {'instructions':>12} {'KiB':>6}   phases (first line: instructions)")
    for first, name in [(0, "-")] + roles:
        if by_role[name]:
            ph = "  ".join(f"{f}: {n}" for (r, f), n in sorted(by_phase.items()) if r == name)
            print(f"{name:>6} {by_role[name]:12d} {by_role[name] * 16 / 1024:6.1f}   {ph}")


if __name__ == "__main__":
    sys.exit(main())
