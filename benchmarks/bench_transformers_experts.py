"""One transformers (>= 5) experts module under its "cake" experts implementation
(cake_ops.nn.register_transformers_experts: moe_sort + cake_ops.grouped_mm) against transformers' own
"grouped_mm" one (torch._grouped_mm), timed in rotation in one run: "fwd" under no_grad (inference: cake runs
one fused_moe_bf16 call on the module's [gate; up] weights) and "fwd+bwd" (training: cake's sort, grouped_mm and
moe_finalize). A training call starts with the module's gradients set to None, as after an optimizer step's
zero_grad(), so that neither side pays an accumulation into .grad (3 weight-sized passes) that a step need not,
and differentiates the hidden states and the routing weights (a router's softmax output in a model).

    python benchmarks/bench_transformers_experts.py [--shapes qwen3_30b,mixtral_8x7b] [--tokens 1024,4096]

--autocast: float32 weights and hidden states, every call inside torch.autocast(bfloat16): a Trainer's
``bf16=True`` on a float32 model (master weights), where cake casts as torch.mm does and transformers' grouped_mm
casts its input to the weights' dtype (so runs its products in float32).

--gate clamped: the experts of DeepSeek-V4 (``DeepseekV4Experts``: the clamped SwiGLU silu(min(gate, L)) *
clamp(up, -L, L), L = 10 as its config's swiglu_limit) at each shape's sizes, in place of Qwen3-MoE's plain SwiGLU.

--profile also prints, per row, where each implementation's time goes: its kernels' GPU time per call
(torch.profiler over --reps calls, eager), largest first.
"""
import argparse
import collections
import warnings

import torch

import cake_ops
from bench_fused_moe import CPU_MODELS, MODELS, check_names
from bench_grouped_gemm import CARD, Timer, fmt, seed_case


def whole_layers(models):
    """bench_fused_moe's models as (E, top_k, hidden, intermediate), but its expert-parallel shards: an experts
    module holds all of its experts."""
    return {name: m[:4] for name, m in models.items() if m[4] == m[0]}


def experts_module(e, hidden, inter, device, dtype=torch.bfloat16, gate="silu"):
    if gate == "clamped":
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
        experts = DeepseekV4Experts(DeepseekV4Config(hidden_size=hidden, intermediate_size=inter, num_local_experts=e,
                                                     swiglu_limit=10.0))
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=e))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.02)
    return experts.to(device, dtype)


def kernel_profile(fn, reps):
    """[(kernel name, mean GPU us per call)] of fn's kernels over reps calls (torch.profiler), largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:80]] += ev.device_time_total / reps
    return sorted(totals.items(), key=lambda kv: -kv[1])


def print_profile(impl, kernels, top=12):
    total = sum(us for _, us in kernels)
    print(f"    {impl}: {total:9.1f} us of kernels per call")
    for name, us in kernels[:top]:
        print(f"      {us:9.1f}  {100 * us / total:5.1f}%  {name}")
    if len(kernels) > top:
        print(f"      {sum(us for _, us in kernels[top:]):9.1f}  the other {len(kernels) - top} kernels")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="")
    p.add_argument("--tokens", default="")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gate", choices=["silu", "clamped"], default="silu",
                   help="the experts' gate: Qwen3-MoE's SwiGLU, or DeepSeek-V4's clamped SwiGLU")
    p.add_argument("--profile", action="store_true", help="print each implementation's kernels (GPU only)")
    p.add_argument("--autocast", action="store_true",
                   help="float32 weights and hidden states, the calls inside torch.autocast(bfloat16)")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = whole_layers({**MODELS, **CPU_MODELS})
    names = args.shapes.split(",") if args.shapes else list(whole_layers(MODELS if device == "cuda" else CPU_MODELS))
    check_names(p, "--shapes", args.shapes, shapes)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1024, 4096, 16384] if device == "cuda" else [64])
    cake_ops.nn.register_transformers_experts()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    impls = {"cake": ALL_EXPERTS_FUNCTIONS["cake"], "grouped_mm": ALL_EXPERTS_FUNCTIONS["grouped_mm"]}
    timer = Timer(device, args.reps, args.warmup)
    dtype = torch.float32 if args.autocast else torch.bfloat16
    amp = lambda: torch.autocast(device, dtype=torch.bfloat16, enabled=args.autocast)  # noqa: E731
    setup = "float32 weights and hidden states under torch.autocast(bfloat16)" if args.autocast else "bfloat16"
    setup += ", DeepSeek-V4's clamped SwiGLU experts (L = 10)" if args.gate == "clamped" else ""
    print(f"# {CARD or 'cpu'}, {setup}: ms per call, median of {args.reps} in rotation; ratio = grouped_mm / cake")
    print(f"{'shape':13} {'T':>6} {'pass':8} {'cake':>8} {'grouped_mm':>10} {'ratio':>6}")
    for name in names:
        e, k, hidden, inter = shapes[name]
        experts = experts_module(e, hidden, inter, device, dtype, args.gate)
        for t in tokens:
            seed_case(name, t)
            x = torch.randn(t, hidden, device=device).to(dtype)
            ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)]).long()
            weights = torch.rand(t, k, device=device)

            def forward(fn):
                with torch.no_grad(), amp():
                    fn(experts, x, ids, weights)

            def train(fn):
                experts.zero_grad(set_to_none=True)
                xg, wg = x.detach().requires_grad_(), weights.detach().requires_grad_()
                with amp():
                    out = fn(experts, xg, ids, wg)
                out.float().sum().backward()

            for label, run in (("fwd", forward), ("fwd+bwd", train)):
                ms = timer.many({n: (lambda fn=fn: run(fn), None) for n, fn in impls.items()})
                ratio = ms["grouped_mm"] / ms["cake"] if all(isinstance(v, float) for v in ms.values()) else "-"
                print(f"{name:13} {t:6d} {label:8} {fmt(ms['cake'], '8.3f')} {fmt(ms['grouped_mm'], '10.3f')} "
                      f"{fmt(ratio, '6.2f')}", flush=True)
                if args.profile and device == "cuda":
                    for n, fn in impls.items():
                        print_profile(n, kernel_profile(lambda fn=fn: run(fn), args.reps))
        experts.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
