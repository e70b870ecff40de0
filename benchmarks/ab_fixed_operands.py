"""Fixed-operand grouped GEMM tiles (fixed_operand_sm90.cuh): a per-group float64 check of every fixed
tactic on ragged groups (empty, one row, not tile multiples, one hot group, rows past the last group, NaN
there), then TFLOP/s against the ptr-array tactic of the same tile, torch._grouped_mm and dense torch.mm,
in rotation.

    python benchmarks/ab_fixed_operands.py [reps] [families, default fwd,dgrad,wgrad,wgrad_f32]
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
    wgrad = family.startswith("wgrad")
    x = torch.randn(m, k if family != "dgrad" else n, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    x[sum(sizes):] = float("nan")  # rows past the last group: read by the fixed tiles, never used
    g[sum(sizes):] = float("nan")
    offs = offs_of(sizes)
    bounds = [0] + offs.tolist()
    worst = {}
    for i, name in enumerate(names):
        if "fixed" not in name:
            continue
        cake_ops._C.set_grouped_gemm_tactic(family, i)
        if wgrad:
            out = gg.grouped_gemm_wgrad(g, x, offs, out_dtype=torch.float32 if family == "wgrad_f32" else None)
        else:
            out = (gg.grouped_gemm_fwd if family == "fwd" else gg.grouped_gemm_dgrad)(x, w, offs)
        out = out.double()
        cake_ops._C.set_grouped_gemm_tactic(family, -1)
        err = 0.0
        for j in range(e):
            s, t = bounds[j], bounds[j + 1]
            if s == t:
                continue
            if wgrad:
                got, ref = out[j], g[s:t].double().T @ x[s:t].double()
            else:
                got, ref = out[s:t], x[s:t].double() @ (w[j].double().T if family == "fwd" else w[j].double())
            err = max(err, ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        # fwd / dgrad: rows past the last group zero; wgrad: empty groups' dw zero
        empty_ok = bool((out[bounds[-1]:] == 0).all()) if not wgrad else all(
            bool((out[j] == 0).all()) for j in range(e) if bounds[j] == bounds[j + 1])
        worst[name] = (err, empty_ok and bool(torch.isfinite(out).all()))
    return worst

cases = [([0, 1, 130, 7, 0, 300, 64, 1000], 136, 264, 9), ([512] * 128, 1536, 2048, 0), ([128] * 3 + [0] * 5 + [1, 255, 257, 3000], 256, 512, 5),
         ([1] * 300, 64, 128, 0), ([4000], 8, 72, 3)]
families = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fwd", "dgrad", "wgrad", "wgrad_f32"]
ok = True
for family in families:
    for sizes, n, k, extra in cases:
        for name, (err, zeros_ok) in check(family, sizes, n, k, extra).items():
            bad = err > 8e-3 or not zeros_ok
            ok &= not bad
            print(f"check {family:9} E={len(sizes):3} n={n:5} k={k:5} {name:45} max group rel err {err:.2e} zeros/finite {zeros_ok} {'FAIL' if bad else 'ok'}", flush=True)
print("CHECK", "PASSED" if ok else "FAILED", flush=True)

timer = Timer("cuda", reps=int(sys.argv[1]) if len(sys.argv) > 1 else 25, warmup=3)
def tactic(family, name):
    return cake_ops._C.grouped_gemm_tactics(family).index(name)
pairs = {"fwd": ["coop_128x256x64_c2x1", "fixed_coop_128x256x64_c2x1", "coop_128x256x64_c1x2", "fixed_coop_128x256x64_c1x2",
                 "ping_128x128x64_c1x1", "fixed_ping_128x128x64_c1x1"],
         "dgrad": ["coop_128x256x64_c2x1", "fixed_coop_128x256x64_c2x1", "ping_128x128x64_c1x1", "fixed_ping_128x128x64_c1x1"],
         "wgrad": ["coop_128x256x64_c2x1", "fixed_coop_128x256x64_c2x1", "coop_128x256x64_c1x2_rasterN_swz4",
                   "fixed_coop_128x256x64_c1x2", "fixed_coop_128x256x64_c1x2_rasterN_swz4", "ping_128x128x64_c1x1_swz4"]}
pairs["wgrad_f32"] = pairs["wgrad"]
shapes_of = {"fwd": [(65536, 1536, 2048, 128), (65536, 2048, 768, 128), (65536, 1536, 2048, 32), (65536, 1536, 2048, 8),
                     (65536, 1536, 2048, 1), (65536, 1536, 8192, 128), (131072, 4096, 6144, 8), (16384, 28672, 4096, 8)],
             "dgrad": [(65536, 1536, 2048, 128), (65536, 2048, 768, 128)],
             "wgrad": [(65536, 1536, 2048, 128), (65536, 2048, 768, 128), (8192, 1536, 2048, 128), (1024, 1536, 2048, 128), (128, 1536, 2048, 128),
                       (65536, 1536, 2048, 64), (65536, 1536, 2048, 32), (65536, 1536, 2048, 8),
                       (131072, 4096, 6144, 8), (16384, 4096, 14336, 8), (16384, 28672, 4096, 8)]}
shapes_of["wgrad_f32"] = shapes_of["wgrad"]
for family in families:
    wgrad = family.startswith("wgrad")
    print(f"\n{family}: TF/s   " + " ".join(f"{p:>27}" for p in ["dense", "gmm", "heuristic"] + pairs[family]))
    for sum_m, n, k, e in shapes_of[family]:
        x = torch.randn(sum_m, k if family != "dgrad" else n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(sum_m, n, device="cuda", dtype=torch.bfloat16)
        offs = offs_of([sum_m // e] * e)
        if wgrad:
            out_dtype = torch.float32 if family == "wgrad_f32" else None
            run = lambda: gg.grouped_gemm_wgrad(g, x, offs, out_dtype=out_dtype)
            fns = {"dense": (lambda: torch.mm(g.t(), x), None),
                   "gmm": (lambda: torch._grouped_mm(g.t(), x, offs=offs), None)}
        elif family == "fwd":
            run = lambda: gg.grouped_gemm_fwd(x, w, offs)
            fns = {"dense": (lambda: torch.mm(x, w[0].t()), None), "gmm": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), None)}
        else:
            run = lambda: gg.grouped_gemm_dgrad(x, w, offs)
            fns = {"dense": (lambda: torch.mm(x, w[0]), None), "gmm": (lambda: torch._grouped_mm(x, w, offs=offs), None)}
        fns["heuristic"] = (run, None)
        prefix = {"wgrad_f32": "wgrad_f32_"}.get(family, f"{family}_bf16_")
        for p in pairs[family]:
            fns[p] = (with_tactics(run, {family: tactic(family, prefix + p)}), None)
        t = timer.many(fns)
        fl = 2 * sum_m * n * k
        print(f"{sum_m:>6} {n:>5} {k:>5} E={e:<4}" + " ".join(f"{fl / t[p] / 1e9:27.1f}" for p in fns), flush=True)
