"""Where a grouped GEMM loses to dense: the same sum_m x N x K product split into E equal groups, cake
(heuristic and three ptr-array tiles forced by name), torch._grouped_mm and dense torch.mm, TFLOP/s timed
in rotation (session 24: the loss grows with E at fixed K and shrinks with K, a fixed cost per change of
group; benchmarks/NOTES.md).

    python benchmarks/grouped_vs_dense.py
"""
import torch, cake_ops
from cake_ops import grouped_gemm as gg
from bench_grouped_gemm import Timer, with_tactics
torch.manual_seed(0)
timer = Timer("cuda", reps=25, warmup=3)
names = cake_ops._C.grouped_gemm_tactics("fwd")
def idx(name):
    for i, n in enumerate(names):
        if n == name: return i
    raise KeyError(name)
forced = {"coop_c1x2": idx("fwd_bf16_coop_128x256x64_c1x2"), "coop_c2x1": idx("fwd_bf16_coop_128x256x64_c2x1"),
          "ping128": idx("fwd_bf16_ping_128x128x64_c1x1")}
print(f"{'sum_m':>6} {'N':>5} {'K':>5} {'E':>4} " + " ".join(f"{k:>10}" for k in ["dense", "gmm", "cake"] + list(forced)) + "   (TF/s)")
for (sum_m, n, k) in [(65536, 1536, 2048), (65536, 2048, 768), (65536, 1536, 8192)]:
    for e in [1, 8, 32, 128, 512]:
        x = torch.randn(sum_m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        offs = (torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (sum_m // e))
        fns = {"dense": (lambda: torch.mm(x, w[0].t()), None),
               "gmm": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), None),
               "cake": (lambda: gg.grouped_gemm_fwd(x, w, offs), None)}
        for name, i in forced.items():
            fns[name] = (with_tactics(lambda: gg.grouped_gemm_fwd(x, w, offs), {"fwd": i}), None)
        t = timer.many(fns)
        fl = 2 * sum_m * n * k
        print(f"{sum_m:>6} {n:>5} {k:>5} {e:>4} " + " ".join(f"{fl / t[name] / 1e9:10.1f}" if not isinstance(t[name], str) else f"{'err':>10}" for name in fns), flush=True)
