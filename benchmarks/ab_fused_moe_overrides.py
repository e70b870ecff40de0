"""A/B of fused_moe_bf16's tile overrides against its automatic choice, in one run: the same call as
shipped and with the overrides given (e.g. GEMM2 on the 128x256 cooperative tile in a 1x2 cluster),
CUDA-graph replays timed in rotation, fused finalize (or --deterministic). For checking a tile rule of
the heuristic end to end before changing it (sweep_moe_gemm.py times the GEMMs alone).

    python benchmarks/ab_fused_moe_overrides.py --models kimi_k2_ep8 --tokens 8192,16384 \\
        --overrides gemm2_tile_n=256,gemm2_cluster_shape_mn=1x2
"""
import argparse
import warnings

import cake_ops
from bench_grouped_gemm import Timer
from cake_ops.fused_moe import fused_moe_bf16
from sweep_moe_gemm import model_problems


def parse_overrides(text):
    """"gemm2_tile_n=256,gemm2_cluster_shape_mn=1x2,gemm2_raster_along_m=0" -> fused_moe_bf16 keywords."""
    overrides = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if "x" in value:
            overrides[key] = tuple(int(v) for v in value.split("x"))
        elif key == "gemm2_raster_along_m":
            overrides[key] = bool(int(value))
        else:
            overrides[key] = int(value)
    return overrides


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="kimi_k2_ep8")
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--overrides", required=True, help="comma-separated fused_moe_bf16 keyword=value (AxB: a pair)")
    p.add_argument("--deterministic", action="store_true", help="use_fused_finalize=False")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    overrides = parse_overrides(args.overrides)
    timer = Timer("cuda", args.reps, 3)
    fused = not args.deterministic
    print(f"{'model':13} {'T':>6} {'shipped':>9} {'override':>9} {'ratio':>7}  (ms, graph replays; ratio = "
          f"override / shipped; overrides {overrides}, {'fused finalize' if fused else 'deterministic'})")
    for name, t, (e, k, _, _, e_local, offset), (x, ids, scales, w1, w2) in model_problems(args.models, args.tokens):
        def call(**kw):
            return lambda: fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset,
                                          use_fused_finalize=fused, **kw)
        fns = {"shipped": (call(), None), "override": (call(**overrides), None)}
        a, b = fns["shipped"][0]().float(), fns["override"][0]().float()
        diff = float((a - b).norm() / a.norm().clamp_min(1e-30))
        assert diff < 1e-2, f"{name} T={t}: the overrides changed the result by {diff:.3g}"
        ms = timer.many(fns, graph=True)
        print(f"{name:13} {t:6d} {ms['shipped']:9.3f} {ms['override']:9.3f} "
              f"{ms['override'] / ms['shipped']:7.3f}", flush=True)


if __name__ == "__main__":
    main()
