"""Builds FlashInfer 0.6.13's SM90 GDN prefill module (its JIT: 64 CUTLASS instantiation files
compiled by nvcc through ninja) ahead of the grid, into the cache that bench/run_grid.py uses,
so a device call can compile it in the background while other stages run. Ninja resumes
where a killed build stopped (object files stay in the cache while the machine is warm).

    MAX_JOBS=24 python3 bench/fi_build.py [--cache-dir /tmp/qla_bench_cache]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default=os.environ.get("QLA_BENCH_CACHE", "/tmp/qla_bench_cache"))
    args = ap.parse_args()
    import peers  # sets the FlashInfer workspace below the cache dir before flashinfer is imported

    peers.set_cache_dirs(args.cache_dir)
    from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module

    spec = gen_gdn_prefill_sm90_module()
    start = time.time()
    spec.build(verbose=True)
    print(f"[fi_build] built {spec.get_library_path()} in {time.time() - start:.0f} s "
          f"(MAX_JOBS={os.environ.get('MAX_JOBS')})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
