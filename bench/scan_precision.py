"""Precision of the split forward's scan (src/sm90/split.cuh) by its arithmetic, on the CPU:
S_{j+1} = M_j S_j + R_j over a sequence's pieces, with the maps (M_j, R_j) of real pieces
computed in fp64 by qla.reference, then the scan run
  - in fp64 (the reference),
  - in fp32 (the FMA scan that split-11 replaced),
  - with tf32 operands, one product (hi hi) or three (hi hi + hi lo + lo hi), fp32 sums: the
    tensor-core scan (split-11 in docs/design.md; the library runs one product). hi is rounded
    to nearest (cvt.rna), lo is x - hi truncated to tf32, as the tensor core reads it.
Only the scan's own error is measured (the same fp64 maps feed every variant). Gates as in the
benchmarks: g = 0 (every head with g = 0 takes the exact path, so this is the case that matters),
the benchmark's decay and strong decay (the maps shrink to ~0: the warm-up path's cases).

    python3 bench/scan_precision.py [--pieces 32 64] [--T 32768] [--blocks 4 8]

Measured (2026-12-05): g = 0, T = 32768: fp32 3.6e-8 / 3.8e-8, tf32x1 2.0e-5 / 7.6e-5, tf32x3
3.7e-8 / 4.3e-8 at 32 / 64 pieces; at pieces of one chunk (T = 4096, 64 pieces; M near the
identity, the worst case for tf32x1) 7.5e-8, 4.3e-4, 1.3e-7. The decaying gates' maps shrink
to ~0, so every variant is exact there (2.5e-8).
Blocked (--blocks B; 2026-12-07, tf32x1 operands, blocks of 4, 6, 8 steps): the same error as the
serial tf32x1 scan to two digits: g = 0, T = 32768: 1.9e-5 at 33 pieces, 7.5e-5 to 7.6e-5 at
65; pieces of one chunk (T = 4096, 64 pieces) 4.34e-4 to 4.47e-4 against 4.32e-4; decaying
gates 2.5e-8 and 9.3e-6 as serial.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
# The reference alone (pure torch): no built module needed.
_spec = importlib.util.spec_from_file_location("qla_reference", os.path.join(_HERE, "..", "python", "qla", "reference.py"))
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

C = 64  # chunk
MODES = ("fp32", "tf32x1", "tf32x3")


def tf32_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 (10 mantissa bits), round to nearest, ties away from zero (cvt.rna.tf32.f32)."""
    b = x.to(torch.float32).view(torch.int32).to(torch.int64)
    return ((b + 0x1000) & ~0x1FFF).to(torch.int32).view(torch.float32)


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 by dropping the low 13 bits (how the tensor core reads an fp32 register)."""
    return (x.to(torch.float32).view(torch.int32) & ~0x1FFF).view(torch.float32)


def scan(maps, rests, mode: str) -> torch.Tensor:
    """The state entering the last piece. The products' sums are taken in fp64 and rounded to
    fp32 once: the fp32 hardware sums round more often, a second-order difference."""
    S = rests[0].clone()
    for M, R in zip(maps[1:], rests[1:]):
        if mode == "fp64":
            S = M @ S + R
            continue
        Mf, Sf = M.float(), S.float()
        if mode == "fp32":
            acc = Mf.double() @ Sf.double()
        else:
            mh, sh = tf32_nearest(Mf), tf32_nearest(Sf)
            acc = mh.double() @ sh.double()
            if mode == "tf32x3":
                ml, sl = tf32_truncate(Mf - mh), tf32_truncate(Sf - sh)
                acc = acc + ml.double() @ sh.double() + mh.double() @ sl.double()
        S = (acc.float() + R.float()).double()
    return S


def blocked_scan(maps, rests, block: int) -> torch.Tensor:
    """The same state by a blocked scan of depth ~2 block + steps / block instead of steps: per
    block of `block` consecutive steps, in parallel, its composed map P = M_j1 ... M_j0 and its
    offset Q (the block's chain from a zero state), each one tf32 product a step as the serial
    scan's; then the chain over the blocks, S <- P S + Q; then (for every piece's state, not
    needed here) each block's steps again from its entering state. tf32x1 operands throughout;
    P is rounded to fp32 after each product, as a scan step's output is."""
    def step(M, X, R):  # one scan step's arithmetic: tf32 operands, fp64 sum rounded to fp32
        acc = tf32_nearest(M.float()).double() @ tf32_nearest(X.float()).double()
        return (acc.float() + (R.float() if R is not None else 0.0)).double()
    steps = list(zip(maps[1:], rests[1:]))
    S = rests[0].clone()
    for b0 in range(0, len(steps), block):
        blk = steps[b0:b0 + block]
        P, Q = blk[0][0].float().double(), blk[0][1].float().double()
        for M, R in blk[1:]:
            P = step(M, P, None)
            Q = step(M, Q, R)
        S = step(P, S, Q)
    return S


def maps_of(T: int, pieces: int, gates: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    K = V = 128
    q = F.normalize(torch.randn(1, T, 1, K, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, 1, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, 1, V, generator=g, dtype=torch.float64)
    ln = torch.randn(1, T, 1, generator=g, dtype=torch.float64)
    gate = {"g=0": torch.zeros_like(ln), "bench": F.logsigmoid(ln) / 16, "strong": F.logsigmoid(ln)}[gates]
    beta = torch.sigmoid(torch.randn(1, T, 1, generator=g, dtype=torch.float64))
    h0 = torch.randn(1, 1, K, V, generator=g, dtype=torch.float64)
    L = T // pieces
    maps, rests = [], []
    for j in range(pieces - 1):  # the last piece needs no map
        a, b = j * L, (j + 1) * L
        qj, kj, vj, gj, bj = (x[:, a:b] for x in (q, k, v, gate, beta))
        _, R = reference.chunked(qj, kj, vj, gj, bj, chunk=C, initial_state=h0 if j == 0 else None)
        maps.append(reference._transfer_map(qj, kj, gj, bj, None, C)[0, 0])
        rests.append(R[0, 0])
    return maps, rests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--pieces", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--gates", nargs="+", default=["g=0", "bench", "strong"])
    ap.add_argument("--blocks", type=int, nargs="*", default=[],
                    help="also the blocked scan (blocked_scan) with these block lengths, in steps")
    args = ap.parse_args()
    print("scan error, relative L2 of the state entering the last piece against the fp64 scan")
    for gates in args.gates:
        for pieces in args.pieces:
            maps, rests = maps_of(args.T, pieces, gates, seed=pieces)
            ref = scan(maps, rests, "fp64")
            errs = {m: float((scan(maps, rests, m) - ref).norm() / ref.norm()) for m in MODES}
            for blk in args.blocks:
                errs[f"blocked{blk}"] = float((blocked_scan(maps, rests, blk) - ref).norm() / ref.norm())
            print(f"{gates:7s} T={args.T} pieces={pieces:3d} ({pieces - 2} steps): "
                  + "  ".join(f"{m} {e:.2e}" for m, e in errs.items()), flush=True)


if __name__ == "__main__":
    main()
