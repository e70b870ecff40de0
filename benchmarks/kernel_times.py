"""Per-kernel GPU times of one grouped GEMM launch (torch.profiler), and the copy bandwidth ceiling.

    python benchmarks/kernel_times.py --shape decode_qwen3_fc1_t16 --op fwd [--tactics a,b]

Splits a launch into its kernels (cake: the offsets prologue and the CUTLASS kernel; torch:
its own), averaged over --iters CUDA-graph replays, so launch gaps and prologue cost are visible
next to the end-to-end time the benchmark reports.
"""
import argparse
import collections
import warnings

import torch

import cake_ops
from bench_grouped_gemm import SHAPES, cases, group_sizes


def graph_events(fn, iters):
    """The CUDA events of `iters` replays of fn's CUDA graph (torch.profiler, in start order) and
    the mean replay time in us, measured separately without the profiler."""
    g = torch.cuda.CUDAGraph()
    fn()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return events, start.elapsed_time(end) * 1e3 / iters


def kernel_means(fn, iters):
    """{kernel name: mean us per replay} of fn's CUDA graph, and the mean replay time in us."""
    events, us = graph_events(fn, iters)
    totals = collections.defaultdict(float)
    for ev in events:
        totals[ev.name[:90]] += ev.device_time_total
    return {k: v / iters for k, v in totals.items()}, us


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="decode_qwen3_fc1_t16")
    p.add_argument("--op", default="fwd", choices=["fwd", "dgrad", "wgrad", "wgrad_f32"])
    p.add_argument("--tactics", default="", help="comma-separated tactic names (default: the heuristic's)")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    _, us = kernel_means(lambda: dst.copy_(src), 20)
    print(f"device copy: {2 * src.numel() / us / 1e6:.2f} TB/s (read + write)")

    e, sum_m, n, k, dist = SHAPES[args.shape]
    sizes = group_sizes(e, sum_m, dist)
    x = torch.randn(sum_m, k, device="cuda").bfloat16()
    w = torch.randn(e, n, k, device="cuda").bfloat16()
    gr = torch.randn(sum_m, n, device="cuda").bfloat16()
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    weight_bytes = sum(1 for s in sizes if s > 0) * n * k * 2
    peers = cases(args.op, x, w, gr, offs, sizes)
    names = cake_ops._C.grouped_gemm_tactics(args.op)
    runs = [("torch_gmm", None)] + [("cake", t) for t in (args.tactics.split(",") if args.tactics else [None])]
    for peer, tactic in runs:
        if tactic is not None:
            cake_ops._C.set_grouped_gemm_tactic(args.op, names.index(tactic))
        try:
            kernels, us = kernel_means(peers[peer][0], args.iters)
        finally:
            cake_ops._C.set_grouped_gemm_tactic(args.op, -1)
        label = f"{peer} {tactic or ''}".strip()
        print(f"{label}: {us:.1f} us per replay, weight read {weight_bytes / us / 1e6:.2f} TB/s")
        for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"    {t:8.1f} us  {name}")


if __name__ == "__main__":
    main()
