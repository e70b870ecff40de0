"""Where the time of one fused_moe_bf16 call goes: per-kernel GPU times under CUDA-graph replay
(torch.profiler), the end-to-end replay time and the weight floor (bytes of the experts touched /
the card's read bandwidth, bench_grouped_gemm.HBM_TBPS). A diagnostic next to bench_fused_moe.py,
which holds the issue's comparison.

    python benchmarks/profile_fused_moe.py --models qwen3_30b,mixtral_8x7b --tokens 1,256,4096
"""
import argparse
import re
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS
from bench_grouped_gemm import HBM_TBPS
from cake_ops.fused_moe import fused_moe_bf16
from kernel_times import graph_events


def kernels_in_order(fn, iters):
    """(short name, mean us) of each kernel of one replay of fn's CUDA graph, in launch order (GEMM1
    and GEMM2 stay apart even when they run the same configuration), and the mean replay time.
    With PDL a kernel's span includes its wait for its predecessor."""
    events, us = graph_events(fn, iters)
    per_replay = len(events) // iters
    spans = [[0.0, ""] for _ in range(per_replay)]
    for i, ev in enumerate(events[:per_replay * iters]):
        spans[i % per_replay][0] += ev.device_time_total / iters
        spans[i % per_replay][1] = ev.name
    return [(short_name(name), kus) for kus, name in spans], us


def print_profile(label, us, floor_us, tflops, kernels):
    """One profiled forward: the replay time against the weight floor, then its kernels."""
    print(f"{label}: {us:8.1f} us per replay, weight floor {floor_us:6.1f} us (x{us / floor_us:.2f}), "
          f"{tflops:6.1f} TFLOP/s; kernels in launch order (us):")
    for kname, kus in kernels:
        print(f"    {kus:8.1f}  {kname}")


def short_name(name):
    if "GemmUniversal" in name:
        return "grouped GEMM (CUTLASS)" + gemm_config(name)
    for word in ("moe_route_and_sort", "moe_sort", "moe_invert", "moe_gather", "moe_swiglu", "moe_finalize",
                 "prepare_groups",
                 "moe_topk_softmax", "fp8_amax", "fp8_quantize", "fp8_scale_from_amax"):
        if word in name:
            return word
    return name[:60]


def gemm_config(name):
    """The configuration in a CUTLASS grouped GEMM kernel's demangled name, in the tactic names' words
    (fixed_ping_64x256x64_c1x1, ...; the raster order and swizzle are launch arguments, not in the name),
    or "" where the name does not show it. The dispatch policy's cluster shape comes first, then the
    schedule, then the tile shape."""
    shapes = re.findall(r"C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)>", name)
    schedule = next((short for word, short in (("Pingpong", "ping"), ("Cooperative", "coop")) if word in name), None)
    if len(shapes) < 2 or schedule is None:
        return ""
    (cm, cn, _), tile = shapes[0], "x".join(shapes[1])
    fixed = "fixed_" if "FixedOperandMainloop" in name else ""
    epilogue = next((f" {short}" for word, short in (("Scatter", "scatter"), ("SwiGlu", "swiglu")) if word in name), "")
    return f" {fixed}{schedule}_{tile}_c{cm}x{cn}{epilogue}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_30b,mixtral_8x7b")
    p.add_argument("--tokens", default="1,16,256,4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--deterministic", action="store_true", help="use_fused_finalize=False")
    p.add_argument("--no-pdl", dest="pdl", action="store_false", help="enable_pdl=False: kernel spans without waits")
    p.add_argument("--seed", type=int, default=None, help="the same weights and routing in every run (A/B runs)")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    for name in args.models.split(","):
        if args.seed is not None:
            torch.manual_seed(args.seed)
        e, k, h, i, e_local, offset = MODELS[name]
        w1 = (torch.randn(e_local, 2 * i, h, device="cuda") / h**0.5).bfloat16()
        w2 = (torch.randn(e_local, h, i, device="cuda") / i**0.5).bfloat16()
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda").bfloat16()
            ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int().cuda()
            scales = torch.softmax(torch.randn(t, k, device="cuda"), -1)
            out = torch.empty_like(x)
            kernels, us = kernels_in_order(lambda: fused_moe_bf16(
                x, ids, scales, w1, w2, e, k, e_local, offset, moe_output=out,
                use_fused_finalize=not args.deterministic, enable_pdl=args.pdl), args.iters)
            local = ids[(ids >= offset) & (ids < offset + e_local)]
            floor_us = max(local.unique().numel() * 3 * h * i * 2 / (HBM_TBPS * 1e12) * 1e6, 1e-9)
            tflops = 2 * local.numel() * 3 * h * i / us / 1e6
            print_profile(f"{name} T={t}", us, floor_us, tflops, kernels)


if __name__ == "__main__":
    main()
