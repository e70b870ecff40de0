"""A/B of the one-launch MoE layer (torch.ops.cake.moe_forward_out's layer kernel) against the
staged ops on the same build, in one run: CUDA-graph replays timed in rotation after an L2 flush.

fused_moe_bf16 models: the layer op (any T with T * top_k <= 64) against fused_moe_bf16 with the
layer off (fused_moe.LAYER_MAX_TOKENS = LAYER_MAX_SHARD_ROUTES = 0: sort, GEMM1, GEMM2 and finalize,
both finalize paths).
StepFun families: the layer plan against the staged default plan (routing included in both), and
the fp8 / bf16 ratio each way (issue 5's T <= 64 target). x floor: over the weight bytes of the
experts touched / the card's read bandwidth (bench_grouped_gemm.HBM_TBPS: the H200's 4.8 TB/s).

    python benchmarks/ab_moe_layer.py [--models ...] [--tokens 1,2,4,8] [--shapes ...] [--stepfun-tokens 1]
"""
import argparse
import warnings

import torch

import cake_ops
import cake_ops.fused_moe as fm
from cake_ops import stepfun_moe as sm
from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import HBM_TBPS, Timer, seed_case
from bench_stepfun_moe import AMPLITUDE, LIMIT, SHAPES, random_weights


def staged(fn):
    def run():
        shipped = fm.LAYER_MAX_TOKENS, fm.LAYER_MAX_SHARD_ROUTES
        fm.LAYER_MAX_TOKENS = fm.LAYER_MAX_SHARD_ROUTES = 0
        try:
            return fn()
        finally:
            fm.LAYER_MAX_TOKENS, fm.LAYER_MAX_SHARD_ROUTES = shipped
    return run


def floor_ms(ids, offset, e_local, bytes_per_expert):
    local = ids.flatten().long() - offset
    touched = local[(local >= 0) & (local < e_local)].unique().numel()
    return touched * bytes_per_expert / (HBM_TBPS * 1e12) * 1e3


def fused_moe_rows(args, timer):
    print(f"{'model':13} {'T':>4} {'layer':>8} {'fused':>8} {'det':>8} {'/fused':>7} {'floor':>8} {'x floor':>7} "
          f"{'was':>7}  (ms, graph replays)", flush=True)
    for name in filter(None, args.models.split(",")):
        e, k, h, inter, e_local, offset = MODELS[name]
        seed_case(name)
        w1 = fm.interleave_up_gate_sm90((torch.randn(e_local, 2 * inter, h, device="cuda") / h**0.5).bfloat16())
        w2 = (torch.randn(e_local, h, inter, device="cuda") / inter**0.5).bfloat16()
        for t in [int(v) for v in args.tokens.split(",") if v]:
            if t * k > 64:
                continue
            seed_case(name, t)
            x = torch.randn(t, h, device="cuda").bfloat16()
            ids, scales = routing(t, e, k, "cuda")
            out = torch.empty_like(x)
            ws = torch.empty(cake_ops._C.moe_forward_workspace_size(t * k, h, inter), dtype=torch.uint8,
                             device="cuda")

            hint = fm.expected_routes(t * k, e_local, e)  # as fused_moe_bf16 passes it

            def layer():
                torch.ops.cake.moe_forward_out(x, ids, scales, w1, w2, offset, out, ws, expected_routes=hint)
                return out
            fns = {"layer": (layer, None),
                   "fused": (staged(lambda: fm.fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset)), None),
                   "det": (staged(lambda: fm.fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset,
                                                            use_fused_finalize=False)), None)}
            a, b = fns["layer"][0]().float(), fns["det"][0]().float()
            diff = float((a - b).norm() / b.norm().clamp_min(1e-30))
            assert diff < 1e-2, f"{name} T={t}: the layer op and the staged ops differ by {diff:.3g}"
            ms = timer.many(fns, graph=True)
            floor = floor_ms(ids, offset, e_local, 3 * h * inter * 2)
            print(f"{name:13} {t:4d} {ms['layer']:8.4f} {ms['fused']:8.4f} {ms['det']:8.4f} "
                  f"{ms['layer'] / ms['fused']:7.3f} {floor:8.4f} {ms['layer'] / floor:7.2f} "
                  f"{ms['fused'] / floor:7.2f}", flush=True)


def stepfun_rows(args, timer):
    print(f"\n{'shape':15} {'fam':5} {'T':>4} {'layer':>8} {'staged':>8} {'/staged':>7} {'floor':>8} {'x floor':>7}"
          f" {'fp8/bf16 layer':>14} {'staged':>7}  (ms, graph replays of stepfun_moe, routing included)", flush=True)
    for name in filter(None, args.shapes.split(",")):
        e, k, h, inter = SHAPES[name]
        seed_case(name)
        w1, w2 = random_weights(e, h, inter, "cuda")
        for t in [int(v) for v in args.stepfun_tokens.split(",") if v]:
            seed_case(name, t)
            x = (AMPLITUDE * torch.randn(t, h, device="cuda")).bfloat16()
            logits = torch.randn(t, e, device="cuda")
            ids = torch.topk(logits, k, dim=-1).indices
            bf16_ms = {}
            for family in ("bf16", "fp8"):
                weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
                layer_plan = sm.Plan(family, 64, sm.LAYER_STAGES)
                # The staged plan of this T (the default's stages past the layer plan's tokens), on 64-row tiles.
                staged_plan = sm.Plan(family, 64, sm._staged_plan(family, t, k, e, inter).stages)
                fns = {"layer": (lambda: sm.stepfun_moe(x, weights, logits, top_k=k, plan=layer_plan), None),
                       "staged": (lambda: sm.stepfun_moe(x, weights, logits, top_k=k, plan=staged_plan), None)}
                same = torch.equal(fns["layer"][0](), fns["staged"][0]())
                ms = timer.many(fns, graph=True)
                floor = floor_ms(ids, 0, e, 3 * h * inter * weights.w1.element_size())
                ratio = ""
                if family == "bf16":
                    bf16_ms = ms
                else:
                    ratio = f"{ms['layer'] / bf16_ms['layer']:14.3f} {ms['staged'] / bf16_ms['staged']:7.3f}"
                print(f"{name:15} {family:5} {t:4d} {ms['layer']:8.4f} {ms['staged']:8.4f} "
                      f"{ms['layer'] / ms['staged']:7.3f} {floor:8.4f} {ms['layer'] / floor:7.2f} {ratio:>22}"
                      f"{'' if same else '  (NOT bitwise equal)'}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_30b,qwen3_235b,mixtral_8x7b,kimi_k2_ep8")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--shapes", default="issue_geometry,step35_flash")
    p.add_argument("--stepfun-tokens", default="1,2")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    timer = Timer("cuda", args.reps, 3)
    # What this timing charges any graph replay: event to event around one one-element kernel.
    tiny = torch.zeros(1, device="cuda")
    print(f"timing floor: graph replay of one one-element kernel {timer(tiny.zero_, graph=True):.4f} ms\n")
    fused_moe_rows(args, timer)
    stepfun_rows(args, timer)


if __name__ == "__main__":
    main()
