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
from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import seed_case
from cake_ops.fused_moe import interleave_up_gate_sm90


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi_k2_ep8", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--gemm", default="gemm1", choices=["gemm1", "gemm2"])
    p.add_argument("--tactics", default="fwd_bf16_ping_64x256x64_c1x1,fwd_bf16_coop_128x256x64_c1x2")
    p.add_argument("--launches", type=int, default=2, help="launches per tactic (after one warm-up)")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    e, k, h, inter, e_local, offset = MODELS[args.model]
    t = args.tokens
    seed_case(args.model, t)
    w1 = interleave_up_gate_sm90((torch.randn(e_local, 2 * inter, h, device="cuda") / h**0.5).bfloat16())
    w2 = (torch.randn(e_local, h, inter, device="cuda") / inter**0.5).bfloat16()
    x = torch.randn(t, h, device="cuda").bfloat16()
    ids, _ = routing(t, e, k, "cuda")
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 128)
    act = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k)
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    for name in args.tactics.split(","):
        if name not in names:
            raise SystemExit(f"ncu_moe_gemm_tactics: no fwd tactic named {name!r}; the fwd tactics: {', '.join(names)}")
        tactic = names.index(name)
        if args.gemm == "gemm1":
            def run():
                return torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, None, tactic)
        else:
            def run():
                return torch.ops.cake.moe_gemm2(act, w2, offsets, True, tactic)
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
