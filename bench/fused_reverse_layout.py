"""Shared-memory slot table of the planned fused reverse step (docs/backward.md, "The fused
reverse step"), checked before any kernel code.

One CTA per (sequence or piece, value head) walks its chunks last to first; per chunk a schedule
of phases, each a set of products by role (S: the state gradient dS in registers; K: dk and dv;
A: the 64 x 64 path and dq; P: the producer's loads and stores). Every tile a product reads or
writes lives in shared memory from the phase that writes it to the last phase that reads it; the
next chunk's inputs are loaded into their slots once the current chunk's last reader has passed,
and must land before the next chunk's first reader (so their lifetimes wrap around the chunk).

The script assigns the tiles to slots (first fit by start phase, a slot holds one tile at a
time), prints the table, the bytes in use at each phase, the peak, and each input's load window
(phases between its slot freeing and its first use: the latency the reload has to hide).
A schedule is a list of phases; each phase a list of (role, product, reads, writes). Tiles and
their bytes are in TILES. CPU only:

    python3 bench/fused_reverse_layout.py [--limit-kib 227]
"""
import argparse

KIB = 1024
C, D = 64, 128  # chunk tokens, head dimension (K = V = 128)
T64x128 = C * D * 2 // KIB     # a 16-bit 64 x 128 tile: 16 KiB
T64x64 = C * C * 2 // KIB      # a 16-bit 64 x 64 tile: 8 KiB
T128x128 = D * D * 2 // KIB    # a 16-bit state image: 32 KiB

# Tiles (KiB), as the reverse step is built (src/sm90/fused_step.cuh; its chain and dv since
# 2026-12-06) and planned on. Inputs arrive per chunk: q, k, v, dO as loaded (16-bit), the
# inverse kernel's Tu' image and T' (the chunk's inverse in the keys' units), the states pass's
# S' (the state entering the chunk, as an image: bf16 for bf16 inputs). dSn' is the chain's fp16
# copy of the state gradient leaving the chunk (written by S at the end of the previous chunk).
# Everything else is formed in the CTA.
INPUTS = {"Q": T64x128, "K": T64x128, "V": T64x128, "dO": T64x128, "Tu": T64x64, "Tm": T64x64, "S": T128x128}
CARRIED = {"dSn": T128x128}  # written at the end of chunk c + 1's step, read in chunk c
TILES = {**INPUTS, **CARRIED,
         "Pg": T64x64,    # 2^ep diag(2^ek) Pg^T's image (i, j), the input type: K's Pg^T dO
         "Qg": T64x128,   # scale diag(e^g) Q (fp16, unit): S's dS^T += D'^T Qg'
         "D": T64x128,    # dO (fp16, unit): the same product's other operand
         "W": T64x128,    # -diag(2^-ek) W (fp16; Kw = e^g K first, the product over it): S's dU^T W
         "dU": T64x128,   # dU' (fp16, unit)
         "Z": T64x128,    # V - diag(e^g) K S, the B operand of U = Tu Z
         "U": T64x128,    # U' (fp16, unit)
         "dA": T64x64,    # scale causal(E o dP) (bf16)
         "dW": T64x128,   # -dU S^T (fp16, unit): the B operand of dKb = Tm^T dW
         "dM": T64x64,    # E o dL (bf16): dM^T needs it transposed, so through shared memory
         "dVb": T64x128,  # Tm^T dU (bf16): A's X = dVb V^T
         "dKb": T64x128,  # Tm^T dW (bf16): A's X += dKb K^T
         }

# The schedule: phases of one chunk, (role, what, reads, writes, MFLOP). Register operands are
# not listed; an operand formed in registers from a shared-memory tile counts as a read of that
# tile (K's Kd' from K). Phases 0-2 are the built kernel's (P = Q K^T and Pg'', Qg' and D'; dU,
# W', D'^T Qg'; dU^T W', dv); the rest is the plan. dq, dk, dv go to global memory from
# registers, so no staging tile. dL's operands need no Uv or W tile: with Uv = Tm diag(beta) V
# and W = Tm diag(beta e^g) K, dL = -(dVb V^T + (dKb K^T) diag(e^g)) diag(beta) Tm^T, dVb and dKb
# in bf16 against V and K as loaded, then the 64 x 64 sum against Tm^T. A slot that passes from
# one role to another (Qg' or D' of S to A's Z, K's dW) needs a hand-over in the kernel: the
# script only refuses a same-phase hand-over between roles.
M64, M128 = 2 * C * C * D / 1e6, 2 * C * D * D / 1e6  # MFLOP of a 64x64x128 and a 64x128x128 product

SCHEDULE = [
    [("A", "P = Q K^T; Pg''", ["Q", "K"], ["Pg"], M64),
     ("S", "Qg' = fp16(scale diag(e^g) Q); D' = fp16(dO)", ["Q", "dO"], ["Qg", "D"], 0)],
    [("K", "dU = Pg^T dO + Kd dSn (Kd from K); dU' with its unit", ["Pg", "dO", "K", "dSn"], ["dU"], M64 + M128),
     ("A", "Kw = e^g K; W' = -2^-et Tu' Kw over it", ["K", "Tu"], ["W"], M64),
     ("S", "dS^T = e^G dSn^T + D'^T Qg'", ["D", "Qg"], [], M128)],
    [("S", "dS^T += dU'^T W'", ["dU", "W"], [], M128),
     ("K", "dv = Tu^T dU -> global", ["Tu", "dU"], [], M64),
     ("A", "Y = K S; Z = V - diag(e^g) Y", ["K", "S", "V"], ["Z"], M128)],
    [("A", "U = Tu Z (into Z's slot once the product has read it)", ["Tu", "Z"], ["U"], M64),
     ("K", "dW = -dU S^T (dU' in bf16 against a bf16 S')", ["dU", "S"], ["dW"], M128)],
    [("A", "dP = dO U^T; dA = scale causal(E o dP); R1 row and column sums", ["dO", "U"], ["dA"], M64)],
    [("A", "dq = scale e^g dO S^T + dA K -> global", ["dO", "S", "dA", "K"], [], M128 + M64),
     ("K", "dK_d = e^(G-g) U dSn^T; dk += dA^T Q", ["U", "dSn", "dA", "Q"], [], M128 + M64)],
    [("K", "dVb = Tm^T dU -> bf16 tile (dbeta's row dot from the accumulator)", ["Tm", "dU"], ["dVb"], M64),
     ("A", "L = strict(diag(beta) E o K K^T) (registers, for R2)", ["K"], [], M64)],
    [("K", "dKb = Tm^T dW; dk += diag(beta e^g) dKb -> bf16 tile", ["Tm", "dW"], ["dKb"], M64),
     ("A", "X = dVb V^T", ["dVb", "V"], [], M64)],
    [("A", "X += (dKb K^T) diag(e^g); dL = -X diag(beta) Tm^T; dM = E o dL", ["dKb", "K", "Tm"], ["dM"],
      M64 + M64 / 2)],
    [("K", "dk += diag(beta) dM K + dM^T diag(beta) K -> global", ["dM", "K"], [], 2 * M64),
     ("S", "<dSn, S> for dg", ["dSn", "S"], [], 0)],
    [("S", "dSn' = the fp16 copy of dS (the next chunk's)", [], ["dSn"], 0)],
]


def lifetimes(schedule):
    """Per tile: its kind and live half-steps (a phase p has a read half 2p, then a write half
    2p + 1: a product's epilogue writes after its operands were read). Inputs and the carried
    dSn own their slots. Checks that every read of a formed tile follows its write."""
    n = len(schedule)
    first_w, last_r, readers, writer = {}, {}, {}, {}
    for ph, ops in enumerate(schedule):
        for role, what, reads, writes, *_ in ops:
            for t in reads:
                if t not in INPUTS and t not in CARRIED and t not in first_w:
                    raise SystemExit(f"phase {ph}: '{what}' reads {t} before it is written")
                if last_r.get(t) != ph:
                    readers[t] = set()
                last_r[t] = ph
                readers[t].add(role)
            for t in writes:
                if t not in first_w:
                    first_w[t], writer[t] = ph, role
    life = {}
    for t in TILES:
        if t not in first_w and t not in last_r:
            continue  # (not in this schedule)
        if t in INPUTS or t in CARRIED:
            life[t] = ("input" if t in INPUTS else "carried", set(range(2 * n)))
        elif t in first_w:
            w, r = first_w[t], last_r.get(t, first_w[t])
            life[t] = ("formed", set(range(2 * w + 1, 2 * r + 1)) or {2 * w + 1})
    return life, n, first_w, last_r, readers, writer


def assign(life, n, first_w, last_r, readers, writer):
    """First fit: tiles by first live half-step, each into the first slot of its size whose
    tiles' half-steps do not overlap; a tile written in the phase where the slot's previous tile
    is last read may follow it only if that phase's readers are its own writer role (program
    order within one warpgroup; another role's read has no order against the write)."""
    order = sorted(life, key=lambda t: (min(life[t][1]), -TILES[t]))
    slots = []  # [size, half-steps, tiles]
    where = {}
    for t in order:
        hs = life[t][1]
        for i, (size, used, tiles) in enumerate(slots):
            if size != TILES[t] or used & hs:
                continue
            prev = tiles[-1]
            if life[t][0] == "formed" and life[prev][0] == "formed" and last_r.get(prev) == first_w[t] \
                    and readers[prev] != {writer[t]}:
                continue
            used |= hs
            tiles.append(t)
            where[t] = i
            break
        else:
            slots.append([TILES[t], set(hs), [t]])
            where[t] = len(slots) - 1
    return slots, where


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit-kib", type=float, default=227.0, help="the SM's opt-in shared memory per CTA")
    ap.add_argument("--reserve-kib", type=float, default=2.0, help="gates, units, row partials, mbarriers")
    args = ap.parse_args()
    life, n, first_w, last_r, readers, writer = lifetimes(SCHEDULE)
    slots, where = assign(life, n, first_w, last_r, readers, writer)
    print(f"{n} phases a chunk; tiles (slot, KiB, kind, live phases):")
    for t in sorted(life, key=lambda t: (where[t], min(life[t][1]))):
        kind, hs = life[t]
        ph = sorted({h // 2 for h in hs})
        print(f"  slot {where[t]:2d}  {t:4s} {TILES[t]:3d}  {kind:8s} "
              f"{'all' if kind != 'formed' else f'{ph[0]}..{ph[-1]}'}")
    used = sum(s[0] for s in slots)
    total = used + args.reserve_kib
    print(f"slots: {len(slots)}, {used} KiB + {args.reserve_kib:g} reserved = {total:g} KiB "
          f"(limit {args.limit_kib:g}: {'fits, ' + format(args.limit_kib - total, 'g') + ' KiB spare' if total <= args.limit_kib else 'over by ' + format(total - args.limit_kib, 'g')})")
    print("input reload windows (the slot is free from its last reader's phase to the next chunk's first):")
    first_r = {}
    for ph, ops in enumerate(SCHEDULE):
        for _, _, reads, _, *_ in ops:
            for t in reads:
                first_r.setdefault(t, ph)
    for t in INPUTS:
        print(f"  {t:3s} last read in phase {last_r[t]}, first in phase {first_r[t]}: "
              f"{n - 1 - last_r[t] + first_r[t]} phases to land")
    work = {}
    for ops in SCHEDULE:
        for role, _, _, _, *mf in ops:
            work[role] = work.get(role, 0.0) + (mf[0] if mf else 0.0)
    print("tensor work per chunk by role (MFLOP):", {r: round(w, 1) for r, w in sorted(work.items())},
          f"total {sum(work.values()):.1f}")
    return 0 if total <= args.limit_kib else 1


if __name__ == "__main__":
    raise SystemExit(main())
