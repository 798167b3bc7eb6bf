"""The tensor-core scan's layouts (gdn_fwd_scan in src/sm90/split.cuh, split-11), checked on
the CPU before the kernel runs: its index expressions (scan_swz, scan_frag, the copy's rows, the
lanes' places of S and R, the permuted k8 steps) written out again here with the m16n8k8 tf32
fragment semantics of the PTX ISA, for one CTA in fp64, against M S + R; and every 16-byte
shared-memory load and copy free of bank conflicts (a quarter-warp's eight 16-byte accesses on
eight distinct 16-byte bank groups). Mirror any change of those expressions here.

    python3 bench/scan_mma_layout.py
"""
import numpy as np
kDK = 128; COLS = 16; rng = np.random.default_rng(1)
def swz(r, x): return r * kDK + (x ^ ((r & 1) << 4))
def frag(kp, h, g, t): return 4 * (((kp * 2 + h) * 8 + g) * 4 + t)
M = rng.standard_normal((kDK, kDK)); S = rng.standard_normal((kDK, COLS)); R = rng.standard_normal((kDK, COLS))
# copy: thread tid copies rows tid/32 + 8q, 4 floats at col 4*(tid%32)
sM = np.full(kDK * kDK, np.nan)
for tid in range(256):
    for q in range(kDK // 8):
        row, col = tid // 32 + 8 * q, 4 * (tid % 32)
        d = swz(row, col); sM[d:d + 4] = M[row, col:col + 4]
assert not np.isnan(sM).any()
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
                    d = swz(16 * warp + 8 * n + g, 16 * kp + 4 * t); mv = sM[d:d + 4]
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
                for n in range(2):
                    ok &= groups([swz(16 * warp + 8 * n + l // 4, 16 * kp + 4 * (l % 4)) for l in lanes])
for row in range(kDK):
    for qw in range(4):
        ok &= groups([swz(row, 4 * l) for l in range(8 * qw, 8 * qw + 8)])
print('16-byte loads and copies conflict-free:', ok)
assert ok
