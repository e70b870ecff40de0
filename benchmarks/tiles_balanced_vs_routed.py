"""The grouped GEMM's fwd / dgrad tiles on balanced groups (equal, tile multiples) and on routed
ones (the multinomial counts of uniform top-k routing), TFLOP/s of CUDA-graph replays timed in
rotation; "auto" is the heuristic's choice. The evidence for heuristic v3 (benchmarks/NOTES.md).

    python benchmarks/tiles_balanced_vs_routed.py
"""
import torch

import cake_ops.grouped_gemm as gg
from bench_grouped_gemm import Timer, seed_case
from cake_ops import _C

SHAPES = {"qwen3_30b_fc1": (128, 65536, 1536, 2048), "qwen3_30b_fc2": (128, 65536, 2048, 768),
          "qwen3_30b_fc1_m131k": (128, 131072, 1536, 2048), "qwen3_235b_fc1": (128, 131072, 3072, 4096),
          "qwen3_235b_fc2": (128, 131072, 4096, 1536), "qwen3_30b_fc1_m32k": (128, 32768, 1536, 2048),
          "qwen3_30b_fc1_m8k": (128, 8192, 1536, 2048)}
TILES = ["ping_128x128x64_c1x1", "ping_128x128x64_c1x1_swz4", "coop_128x256x64_c1x2",
         "coop_128x256x64_c1x2_rasterN_swz4", "coop_128x256x64_c2x1", "ping_64x256x64_c1x1",
         "fixed_ping_128x128x64_c1x1", "fixed_ping_64x256x64_c1x1", "fixed_coop_128x256x64_c1x2",
         "fixed_coop_128x256x64_c2x1"]


def group_ends(e, m, dist):
    """int32 cumulative group ends: equal groups, or the counts of m routes drawn uniformly."""
    counts = torch.full((e,), m // e) if dist == "balanced" else torch.bincount(torch.randint(0, e, (m,)), minlength=e)
    return torch.cumsum(counts, 0).to(torch.int32).cuda()


def main():
    timer = Timer("cuda", 10, 2)
    for op in ["fwd", "dgrad"]:
        names = list(_C.grouped_gemm_tactics(op))
        run = gg.grouped_gemm_fwd if op == "fwd" else gg.grouped_gemm_dgrad
        for shape, (e, m, n, k) in SHAPES.items():
            for dist in ["balanced", "routed"]:
                seed_case(shape, dist)
                offs = group_ends(e, m, dist)
                w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
                a = torch.randn(m, k if op == "fwd" else n, device="cuda", dtype=torch.bfloat16)
                fns = {}
                for tile in ["auto"] + [t for t in TILES if f"{op}_bf16_{t}" in names]:
                    index = -1 if tile == "auto" else names.index(f"{op}_bf16_{tile}")

                    def fn(index=index):  # the tactic is fixed when the CUDA graph is captured
                        _C.set_grouped_gemm_tactic(op, index)
                        run(a, w, offs)
                        _C.set_grouped_gemm_tactic(op, -1)
                    fns[tile] = (fn, None)
                times = timer.many(fns, graph=True)
                line = " ".join(f"{t}={2 * m * n * k / times[t] / 1e9:5.0f}" for t in fns)
                print(f"{op:5s} {shape:20s} {dist:8s} TF/s {line}", flush=True)


if __name__ == "__main__":
    main()
