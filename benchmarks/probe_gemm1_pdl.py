"""GEMM1 (moe_gemm1_swiglu) of an expert-parallel shard on one forced tactic, as CUDA-graph replays, by
the shard's expected_routes hint (which sizes the PDL bound, kPdlMaxRows), zero_tail and the sort's
inverse (expanded_to_permuted). A diagnostic of session 35's PDL hazard (benchmarks/NOTES.md): with the
hint and zero_tail=True the fixed 64x256 tile ran 1.6x slower while PDL was on.

    python benchmarks/probe_gemm1_pdl.py --model kimi_k2_ep8 --tokens 9216 --tactic fwd_bf16_fixed_ping_64x256x64_c1x1
"""
import argparse
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import Timer
from cake_ops.fused_moe import expected_routes
from sweep_moe_gemm import model_weights


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi_k2_ep8")
    p.add_argument("--tokens", type=int, default=9216)
    p.add_argument("--tactic", default="fwd_bf16_fixed_ping_64x256x64_c1x1")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    e, k, h, _, e_local, offset = MODELS[args.model]
    w1, _ = model_weights(args.model)
    x = torch.randn(args.tokens, h, device="cuda").bfloat16()
    ids, _ = routing(args.tokens, e, k, "cuda")
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 128)
    tactic = cake_ops._C.grouped_gemm_tactics("fwd").index(args.tactic)
    fns = {}
    for hint in (-1, expected_routes(args.tokens * k, e_local, e)):
        for zero_tail in (True, False):
            for inverse in (None, e2p):
                kw = dict(expected_routes=hint, zero_tail=zero_tail, expanded_to_permuted=inverse)
                name = f"hint={hint} zero_tail={zero_tail} inverse={inverse is not None}"
                fns[name] = (lambda kw=kw: torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, None,
                                                                           tactic, **kw), None)
    print(f"{args.model} T={args.tokens} GEMM1 {args.tactic}, graph replays:")
    for name, ms in Timer("cuda", args.reps, 2).many(fns, graph=True).items():
        print(f"    {ms * 1e3:9.1f} us  {name}")


if __name__ == "__main__":
    main()
