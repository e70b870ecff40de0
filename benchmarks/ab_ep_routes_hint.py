"""A/B of the MoE GEMMs' expected_routes hint on an expert-parallel shard, in one run: fused_moe_bf16
as shipped (the shard's GEMMs choose tiles by its share of the routes) against the same call with
the hint off (-1: tiles chosen as if every one of the T * top_k rows were local). CUDA-graph
replays timed in rotation after an L2 flush, both finalize paths; also the tactics each GEMM runs.

    python benchmarks/ab_ep_routes_hint.py [--models kimi_k2_ep8] [--tokens 64,256,1024,4096]
"""
import argparse
import warnings

import cake_ops
import cake_ops.fused_moe as fm
from bench_grouped_gemm import Timer
from cake_ops import _C
from sweep_moe_gemm import model_problems


def call(x, ids, scales, w1, w2, e, k, e_local, offset, fused, hint):
    def run():
        shipped = fm.expected_routes
        if not hint:
            fm.expected_routes = lambda routes, local, total: -1
        try:
            return fm.fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=fused)
        finally:
            fm.expected_routes = shipped
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="kimi_k2_ep8")
    p.add_argument("--tokens", default="64,256,1024,4096")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    timer = Timer("cuda", args.reps, 3)
    names = _C.grouped_gemm_tactics("fwd")
    print(f"{'model':13} {'T':>6} {'fused':>8} {'fused/no':>8} {'det':>8} {'det/no':>8}  (ms, graph replay; "
          "no = hint off)  GEMM1 tactic with / without the hint")
    for name, t, (e, k, h, inter, e_local, offset), (x, ids, scales, w1, w2) in model_problems(args.models,
                                                                                               args.tokens):
        fns = {f"{fin}_{mode}": (call(x, ids, scales, w1, w2, e, k, e_local, offset, fin == "fused", mode == "hint"),
                                 None)
               for fin in ("fused", "det") for mode in ("hint", "no")}
        a, b = fns["det_hint"][0](), fns["det_no"][0]()
        diff = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        assert diff < 1e-2, f"{name} T={t}: the hint changed the result by {diff:.3g}"
        ms = timer.many(fns, graph=True)
        routes = t * k
        hint = fm.expected_routes(routes, e_local, e)
        with_hint = names[_C.grouped_gemm_tactic_for("fwd", e_local, routes, 2 * inter, h, hint)]
        without = names[_C.grouped_gemm_tactic_for("fwd", e_local, routes, 2 * inter, h)]
        print(f"{name:13} {t:6d} {ms['fused_hint']:8.3f} {ms['fused_hint'] / ms['fused_no']:8.3f} "
              f"{ms['det_hint']:8.3f} {ms['det_hint'] / ms['det_no']:8.3f}  {with_hint} / {without}", flush=True)


if __name__ == "__main__":
    main()
