"""Where the time of one fused_moe_bf16 call goes: per-kernel GPU times under CUDA-graph replay
(torch.profiler), the end-to-end replay time and the weight floor (bytes of the experts touched /
4.8 TB/s). A diagnostic next to bench_fused_moe.py, which holds the issue's comparison.

    python benchmarks/profile_fused_moe.py --models qwen3_30b,mixtral --tokens 1,256,4096
"""
import argparse
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS
from cake_ops.fused_moe import fused_moe_bf16
from kernel_times import kernel_means


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_30b,mixtral_8x7b")
    p.add_argument("--tokens", default="1,16,256,4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--deterministic", action="store_true", help="use_fused_finalize=False")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    for name in args.models.split(","):
        e, k, h, i, e_local, offset = MODELS[name]
        w1 = (torch.randn(e_local, 2 * i, h, device="cuda") / h**0.5).bfloat16()
        w2 = (torch.randn(e_local, h, i, device="cuda") / i**0.5).bfloat16()
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda").bfloat16()
            ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int().cuda()
            scales = torch.softmax(torch.randn(t, k, device="cuda"), -1)
            out = torch.empty_like(x)
            kernels, us = kernel_means(lambda: fused_moe_bf16(
                x, ids, scales, w1, w2, e, k, e_local, offset, moe_output=out,
                use_fused_finalize=not args.deterministic), args.iters)
            local = ids[(ids >= offset) & (ids < offset + e_local)]
            floor_us = local.unique().numel() * 3 * h * i * 2 / 4.8e12 * 1e6
            tflops = 2 * local.numel() * 3 * h * i / us / 1e6
            print(f"{name} T={t}: {us:8.1f} us per replay, weight floor {floor_us:6.1f} us (x{us / floor_us:.2f}), "
                  f"{tflops:6.1f} TFLOP/s; kernels (us):")
            for kname, kus in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"    {kus:8.1f}  {kname}")


if __name__ == "__main__":
    main()
