#!/usr/bin/env python3
"""Local-memory traffic (spill reloads LDL, spill stores STL) of one kernel, by source line.

A spilled value inside a role's chunk loop is reloaded every chunk, and beside ~227 KiB of shared
memory the L1 keeps ~28 KiB, so the reload comes from L2: the reverse step's K role reloaded 182
a chunk, over half its stall cycles (docs/design.md bwd-41). Each instruction is charged to the
outermost frame of its inlined call chain that lies in --source, so a helper's spills show at the
line of the kernel that calls it. Give --loop FIRST LAST to count only lines inside a loop.

    python3 scripts/sass_spills.py .ab/step --kernel 'fused_stepIN7cutlass10bfloat16' \\
        --source fused_step.cuh --loop 676 1150

Build the binary with -lineinfo. nvdisasm and cuobjdump: PATH, beside nvcc, or PyPI's
nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump wheels (their nvidia/cu13/bin)."""
import argparse
import collections
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile


def tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc:
        beside = os.path.join(os.path.dirname(os.path.realpath(nvcc)), name)
        if os.path.isfile(beside):
            return beside
    sys.exit(f"{name} not found: put it on PATH (PyPI nvidia-cuda-{name})")


def disassembly(binary: str, kernel: str) -> list:
    """The text lines of `nvdisasm -gi` of the first kernel whose name matches."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([tool("cuobjdump"), "-xelf", "all", os.path.abspath(binary)], cwd=tmp, check=True,
                       capture_output=True)
        for cubin in sorted(glob.glob(os.path.join(tmp, "*.cubin"))):
            text = subprocess.run([tool("nvdisasm"), "-gi", "-c", cubin], capture_output=True, text=True).stdout
            sections = re.split(r"^\.text\.", text, flags=re.M)
            for sec in sections[1:]:
                if re.search(kernel, sec.split(":", 1)[0]):
                    return sec.splitlines()
    sys.exit(f"no kernel matching {kernel!r} in {binary}")


def instructions(binary: str, kernel: str, source: str):
    """(offset, line, opcode) of each instruction of the kernel: line is the outermost frame of its
    inlined call chain that lies in the file named source (None outside it)."""
    frame = re.compile(r'"([^"]*)", line (\d+)')
    line = None
    for text in disassembly(binary, kernel):
        if "//##" in text:
            lines = [int(n) for f, n in frame.findall(text) if f.endswith(source)]
            line = lines[-1] if lines else None
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
        if m:
            yield int(m.group(1), 16), line, m.group(2)


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # (piped into head)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--kernel", required=True, help="regular expression on the mangled name")
    ap.add_argument("--source", required=True, help="file name whose lines are reported")
    ap.add_argument("--loop", nargs=2, type=int, metavar=("FIRST", "LAST"), help="only lines in this range")
    args = ap.parse_args()
    counts, total = collections.Counter(), collections.Counter()
    for _, line, op in instructions(args.binary, args.kernel, args.source):
        if line is None:
            continue
        if args.loop and not args.loop[0] <= line <= args.loop[1]:
            continue
        total["instructions"] += 1
        if op in ("LDL", "STL"):
            counts[(line, op)] += 1
            total[op] += 1
    print(f"{args.source} lines {args.loop or 'all'}: {total['instructions']} instructions, "
          f"{total['LDL']} LDL, {total['STL']} STL")
    for (ln, kind), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:5d} {kind} line {ln}")


if __name__ == "__main__":
    main()
