"""The tensor-core scan's layouts (gdn_fwd_scan in src/sm90/split.cuh, split-11 and split-12),
checked on the CPU: its index expressions (scan_load_m's fragments of M from the map, scan_frag,
the lanes' places of S and R, the permuted k8 steps) written out again here with the m16n8k8
tf32 fragment semantics of the PTX ISA, for one CTA in fp64, against M S + R; and every 16-byte
shared-memory access of S_j free of bank conflicts (a quarter-warp's eight 16-byte accesses on
eight distinct 16-byte bank groups). Mirror any change of those expressions here.

    python3 bench/scan_mma_layout.py
"""
import numpy as np
kDK = 128; COLS = 16; rng = np.random.default_rng(1)
def frag(kp, h, g, t): return 4 * (((kp * 2 + h) * 8 + g) * 4 + t)
M = rng.standard_normal((kDK, kDK)); S = rng.standard_normal((kDK, COLS)); R = rng.standard_normal((kDK, COLS))
sF = np.full(COLS * kDK, np.nan)
def put_s(warp, g, t, n, v):
    c = [v[0], v[2], v[1], v[3]]; d = frag(warp, t & 1, g, 2 * n + t // 2); sF[d:d + 4] = c
def at_idx(warp, g, t, n, q): return (16 * warp + 8 * n + 2 * t + (q & 1), g + 8 * (q >> 1))
for warp in range(8):
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(2):
            put_s(warp, g, t, n, [S[at_idx(warp, g, t, n, q)] for q in range(4)])
assert not np.isnan(sF).any()
out = np.full((kDK, COLS), np.nan)
for warp in range(8):
    # gather the warp's fragments, then do the mma semantics per k8 step
    part = np.zeros((2, 2, 32, 4))
    for kp in range(8):
        for h in range(2):
            A = np.zeros((16, 8)); B = np.zeros((2, 8, 8)); seenA = np.zeros((16, 8)); seenB = np.zeros((2, 8, 8))
            for lane in range(32):
                g, t = lane // 4, lane % 4
                sv = sF[frag(kp, h, g, t):frag(kp, h, g, t) + 4]
                A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = sv
                for n in range(2):
                    mv = M[16 * warp + 8 * n + g, 16 * kp + 4 * t:16 * kp + 4 * t + 4]  # scan_load_m
                    b = (mv[0], mv[1]) if h == 0 else (mv[2], mv[3])
                    B[n, t, g], B[n, t + 4, g] = b
            for n in range(2):
                D = A @ B[n]  # 16 x 8
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    part[h, n, lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for n in range(2):
            for q in range(4):
                out[at_idx(warp, g, t, n, q)] = part[0, n, lane, q] + part[1, n, lane, q] + R[at_idx(warp, g, t, n, q)]
ref = M @ S + R
err = np.abs(out - ref).max()
print('max |out - ref|', err, 'unwritten', int(np.isnan(out).sum()))
assert err < 1e-12 and not np.isnan(out).any()
# bank conflicts: 16-byte loads by quarter-warps must hit distinct 16-byte groups (of 8)
def groups(addrs): return len(set((a // 4) % 8 for a in addrs)) == len(addrs)
ok = True
for warp in range(8):
    for kp in range(8):
        for h in range(2):
            for qw in range(4):
                lanes = range(8 * qw, 8 * qw + 8)
                ok &= groups([frag(kp, h, l // 4, l % 4) for l in lanes])
print("16-byte loads of S_j conflict-free:", ok)
assert ok
