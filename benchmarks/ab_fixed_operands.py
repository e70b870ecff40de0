"""Fixed-operand grouped GEMM tiles (fixed_operand_sm90.cuh): a per-group float64 check of every fixed
tactic on ragged groups (empty, one row, not tile multiples, one hot group, rows past the last group), then
TFLOP/s against the ptr-array tactic of the same tile, torch._grouped_mm and dense torch.mm, in rotation.

    python benchmarks/ab_fixed_operands.py [reps]
"""
import sys, torch, cake_ops
from cake_ops import grouped_gemm as gg
from bench_grouped_gemm import Timer, with_tactics
torch.manual_seed(1)

def offs_of(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()

def check(family, sizes, n, k, extra_rows=0):
    names = cake_ops._C.grouped_gemm_tactics(family)
    e = len(sizes)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k if family == "fwd" else n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = offs_of(sizes)
    bounds = [0] + offs.tolist()
    worst = {}
    for i, name in enumerate(names):
        if "fixed" not in name:
            continue
        cake_ops._C.set_grouped_gemm_tactic(family, i)
        out = (gg.grouped_gemm_fwd if family == "fwd" else gg.grouped_gemm_dgrad)(x, w, offs).double()
        cake_ops._C.set_grouped_gemm_tactic(family, -1)
        err = 0.0
        for g in range(e):
            s, t = bounds[g], bounds[g + 1]
            if s == t:
                continue
            ref = x[s:t].double() @ (w[g].double().T if family == "fwd" else w[g].double())
            err = max(err, ((out[s:t] - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        tail_ok = bool((out[bounds[-1]:] == 0).all())
        worst[name] = (err, tail_ok)
    return worst

cases = [([0, 1, 130, 7, 0, 300, 64, 1000], 136, 264, 9), ([512] * 128, 1536, 2048, 0), ([128] * 3 + [0] * 5 + [1, 255, 257, 3000], 256, 512, 5),
         ([1] * 300, 64, 128, 0), ([4000], 8, 72, 3)]
ok = True
for family in ("fwd", "dgrad"):
    for sizes, n, k, extra in cases:
        for name, (err, tail_ok) in check(family, sizes, n, k, extra).items():
            bad = err > 8e-3 or not tail_ok
            ok &= not bad
            print(f"check {family:5} E={len(sizes):3} n={n:5} k={k:5} {name:45} max group rel err {err:.2e} tail zero {tail_ok} {'FAIL' if bad else 'ok'}", flush=True)
print("CHECK", "PASSED" if ok else "FAILED", flush=True)

timer = Timer("cuda", reps=int(sys.argv[1]) if len(sys.argv) > 1 else 25, warmup=3)
def tactic(family, name):
    return cake_ops._C.grouped_gemm_tactics(family).index(name)
pairs = {"fwd": ["coop_128x256x64_c2x1", "fixed_coop_128x256x64_c2x1", "coop_128x256x64_c1x2", "fixed_coop_128x256x64_c1x2",
                 "ping_128x128x64_c1x1", "fixed_ping_128x128x64_c1x1"],
         "dgrad": ["coop_128x256x64_c2x1", "fixed_coop_128x256x64_c2x1", "ping_128x128x64_c1x1", "fixed_ping_128x128x64_c1x1"]}
for family, shapes in (("fwd", [(65536, 1536, 2048, 128), (65536, 2048, 768, 128), (65536, 1536, 2048, 32), (65536, 1536, 2048, 8),
                                 (65536, 1536, 2048, 1), (65536, 1536, 8192, 128), (131072, 4096, 6144, 8), (16384, 28672, 4096, 8)]),
                       ("dgrad", [(65536, 1536, 2048, 128), (65536, 2048, 768, 128)])):
    print(f"\n{family}: TF/s   " + " ".join(f"{p:>27}" for p in ["dense", "gmm", "heuristic"] + pairs[family]))
    for sum_m, n, k, e in shapes:
        x = torch.randn(sum_m, k if family == "fwd" else n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        offs = offs_of([sum_m // e] * e)
        if family == "fwd":
            run = lambda: gg.grouped_gemm_fwd(x, w, offs)
            fns = {"dense": (lambda: torch.mm(x, w[0].t()), None), "gmm": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), None)}
        else:
            run = lambda: gg.grouped_gemm_dgrad(x, w, offs)
            fns = {"dense": (lambda: torch.mm(x, w[0]), None), "gmm": (lambda: torch._grouped_mm(x, w, offs=offs), None)}
        fns["heuristic"] = (run, None)
        for p in pairs[family]:
            fns[p] = (with_tactics(run, {family: tactic(family, f"{family}_bf16_{p}")}), None)
        t = timer.many(fns)
        fl = 2 * sum_m * n * k
        print(f"{sum_m:>6} {n:>5} {k:>5} E={e:<4}" + " ".join(f"{fl / t[p] / 1e9:27.1f}" for p in fns), flush=True)
