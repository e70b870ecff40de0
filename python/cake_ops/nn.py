"""Modules built on the cake ops.

``FusedMoE`` is a router plus experts that a model can use in place of a Hugging Face-style
sparse MoE block (Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``):
the same call (``hidden_states [..., H]`` -> ``out [..., H]``, or ``(out, router_logits [T, E])``
as the blocks of transformers 4 return), the same routing (softmax over the experts in float32,
top-k, optional renormalisation), with the experts run by
:func:`cake_ops.fused_moe.fused_moe_bf16` on weights prepared once (up/gate interleaved).
``replace_sparse_moe_blocks(model)`` swaps every such block of a model for one.
Forward only: the expert weights are buffers, not trained.

``register_transformers_experts()`` adds ``"cake"`` to the experts implementations of Hugging Face
transformers (>= 5): ``from_pretrained(..., experts_implementation="cake")`` or
``model.set_experts_implementation("cake")`` then runs each experts module's forward and backward
on cake's token sort and grouped GEMMs, on the model's own weights (no copy), for training too; in
inference, plain SwiGLU experts run as one ``fused_moe_bf16`` call on their ``[gate; up]`` weights.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .fused_moe import fused_moe_bf16, interleave_up_gate_sm90
from .grouped_gemm import _autocast, _call, _compute_dtype, _fwd, _fwd_grads, _weight_grad_dtype, grouped_mm

__all__ = ["FusedMoE", "register_transformers_experts", "replace_sparse_moe_blocks", "transformers_experts_forward"]

# (gate, up, down) projection names of one expert: Qwen / DeepSeek style, Mixtral style.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Parts of MoE blocks that FusedMoE does not compute: refused rather than dropped.
_SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_expert_gate", "shared_mlp")


def _block_experts(block: torch.nn.Module, shard: slice, fn: str):
    """The shard's experts as gate and up [E_local, I, H] and down [E_local, H, I], the block's expert count,
    and whether they are stored as 3-D tensors (transformers >= 5: ``experts.gate_up_proj [E, 2I, H]`` gate
    first, ``experts.down_proj``) rather than a ModuleList of per-expert MLPs (transformers 4). Only the
    shard's weights are stacked."""
    experts = block.experts
    if isinstance(experts, torch.nn.ModuleList):
        names = next((n for n in _EXPERT_NAMES if all(hasattr(experts[0], a) for a in n)), None)
        if names is None:
            raise ValueError(f"{fn}: experts must have gate_proj/up_proj/down_proj or w1/w3/w2 projections, got "
                             f"{type(experts[0]).__name__}")
        if any(getattr(getattr(x, n), "bias", None) is not None for x in experts for n in names):
            raise ValueError(f"{fn}: expert projections with a bias are not supported")
        g, u, d = (torch.stack([getattr(x, n).weight for x in experts[shard]]) for n in names)
        return g, u, d, len(experts), False
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3):
        raise ValueError(f"{fn}: experts must be a ModuleList of per-expert MLPs or hold gate_up_proj [E, 2I, H] "
                         f"and down_proj [E, H, I] tensors, got {type(experts).__name__}")
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if (getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False)
            or not getattr(experts, "is_concatenated", True)
            or (apply_gate is not None and apply_gate.__name__ != "_default_apply_gate")):
        raise ValueError(f"{fn}: {type(experts).__name__} stores its experts with a bias, transposed, interleaved or "
                         "with its own gating; FusedMoE takes [gate; up] SwiGLU experts without bias")
    inter = gate_up.shape[1] // 2
    if list(gate_up.shape) != [down.shape[0], 2 * inter, down.shape[1]] or down.shape[2] != inter:
        raise ValueError(f"{fn}: gate_up_proj [E, 2I, H] and down_proj [E, H, I] disagree: {list(gate_up.shape)} "
                         f"and {list(down.shape)}")
    return gate_up[shard, :inter], gate_up[shard, inter:], down[shard], down.shape[0], True


def _block_setting(block: torch.nn.Module, name: str, default=None):
    """A routing setting (top_k, norm_topk_prob) of the block, or of its router (transformers >= 5)."""
    value = getattr(block, name, None)
    return value if value is not None else getattr(block.gate, name, default)


class FusedMoE(torch.nn.Module):
    """Router (``gate``, a bias-free Linear H -> E) and the experts of one shard.

    ``num_local_experts`` / ``local_expert_offset`` hold experts ``[offset, offset + E_local)``
    of ``num_experts`` (expert parallel): routes to other shards contribute zero, and the caller
    sums the shards' outputs. ``norm_topk_prob`` renormalises the top-k probabilities to sum to
    one (Mixtral does; Qwen3-MoE follows its config). ``forward`` returns ``(out, router_logits)``,
    or ``out`` alone with ``return_router_logits=False`` (the blocks of transformers >= 5).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, num_local_experts: Optional[int] = None,
                 local_expert_offset: int = 0, use_fused_finalize: bool = True,
                 return_router_logits: bool = True, dtype: torch.dtype = torch.bfloat16, device=None):
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
        self.return_router_logits = return_router_logits
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
                              local_expert_offset: int = 0, use_fused_finalize: bool = True,
                              check: bool = True) -> "FusedMoE":
        """A FusedMoE holding the router and experts of a Hugging Face-style sparse MoE block: a router
        ``block.gate`` with a weight ``[E, H]``, and experts as a ModuleList of MLPs with
        ``{gate_proj, up_proj, down_proj}`` or ``{w1, w3, w2}`` (transformers 4) or as 3-D
        ``gate_up_proj`` / ``down_proj`` tensors (transformers >= 5). top_k and norm_topk_prob default
        to the block's (or its router's); renormalised where neither says (Mixtral). It returns what
        the block returns: ``(out, router_logits)`` for ModuleList experts, ``out`` for 3-D ones.

        Blocks with parts FusedMoE does not compute (shared experts, biased or custom-gated experts)
        are refused. ``check`` (whole blocks only) runs the block and the FusedMoE on 8 random tokens
        and raises if they disagree, which catches a router that is not softmax top-k."""
        fn = "FusedMoE.from_sparse_moe_block"
        gate_w = getattr(getattr(block, "gate", None), "weight", None)
        if not (isinstance(gate_w, torch.Tensor) and gate_w.dim() == 2 and isinstance(getattr(block, "experts", None),
                                                                                     torch.nn.Module)):
            raise ValueError(f"{fn}: the block must have a router `gate` with a weight [E, H] and `experts`, got "
                             f"{type(block).__name__}")
        shared = [n for n in _SHARED_EXPERT_NAMES if getattr(block, n, None) is not None]
        if shared:
            raise ValueError(f"{fn}: the block has shared experts ({', '.join(shared)}), which FusedMoE does not compute")
        if getattr(block.gate, "bias", None) is not None:
            raise ValueError(f"{fn}: a router with a bias is not supported")
        top_k = top_k if top_k is not None else _block_setting(block, "top_k")
        if top_k is None:
            raise ValueError(f"{fn}: neither the block nor its router has a top_k attribute; pass top_k")
        norm = norm_topk_prob if norm_topk_prob is not None else _block_setting(block, "norm_topk_prob", True)
        num_experts, hidden = gate_w.shape
        e_local = num_experts if num_local_experts is None else num_local_experts
        if not (1 <= e_local and 0 <= local_expert_offset <= num_experts - e_local):
            raise ValueError(f"{fn}: the shard [{local_expert_offset}, {local_expert_offset + e_local}) is not within "
                             f"the block's {num_experts} experts")
        with torch.no_grad():
            g, u, d, held, stacked = _block_experts(block, slice(local_expert_offset, local_expert_offset + e_local), fn)
        if held != num_experts:
            raise ValueError(f"{fn}: the router has {num_experts} experts but the block holds {held}")
        moe = cls(hidden, g.shape[1], num_experts, top_k, norm_topk_prob=norm, num_local_experts=e_local,
                  local_expert_offset=local_expert_offset, use_fused_finalize=use_fused_finalize,
                  return_router_logits=not stacked, dtype=gate_w.dtype, device=gate_w.device)
        with torch.no_grad():
            moe.gate.weight.copy_(gate_w)
            moe.load_experts(g, u, d)
        if check and e_local == num_experts:
            _check_against_block(moe, block, fn)
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
        hidden_states = _autocast(hidden_states)  # inside torch.autocast: its dtype, as a Linear's input
        if shape[-1] != self.w1.shape[2] or hidden_states.dtype != self.w1.dtype:
            raise ValueError(f"FusedMoE: hidden_states must be [..., hidden={self.w1.shape[2]}] {self.w1.dtype}, got "
                             f"{list(shape)} {hidden_states.dtype}")
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        logits, ids, weights = self.route(x)
        out = fused_moe_bf16(x, ids, weights, self.w1, self.w2, self.num_experts, self.top_k,
                             self.num_local_experts, self.local_expert_offset, self.use_fused_finalize)
        return (out.view(shape), logits) if self.return_router_logits else out.view(shape)


def _check_against_block(moe: FusedMoE, block: torch.nn.Module, fn: str) -> None:
    """Raise unless the FusedMoE and the block agree on 8 random tokens (bf16 / fp16 rounding apart)."""
    hidden = moe.w1.shape[2]
    x = torch.randn(1, 8, hidden, generator=torch.Generator().manual_seed(0)).to(moe.w1.device, moe.w1.dtype)
    was_training = block.training
    try:
        block.eval()
        with torch.no_grad():
            want = block(x)
            got = moe(x)
    finally:
        block.train(was_training)
    want = (want[0] if isinstance(want, tuple) else want).float()
    got = (got[0] if isinstance(got, tuple) else got).float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not err < 5e-2:
        raise ValueError(f"{fn}: the FusedMoE does not reproduce {type(block).__name__} (relative error {err:.3g} on "
                         "random tokens): its router or experts compute something else than softmax top-k routing "
                         "over SwiGLU experts; check=False skips this check")


def replace_sparse_moe_blocks(model: torch.nn.Module, **kwargs) -> int:
    """Replace every sparse MoE block of ``model`` (a module with a router ``gate`` and ``experts``, as
    :meth:`FusedMoE.from_sparse_moe_block` reads them) by a FusedMoE built from it, in place; the
    blocks' expert weights are released with them. ``kwargs`` go to ``from_sparse_moe_block``.
    Returns how many blocks were replaced; raises ValueError if there is none."""
    blocks = [(name, module) for name, module in model.named_modules()
              if name and isinstance(getattr(module, "experts", None), torch.nn.Module)
              and isinstance(getattr(getattr(module, "gate", None), "weight", None), torch.Tensor)]
    if not blocks:
        raise ValueError(f"replace_sparse_moe_blocks: {type(model).__name__} has no sparse MoE block (a module with a "
                         "router `gate` and `experts`)")
    replacements = [(name, FusedMoE.from_sparse_moe_block(block, **kwargs)) for name, block in blocks]  # all or none
    for name, moe in replacements:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, moe)
    return len(replacements)


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers' experts interface


# Experts classes of transformers whose own gate is the clamped SwiGLU silu(min(gate, L)) * clamp(up, -L, L)
# (cake::swiglu's limit): the attribute holding L, and whether the gate calls the module's act_fn (which must then
# be silu) rather than F.silu itself. By class name: torch.compile traces that, not a function's __qualname__.
_CLAMPED_SWIGLU_GATES = {
    "DeepseekV4Experts": ("limit", True),
    "Glm5NextTextExperts": ("swiglu_limit", False),
    "HYV4Experts": ("swiglu_limit", False),
}


def _swiglu_limit(experts: torch.nn.Module, hidden_states: torch.Tensor) -> Optional[float]:
    """The SwiGLU that :class:`_SwigluExperts` computes for an experts module, or None where it is not one:
    ``math.inf`` for transformers' plain SwiGLU experts (the default gate on silu), the limit L for the clamped
    SwiGLU gates of ``_CLAMPED_SWIGLU_GATES``. Either with gate-first ``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``, both contiguous, no bias, in hidden_states' dtype (inside torch.autocast: once cast, as the GEMMs
    see them)."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    act = getattr(experts, "act_fn", None)
    silu = isinstance(act, (SiLUActivation, torch.nn.SiLU)) or act is F.silu
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is _default_apply_gate:
        limit = math.inf if silu else None
    else:
        name, uses_act = _CLAMPED_SWIGLU_GATES.get(type(experts).__name__, (None, False))
        limit = getattr(experts, name, None) if name and (silu or not uses_act) else None
        limit = float(limit) if isinstance(limit, (int, float)) and limit > 0 else None
    layout = (getattr(experts, "has_gate", True) and not getattr(experts, "has_bias", False)
              and not getattr(experts, "is_transposed", False) and getattr(experts, "is_concatenated", True))
    shapes = (gate_up.dim() == 3 and gate_up.shape[1] % 2 == 0
              and list(down.shape) == [gate_up.shape[0], hidden_states.shape[-1], gate_up.shape[1] // 2]
              and _compute_dtype(gate_up) == hidden_states.dtype and _compute_dtype(down) == hidden_states.dtype
              and gate_up.is_contiguous() and down.is_contiguous())
    return limit if layout and shapes else None


def _runs_fused(limit: Optional[float], experts: torch.nn.Module, hidden_states: torch.Tensor,
                top_k_weights: torch.Tensor) -> bool:
    """Whether an experts module's forward can be one fused_moe_bf16 call on its own weights: nothing to
    differentiate, plain SwiGLU experts (``limit``: :func:`_swiglu_limit`, inf) in bf16 / fp16, and the fused
    kernels' shape rules (H % 64, I % 32)."""
    if limit != math.inf:
        return False
    tensors = (hidden_states, top_k_weights, experts.gate_up_proj, experts.down_proj)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    hidden, inter = hidden_states.shape[-1], experts.down_proj.shape[-1]
    return hidden_states.dtype in (torch.bfloat16, torch.float16) and hidden % 64 == 0 and inter % 32 == 0


def _gates_by_swiglu(limit: Optional[float], experts: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether :class:`_SwigluExperts` takes a module: SwiGLU experts (``limit``: :func:`_swiglu_limit`, not None)
    where cake::swiglu runs (any dtype on the CPU; 16-bit with I % 8 on CUDA)."""
    return limit is not None and (
        not hidden_states.is_cuda
        or (hidden_states.dtype in (torch.bfloat16, torch.float16) and experts.down_proj.shape[-1] % 8 == 0))


class _SwigluExperts(torch.autograd.Function):
    """SwiGLU experts on expert-sorted rows, ``down[e] @ swiglu(gate_up[e] @ x)`` per group, as one autograd
    node: forward two grouped GEMMs and cake::swiglu (with ``limit`` < inf its clamped form); backward two dgrad,
    two wgrad (deterministic) and swiglu_backward. Where grouped_mm and the module's own gate (chunk, silu, mul;
    two clamps more for the clamped form) record five nodes or more and run six elementwise passes; at Qwen3-30B
    sizes a training step's host time is close to its GPU time, so the nodes' host time counts as much as the
    gate's kernels (NOTES, session 58)."""

    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, m_indptr, limit=math.inf):
        ctx.w_grad_dtypes = _weight_grad_dtype(gate_up_proj), _weight_grad_dtype(down_proj)
        ctx.limit = None if limit == math.inf else limit
        x, gate_up_proj, down_proj = _autocast(x), _autocast(gate_up_proj), _autocast(down_proj)
        gate_up = _fwd(x, gate_up_proj, m_indptr)
        h = _call(torch.ops.cake.swiglu, (gate_up, ctx.limit))
        ctx.save_for_backward(x, gate_up, h, gate_up_proj, down_proj, m_indptr)
        return _fwd(h, down_proj, m_indptr)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, gate_up, h, gate_up_proj, down_proj, m_indptr = ctx.saved_tensors
        need_x, need_gate_up, need_down = ctx.needs_input_grad[:3]
        # h's gradient only where x's or gate_up_proj's is wanted (a run may train down_proj alone)
        gate_up_grad_dtype, down_grad_dtype = ctx.w_grad_dtypes
        d_h, d_down = _fwd_grads(grad.contiguous(), h, down_proj, m_indptr, need_x or need_gate_up, need_down,
                                 down_grad_dtype)
        if d_h is None:
            return None, None, d_down, None, None
        d_gate_up = _call(torch.ops.cake.swiglu_backward, (d_h, gate_up, ctx.limit))
        d_x, d_gate_up_proj = _fwd_grads(d_gate_up, x, gate_up_proj, m_indptr, need_x, need_gate_up,
                                         gate_up_grad_dtype)
        return d_x, d_gate_up_proj, d_down, None, None


def _combines_on_cake(rows: torch.Tensor) -> bool:
    """Whether moe_finalize takes these rows: any dtype on the CPU; 16-bit, 16-byte rows on CUDA."""
    return not rows.is_cuda or (rows.dtype in (torch.bfloat16, torch.float16) and rows.shape[-1] % 8 == 0)


class _TokenRows(torch.autograd.Function):
    """``hidden_states[token_of_row]``: each permuted row's token. The gradient sums each token's kept routes' row
    gradients in float32 in route order (moe_finalize with unit scales): one pass, no index sort, no atomics,
    where indexing's backward sorts the indices and accumulates."""

    @staticmethod
    def forward(ctx, hidden_states, token_of_row, expanded_to_permuted, top_k):
        ctx.save_for_backward(expanded_to_permuted)
        ctx.top_k = top_k
        return hidden_states.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (expanded_to_permuted,) = ctx.saved_tensors
        ones = grad.new_ones((expanded_to_permuted.shape[0] // ctx.top_k, ctx.top_k), dtype=torch.float32)
        return torch.ops.cake.moe_finalize(grad.contiguous(), expanded_to_permuted, ones), None, None, None


def transformers_experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward of a transformers (>= 5) experts module on cake's kernels, as its ``"grouped_mm"``
    implementation computes it: ``moe_sort`` orders the routes by expert on the device (stable, no host
    sync), ``grouped_mm`` runs the up (gate_up) and down projections on the module's own weights (either
    layout, no copy; bias and gating as the module defines them), and ``moe_finalize`` sums the weighted routes
    per token in float32 in route order. Routes to ids outside ``[0, num_experts)`` (expert-parallel sentinels)
    contribute zero. Differentiable, without atomics: the projection weights' gradients come from
    cake's deterministic wgrad kernel, the hidden states' and the routing weights' from moe_finalize's kernel
    and autograd formula (the biases' from torch's indexed adds, as in transformers' own implementations).
    SwiGLU experts, plain or with the clamped gate of DeepSeek-V4, GLM-5 and HY-V4 (silu(min(gate, L)) *
    clamp(up, -L, L)), train and infer through one autograd node (:class:`_SwigluExperts`: the two projections
    and cake::swiglu, the gate in float32 rounded once). Where nothing needs a gradient, plain SwiGLU experts run
    as one :func:`fused_moe_bf16` call on the ``[gate; up]`` weights as they are (``w1_layout="gate_up"``) with
    its fixed-order float32 combine (``use_fused_finalize=False``: deterministic, as the sum above). Inside
    ``torch.autocast`` (float32 weights, or float32 hidden states next to bfloat16 weights) the projections run
    in autocast's dtype, as ``torch.mm`` would, with the gradients reaching the float32 tensors in their dtype;
    the output is in hidden_states' dtype."""
    num_tokens, top_k = top_k_index.shape
    num_experts = experts.num_experts
    out_dtype = hidden_states.dtype
    hidden_states = _autocast(hidden_states)  # inside torch.autocast: the GEMMs' dtype, cast before the gather
    limit = _swiglu_limit(experts, hidden_states)  # once: both paths' predicates start from it
    if _runs_fused(limit, experts, hidden_states, top_k_weights):
        return fused_moe_bf16(hidden_states.contiguous(), top_k_index.to(torch.int32).contiguous(),
                              top_k_weights.float().contiguous(), _autocast(experts.gate_up_proj),
                              _autocast(experts.down_proj), num_experts, top_k, use_fused_finalize=False,
                              w1_layout="gate_up").to(out_dtype)
    transposed = getattr(experts, "is_transposed", False)
    bias = getattr(experts, "has_bias", False)
    _, m_indptr, permuted_to_expanded, expanded_to_permuted, _ = torch.ops.cake.moe_sort(
        top_k_index.to(torch.int32).contiguous(), num_experts, num_experts, 0, 128)
    expanded = permuted_to_expanded.clamp_min(0).long()  # rows past the kept routes: token 0's, computed as zeros
    x = (_TokenRows.apply(hidden_states, expanded // top_k, expanded_to_permuted, top_k)
         if _combines_on_cake(hidden_states) else hidden_states[expanded // top_k])
    if bias:  # per row: its expert, and whether it holds a kept route (its bias is zero otherwise, as the row)
        row_expert = top_k_index.reshape(-1)[expanded].clamp(0, num_experts - 1)
        row_kept = (permuted_to_expanded >= 0).unsqueeze(-1)

    def project(inp, name):
        weight = getattr(experts, name)
        out = grouped_mm(inp, weight if transposed else weight.transpose(-2, -1), m_indptr[1:])
        # the bias in the GEMM's dtype under torch.autocast, as F.linear casts its bias
        return out + _autocast(getattr(experts, name + "_bias"))[row_expert] * row_kept if bias else out

    if _gates_by_swiglu(limit, experts, hidden_states):
        y = _SwigluExperts.apply(x.contiguous(), experts.gate_up_proj, experts.down_proj, m_indptr, limit)
    else:
        h = (experts._apply_gate(project(x, "gate_up_proj")) if getattr(experts, "has_gate", True)
             else experts.act_fn(project(x, "up_proj")))
        y = project(h, "down_proj")
    scales = top_k_weights.reshape(num_tokens, top_k).float()
    if _combines_on_cake(y):
        # one kernel each way (moe_finalize's autograd formula), where the torch ops below take five passes
        return torch.ops.cake.moe_finalize(y, expanded_to_permuted, scales).to(out_dtype)
    dropped = expanded_to_permuted < 0
    y = y[expanded_to_permuted.clamp_min(0).long()].float()
    weights = scales.reshape(-1, 1).masked_fill(dropped.unsqueeze(-1), 0.0)
    return (y * weights).view(num_tokens, top_k, y.shape[-1]).sum(dim=1).to(out_dtype)


def register_transformers_experts(name: str = "cake") -> None:
    """Register :func:`transformers_experts_forward` as the experts implementation ``name`` of
    transformers (>= 5), for ``from_pretrained(..., experts_implementation=name)`` and
    ``model.set_experts_implementation(name)``."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError("register_transformers_experts: needs transformers >= 5 (its ExpertsInterface), "
                          f"got {e}") from e
    ExpertsInterface.register(name, transformers_experts_forward)
