"""One-off probe: the current (unfused) fused_moe_bf16 under CUDA-graph replay against the weight
floor (bytes of the experts touched / 4.8 TB/s). Not the issue-4 benchmark (bench_fused_moe.py)."""
import warnings

import torch

from cake_ops.fused_moe import fused_moe_bf16

warnings.simplefilter("ignore")
for name, (e, k, h, i) in {"qwen3_30b": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}.items():
    w1 = torch.randn(e, 2 * i, h, device="cuda").bfloat16()
    w2 = torch.randn(e, h, i, device="cuda").bfloat16()
    for t in (1, 16, 256, 4096):
        x = torch.randn(t, h, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int().cuda()
        scales = torch.softmax(torch.randn(t, k, device="cuda"), -1)
        out = torch.empty_like(x)
        fused_moe_bf16(x, ids, scales, w1, w2, e, k, moe_output=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fused_moe_bf16(x, ids, scales, w1, w2, e, k, moe_output=out)
        for _ in range(3):
            g.replay()
        s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            g.replay()
        f.record()
        f.synchronize()
        ms = s.elapsed_time(f) / 20
        touched = ids.unique().numel()
        floor = touched * 3 * h * i * 2 / 4.8e12 * 1e3
        tflops = 2 * t * k * 3 * h * i / ms / 1e9
        print(f"{name:10} T={t:5} {ms:8.3f} ms  weight floor {floor:6.3f} ms  x{ms / floor:5.2f}  {tflops:6.1f} TFLOP/s")
