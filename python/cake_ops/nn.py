"""Modules built on the cake ops.

``FusedMoE`` is a router plus experts that a model can use in place of a Hugging Face-style
sparse MoE block (Mixtral's ``MixtralSparseMoeBlock``, Qwen2/Qwen3-MoE's ``*SparseMoeBlock``):
same call (``hidden_states [..., H]`` -> ``(out [..., H], router_logits [T, E])``), same routing
(softmax over the experts in float32, top-k, optional renormalisation), with the experts run by
:func:`cake_ops.fused_moe.fused_moe_bf16` on weights prepared once (up/gate interleaved).
Forward only: the expert weights are buffers, not trained.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .fused_moe import fused_moe_bf16, interleave_up_gate_sm90

__all__ = ["FusedMoE"]

# (gate, up, down) projection names of one expert: Qwen / DeepSeek style, Mixtral style.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class FusedMoE(torch.nn.Module):
    """Router (``gate``, a bias-free Linear H -> E) and the experts of one shard.

    ``num_local_experts`` / ``local_expert_offset`` hold experts ``[offset, offset + E_local)``
    of ``num_experts`` (expert parallel): routes to other shards contribute zero, and the caller
    sums the shards' outputs. ``norm_topk_prob`` renormalises the top-k probabilities to sum to
    one (Mixtral does; Qwen3-MoE follows its config).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, num_local_experts: Optional[int] = None,
                 local_expert_offset: int = 0, use_fused_finalize: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        e_local = num_experts if num_local_experts is None else num_local_experts
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if not (1 <= e_local and 0 <= local_expert_offset <= num_experts - e_local):
            raise ValueError(f"FusedMoE: the shard [{local_expert_offset}, {local_expert_offset + e_local}) must lie "
                             f"within [0, num_experts={num_experts})")
        if hidden_size % 64 or intermediate_size % 32 or hidden_size < 64 or intermediate_size < 32:
            raise ValueError(f"FusedMoE: needs hidden_size % 64 == 0 and intermediate_size % 32 == 0, got "
                             f"{hidden_size} and {intermediate_size}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_local_experts = e_local
        self.local_expert_offset = local_expert_offset
        self.use_fused_finalize = use_fused_finalize
        self.gate = torch.nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        # w1: [E_local, 2I, H] up/gate interleaved at 32 rows (interleave_up_gate_sm90); w2: [E_local, H, I].
        self.register_buffer("w1", torch.zeros(e_local, 2 * intermediate_size, hidden_size, dtype=dtype, device=device))
        self.register_buffer("w2", torch.zeros(e_local, hidden_size, intermediate_size, dtype=dtype, device=device))

    def load_experts(self, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor) -> None:
        """Per-expert weights of this shard in nn.Linear layout: gate and up ``[E_local, I, H]``,
        down ``[E_local, H, I]``."""
        e_local, two_i, hidden = self.w1.shape
        expected = {"gate_weight": [e_local, two_i // 2, hidden], "up_weight": [e_local, two_i // 2, hidden],
                    "down_weight": [e_local, hidden, two_i // 2]}
        for (name, shape), t in zip(expected.items(), (gate_weight, up_weight, down_weight)):
            if list(t.shape) != shape:
                raise ValueError(f"FusedMoE.load_experts: {name} must be {shape}, got {list(t.shape)}")
        w1 = interleave_up_gate_sm90(torch.cat([gate_weight, up_weight], dim=1))
        self.w1.copy_(w1)
        self.w2.copy_(down_weight)

    @classmethod
    def from_sparse_moe_block(cls, block: torch.nn.Module, *, top_k: Optional[int] = None,
                              norm_topk_prob: Optional[bool] = None, num_local_experts: Optional[int] = None,
                              local_expert_offset: int = 0, use_fused_finalize: bool = True) -> "FusedMoE":
        """A FusedMoE holding the router and experts of a Hugging Face-style sparse MoE block
        (``block.gate`` and ``block.experts[i].{gate_proj, up_proj, down_proj}`` or ``{w1, w3, w2}``);
        top_k and norm_topk_prob default to the block's own (``top_k``, ``norm_topk_prob``;
        renormalised when the block has no such flag, as Mixtral)."""
        gate_w = getattr(getattr(block, "gate", None), "weight", None)
        if not (isinstance(gate_w, torch.Tensor) and gate_w.dim() == 2
                and isinstance(getattr(block, "experts", None), torch.nn.ModuleList)):
            raise ValueError("FusedMoE.from_sparse_moe_block: the block must have a router `gate` with a weight "
                             f"[E, H] and `experts` as a ModuleList of per-expert MLPs, got {type(block).__name__}")
        experts = list(block.experts)
        names = next((n for n in _EXPERT_NAMES if all(hasattr(experts[0], a) for a in n)), None)
        if names is None:
            raise ValueError("FusedMoE.from_sparse_moe_block: experts must have gate_proj/up_proj/down_proj "
                             f"or w1/w3/w2 projections, got {type(experts[0]).__name__}")
        top_k = top_k if top_k is not None else getattr(block, "top_k", None)
        if top_k is None:
            raise ValueError("FusedMoE.from_sparse_moe_block: the block has no top_k attribute; pass top_k")
        norm = norm_topk_prob if norm_topk_prob is not None else getattr(block, "norm_topk_prob", True)
        num_experts, hidden = gate_w.shape
        e_local = num_experts if num_local_experts is None else num_local_experts
        shard = experts[local_expert_offset:local_expert_offset + e_local]
        if len(shard) != e_local:
            raise ValueError(f"FusedMoE.from_sparse_moe_block: the shard [{local_expert_offset}, "
                             f"{local_expert_offset + e_local}) is not within the block's {len(experts)} experts")
        g, u, d = (torch.stack([getattr(x, n).weight for x in shard]) for n in names)
        moe = cls(hidden, g.shape[1], num_experts, top_k, norm_topk_prob=norm, num_local_experts=e_local,
                  local_expert_offset=local_expert_offset, use_fused_finalize=use_fused_finalize,
                  dtype=gate_w.dtype, device=gate_w.device)
        with torch.no_grad():
            moe.gate.weight.copy_(gate_w)
            moe.load_experts(g, u, d)
        return moe

    def route(self, x: torch.Tensor):
        """Router logits [T, E], expert ids [T, k] (int32) and their weights [T, k] (float32)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, ids.to(torch.int32), weights

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if shape[-1] != self.w1.shape[2] or hidden_states.dtype != self.w1.dtype:
            raise ValueError(f"FusedMoE: hidden_states must be [..., hidden={self.w1.shape[2]}] {self.w1.dtype}, got "
                             f"{list(shape)} {hidden_states.dtype}")
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        logits, ids, weights = self.route(x)
        out = fused_moe_bf16(x, ids, weights, self.w1, self.w2, self.num_experts, self.top_k,
                             self.num_local_experts, self.local_expert_offset, self.use_fused_finalize)
        return out.view(shape), logits
