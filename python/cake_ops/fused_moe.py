"""Fused bf16 MoE forward for Hopper (``../shared/spec/fused_moe_bf16_sm90.txt``).

Work in progress (issue 4). The pipeline's ops exist with their semantics, on the CPU and (unfused,
through ATen kernels and the SM90 grouped GEMM) on the GPU: ``torch.ops.cake.moe_sort`` ->
``moe_gemm1_swiglu`` -> ``grouped_gemm_fwd`` -> ``moe_finalize``; ``fused_moe_bf16`` comes with the
fused SM90 kernels that replace them.
"""
import torch

INTERLEAVE_ROWS = 32


def interleave_up_gate_sm90(w_gate_up: torch.Tensor) -> torch.Tensor:
    """Gate-first ``[E, 2I, H]`` weights (``[gate; up]``) -> the SM90 kernel's order, interleaved at
    32 rows: ``[up 0:32 | gate 0:32 | up 32:64 | gate 32:64 | ...]``, so that one wgmma accumulator
    fragment holds a gate column and its up column together. Needs I % 32 == 0. Returns a new
    contiguous tensor (cache it with the model's weights)."""
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % (2 * INTERLEAVE_ROWS) != 0:
        raise ValueError("interleave_up_gate_sm90: w_gate_up must be [E, 2I, H] with I % 32 == 0, "
                         f"got shape {list(w_gate_up.shape)}")
    e, two_i, h = w_gate_up.shape
    chunks = two_i // 2 // INTERLEAVE_ROWS
    gate, up = w_gate_up.view(e, 2, chunks, INTERLEAVE_ROWS, h).unbind(1)
    return torch.stack([up, gate], dim=2).reshape(e, two_i, h).contiguous()
