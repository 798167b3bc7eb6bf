"""The loops of a kernel's SASS and their sizes: the instruction-cache budget of a kernel.

Each scheduler (SM sub-partition) has its own instruction cache of about 32-36 KiB on the
H200 (bench/icache_probe.cu; 16 bytes per instruction, ~2100 instructions); a warp-specialized
kernel puts one warp of every warpgroup on each scheduler, so the per-chunk loops of all its
roles share it. This lists every backward branch (target <= its own address) as a loop
[target, branch] with its instruction count, largest first, skipping the retry stubs of
mbarrier waits (loops that end in the out-of-line code after the kernel's EXIT).

Usage: cuobjdump -sass -fun KERNEL BINARY > k.sass; python3 bench/sass_loops.py k.sass [N]
"""
import re
import sys


def read_sass(path):
    ins = []
    for line in open(path):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    return ins


def loops(ins):
    last_exit = max((a for a, t in ins if re.search(r"\bEXIT\b", t)), default=None)
    found = []
    for a, t in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target <= a and not (last_exit is not None and a > last_exit):
            found.append((target, a, (a - target) // 16 + 1))
    return sorted(found, key=lambda x: -x[2])


def main():
    ins = read_sass(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    print(f"{len(ins)} instructions ({len(ins) * 16 / 1024:.1f} KiB)")
    for lo, hi, size in loops(ins)[:n]:
        print(f"  loop {lo:#07x}-{hi:#07x}: {size:5d} instructions ({size * 16 / 1024:5.1f} KiB)")


if __name__ == "__main__":
    main()
