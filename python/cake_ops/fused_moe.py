"""Fused bf16 MoE forward for Hopper (``../shared/spec/fused_moe_bf16_sm90.txt``).

``fused_moe_bf16`` has the specification's signature, semantics, defaults and shape rules. It is
built from the ``torch.ops.cake`` MoE ops: ``moe_sort`` (counts, offsets, permutation, tiles, on
the device) -> ``moe_gemm1_swiglu`` -> ``moe_gemm2`` -> ``moe_finalize`` (router-scaled combine in
float32, fixed order), or with the fused finalize ``moe_gemm2_finalize_out`` for the last two.
No value leaves the device, so a call never synchronises and can be captured in a CUDA graph or
traced by ``torch.compile(fullgraph=True)``.

On the GPU (SM90) each stage is a CUDA kernel: a stable token sort (one block, or one cooperative
launch of a block per chunk for many routes), a row gather, the grouped GEMM (bf16 or fp16) with the
SwiGLU, the grouped GEMM again and the combine; with
``enable_pdl`` (default) every kernel of the chain launches with Programmatic Dependent Launch,
but for grouped GEMMs of more than 4096 (expected) rows, where it gains nothing and two chained
ones slowed CUDA-graph replays (benchmarks/NOTES.md, session 28).
Decode sizes run both GEMMs in a weight-streaming kernel (gather and SwiGLU inside). Above ~32
rows per expert the grouped GEMM's tiles apply the SwiGLU in GEMM1's epilogue; with
``use_fused_finalize`` (default) GEMM2's tiles add its router-scaled rows into the output with
atomics (one output-dtype rounding per route, not bitwise reproducible), below 32 rows per expert
too where the decode kernel does not run (the 64x256 tile's scatter twin); ``use_fused_finalize=False``,
the decode kernel, the swap-AB tiles and the 64-row tiles past I = 4096 (their atomic epilogue
measured slower there) combine in float32 in a fixed order (``moe_finalize``). On the
128x256 cooperative tiles up to 2I = 2048, GEMM1's mainloop gathers x's rows itself (no gather
kernel); the other tiles read a gathered copy (benchmarks/NOTES.md, sessions 22, 26 and 30: on
Hopper neither cp.async nor a TMA per row feeds the 64-row pingpong tiles). A decode batch
(``LAYER_MAX_TOKENS``: T <= 2, or an expert-parallel shard's expected share of the routes up to
``LAYER_MAX_SHARD_ROUTES``; shapes :func:`layer_fits` takes, no buffer or tile override) runs the
whole layer as one launch (``moe_forward_out``: GEMM1 + SwiGLU, GEMM2 and the fixed-order combine,
with grid barriers; given the shard's expected routes, it spreads a phase with few items over the
idle CTAs).

Tiles: the tile / cluster / raster overrides, checked by the specification's rules, pick the
grouped GEMM configuration of each GEMM (:func:`override_tactic`; a combination this build has no
kernel for is an error that lists the ones it has); without them the grouped GEMM's heuristic
decides, or inside ``cake_ops.autotune()`` the fastest of every tactic, timed per shape bucket of
each GEMM and kept (in memory, and in the context's cache file) for later calls, graphs and
compiled code.
"""
from __future__ import annotations

import re
from typing import Callable, Optional, Tuple

import torch

from . import _C
from ._experimental import warn_experimental
from .autotune import tune_grouped_gemm, tuning_active

__all__ = ["default_tile_size", "expected_routes", "fused_moe_bf16", "interleave_up_gate_sm90", "override_tactic"]

INTERLEAVE_ROWS = 32
# fused_moe_bf16's w1 layouts: up/gate interleaved at 32 rows (the specification's), or [gate; up] halves.
W1_LAYOUTS = ("interleaved", "gate_up")
_NAME = "cake_ops.fused_moe_bf16"


# Tokens up to which a CUDA forward runs as one moe_forward_out launch (the layer kernel), when it
# takes the shapes and no buffer or tile override asks for the staged ops. H200, graph replays against
# the staged ops in one run (benchmarks/NOTES.md, sessions 12, 29 and 33): T=1 -1 to -24%, T=2 -1 to
# -24% (Qwen3-30B 0.047 vs 0.054 ms, Qwen3-235B 0.150 vs 0.153, Mixtral 0.324 vs 0.326, Kimi-K2 EP8
# shard 0.035 vs 0.047; results/ab_layer_phase2_prefetch_h200_s29.txt); from T=4 slower (one item per
# route: routes sharing an expert read it once each). Benchmarks set 0 to time the staged ops on the
# same build.
LAYER_MAX_TOKENS = 2
# An expert-parallel shard runs it too while its expected share of the routes (T * top_k * E_local / E,
# :func:`expected_routes`) is at most this many: its routes seldom share an expert, which is where the
# layer kernel loses. The Kimi-K2 EP8 shard (48 of 384 experts) at T=4 / 8 (~4 / 8 of its 32 / 64 routes):
# 0.132 vs 0.136 ms, 0.234 vs 0.242 (session 34, results/ab_layer_shard_h200_s34.txt). Benchmarks set 0 too.
LAYER_MAX_SHARD_ROUTES = 8
_LAYER_MAX_ROUTES = 64  # kMoeDecodeLayerMaxRoutes
_DECODE_STEP_BYTES = 256  # kMoeDecodeStepBytes
_DECODE_MAX_AMAX_ELEMENTS = 1 << 15  # kMoeDecodeMaxAmaxElements


def _finalize_setup_context(ctx, inputs, output):
    permuted_rows, expanded_to_permuted, token_final_scales, _ = inputs
    ctx.save_for_backward(permuted_rows if ctx.needs_input_grad[2] else None, expanded_to_permuted,
                          token_final_scales)
    ctx.rows = permuted_rows.shape[0]


def _finalize_backward(ctx, grad):
    """moe_finalize's gradients, without atomics (bitwise reproducible): a permuted row's is its route's scale
    times its token's output gradient (zero for rows no kept route reads), a scale's the float32 dot product of
    its row and its token's output gradient (zero for dropped routes)."""
    permuted_rows, expanded_to_permuted, scales = ctx.saved_tensors
    d_rows, d_scales = torch.ops.cake.moe_finalize_backward(grad.contiguous(), expanded_to_permuted, scales, ctx.rows,
                                                            permuted_rows)
    return d_rows if ctx.needs_input_grad[0] else None, None, d_scales if ctx.needs_input_grad[2] else None, None


torch.library.register_autograd("cake::moe_finalize", _finalize_backward, setup_context=_finalize_setup_context)


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.limit = inputs[1] if len(inputs) > 1 else None


def _swiglu_backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.cake.swiglu_backward(grad.contiguous(), gate_up, ctx.limit), None


torch.library.register_autograd("cake::swiglu", _swiglu_backward, setup_context=_swiglu_setup_context)


def layer_fits(routes: int, hidden: int, intermediate: int, weight_bytes: int) -> bool:
    """Whether moe_forward_out runs these shapes as the one-launch layer kernel on CUDA: the C++
    rule (cake_ops._C.moe_forward_layer_fits; a test keeps the two equal) in Python, which
    torch.compile traces through."""
    def gemm_fits(n, k_bytes):
        return n > 0 and n % 64 == 0 and k_bytes > 0 and k_bytes % _DECODE_STEP_BYTES == 0
    return (1 <= routes <= _LAYER_MAX_ROUTES and hidden % 64 == 0 and gemm_fits(2 * intermediate, hidden * weight_bytes)
            and gemm_fits(hidden, intermediate * weight_bytes)
            and (weight_bytes == 2 or (routes * hidden <= _DECODE_MAX_AMAX_ELEMENTS
                                       and routes * intermediate <= _DECODE_MAX_AMAX_ELEMENTS)))


def interleave_up_gate_sm90(w_gate_up: torch.Tensor) -> torch.Tensor:
    """Gate-first ``[E, 2I, H]`` weights (``[gate; up]``) -> the SM90 kernel's order, interleaved at
    32 rows: ``[up 0:32 | gate 0:32 | up 32:64 | gate 32:64 | ...]``, so that one wgmma accumulator
    fragment holds a gate column and its up column together. Needs I % 32 == 0. Returns a new
    contiguous tensor (cache it with the model's weights)."""
    if not isinstance(w_gate_up, torch.Tensor):
        raise TypeError(f"interleave_up_gate_sm90: w_gate_up must be a tensor, got {type(w_gate_up).__name__}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % (2 * INTERLEAVE_ROWS) != 0:
        raise ValueError("interleave_up_gate_sm90: w_gate_up must be [E, 2I, H] with I % 32 == 0, "
                         f"got shape {list(w_gate_up.shape)}")
    e, two_i, h = w_gate_up.shape
    chunks = two_i // 2 // INTERLEAVE_ROWS
    gate, up = w_gate_up.view(e, 2, chunks, INTERLEAVE_ROWS, h).unbind(1)
    return torch.stack([up, gate], dim=2).reshape(e, two_i, h).contiguous()


def default_tile_size(num_tokens: int, top_k: int, num_local_experts: int, intermediate: int) -> int:
    """The specification's tile rule: 64 below an average of 64 rows per local expert (decode
    batches pad every expert to a full tile), 128 from there; with a per-rank I under 192 the
    switch to 128 comes at 16 rows per expert."""
    rows_per_expert = num_tokens * top_k / max(num_local_experts, 1)
    return 128 if rows_per_expert >= (16 if intermediate < 192 else 64) else 64


def expected_routes(routes: int, num_local_experts: int, num_experts: int) -> int:
    """The MoE GEMMs' ``expected_routes`` hint for a shard of ``num_local_experts`` of ``num_experts``
    over ``routes`` (T * top_k) routes: its share under even routing, rounded up; -1 (every row) for
    the whole set. Only the tile choice reads it: a shard's GEMMs are sized for all the routes but
    hold about E_local / E of them (Kimi-K2 EP8: 1/8), which wants the small-group tiles."""
    if num_local_experts >= num_experts:
        return -1
    return -(-routes * num_local_experts // num_experts)


def runs_layer_kernel(num_tokens: int, top_k: int, num_local_experts: int, num_experts: int) -> bool:
    """Whether a CUDA forward of these many tokens takes the one-launch layer kernel (where
    :func:`layer_fits` takes the shapes): a decode batch, or a shard's few expected routes."""
    shard_routes = expected_routes(num_tokens * top_k, num_local_experts, num_experts)
    return num_tokens <= LAYER_MAX_TOKENS or 0 <= shard_routes <= LAYER_MAX_SHARD_ROUTES


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def _check(cond: bool, message: Callable[[], str]) -> None:
    """Raise ValueError(message()) unless cond. The message is formatted only on failure: these checks
    run on every call (formatting them all took ~10 us of host time per call), and under
    torch.compile with dynamic shapes formatting a SymInt would break the graph."""
    if not cond:
        raise ValueError(f"{_NAME}: {message()}")


def _check_buffer(buf: torch.Tensor, name: str, shape: list, x: torch.Tensor) -> None:
    _check(_shape(buf) == shape, lambda: f"{name} must have shape {shape}, got {_shape(buf)}")
    _check(buf.dtype == x.dtype, lambda: f"{name} must have x's dtype {x.dtype}, got {buf.dtype}")
    _check(buf.device == x.device, lambda: f"{name} must be on x's device {x.device}, got {buf.device}")
    _check(buf.is_contiguous(), lambda: f"{name} must be contiguous")


def _check_overrides(hidden: int, intermediate: int, tile_size, gemm1_tile_n, gemm2_tile_n,
                     gemm2_tile_k, gemm2_cluster_shape_mn, gemm2_raster_along_m) -> None:
    _check(tile_size in (None, 64, 128), lambda: f"tile_size must be 64 or 128, got {tile_size}")
    _check(gemm1_tile_n is None or (gemm1_tile_n in (64, 128, 256) and (2 * intermediate) % gemm1_tile_n == 0),
           lambda: f"gemm1_tile_n must be 64, 128 or 256 and divide 2I={2 * intermediate}, got {gemm1_tile_n}")
    _check(gemm2_tile_n is None or (gemm2_tile_n in (64, 128, 256) and hidden % gemm2_tile_n == 0),
           lambda: f"gemm2_tile_n must be 64, 128 or 256 and divide hidden={hidden}, got {gemm2_tile_n}")
    _check(gemm2_tile_k is None or (gemm2_tile_k in (32, 64) and intermediate % gemm2_tile_k == 0),
           lambda: f"gemm2_tile_k must be 32 or 64 and divide I={intermediate}, got {gemm2_tile_k}")
    if gemm2_cluster_shape_mn is not None:
        cluster = tuple(gemm2_cluster_shape_mn)
        _check(cluster in ((1, 1), (1, 2)), lambda: f"gemm2_cluster_shape_mn must be (1, 1) or (1, 2), got {cluster}")
        if cluster == (1, 2):
            tile_n = gemm2_tile_n or 128
            _check((hidden // tile_n) % 2 == 0,
                   lambda: f"gemm2_cluster_shape_mn=(1, 2) needs an even number of GEMM2 N tiles, got "
                   f"hidden={hidden} / gemm2_tile_n={tile_n} = {hidden // tile_n}")
    _check(gemm2_raster_along_m is None or isinstance(gemm2_raster_along_m, bool),
           lambda: f"gemm2_raster_along_m must be a bool or None, got {gemm2_raster_along_m!r}")


_TACTIC_NAME = re.compile(r"^fwd_(?:bf16|f16)_(?:fixed_)?(?:coop|ping)_(\d+)x(\d+)x(\d+)_c(\d+)x(\d+)(_rasterN)?(_swz\d+)?$")


def override_tactic(family: str, gemm: str, tile_m: Optional[int] = None, tile_n: Optional[int] = None,
                    tile_k: Optional[int] = None, cluster_mn: Optional[Tuple[int, int]] = None,
                    raster_along_m: Optional[bool] = None) -> int:
    """The grouped GEMM tactic (index into ``_C.grouped_gemm_tactics(family)``) that honours every
    override given, -1 when none is given (the tuned or heuristic choice then runs). A tile with
    fixed operand descriptors wins over the ptr-array configuration of the same tile (the same
    numbers, faster: benchmarks/NOTES.md, session 24), then the first match in table order (a
    configuration's default tile order comes first). Swap-AB tactics (weight on the tile's M side)
    never match: the overrides name the row tile."""
    wanted = (tile_m, tile_n, tile_k, None if cluster_mn is None else tuple(cluster_mn), raster_along_m)
    if all(v is None for v in wanted) or not hasattr(_C, "grouped_gemm_tactics"):
        return -1  # nothing asked, or a CPU-only build (no kernels to choose from)
    tiles = set()
    names = list(enumerate(_C.grouped_gemm_tactics(family)))
    for index, name in sorted(names, key=lambda item: "_fixed_" not in item[1]):  # stable: fixed ones first
        m = _TACTIC_NAME.match(name)
        if not m:
            continue
        tm, tn, tk, cm, cn = map(int, m.groups()[:5])
        tiles.add(f"{tm}x{tn}x{tk} c{cm}x{cn}")
        have = (tm, tn, tk, (cm, cn), m.group(6) is None)
        if all(w is None or w == h for w, h in zip(wanted, have)):
            return index
    asked = ", ".join(f"{k}={v}" for k, v in zip(("tile_m", "tile_n", "tile_k", "cluster", "raster_along_m"), wanted)
                      if v is not None)
    raise ValueError(f"{_NAME}: no {gemm} kernel configuration has {asked}; this build's {family} tiles (M x N x K, "
                     f"cluster): {', '.join(sorted(tiles))}")


def fused_moe_bf16(x: torch.Tensor, token_selected_experts: torch.Tensor, token_final_scales: torch.Tensor,
                   w1_weight: torch.Tensor, w2_weight: torch.Tensor, num_experts: int, top_k: int,
                   num_local_experts: Optional[int] = None, local_expert_offset: int = 0,
                   use_fused_finalize: bool = True, moe_output: Optional[torch.Tensor] = None,
                   enable_pdl: bool = True, *, intermediate_buffer: Optional[torch.Tensor] = None,
                   tile_size: Optional[int] = None, gemm1_tile_n: Optional[int] = None,
                   gemm2_tile_n: Optional[int] = None, gemm2_tile_k: Optional[int] = None,
                   gemm2_cluster_shape_mn: Optional[Tuple[int, int]] = None,
                   gemm2_raster_along_m: Optional[bool] = None, w1_layout: str = "interleaved") -> torch.Tensor:
    """``out[t] = sum_k scale[t, k] * ffn(x[t]; e[t, k])``, ``ffn(x; e) = (silu(x @ w1_gate[e].T) *
    (x @ w1_up[e].T)) @ w2[e].T``, over the routes whose expert is in this shard.

    x ``[T, H]`` bf16/fp16; token_selected_experts ``[T, top_k]`` int32 global ids;
    token_final_scales ``[T, top_k]`` float32; w1_weight ``[E_local, 2I, H]`` up/gate interleaved
    at 32 rows (:func:`interleave_up_gate_sm90`), or with ``w1_layout="gate_up"`` gate-first
    ``[gate; up]`` halves as they are (transformers' ``gate_up_proj``; the same numbers, no copy; bf16
    GEMM1 tiles load a tile's gate and up rows as two boxes and keep the SwiGLU in their epilogue, fp16
    ones store the product for a SwiGLU kernel); w2_weight ``[E_local, H, I]``. Routes to experts
    outside ``[local_expert_offset, local_expert_offset + num_local_experts)`` (other shards, or
    ids outside ``[0, num_experts)``) contribute zero. Needs H % 64 == 0 and I % 32 == 0.
    Returns ``[T, H]`` in x's dtype (``moe_output`` when given, overwritten); the GEMM1 output
    (``[T * top_k, I]``, permuted rows; on CUDA the rows past the shard's kept routes may be left
    unwritten) is left in ``intermediate_buffer`` when given. See the
    module doc for what is fused today.
    """
    warn_experimental("cake_ops.fused_moe")
    ids, scales = token_selected_experts, token_final_scales
    for name, t in (("x", x), ("token_selected_experts", ids), ("token_final_scales", scales),
                    ("w1_weight", w1_weight), ("w2_weight", w2_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cake_ops.fused_moe_bf16: {name} must be a tensor, got {type(t).__name__}")
    _check(x.dim() == 2, lambda: f"x must be a 2-D [num_tokens, hidden] tensor, got shape {_shape(x)}")
    _check(x.dtype in (torch.bfloat16, torch.float16), lambda: f"x must be bfloat16 or float16, got {x.dtype}")
    num_tokens, hidden = x.shape
    _check(isinstance(top_k, (int, torch.SymInt)) and top_k >= 1, lambda: f"top_k must be a positive int, got {top_k!r}")
    _check(_shape(ids) == [num_tokens, top_k],
           lambda: f"token_selected_experts must have shape [num_tokens, top_k] = {[num_tokens, top_k]}, got {_shape(ids)}")
    _check(ids.dtype == torch.int32, lambda: f"token_selected_experts must be int32, got {ids.dtype}")
    _check(_shape(scales) == [num_tokens, top_k],
           lambda: f"token_final_scales must have shape [num_tokens, top_k] = {[num_tokens, top_k]}, got {_shape(scales)}")
    _check(scales.dtype == torch.float32, lambda: f"token_final_scales must be float32, got {scales.dtype}")
    num_local = num_experts if num_local_experts is None else num_local_experts
    _check(num_experts >= 1, lambda: f"num_experts must be positive, got {num_experts}")
    _check(1 <= num_local <= num_experts, lambda: f"num_local_experts must be in [1, num_experts={num_experts}], got {num_local}")
    _check(0 <= local_expert_offset <= num_experts - num_local,
           lambda: f"the shard [local_expert_offset, local_expert_offset + num_local_experts) = "
           f"[{local_expert_offset}, {local_expert_offset + num_local}) must lie within [0, num_experts={num_experts})")
    _check(w1_weight.dim() == 3 and w1_weight.shape[0] == num_local and w1_weight.shape[2] == hidden,
           lambda: f"w1_weight must be [num_local_experts={num_local}, 2I, hidden={hidden}], got {_shape(w1_weight)}")
    intermediate = w1_weight.shape[1] // 2
    _check(_shape(w2_weight) == [num_local, hidden, intermediate],
           lambda: f"w2_weight must be [num_local_experts, hidden, I] = {[num_local, hidden, intermediate]} "
           f"(I = w1_weight.shape[1] // 2, w1_weight being {_shape(w1_weight)}), got {_shape(w2_weight)}")
    for name, w in (("w1_weight", w1_weight), ("w2_weight", w2_weight)):
        _check(w.dtype == x.dtype, lambda: f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
    for name, t in (("token_selected_experts", ids), ("token_final_scales", scales),
                    ("w1_weight", w1_weight), ("w2_weight", w2_weight)):
        _check(t.device == x.device, lambda: f"{name} must be on x's device {x.device}, got {t.device}")
    for name, w in (("w1_weight", w1_weight), ("w2_weight", w2_weight)):
        _check(w.is_contiguous(), lambda: f"{name} must be contiguous (prepare it once with the model's weights)")
    x, ids, scales = x.contiguous(), ids.contiguous(), scales.contiguous()
    _check(hidden % 64 == 0, lambda: f"hidden must be a multiple of 64, got {hidden}")
    _check(w1_weight.shape[1] % 64 == 0 and intermediate % 32 == 0,
           lambda: f"2I must be a multiple of 64 (I % 32 == 0), got 2I={w1_weight.shape[1]}")
    if moe_output is not None:
        _check_buffer(moe_output, "moe_output", [num_tokens, hidden], x)
    if intermediate_buffer is not None:
        _check_buffer(intermediate_buffer, "intermediate_buffer", [num_tokens * top_k, intermediate], x)
    _check_overrides(hidden, intermediate, tile_size, gemm1_tile_n, gemm2_tile_n, gemm2_tile_k,
                     gemm2_cluster_shape_mn, gemm2_raster_along_m)
    _check(w1_layout in W1_LAYOUTS, lambda: f"w1_layout must be one of {W1_LAYOUTS}, got {w1_layout!r}")
    gate_up = w1_layout == "gate_up"

    # A shard's kernels size their work by its expected share of the routes: the layer kernel spreads a phase
    # of few items over the idle CTAs, the GEMMs choose their tiles by it (tuned under that bucket too).
    hint = expected_routes(num_tokens * top_k, num_local, num_experts)
    if (x.is_cuda and runs_layer_kernel(num_tokens, top_k, num_local, num_experts) and intermediate_buffer is None
            and all(o is None for o in (tile_size, gemm1_tile_n, gemm2_tile_n, gemm2_tile_k, gemm2_cluster_shape_mn,
                                        gemm2_raster_along_m))
            and layer_fits(num_tokens * top_k, hidden, intermediate, x.element_size())):
        # A decode batch (or a shard's few routes): the whole layer in one launch (moe_finalize's
        # fixed-order combine, which the fused finalize's contract allows too).
        out = moe_output if moe_output is not None else x.new_empty(num_tokens, hidden)
        torch.ops.cake.moe_forward_out(x, ids, scales, w1_weight, w2_weight, local_expert_offset, out,
                                       x.new_empty(0, dtype=torch.uint8), enable_pdl, expected_routes=hint,
                                       w1_gate_up=gate_up)
        return out
    tile = tile_size or default_tile_size(num_tokens, top_k, num_local, intermediate)
    _, offsets, permuted_to_expanded, expanded_to_permuted, _ = torch.ops.cake.moe_sort(
        ids, num_experts, num_local, local_expert_offset, tile)
    # Explicit tile / cluster / raster overrides pick the grouped GEMM tactic of each GEMM (and
    # bypass the tuner). Otherwise, inside cake_ops.autotune(), a new shape bucket first times
    # every tactic of each GEMM as it runs (keyed by E_local, T * top_k rounded up, N, K and its epilogue).
    family = "fwd_f16" if x.dtype == torch.float16 else "fwd"
    gemm1_tactic = override_tactic(family, "GEMM1", tile_size, gemm1_tile_n) if x.is_cuda else -1
    gemm2_tactic = override_tactic(family, "GEMM2", tile_size, gemm2_tile_n, gemm2_tile_k, gemm2_cluster_shape_mn,
                                   gemm2_raster_along_m) if x.is_cuda else -1
    overrides = (tile_size, gemm1_tile_n, gemm2_tile_n, gemm2_tile_k, gemm2_cluster_shape_mn,
                 gemm2_raster_along_m, intermediate_buffer)
    tune = tuning_active() and x.is_cuda and all(o is None for o in overrides)
    routes = num_tokens * top_k if hint < 0 else hint
    # GEMM1's rows past the last local expert's end are left unwritten (zero_tail=False): GEMM2 and
    # the finalize never read them, and on an expert-parallel shard they are most of the tensor
    # (Kimi-K2 EP8 shard, T=16384: 2.69 -> 2.54 ms, benchmarks/results/ab_gemm1_tail_h200.txt).
    # With fp16 gate_up weights GEMM1 runs the plain GEMM's tactics (bf16 ones have gate-up SwiGLU twins), tuned
    # as such.
    if tune:
        tune_grouped_gemm(family, lambda: (num_local, routes, 2 * intermediate, hidden), lambda: torch.ops.cake.moe_gemm1_swiglu(
            x, w1_weight, permuted_to_expanded, offsets, top_k, enable_pdl, expected_routes=hint, zero_tail=False,
            expanded_to_permuted=expanded_to_permuted, w1_gate_up=gate_up), x.device,
            "none" if gate_up and x.dtype == torch.float16 else "swiglu")
    # GEMM1 gathers a large x in token order through the sort's inverse (expanded_to_permuted).
    if intermediate_buffer is not None:  # GEMM1 writes it in place (an empty workspace: the op sizes its own)
        torch.ops.cake.moe_gemm1_swiglu_out(x, w1_weight, permuted_to_expanded, offsets, top_k, intermediate_buffer,
                                            x.new_empty(0, dtype=torch.uint8), enable_pdl, tactic=gemm1_tactic,
                                            expected_routes=hint, zero_tail=False,
                                            expanded_to_permuted=expanded_to_permuted, w1_gate_up=gate_up)
        inter = intermediate_buffer
    else:
        inter = torch.ops.cake.moe_gemm1_swiglu(x, w1_weight, permuted_to_expanded, offsets, top_k, enable_pdl,
                                                tactic=gemm1_tactic, expected_routes=hint, zero_tail=False,
                                                expanded_to_permuted=expanded_to_permuted, w1_gate_up=gate_up)
    gemm2_dims = (num_local, routes, hidden, intermediate)
    if use_fused_finalize:
        # GEMM2 adds the router-scaled rows into the output itself (atomics: one rounding per route).
        # The tuner times this launch as it runs (the scatter twin; out is overwritten by each call).
        out = moe_output if moe_output is not None else x.new_empty(num_tokens, hidden)

        def gemm2_finalize(tactic: int) -> None:
            torch.ops.cake.moe_gemm2_finalize_out(inter, w2_weight, offsets, permuted_to_expanded,
                                                  expanded_to_permuted, scales, out, enable_pdl, tactic, hint)

        if tune:
            tune_grouped_gemm(family, lambda: gemm2_dims, lambda: gemm2_finalize(-1), x.device, "scatter")
        gemm2_finalize(gemm2_tactic)
        return out

    def gemm2(tactic: int) -> torch.Tensor:
        return torch.ops.cake.moe_gemm2(inter, w2_weight, offsets, enable_pdl, tactic, expected_routes=hint)

    if tune:
        tune_grouped_gemm(family, lambda: gemm2_dims, lambda: gemm2(-1), x.device)
    expert_rows = gemm2(gemm2_tactic)
    if moe_output is not None:
        torch.ops.cake.moe_finalize_out(expert_rows, expanded_to_permuted, scales, moe_output, enable_pdl)
        return moe_output
    return torch.ops.cake.moe_finalize(expert_rows, expanded_to_permuted, scales, enable_pdl)
