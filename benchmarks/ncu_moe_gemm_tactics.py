"""One MoE GEMM of a model shape with each of the named grouped GEMM tactics forced, a few launches
each: a target for ncu, to compare two tiles kernel against kernel (DRAM bytes, L2 hit rate,
stalls). Prints each tactic's CUDA-event time too. GPU only.

    ncu --clock-control none --kernel-name-base demangled --kernel-name regex:GemmUniversal \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        python3 benchmarks/ncu_moe_gemm_tactics.py --model kimi_k2_ep8 --tokens 16384 --gemm gemm1 \\
        --tactics fwd_bf16_ping_64x256x64_c1x1,fwd_bf16_coop_128x256x64_c1x2
"""
import argparse
import warnings

import torch

import cake_ops
from bench_fused_moe import MODELS
from sweep_moe_gemm import model_gemms, model_weights


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi_k2_ep8", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--gemm", default="gemm1", choices=["gemm1", "gemm2", "gemm2 fused finalize"])
    p.add_argument("--tactics", default="fwd_bf16_ping_64x256x64_c1x1,fwd_bf16_coop_128x256x64_c1x2")
    p.add_argument("--launches", type=int, default=2, help="launches per tactic (after one warm-up)")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    t = args.tokens
    make = model_gemms(args.model, *model_weights(args.model), t)[0][args.gemm]
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    for name in args.tactics.split(","):
        if name not in names:
            raise SystemExit(f"ncu_moe_gemm_tactics: no fwd tactic named {name!r}; the fwd tactics: {', '.join(names)}")
        run = make(names.index(name))
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.launches):
            run()
        end.record()
        torch.cuda.synchronize()
        print(f"{args.model} T={t} {args.gemm} {name}: {start.elapsed_time(end) / args.launches * 1e3:9.1f} us "
              f"(mean of {args.launches}, the gather and any separate SwiGLU included)")


if __name__ == "__main__":
    main()
