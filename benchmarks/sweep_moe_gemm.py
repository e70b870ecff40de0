"""Every tactic of the MoE GEMMs' family: GEMM1 (gather, grouped GEMM, SwiGLU(Step)) and GEMM2,
CUDA-graph replays timed in rotation, next to the automatic choice (tactic -1) and the decode
kernel (tactic -2). On the StepFun shapes (bf16 and fp8 families) and, with --models, on
fused_moe_bf16's model shapes (bf16). For choosing the heuristics from measurements.

    python benchmarks/sweep_moe_gemm.py --shapes issue_geometry --families fp8 --tokens 8,2048,8192
    python benchmarks/sweep_moe_gemm.py --shapes "" --models qwen3_30b,kimi_k2_ep8 --tokens 1,16,64 --top 3
"""
import argparse
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import Timer, seed_case
from bench_stepfun_moe import AMPLITUDE, LIMIT, SHAPES, random_weights
from cake_ops import stepfun_moe as sm
from cake_ops.fused_moe import expected_routes, interleave_up_gate_sm90

TACTIC_FAMILY = {"bf16": "fwd", "fp8": "fwd_e4m3"}


def sweep(timer, label, tactics, make, flops, top, only=()):
    """Time `make(tactic)` for -1, -2 and every grouped GEMM tactic (or those named in `only`); print the
    fastest `top`."""
    fns = {"automatic": (make(-1), None), "decode kernel": (make(-2), None)}
    fns.update({tactic: (make(i), None) for i, tactic in enumerate(tactics) if not only or tactic in only})
    times = timer.many(fns, graph=True)
    ranked = sorted((v, n) for n, v in times.items() if not isinstance(v, str))
    print(f"{label}: automatic {times['automatic'] * 1e3:8.1f} us, decode kernel "
          f"{times['decode kernel'] * 1e3:8.1f} us; best:")
    for ms, tactic in ranked[:top]:
        print(f"    {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s  {tactic}")


def stepfun_shapes(args, timer):
    for name in filter(None, args.shapes.split(",")):
        e, k, h, inter = SHAPES[name]
        seed_case(name)
        w1, w2 = random_weights(e, h, inter, "cuda")
        for family in args.families.split(","):
            weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
            tactics = cake_ops._C.grouped_gemm_tactics(TACTIC_FAMILY[family])
            for t in map(int, args.tokens.split(",")):
                seed_case(name, t)
                x = (AMPLITUDE * torch.randn(t, h, device="cuda")).bfloat16()
                routed = sm.routing(torch.randn(t, e, device="cuda"), top_k=k, num_experts=e)
                x_q, x_scale = (torch.ops.cake.quantize_fp8(x) if family == "fp8" else (x, None))
                act = sm.fc1(x, weights, routed)
                a_q, a_scale = (torch.ops.cake.quantize_fp8(act) if family == "fp8" else (act, None))

                def gemm1(tactic):
                    return lambda: torch.ops.cake.moe_gemm1_swiglu(
                        x_q, weights.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, k, True,
                        weights.gemm1_clamp_limit, tactic, x_scale, weights.w1_scale)

                def gemm2(tactic):
                    return lambda: torch.ops.cake.moe_gemm2(a_q, weights.w2, routed.expert_offsets, True, tactic,
                                                            a_scale, weights.w2_scale)
                sweep(timer, f"{name} {family} T={t} gemm1", tactics, gemm1, 2 * t * k * 2 * inter * h, args.top,
                      args.only)
                sweep(timer, f"{name} {family} T={t} gemm2", tactics, gemm2, 2 * t * k * h * inter, args.top,
                      args.only)


def model_weights(name):
    """A fused_moe_bf16 model shape's bf16 w1 (up/gate interleaved) and w2, seeded by its name."""
    e, k, h, inter, e_local, offset = MODELS[name]
    seed_case(name)
    w1 = interleave_up_gate_sm90((torch.randn(e_local, 2 * inter, h, device="cuda") / h**0.5).bfloat16())
    w2 = (torch.randn(e_local, h, inter, device="cuda") / inter**0.5).bfloat16()
    return w1, w2


def model_problems(models, tokens):
    """fused_moe_bf16's model shapes on CUDA, each T seeded as the other model scripts seed it: yields
    (name, t, dims, (x, ids, scales, w1, w2)) with dims = (E, top_k, H, I, E_local, offset), for the A/B
    scripts' loops (comma-separated models and tokens)."""
    for name in models.split(","):
        dims = MODELS[name]
        e, k, h = dims[:3]
        w1, w2 = model_weights(name)
        for t in [int(v) for v in tokens.split(",")]:
            seed_case(name, t)
            x = torch.randn(t, h, device="cuda").bfloat16()
            ids, scales = routing(t, e, k, "cuda")
            yield name, t, dims, (x, ids, scales, w1, w2)


def model_gemms(name, w1, w2, t):
    """The MoE GEMMs of T routed tokens of a model shape, each as tactic -> launch: "gemm1" (gather,
    GEMM, SwiGLU), "gemm2" and "gemm2 fused finalize" (the scatter epilogue twin where there is one). An
    EP shard's GEMMs get fused_moe_bf16's expected_routes hint, so "automatic" is its choice."""
    e, k, h, inter, e_local, offset = MODELS[name]
    seed_case(name, t)
    x = torch.randn(t, h, device="cuda").bfloat16()
    ids, scales = routing(t, e, k, "cuda")
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 128)
    out = x.new_empty(t, h)
    hint = expected_routes(t * k, e_local, e)
    act = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k)

    def gemm1(tactic):
        return lambda: torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, None, tactic,
                                                       expected_routes=hint, expanded_to_permuted=e2p)

    def gemm2(tactic):
        return lambda: torch.ops.cake.moe_gemm2(act, w2, offsets, True, tactic, expected_routes=hint)

    def gemm2_finalize(tactic):
        return lambda: torch.ops.cake.moe_gemm2_finalize_out(act, w2, offsets, p2e, e2p, scales, out, True, tactic,
                                                             hint)
    # Routes to this shard's experts (t * k unless it is an EP shard): the rows the GEMMs multiply.
    local_routes = int(offsets[-1])
    return {"gemm1": gemm1, "gemm2": gemm2, "gemm2 fused finalize": gemm2_finalize}, local_routes


def model_shapes(args, timer):
    tactics = cake_ops._C.grouped_gemm_tactics("fwd")
    for name in filter(None, args.models.split(",")):
        _, _, h, inter, _, _ = MODELS[name]
        w1, w2 = model_weights(name)
        for t in map(int, args.tokens.split(",")):
            gemms, routes = model_gemms(name, w1, w2, t)
            for label, make in gemms.items():
                if args.gemms and label not in args.gemms:
                    continue
                flops = 2 * routes * inter * h * (2 if label == "gemm1" else 1)
                sweep(timer, f"{name} bf16 T={t} {label}", tactics, make, flops, args.top, args.only)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="issue_geometry", help="StepFun shapes (empty: none)")
    p.add_argument("--families", default="fp8")
    p.add_argument("--models", default="", help="fused_moe_bf16 model shapes, bf16")
    p.add_argument("--tokens", default="8,2048,8192")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=5, help="fastest tactics printed per GEMM")
    p.add_argument("--only", default="", help="comma-separated tactic names: time these (and -1, -2) only")
    p.add_argument("--gemms", default="", help="model shapes: comma-separated 'gemm1', 'gemm2', "
                                               "'gemm2 fused finalize' (default: all three)")
    args = p.parse_args()
    args.only = tuple(filter(None, args.only.split(",")))
    args.gemms = tuple(filter(None, args.gemms.split(",")))
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    timer = Timer("cuda", args.reps, 2)
    stepfun_shapes(args, timer)
    model_shapes(args, timer)


if __name__ == "__main__":
    main()
