"""Shared test helpers: routing cases and random MoE problems (the MoE op and fused_moe_bf16 tests), the
relative error the GEMM tests compare by, and a record of the ops a call dispatches."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """The ops dispatched inside the context (views left out), in order: ``with RecordOps() as r: ...; r.ops``;
    with ``args=True`` also ``r.calls``, [(op, positional args)]."""

    def __init__(self, args=False):
        super().__init__()
        self.ops, self.calls, self.record_args = [], [], args

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
            if self.record_args:
                self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))


def rel_err(out, expected):
    """||out - expected|| / ||expected|| in float64, on expected's device; out must be finite."""
    out, expected = out.double().to(expected.device), expected.double()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()

# name -> (num_tokens, top_k, num_experts, num_local_experts, local_expert_offset)
ROUTING_CASES = {
    "top8": (37, 8, 32, 32, 0),
    "top2": (64, 2, 8, 8, 0),
    "top1": (19, 1, 16, 16, 0),
    "hot_expert": (48, 2, 8, 8, 0),
    "ep_shard": (40, 8, 64, 16, 16),
    "one_token": (1, 8, 128, 128, 0),
    "no_tokens": (0, 8, 16, 16, 0),
}


def moe_problem(t, k, e, e_local, h, inter, device, dtype=torch.bfloat16):
    """x [t, h], distinct expert ids per token [t, k] int32, softmax scales [t, k], gate-first w1
    [e_local, 2 * inter, h] and w2 [e_local, h, inter]."""
    x = torch.randn(t, h, device=device).to(dtype)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32).to(device) if t else \
        torch.zeros(0, k, dtype=torch.int32, device=device)
    scales = torch.softmax(torch.randn(t, k, device=device), -1)
    w1 = (torch.randn(e_local, 2 * inter, h, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(e_local, h, inter, device=device) / inter**0.5).to(dtype)
    return x, ids, scales, w1, w2
