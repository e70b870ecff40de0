"""The unified MoE API: a config names the activation and the backend; the backend prepares the
weight view it runs on.

    config = MoEConfig(num_experts=64, top_k=8, hidden_size=4096, intermediate_size=1536,
                       activation=SwiGLUStep(limit=7.0),
                       backend=CakeStepFunConfig(backend="cake_stepfun"))
    weights = config.prepare_weights(w1_gate_up, w2)            # per-expert limits optional
    out = moe_forward(config, weights, hidden_states, router_logits)

The ``cake_stepfun`` backend (:mod:`cake_ops.stepfun_moe`) is experimental: naming it is the
opt-in, and the first forward warns once (``cake_ops.ExperimentalWarning``). It runs the full
path only: ``CAKE_STEPFUN_FULL_PATH`` may be unset, ``auto`` or ``1``; ``0`` (the FC1-only hybrid
of the original backend, since removed) raises ``NotImplementedError``. Fused shared experts and
LoRA deltas are not supported and are rejected when the config is made.
"""
from __future__ import annotations

import dataclasses
import enum
import numbers
import os
from typing import Any, Optional, Sequence, Union

import torch

from . import stepfun_moe as _stepfun
from ._experimental import warn_experimental

__all__ = ["CakeStepFunConfig", "MoEConfig", "RoutingInputMode", "SwiGLUStep", "moe_forward"]

FULL_PATH_ENV = "CAKE_STEPFUN_FULL_PATH"


class RoutingInputMode(enum.Enum):
    """What the forward's routing reads: router logits (Renormalize top-k inside), or top-k expert
    ids and weights computed by the caller (taken as they are)."""
    FromLogits = "from_logits"
    UnpackedPrecomputed = "unpacked_precomputed"


@dataclasses.dataclass(frozen=True)
class SwiGLUStep:
    """``min(silu(gate), limit) * clamp(up, -limit, limit)``; the limit is in physical units (after
    any dequantization scale). The weight view may carry a different limit per expert."""
    limit: float = 7.0

    def __post_init__(self):
        if not isinstance(self.limit, numbers.Real) or not self.limit > 0:
            raise ValueError(f"SwiGLUStep: limit must be a positive number, got {self.limit!r}")


@dataclasses.dataclass(frozen=True)
class CakeStepFunConfig:
    """The cake_stepfun backend and its weight family (``bf16`` or ``fp8`` in this build)."""
    backend: str = "cake_stepfun"
    family: str = "bf16"

    def __post_init__(self):
        if self.backend != "cake_stepfun":
            raise ValueError(f"CakeStepFunConfig: backend must be 'cake_stepfun', got {self.backend!r}")
        if self.family not in _stepfun.FAMILIES:
            raise ValueError(f"CakeStepFunConfig: family must be one of {_stepfun.FAMILIES}, got {self.family!r}")

    def prepare_weights(self, w1_gate_up: torch.Tensor, w2: torch.Tensor,
                        gemm1_clamp_limit: Union[float, Sequence[float], torch.Tensor], *,
                        num_experts: Optional[int] = None, local_expert_offset: int = 0,
                        **scales) -> _stepfun.StepFunWeights:
        """The ``cake_stepfun`` view (see :func:`cake_ops.stepfun_moe.prepare_weights`; ``scales``: the
        fp8 family's ``w1_scale``, ``w2_scale``, ``fc1_input_scale``, ``fc2_input_scale``)."""
        return _stepfun.prepare_weights(w1_gate_up, w2, gemm1_clamp_limit, family=self.family,
                                        num_experts=num_experts, local_expert_offset=local_expert_offset, **scales)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: SwiGLUStep = SwiGLUStep()
    backend: CakeStepFunConfig = CakeStepFunConfig()
    routing_input_mode: RoutingInputMode = RoutingInputMode.FromLogits
    num_local_experts: Optional[int] = None
    local_expert_offset: int = 0
    num_fused_shared_experts: int = 0
    lora: Any = None

    def __post_init__(self):
        def fail(message):
            raise ValueError(f"MoEConfig: {message}")
        if self.num_fused_shared_experts:
            fail(f"the cake_stepfun backend does not support fused shared experts, got "
                 f"num_fused_shared_experts={self.num_fused_shared_experts} (run shared experts separately)")
        if self.lora is not None:
            fail("the cake_stepfun backend does not support LoRA deltas on the experts")
        if not isinstance(self.activation, SwiGLUStep):
            fail(f"the cake_stepfun backend runs SwiGLUStep, got activation {self.activation!r}")
        if not isinstance(self.backend, CakeStepFunConfig):
            fail(f"backend must be a CakeStepFunConfig, got {self.backend!r}")
        if not isinstance(self.routing_input_mode, RoutingInputMode):
            fail(f"routing_input_mode must be a RoutingInputMode, got {self.routing_input_mode!r}")
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or value < 1:
                fail(f"{name} must be a positive int, got {value!r}")
        if not 1 <= self.top_k <= self.num_experts:
            fail(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        local = self.experts_here
        if not (1 <= local and 0 <= self.local_expert_offset <= self.num_experts - local):
            fail(f"the shard [{self.local_expert_offset}, {self.local_expert_offset + local}) must lie within "
                 f"[0, num_experts={self.num_experts})")

    @property
    def experts_here(self) -> int:
        return self.num_experts if self.num_local_experts is None else self.num_local_experts

    def prepare_weights(self, w1_gate_up: torch.Tensor, w2: torch.Tensor,
                        gemm1_clamp_limit: Union[None, float, Sequence[float], torch.Tensor] = None, **scales):
        """The backend's weight view for this config's shard; the clamp limit defaults to the
        activation's (the same for every expert); ``scales`` go to the backend (fp8)."""
        expected = [self.experts_here, 2 * self.intermediate_size, self.hidden_size]
        if list(w1_gate_up.shape) != expected:
            raise ValueError(f"MoEConfig.prepare_weights: w1_gate_up must be {expected}, got {list(w1_gate_up.shape)}")
        limit = self.activation.limit if gemm1_clamp_limit is None else gemm1_clamp_limit
        return self.backend.prepare_weights(w1_gate_up, w2, limit, num_experts=self.num_experts,
                                            local_expert_offset=self.local_expert_offset, **scales)


def _full_path() -> None:
    value = os.environ.get(FULL_PATH_ENV, "auto").strip().lower()
    if value == "0":
        raise NotImplementedError(f"{FULL_PATH_ENV}=0 asked for the FC1-only hybrid path, which the cake_stepfun "
                                  "backend no longer has; unset it or set auto / 1")
    if value not in ("auto", "1"):
        raise ValueError(f"{FULL_PATH_ENV} must be auto, 1 or 0, got {value!r}")


def moe_forward(config: MoEConfig, weights, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor] = None,
                *, topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                do_finalize: bool = True, enable_pdl: bool = True, hidden_states_scale: Optional[torch.Tensor] = None):
    """One MoE forward on ``config``'s backend. ``router_logits [T, E]`` for
    ``RoutingInputMode.FromLogits``; ``topk_ids``/``topk_weights [T, top_k]`` for
    ``UnpackedPrecomputed``. ``weights`` must be the view of ``config.prepare_weights``;
    ``hidden_states_scale`` goes with fp8 (e4m3) hidden states."""
    warn_experimental("the cake_stepfun MoE backend")
    _full_path()
    if not isinstance(weights, _stepfun.StepFunWeights) or weights.view != "cake_stepfun":
        raise TypeError("moe_forward: weights must be the cake_stepfun view from CakeStepFunConfig.prepare_weights, "
                        f"got {type(weights).__name__}")
    if weights.family != config.backend.family or weights.num_experts != config.num_experts:
        raise ValueError(f"moe_forward: the weights ({weights.family}, {weights.num_experts} experts) do not match "
                         f"the config ({config.backend.family}, {config.num_experts} experts)")
    from_logits = config.routing_input_mode is RoutingInputMode.FromLogits
    if from_logits and (router_logits is None or topk_ids is not None or topk_weights is not None):
        raise ValueError("moe_forward: RoutingInputMode.FromLogits takes router_logits only")
    if not from_logits and (router_logits is not None or topk_ids is None or topk_weights is None):
        raise ValueError("moe_forward: RoutingInputMode.UnpackedPrecomputed takes topk_ids and topk_weights only")
    return _stepfun.stepfun_moe(hidden_states, weights, router_logits, topk_ids=topk_ids, topk_weights=topk_weights,
                                top_k=config.top_k, do_finalize=do_finalize, enable_pdl=enable_pdl,
                                hidden_states_scale=hidden_states_scale)
