"""A/B of programmatic dependent launch in fused_moe_bf16, in one run: enable_pdl=True (the default)
against False, both finalize paths, CUDA-graph replays timed in rotation after an L2 flush.

    python benchmarks/ab_pdl.py [--models kimi_k2_ep8,qwen3_235b] [--tokens 1,1024,4096,16384]
"""
import argparse
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS
from bench_grouped_gemm import Timer
from cake_ops.fused_moe import fused_moe_bf16
from sweep_moe_gemm import model_problems


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1,64,1024,4096,16384")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    timer = Timer("cuda", args.reps, 3)
    print(f"{'model':13} {'T':>6} {'fused':>8} {'no pdl':>8} {'ratio':>6} {'det':>8} {'no pdl':>8} {'ratio':>6}"
          "  (ms, graph replays; ratio = no PDL / PDL)")
    for name, t, (e, k, _, _, e_local, offset), (x, ids, scales, w1, w2) in model_problems(args.models, args.tokens):
        def call(fused, pdl):
            return lambda: fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset,
                                          use_fused_finalize=fused, enable_pdl=pdl)
        fns = {f"{fin}_{pdl}": (call(fin == "fused", pdl), None) for fin in ("fused", "det") for pdl in (True, False)}
        assert torch.equal(fns["det_True"][0](), fns["det_False"][0]()), f"{name} T={t}: PDL changed the result"
        ms = timer.many(fns, graph=True)
        print(f"{name:13} {t:6d} {ms['fused_True']:8.3f} {ms['fused_False']:8.3f} "
              f"{ms['fused_False'] / ms['fused_True']:6.3f} {ms['det_True']:8.3f} {ms['det_False']:8.3f} "
              f"{ms['det_False'] / ms['det_True']:6.3f}", flush=True)


if __name__ == "__main__":
    main()
