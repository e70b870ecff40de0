"""The StepFun MoE pipeline (``../shared/spec/stepfun_moe.rst``), experimental.

Every stage is a ``torch.ops.cake`` op with CPU, fake and CUDA implementations:

========  ===========================================================================================
routing   ``cake::moe_routing``: Renormalize top-k from logits (ties to the lower id, softmax over the
          k selected in float32) or precomputed top-k ids and weights; per-expert counts, offsets and
          the permutation, on the device.
fc1       ``cake::moe_gemm1_swiglu`` with ``clamp_limits``: the grouped GEMM over gathered token rows
          and the SwiGLUStep epilogue ``min(silu(gate), L_e) * clamp(up, -L_e, L_e)``, ``L_e`` the
          expert's ``gemm1_clamp_limit``.
requant   ``cake::quantize_fp8``: the fp8 family's per-tensor e4m3 quantization of fc1's output; the
          bf16 family has none (its plans skip the stage, the one-shot function returns its input).
fc2       ``cake::moe_gemm2``: the grouped GEMM.
finalize  ``cake::moe_finalize``: the weighted combine into token order, float32, fixed order.
========  ===========================================================================================

Weight families: ``bf16`` and ``fp8`` (per tensor); ``nvfp4``, ``nvfp4_bf16tok`` and ``mxfp8`` plug
into the same :class:`Plan` / :class:`StepFunWeights` shape later (their scales ride in the view,
their quantized activations in :class:`QuantizedActivations`). Asking for a family this build does
not run raises ``NotImplementedError`` naming it.

fp8: e4m3 weights with one float32 scale per expert (``w1_scale``, ``w2_scale``) and activations
quantized per tensor, ``q = e4m3(clamp(x / s, -448, 448))``, on Hopper's fp8 tensor cores (QGMMA).
Each GEMM scales expert e's product by ``s * w_scale[e]`` in its epilogue, before the clamp (the
limit is in physical units) and rounds it to bf16. fc1 quantizes bf16 hidden states first, or at
decode sizes as GEMM1 stages their rows (one launch fewer); requant quantizes fc1's bf16 output
for fc2, or at decode sizes fc2 does as it stages it.
The activation scales are static when the view carries them (``fc1_input_scale``,
``fc2_input_scale``, e.g. from calibration) and otherwise dynamic, ``max(|x|) / 448`` computed on
the device per call. fc1 also takes hidden states already in e4m3 with their scale.

The weight view (:func:`prepare_weights`, view ``"cake_stepfun"``) holds w1 up/gate interleaved at
32 rows (:func:`cake_ops.fused_moe.interleave_up_gate_sm90`: the same GEMM1 as fused_moe_bf16),
w2, and the per-expert ``gemm1_clamp_limit`` as a float32 tensor.

Prepared launches: :func:`prepare_stepfun_moe` checks the arguments, picks the plan and allocates
the buffer set once; its ``launch()`` runs the out-variant ops (``moe_routing_out``,
``moe_gemm1_swiglu_out``, ``grouped_gemm_fwd_out``, ``moe_finalize_out``) on those buffers: on the
GPU no allocation, no host synchronisation, CUDA-graph capturable, reading the bound inputs'
current contents. :func:`prepare_routing` / :func:`prepare_fc1` / :func:`prepare_requant` /
:func:`prepare_fc2` / :func:`prepare_finalize` bind one stage on caller-owned buffers.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Union

import torch

from . import _C
from . import fused_moe
from ._experimental import warn_experimental
from .fused_moe import default_tile_size, expected_routes, interleave_up_gate_sm90, layer_fits

__all__ = ["FAMILIES", "LAYER_STAGES", "Plan", "QuantizedActivations", "RoutingOutput", "StepFunMoeLaunch", "StepFunStageLaunch",
           "StepFunWeights", "default_plan", "empty_routing_output", "fc1", "fc2", "finalize", "plans_for",
           "prepare_fc1", "prepare_fc2", "prepare_finalize", "prepare_requant", "prepare_routing",
           "prepare_stepfun_moe", "prepare_weights", "requant", "routing", "stepfun_moe"]

_FEATURE = "cake_ops.stepfun_moe"
FAMILIES = ("bf16", "fp8", "nvfp4", "nvfp4_bf16tok", "mxfp8")
RUNNABLE_FAMILIES = ("bf16", "fp8")
STAGES = ("routing", "fc1", "requant", "fc2", "finalize")
# The decode plan: routing, fc1, requant, fc2 and finalize as one unit (torch.ops.cake.
# moe_forward_from_logits_out, or moe_forward_out for precomputed top-k: on CUDA the routing
# kernel and one launch of the layer kernel; the staged ops' numbers).
LAYER_STAGES = ("routing", "layer")


def _fail(fn: str, message: str, error=ValueError):
    raise error(f"cake_ops.stepfun_moe.{fn}: {message}")


def _check_family(fn: str, family: str) -> None:
    if family not in FAMILIES:
        _fail(fn, f"family must be one of {FAMILIES}, got {family!r}")
    if family not in RUNNABLE_FAMILIES:
        _fail(fn, f"the {family!r} weight family is not implemented yet (runs: {RUNNABLE_FAMILIES})",
              NotImplementedError)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The units one forward runs: the family's stages in order (bf16 skips requant) and the row
    tile shared by the routing's tile offsets and the GEMMs (64 or 128)."""
    family: str
    tile_size: int
    stages: tuple

    def __post_init__(self):
        _check_family("Plan", self.family)
        if self.tile_size not in (64, 128):
            _fail("Plan", f"tile_size must be 64 or 128, got {self.tile_size}")
        if self.stages == LAYER_STAGES:
            return
        if not set(self.stages) <= set(STAGES) or "routing" not in self.stages or "fc1" not in self.stages:
            _fail("Plan", f"stages must be {LAYER_STAGES}, or drawn from {STAGES} with routing and fc1, got "
                          f"{self.stages}")


def _stages(family: str, fc2_quantizes: bool = False) -> tuple:
    """bf16 has no requant; fp8's fc2 can quantize fc1's output itself (bit for bit requant)."""
    return tuple(s for s in STAGES if s != "requant" or (family != "bf16" and not fc2_quantizes))


# fc2 quantizing its own input pays at decode: the decode kernel takes the amax of fc1's output in
# each CTA (up to this many elements, cake_ops/_C's kMoeDecodeMaxAmaxElements) while staging it,
# one launch fewer than requant + fc2. Larger: a separate requant.
_FC2_QUANTIZES_MAX_ROWS = 16
_FC2_QUANTIZES_MAX_ELEMENTS = 1 << 15


def plans_for(family: str) -> List[Plan]:
    """Every plan of a family: one per tile size; fp8 also with fc2 quantizing its input; and the
    layer plan (routing, then the rest as one unit: finalized output only)."""
    _check_family("plans_for", family)
    folds = (False, True) if family == "fp8" else (False,)
    return [Plan(family, tile, _stages(family, fold)) for fold in folds for tile in (64, 128)] + [
        Plan(family, 64, LAYER_STAGES)]


# The layer plan by default up to this many tokens (and fused_moe.LAYER_MAX_TOKENS, which benchmarks set
# to 0 for the staged ops): measured at T=1 (benchmarks/NOTES.md, sessions 12-13); fused_moe_bf16 runs the
# layer kernel at T=2 too, which the StepFun shapes (routing in front, E=64 sharing more experts between
# two tokens' routes) have not been measured at.
LAYER_PLAN_MAX_TOKENS = 1


def default_plan(family: str, num_tokens: int, top_k: int, num_local_experts: int, intermediate: int) -> Plan:
    """The family's plan with the tile rule of fused_moe_bf16 (64 below 64 rows per expert); fp8
    at decode sizes folds requant into fc2; a decode token (T=1) runs the layer plan."""
    _check_family("default_plan", family)
    if num_tokens <= min(fused_moe.LAYER_MAX_TOKENS, LAYER_PLAN_MAX_TOKENS):
        return Plan(family, 64, LAYER_STAGES)
    return _staged_plan(family, num_tokens, top_k, num_local_experts, intermediate)


def _staged_plan(family: str, num_tokens: int, top_k: int, num_local_experts: int, intermediate: int) -> Plan:
    rows = num_tokens * top_k
    fold = family == "fp8" and rows <= _FC2_QUANTIZES_MAX_ROWS and rows * intermediate <= _FC2_QUANTIZES_MAX_ELEMENTS
    return Plan(family, default_tile_size(num_tokens, top_k, num_local_experts, intermediate), _stages(family, fold))


@dataclasses.dataclass(frozen=True)
class StepFunWeights:
    """The ``cake_stepfun`` weight view: w1 ``[E_local, 2I, H]`` up/gate interleaved at 32 rows,
    w2 ``[E_local, H, I]``, gemm1_clamp_limit float32 ``[E_local]``, for experts
    ``[local_expert_offset, local_expert_offset + E_local)`` of ``num_experts``. fp8: w1 and w2 in
    e4m3 with their per-expert float32 scales, and the static activation scales (float32 ``[1]``)
    or None for dynamic ones."""
    family: str
    w1: torch.Tensor
    w2: torch.Tensor
    gemm1_clamp_limit: torch.Tensor
    num_experts: int
    local_expert_offset: int = 0
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    fc1_input_scale: Optional[torch.Tensor] = None
    fc2_input_scale: Optional[torch.Tensor] = None
    view: str = "cake_stepfun"

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2


@dataclasses.dataclass
class QuantizedActivations:
    """fc2's input in a quantized family: the values and their scale (fp8: e4m3 ``[rows, I]`` and
    one float32 scale)."""
    values: torch.Tensor
    scale: torch.Tensor


def _scale_tensor(fn: str, name: str, value, device) -> Optional[torch.Tensor]:
    if value is None:
        return None
    scale = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    if scale.numel() != 1 or not bool(scale.isfinite().all()) or not bool((scale > 0).all()):
        _fail(fn, f"{name} must be one positive finite number, got {value!r}")
    return scale.contiguous()


def _quantize_per_expert(w: torch.Tensor):
    """e4m3 weights with one scale per expert, max(|w[e]|) / 448."""
    amax = w.detach().float().abs().amax(dim=(1, 2)).clamp_min(1e-12)
    scale = amax / torch.full_like(amax, 448.0)  # a tensor divisor: CUDA divides by a scalar via its reciprocal
    return (w.float() / scale.view(-1, 1, 1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _fp8_weights(fn: str, w1_gate_up, w2, w1_scale, w2_scale):
    """The fp8 family's weights and scales: quantized here from a wider dtype, or e4m3 as given."""
    e_local = w1_gate_up.shape[0]
    if w1_gate_up.dtype == torch.float8_e4m3fn and w2.dtype == torch.float8_e4m3fn:
        for name, scale in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if scale is None or scale.dtype != torch.float32 or list(scale.shape) != [e_local] or \
                    scale.device != w1_gate_up.device:
                _fail(fn, f"e4m3 weights need {name} as float32 [E_local={e_local}] on {w1_gate_up.device}, got "
                          f"{None if scale is None else (scale.dtype, list(scale.shape), str(scale.device))}")
        return w1_gate_up, w2, w1_scale.contiguous(), w2_scale.contiguous()
    if w1_gate_up.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w2.dtype != w1_gate_up.dtype:
        _fail(fn, f"the fp8 family takes float8_e4m3fn weights with their scales, or bfloat16 / float16 / float32 "
                  f"weights to quantize, one dtype for both, got {w1_gate_up.dtype} and {w2.dtype}")
    if w1_scale is not None or w2_scale is not None:
        _fail(fn, "w1_scale and w2_scale go with float8_e4m3fn weights; wider weights are quantized here")
    w1_q, w1_s = _quantize_per_expert(w1_gate_up)
    w2_q, w2_s = _quantize_per_expert(w2)
    return w1_q, w2_q, w1_s, w2_s


def prepare_weights(w1_gate_up: torch.Tensor, w2: torch.Tensor,
                    gemm1_clamp_limit: Union[float, Sequence[float], torch.Tensor], *, family: str = "bf16",
                    num_experts: Optional[int] = None, local_expert_offset: int = 0,
                    w1_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                    fc1_input_scale=None, fc2_input_scale=None) -> StepFunWeights:
    """Gate-first ``w1_gate_up [E_local, 2I, H]`` (``[gate; up]``) and ``w2 [E_local, H, I]`` ->
    the ``cake_stepfun`` view. ``gemm1_clamp_limit``: one limit for every expert, or one per
    local expert (physical units). Needs H % 64 == 0 and I % 32 == 0.

    fp8: e4m3 weights with ``w1_scale`` / ``w2_scale`` (float32 ``[E_local]``), or wider weights
    that are quantized here (one scale per expert, ``max(|w[e]|) / 448``); ``fc1_input_scale`` and
    ``fc2_input_scale``: static per-tensor activation scales (None: dynamic, per call)."""
    fn = "prepare_weights"
    _check_family(fn, family)
    if w1_gate_up.dim() != 3 or w2.dim() != 3:
        _fail(fn, f"w1_gate_up must be [E_local, 2I, H] and w2 [E_local, H, I], got {list(w1_gate_up.shape)} "
                  f"and {list(w2.shape)}")
    e_local, two_i, hidden = w1_gate_up.shape
    if list(w2.shape) != [e_local, hidden, two_i // 2]:
        _fail(fn, f"w2 must be [E_local, H, I] = {[e_local, hidden, two_i // 2]}, got {list(w2.shape)}")
    if hidden % 64 != 0 or two_i % 64 != 0:
        _fail(fn, f"needs hidden % 64 == 0 and I % 32 == 0, got hidden={hidden}, I={two_i // 2}")
    if family == "bf16" and (w1_gate_up.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16):
        _fail(fn, f"the bf16 family takes bfloat16 weights, got {w1_gate_up.dtype} and {w2.dtype}")
    if family == "bf16" and any(s is not None for s in (w1_scale, w2_scale, fc1_input_scale, fc2_input_scale)):
        _fail(fn, "the bf16 family takes no scales")
    try:
        limit = torch.as_tensor(gemm1_clamp_limit, dtype=torch.float32, device=w1_gate_up.device)
    except (TypeError, ValueError, RuntimeError):
        _fail(fn, f"gemm1_clamp_limit must be a number, a sequence of numbers or a tensor, got "
                  f"{type(gemm1_clamp_limit).__name__}", TypeError)
    limit = limit.expand(e_local).contiguous() if limit.dim() == 0 else limit.contiguous()
    if list(limit.shape) != [e_local]:
        _fail(fn, f"gemm1_clamp_limit must be a number or [E_local={e_local}] limits, got shape {list(limit.shape)}")
    if not bool((limit > 0).all()):
        _fail(fn, "gemm1_clamp_limit must be positive")
    num_experts = e_local if num_experts is None else num_experts
    if not 0 <= local_expert_offset <= num_experts - e_local:
        _fail(fn, f"the shard [{local_expert_offset}, {local_expert_offset + e_local}) must lie within "
                  f"[0, num_experts={num_experts})")
    if family == "bf16":
        return StepFunWeights(family, interleave_up_gate_sm90(w1_gate_up), w2.contiguous(), limit, num_experts,
                              local_expert_offset)
    w1_q, w2_q, w1_s, w2_s = _fp8_weights(fn, w1_gate_up, w2, w1_scale, w2_scale)
    device = w1_gate_up.device
    return StepFunWeights(family, interleave_up_gate_sm90(w1_q), w2_q.contiguous(), limit, num_experts,
                          local_expert_offset, w1_s, w2_s, _scale_tensor(fn, "fc1_input_scale", fc1_input_scale, device),
                          _scale_tensor(fn, "fc2_input_scale", fc2_input_scale, device))


def _plan(fn: str, plan: Optional[Plan], weights: StepFunWeights, hidden_states: torch.Tensor, top_k: int,
          do_finalize: bool, prepared: bool = False) -> Plan:
    """The given plan, checked against the weights' family and the call, or the family's default
    plan (the staged one where the layer plan cannot run: do_finalize=False, e4m3 hidden states,
    and on CUDA shapes the layer kernel does not take)."""
    num_tokens = hidden_states.shape[0]
    args = (weights.family, num_tokens, top_k, weights.num_local_experts, weights.intermediate)
    # Why the layer unit cannot run here, if it cannot; a one-shot call may still run its four-op
    # composition for shapes the kernel does not take (a prepared launch may not: it allocates).
    layer_why, composition_runs = None, False
    if not do_finalize:
        layer_why = "do_finalize=False (the layer unit returns the finalized output only)"
    elif hidden_states.dtype == torch.float8_e4m3fn:
        layer_why = "float8_e4m3fn hidden states (the layer unit quantizes bfloat16 ones itself)"
    elif hidden_states.is_cuda and not layer_fits(num_tokens * top_k, weights.hidden, weights.intermediate,
                                                  weights.w1.element_size()):
        layer_why = "these shapes (not the layer kernel's: cake_ops.fused_moe.layer_fits)"
        composition_runs = not prepared
    if plan is None:
        plan = default_plan(*args)
        if plan.stages == LAYER_STAGES and layer_why is not None:
            plan = _staged_plan(*args)
    if plan.family != weights.family:
        _fail(fn, f"the plan is for the {plan.family!r} family, the weights are {weights.family!r}")
    if plan.stages == LAYER_STAGES and layer_why is not None and not composition_runs:
        _fail(fn, f"the layer plan cannot run with {layer_why}; pass a staged plan (plans_for)")
    return plan


def _check_layer_routing(fn: str, router_logits, topk_ids, topk_weights, top_k: int, weights: StepFunWeights) -> None:
    """What the layer ops cannot see: they take E from the logits and top_k from the ids' width."""
    _check_routing_inputs(fn, router_logits, topk_ids, topk_weights)
    if router_logits is not None and (topk_ids is not None or topk_weights is not None):
        _fail(fn, "give either router_logits (FromLogits) or topk_ids and topk_weights (UnpackedPrecomputed), "
                  "not both")
    if router_logits is not None and (router_logits.dim() != 2 or router_logits.shape[1] != weights.num_experts):
        _fail(fn, f"router_logits must be [num_tokens, num_experts={weights.num_experts}], got "
                  f"{list(router_logits.shape)}")
    if router_logits is None and (topk_ids.dim() != 2 or topk_ids.shape[1] != top_k or
                                  topk_weights.shape != topk_ids.shape):
        _fail(fn, f"topk_ids and topk_weights must be [num_tokens, top_k={top_k}], got {list(topk_ids.shape)} "
                  f"and {list(topk_weights.shape)}")


def _routing_outputs(hidden_states: torch.Tensor, top_k: int, router_logits: Optional[torch.Tensor]):
    """The layer unit's routing ids and weights [T, top_k] when it routes from logits, else None."""
    if router_logits is None:
        return None, None
    ids = hidden_states.new_empty((hidden_states.shape[0], top_k), dtype=torch.int32)
    return ids, ids.new_empty(ids.shape, dtype=torch.float32)


def _layer(hidden_states: torch.Tensor, weights: StepFunWeights, router_logits: Optional[torch.Tensor],
           topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], routed_ids: Optional[torch.Tensor],
           routed_weights: Optional[torch.Tensor], out: torch.Tensor, workspace: torch.Tensor,
           enable_pdl: bool) -> None:
    """The layer unit into out: from logits, routing -> fc1 -> requant -> fc2 -> finalize in one op
    (moe_forward_from_logits_out; the routing's ids and weights into routed_ids / routed_weights);
    precomputed top-k ids and weights go to moe_forward_out as they are (no routing launch)."""
    fp8 = weights.family == "fp8"
    quantization = (weights.gemm1_clamp_limit, weights.fc1_input_scale if fp8 else None, weights.w1_scale,
                    weights.fc2_input_scale if fp8 else None, weights.w2_scale)
    if router_logits is not None:
        torch.ops.cake.moe_forward_from_logits_out(hidden_states, router_logits, weights.w1, weights.w2,
                                                   weights.local_expert_offset, routed_ids, routed_weights, out,
                                                   workspace, enable_pdl, *quantization)
    else:
        torch.ops.cake.moe_forward_out(hidden_states, topk_ids, topk_weights, weights.w1, weights.w2,
                                       weights.local_expert_offset, out, workspace, enable_pdl, *quantization,
                                       expected_routes(topk_ids.numel(), weights.num_local_experts,
                                                       weights.num_experts))


def _check_weights(fn: str, weights) -> StepFunWeights:
    if not isinstance(weights, StepFunWeights) or weights.view != "cake_stepfun":
        _fail(fn, f"weights must be the cake_stepfun view from prepare_weights, got {type(weights).__name__}",
              TypeError)
    _check_family(fn, weights.family)
    return weights


@dataclasses.dataclass
class RoutingOutput:
    """What routing produces, on the device: ``expert_ids``/``expert_weights`` ``[T, top_k]`` and the
    sort of the routes by local expert (rows past the kept ones: -1)."""
    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    permuted_idx_to_expanded_idx: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    expert_tile_offsets: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]


def _check_routing_inputs(fn: str, router_logits, topk_ids, topk_weights) -> torch.Tensor:
    """The tensor the routing op dispatches on; said here because the op cannot dispatch without one."""
    if router_logits is None and (topk_ids is None or topk_weights is None):
        _fail(fn, "give router_logits (FromLogits) or both topk_ids and topk_weights (UnpackedPrecomputed)")
    return router_logits if router_logits is not None else topk_ids


def _check_routing_rows(fn: str, hidden_states: torch.Tensor, router_logits, topk_ids, topk_weights) -> None:
    """A routing input row per token of hidden_states (the ops would only see mismatched internal sizes)."""
    for name, t in (("router_logits", router_logits), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t is not None and (t.dim() != 2 or t.shape[0] != hidden_states.shape[0]):
            _fail(fn, f"{name} must have a row per token of hidden_states ({hidden_states.shape[0]}), got shape "
                      f"{list(t.shape)}")


def _check_routed_tokens(fn: str, hidden_states: torch.Tensor, routed: "RoutingOutput") -> None:
    if routed.expert_ids.shape[0] != hidden_states.shape[0]:
        _fail(fn, f"routed is the routing of {routed.expert_ids.shape[0]} tokens, hidden_states has "
                  f"{hidden_states.shape[0]}")


def routing(router_logits: Optional[torch.Tensor] = None, *, topk_ids: Optional[torch.Tensor] = None,
            topk_weights: Optional[torch.Tensor] = None, top_k: int, num_experts: int,
            num_local_experts: Optional[int] = None, local_expert_offset: int = 0, tile_size: int = 128) -> RoutingOutput:
    """Renormalize routing from ``router_logits [T, E]`` (RoutingInputMode.FromLogits) or from
    ``topk_ids [T, k]`` int32 and ``topk_weights [T, k]`` float32 (UnpackedPrecomputed)."""
    warn_experimental(_FEATURE)
    _check_routing_inputs("routing", router_logits, topk_ids, topk_weights)
    num_local = num_experts if num_local_experts is None else num_local_experts
    return RoutingOutput(*torch.ops.cake.moe_routing(router_logits, topk_ids, topk_weights, top_k, num_experts,
                                                      num_local, local_expert_offset, tile_size))


def _check_hidden_states(fn: str, hidden_states: torch.Tensor, weights: StepFunWeights, hidden_states_scale) -> None:
    if hidden_states.dim() != 2 or hidden_states.shape[1] != weights.hidden:
        _fail(fn, f"hidden_states must be [num_tokens, hidden={weights.hidden}], got {list(hidden_states.shape)}")
    if weights.family == "bf16" and hidden_states.dtype != torch.bfloat16:
        _fail(fn, f"the bf16 family takes bfloat16 hidden_states, got {hidden_states.dtype}")
    if weights.family == "fp8":
        if hidden_states.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            _fail(fn, f"the fp8 family takes bfloat16 hidden_states, or float8_e4m3fn ones with hidden_states_scale, "
                      f"got {hidden_states.dtype}")
        if (hidden_states.dtype == torch.float8_e4m3fn) != (hidden_states_scale is not None):
            _fail(fn, "hidden_states_scale goes with float8_e4m3fn hidden_states (and only with them)")
    elif hidden_states_scale is not None:
        _fail(fn, f"the {weights.family} family takes no hidden_states_scale")


def _expected_routes(routed: RoutingOutput, weights: StepFunWeights) -> int:
    """The MoE GEMMs' tile hint for the weights' shard (fused_moe.expected_routes)."""
    return expected_routes(routed.expert_ids.numel(), weights.num_local_experts, weights.num_experts)


def fc1(hidden_states: torch.Tensor, weights: StepFunWeights, routed: RoutingOutput, enable_pdl: bool = True,
        hidden_states_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GEMM1 with the SwiGLUStep epilogue -> ``[T * top_k, I]`` in permuted row order (bf16 for
    fp8). fp8: bf16 hidden states are quantized per tensor on their way into GEMM1 (the view's
    ``fc1_input_scale``, else a dynamic scale); e4m3 ones come with ``hidden_states_scale``."""
    warn_experimental(_FEATURE)
    weights = _check_weights("fc1", weights)
    _check_hidden_states("fc1", hidden_states, weights, hidden_states_scale)
    _check_routed_tokens("fc1", hidden_states, routed)
    x, x_scale = hidden_states, _fc1_input_scale(hidden_states, weights, hidden_states_scale)
    if _fc1_quantizes_first(hidden_states, weights):
        x, x_scale = torch.ops.cake.quantize_fp8(hidden_states, weights.fc1_input_scale)
    return torch.ops.cake.moe_gemm1_swiglu(x, weights.w1, routed.permuted_idx_to_expanded_idx,
                                           routed.expert_offsets, routed.top_k, enable_pdl,
                                           weights.gemm1_clamp_limit, -1, x_scale, weights.w1_scale,
                                           _expected_routes(routed, weights),
                                           expanded_to_permuted=routed.expanded_idx_to_permuted_idx)


# GEMM1 quantizing bf16 hidden states itself pays at decode only: the decode kernel takes their
# amax in every CTA before streaming (H200, H=4096: T=8 fp8 GEMM1 182 us against 122 us for the e4m3
# GEMM1 after a quantize launch), and the grouped GEMM's quantizing gather was 1-3% slower than
# quantize + GEMM1 at T >= 512 (benchmarks/NOTES.md).
_FC1_QUANTIZES_MAX_ELEMENTS = 1 << 13


def _fc1_quantizes_first(hidden_states: torch.Tensor, weights: StepFunWeights) -> bool:
    """fp8 with bf16 hidden states too many for GEMM1 to quantize them as it stages them."""
    return (weights.family == "fp8" and hidden_states.dtype != torch.float8_e4m3fn
            and hidden_states.numel() > _FC1_QUANTIZES_MAX_ELEMENTS)


def _fc1_input_scale(hidden_states: torch.Tensor, weights: StepFunWeights, hidden_states_scale):
    """moe_gemm1_swiglu's x_scale: e4m3 hidden states' own; for bf16 ones with fp8 weights, which
    GEMM1 quantizes on the way in, the static fc1_input_scale (None: dynamic)."""
    if weights.family == "fp8" and hidden_states.dtype != torch.float8_e4m3fn:
        return weights.fc1_input_scale
    return hidden_states_scale


def requant(fc1_output: torch.Tensor, weights: StepFunWeights) -> Union[torch.Tensor, QuantizedActivations]:
    """The family's requantization of fc1's output: fp8, per-tensor e4m3 with the view's
    ``fc2_input_scale`` (else a dynamic scale); none for bf16 (returns its input)."""
    warn_experimental(_FEATURE)
    weights = _check_weights("requant", weights)
    if weights.family == "bf16":
        return fc1_output
    return QuantizedActivations(*torch.ops.cake.quantize_fp8(fc1_output, weights.fc2_input_scale))


def _fc2_operands(fn: str, activations, weights: StepFunWeights):
    """fc2's activations and scale for moe_gemm2: requant's output for quantized families, or fp8's
    bf16 fc1 output, which moe_gemm2 quantizes as requant would (``fc2_input_scale`` or dynamic)."""
    if weights.family == "bf16":
        if not isinstance(activations, torch.Tensor):
            _fail(fn, f"the bf16 family's fc2 takes fc1's output tensor, got {type(activations).__name__}", TypeError)
        return activations, None
    if isinstance(activations, torch.Tensor) and activations.dtype == torch.bfloat16:
        return activations, weights.fc2_input_scale
    if not isinstance(activations, QuantizedActivations):
        got = f"{activations.dtype} Tensor" if isinstance(activations, torch.Tensor) else type(activations).__name__
        _fail(fn, f"the {weights.family} family's fc2 takes requant's QuantizedActivations or fc1's bfloat16 "
                  f"output, got {got}", TypeError)
    return activations.values, activations.scale


def fc2(activations: Union[torch.Tensor, QuantizedActivations], weights: StepFunWeights, routed: RoutingOutput,
        enable_pdl: bool = True) -> torch.Tensor:
    """GEMM2 -> ``[T * top_k, H]`` unscaled, permuted row order (bf16 for fp8); rows past the
    kept routes are unspecified."""
    warn_experimental(_FEATURE)
    weights = _check_weights("fc2", weights)
    values, scale = _fc2_operands("fc2", activations, weights)
    return torch.ops.cake.moe_gemm2(values, weights.w2, routed.expert_offsets, enable_pdl, -1, scale,
                                    weights.w2_scale, _expected_routes(routed, weights))


def finalize(gemm2_output: torch.Tensor, expert_weights: torch.Tensor, expanded_idx_to_permuted_idx: torch.Tensor,
             enable_pdl: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_j expert_weights[t, j] * gemm2_output[p(t, j)]`` in float32, fixed order."""
    warn_experimental(_FEATURE)
    if out is not None:
        torch.ops.cake.moe_finalize_out(gemm2_output, expanded_idx_to_permuted_idx, expert_weights, out, enable_pdl)
        return out
    return torch.ops.cake.moe_finalize(gemm2_output, expanded_idx_to_permuted_idx, expert_weights, enable_pdl)


def stepfun_moe(hidden_states: torch.Tensor, weights: StepFunWeights, router_logits: Optional[torch.Tensor] = None,
                *, topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                top_k: int, plan: Optional[Plan] = None, do_finalize: bool = True, enable_pdl: bool = True,
                hidden_states_scale: Optional[torch.Tensor] = None) -> Union[torch.Tensor, List[torch.Tensor]]:
    """The whole forward: routing -> fc1 -> requant -> fc2 -> finalize.

    Returns ``output [T, H]`` (bf16); with ``do_finalize=False`` ``[gemm2_output, expert_weights,
    expanded_idx_to_permuted_idx]`` for the caller's own combine. fp8 takes bf16 hidden states, or
    e4m3 ones with ``hidden_states_scale``."""
    warn_experimental(_FEATURE)
    weights = _check_weights("stepfun_moe", weights)
    _check_hidden_states("stepfun_moe", hidden_states, weights, hidden_states_scale)
    _check_routing_rows("stepfun_moe", hidden_states, router_logits, topk_ids, topk_weights)
    plan = _plan("stepfun_moe", plan, weights, hidden_states, top_k, do_finalize)
    if plan.stages == LAYER_STAGES:
        _check_layer_routing("stepfun_moe", router_logits, topk_ids, topk_weights, top_k, weights)
        out = hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)
        _layer(hidden_states.contiguous(), weights, router_logits, topk_ids, topk_weights,
               *_routing_outputs(hidden_states, top_k, router_logits), out, _bytes(0, hidden_states.device),
               enable_pdl)
        return out
    routed = routing(router_logits, topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                     num_experts=weights.num_experts, num_local_experts=weights.num_local_experts,
                     local_expert_offset=weights.local_expert_offset, tile_size=plan.tile_size)
    act = fc1(hidden_states.contiguous(), weights, routed, enable_pdl, hidden_states_scale)
    if "requant" in plan.stages:
        act = requant(act, weights)
    rows = fc2(act, weights, routed, enable_pdl)
    if not do_finalize:
        return [rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx]
    return finalize(rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx, enable_pdl)


# ---------------------------------------------------------------------------------------------
# Prepared launches: arguments checked and buffers bound once; launch() runs the stage's kernels
# into the bound buffers (on the GPU: no allocation, no host synchronisation, CUDA-graph
# capturable) and reads whatever the bound inputs hold at that moment.


class StepFunStageLaunch:
    """One stage bound to its inputs and caller-owned outputs. ``launch()`` returns
    :meth:`outputs`."""

    def __init__(self, name: str, run, outputs: list):
        self.name, self._run, self._outputs = name, run, outputs

    def launch(self) -> list:
        self._run()
        return self._outputs

    __call__ = launch

    def outputs(self) -> list:
        return list(self._outputs)


def _bound(name: str, run, outputs: list) -> StepFunStageLaunch:
    """A stage launch, launched once here: the first run checks every argument (and warms up)."""
    stage = StepFunStageLaunch(name, run, outputs)
    stage.launch()
    return stage


def empty_routing_output(num_tokens: int, top_k: int, num_local_experts: int, device) -> RoutingOutput:
    """Buffers for :func:`prepare_routing`."""
    ints = dict(dtype=torch.int32, device=device)
    return RoutingOutput(torch.empty(num_tokens, top_k, **ints), torch.empty(num_tokens, top_k, dtype=torch.float32,
                                                                             device=device),
                         torch.empty(num_local_experts, **ints), torch.empty(num_local_experts + 1, **ints),
                         torch.empty(num_tokens * top_k, **ints), torch.empty(num_tokens * top_k, **ints),
                         torch.empty(num_local_experts + 1, **ints))


def _bytes(n: int, device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


def prepare_routing(router_logits: Optional[torch.Tensor] = None, *, topk_ids: Optional[torch.Tensor] = None,
                    topk_weights: Optional[torch.Tensor] = None, top_k: int, num_experts: int,
                    num_local_experts: Optional[int] = None, local_expert_offset: int = 0, tile_size: int = 128,
                    out: Optional[RoutingOutput] = None, workspace: Optional[torch.Tensor] = None) -> StepFunStageLaunch:
    """Routing into ``out`` (a :class:`RoutingOutput` of caller-owned buffers, default: allocated
    here) with a uint8 ``workspace`` of ``_C.moe_routing_workspace_size(T * top_k, E_local)`` bytes."""
    warn_experimental(_FEATURE)
    like = _check_routing_inputs("prepare_routing", router_logits, topk_ids, topk_weights)
    num_local = num_experts if num_local_experts is None else num_local_experts
    out = out or empty_routing_output(like.shape[0], top_k, num_local, like.device)
    if workspace is None:
        workspace = _bytes(_C.moe_routing_workspace_size(like.shape[0] * top_k, num_local), like.device)
    buffers = [getattr(out, f.name) for f in dataclasses.fields(out)]  # (astuple would copy them)

    def run():
        torch.ops.cake.moe_routing_out(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local,
                                       local_expert_offset, tile_size, *buffers, workspace)
    return _bound("routing", run, [out])


def _empty_fp8(like: torch.Tensor, rows: int, cols: int) -> QuantizedActivations:
    return QuantizedActivations(like.new_empty((rows, cols), dtype=torch.float8_e4m3fn),
                                like.new_empty(1, dtype=torch.float32))


def prepare_fc1(hidden_states: torch.Tensor, weights: StepFunWeights, routed: RoutingOutput,
                out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                enable_pdl: bool = True, hidden_states_scale: Optional[torch.Tensor] = None) -> StepFunStageLaunch:
    """fc1 into ``out [T * top_k, I]`` (bf16) with a uint8 ``workspace`` of
    ``_C.moe_gemm1_workspace_size(T * top_k, H, I, E_local, element_size)`` bytes (element_size of
    the weights: 1 for fp8, whose GEMM1 gathers e4m3 rows, quantized by it at decode sizes or
    first into a bound e4m3 copy)."""
    warn_experimental(_FEATURE)
    weights = _check_weights("prepare_fc1", weights)
    _check_hidden_states("prepare_fc1", hidden_states, weights, hidden_states_scale)
    _check_routed_tokens("prepare_fc1", hidden_states, routed)
    rows, hint = routed.expert_ids.numel(), _expected_routes(routed, weights)
    x = QuantizedActivations(hidden_states, _fc1_input_scale(hidden_states, weights, hidden_states_scale))
    quantize_first = _fc1_quantizes_first(hidden_states, weights)
    if quantize_first:
        x = _empty_fp8(hidden_states, *hidden_states.shape)
    out = out if out is not None else hidden_states.new_empty((rows, weights.intermediate), dtype=torch.bfloat16)
    if workspace is None:
        workspace = _bytes(_C.moe_gemm1_workspace_size(rows, weights.hidden, weights.intermediate,
                                                       weights.num_local_experts, weights.w1.element_size()),
                           hidden_states.device)

    def run():
        if quantize_first:
            torch.ops.cake.quantize_fp8_out(hidden_states, weights.fc1_input_scale, x.values, x.scale)
        torch.ops.cake.moe_gemm1_swiglu_out(x.values, weights.w1, routed.permuted_idx_to_expanded_idx,
                                            routed.expert_offsets, routed.top_k, out, workspace, enable_pdl,
                                            weights.gemm1_clamp_limit, -1, x.scale, weights.w1_scale, hint,
                                            expanded_to_permuted=routed.expanded_idx_to_permuted_idx)
    return _bound("fc1", run, [out])


def prepare_requant(fc1_output: torch.Tensor, weights: StepFunWeights,
                    out: Optional[QuantizedActivations] = None) -> StepFunStageLaunch:
    """The family's requantization into ``out`` (fp8: e4m3 ``[T * top_k, I]`` and a float32 ``[1]``
    scale); bf16 has none: ``launch()`` returns ``[fc1_output]``."""
    warn_experimental(_FEATURE)
    weights = _check_weights("prepare_requant", weights)
    if weights.family == "bf16":
        return StepFunStageLaunch("requant", lambda: None, [fc1_output])
    out = out if out is not None else _empty_fp8(fc1_output, *fc1_output.shape)

    def run():
        torch.ops.cake.quantize_fp8_out(fc1_output, weights.fc2_input_scale, out.values, out.scale)
    return _bound("requant", run, [out])


def prepare_fc2(activations: Union[torch.Tensor, QuantizedActivations], weights: StepFunWeights,
                routed: RoutingOutput, out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                enable_pdl: bool = True) -> StepFunStageLaunch:
    """fc2 into ``out [T * top_k, H]`` (bf16) with a uint8 ``workspace`` of
    ``_C.grouped_gemm_workspace_size(E_local)`` bytes."""
    warn_experimental(_FEATURE)
    weights = _check_weights("prepare_fc2", weights)
    values, scale = _fc2_operands("prepare_fc2", activations, weights)
    hint = _expected_routes(routed, weights)
    out = out if out is not None else values.new_empty((values.shape[0], weights.hidden), dtype=torch.bfloat16)
    if workspace is None:
        workspace = _bytes(_C.grouped_gemm_workspace_size(weights.num_local_experts), values.device)

    def run():
        torch.ops.cake.moe_gemm2_out(values, weights.w2, routed.expert_offsets, out, workspace, enable_pdl, -1, scale,
                                     weights.w2_scale, hint)
    return _bound("fc2", run, [out])


def prepare_finalize(gemm2_output: torch.Tensor, expert_weights: torch.Tensor,
                     expanded_idx_to_permuted_idx: torch.Tensor, out: Optional[torch.Tensor] = None,
                     enable_pdl: bool = True) -> StepFunStageLaunch:
    """finalize into ``out [T, H]``."""
    warn_experimental(_FEATURE)
    out = out if out is not None else gemm2_output.new_empty(expert_weights.shape[0], gemm2_output.shape[1])

    def run():
        torch.ops.cake.moe_finalize_out(gemm2_output, expanded_idx_to_permuted_idx, expert_weights, out, enable_pdl)
    return _bound("finalize", run, [out])


class StepFunMoeLaunch:
    """The whole forward on buffers allocated once by :func:`prepare_stepfun_moe`."""

    def __init__(self, stages: List[StepFunStageLaunch], outputs: list):
        self.stages, self._outputs = stages, outputs

    def launch(self) -> Union[torch.Tensor, List[torch.Tensor]]:
        for stage in self.stages:
            stage.launch()
        return self._outputs[0] if len(self._outputs) == 1 else list(self._outputs)

    __call__ = launch

    def outputs(self) -> List[torch.Tensor]:
        """``[output]``, or with ``do_finalize=False`` ``[gemm2_output, expert_weights,
        expanded_idx_to_permuted_idx]``."""
        return list(self._outputs)


def prepare_stepfun_moe(hidden_states: torch.Tensor, weights: StepFunWeights,
                        router_logits: Optional[torch.Tensor] = None, *, topk_ids: Optional[torch.Tensor] = None,
                        topk_weights: Optional[torch.Tensor] = None, top_k: int, plan: Optional[Plan] = None,
                        do_finalize: bool = True, enable_pdl: bool = True,
                        hidden_states_scale: Optional[torch.Tensor] = None) -> StepFunMoeLaunch:
    """Check the arguments, pick the plan, allocate the buffer set once and bind it: the returned
    launch reads the current contents of ``hidden_states`` and the routing inputs on every
    ``launch()``."""
    warn_experimental(_FEATURE)
    weights = _check_weights("prepare_stepfun_moe", weights)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != weights.hidden or not hidden_states.is_contiguous():
        _fail("prepare_stepfun_moe", f"hidden_states must be a contiguous [num_tokens, hidden={weights.hidden}] "
                                     f"tensor, got {list(hidden_states.shape)}")
    _check_routing_rows("prepare_stepfun_moe", hidden_states, router_logits, topk_ids, topk_weights)
    plan = _plan("prepare_stepfun_moe", plan, weights, hidden_states, top_k, do_finalize, prepared=True)
    if plan.stages == LAYER_STAGES:  # one unit, the routing included
        _check_hidden_states("prepare_stepfun_moe", hidden_states, weights, hidden_states_scale)
        _check_layer_routing("prepare_stepfun_moe", router_logits, topk_ids, topk_weights, top_k, weights)
        out = hidden_states.new_empty(hidden_states.shape, dtype=torch.bfloat16)
        routed_ids, routed_weights = _routing_outputs(hidden_states, top_k, router_logits)
        workspace = _bytes(_C.moe_forward_workspace_size(hidden_states.shape[0] * top_k, weights.hidden,
                                                         weights.intermediate), hidden_states.device)
        layer = _bound("layer", lambda: _layer(hidden_states, weights, router_logits, topk_ids, topk_weights,
                                               routed_ids, routed_weights, out, workspace, enable_pdl), [out])
        return StepFunMoeLaunch([layer], [out])
    routing_stage = prepare_routing(router_logits, topk_ids=topk_ids, topk_weights=topk_weights, top_k=top_k,
                                    num_experts=weights.num_experts, num_local_experts=weights.num_local_experts,
                                    local_expert_offset=weights.local_expert_offset, tile_size=plan.tile_size)
    routed = routing_stage.outputs()[0]
    stages = [routing_stage, prepare_fc1(hidden_states, weights, routed, enable_pdl=enable_pdl,
                                         hidden_states_scale=hidden_states_scale)]
    if "requant" in plan.stages:
        stages.append(prepare_requant(stages[-1].outputs()[0], weights))
    stages.append(prepare_fc2(stages[-1].outputs()[0], weights, routed, enable_pdl=enable_pdl))
    rows = stages[-1].outputs()[0]
    if not do_finalize:
        return StepFunMoeLaunch(stages, [rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx])
    stages.append(prepare_finalize(rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx,
                                   enable_pdl=enable_pdl))
    return StepFunMoeLaunch(stages, stages[-1].outputs())
