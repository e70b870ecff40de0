"""Ragged grouped GEMM for the expert projections of Mixture-of-Experts layers.

Groups are consecutive row ranges of the packed activations, described by an int32 tensor on
the operands' device: ``offs [E]`` of cumulative group ends, or ``m_indptr [E + 1]`` with a
leading zero (the ``torch._grouped_mm`` and ``grouped_mm_bf16`` conventions). The GPU kernels
read the offsets on the device: the host never synchronises on them, no padding is needed and
groups may be empty, one row or any size. Output rows past the last group end are zeros.

Layouts (all row-major, contiguous), with ``w`` of shape ``[E, N, K]``:

========== ====================================== ======================================
op         computation for group e (rows g)       output
========== ====================================== ======================================
fwd        ``y[g] = x[g] @ w[e].T``               ``[sum_m, N]``, dtype of x
dgrad      ``dx[g] = grad_out[g] @ w[e]``         ``[sum_m, K]``, dtype of grad_out
wgrad      ``dw[e] = grad_out[g].T @ x[g]``       ``[E, N, K]``, bfloat16 or float32
========== ====================================== ======================================

On CUDA (Hopper, sm_90a) operands are bfloat16 with N and K multiples of 8; accumulation is
fp32 and every reduction runs in a fixed order (no atomics, no split-K), so results are bitwise
reproducible and empty groups give exactly zero weight gradients. On the CPU the same ops take
bfloat16, float16, float32 and float64. The API is experimental: the first call emits an
``ExperimentalWarning`` once.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _C, _fake
from ._experimental import warn_experimental
from .autotune import tune_grouped_gemm, tuning_active

__all__ = [
    "CakeGroupedMm",
    "GroupedGemmLaunch",
    "cake_grouped_mm",
    "grouped_gemm_dgrad",
    "grouped_gemm_fwd",
    "grouped_gemm_wgrad",
    "grouped_mm",
    "grouped_mm_bf16",
    "prepare_grouped_gemm_dgrad",
    "prepare_grouped_gemm_fwd",
    "prepare_grouped_gemm_wgrad",
]

_FEATURE = "cake_ops.grouped_gemm"


def _bounds(fn: str, offs, m_indptr, num_groups: Optional[int]):
    """The boundary tensor to pass to the op: offs [E] or m_indptr [E + 1], exactly one."""
    if (offs is None) == (m_indptr is None):
        raise TypeError(f"{fn}: pass exactly one of offs [E] (group ends) or m_indptr [E+1]")
    if m_indptr is not None and num_groups is not None and m_indptr.dim() == 1:
        if m_indptr.shape[0] != num_groups + 1:
            raise ValueError(
                f"{fn}: m_indptr must have E+1={num_groups + 1} entries, got {m_indptr.shape[0]}")
    return offs if offs is not None else m_indptr


def _num_groups(fn: str, offs, m_indptr) -> int:
    if offs is not None and m_indptr is None:
        return offs.shape[0]
    if m_indptr is not None and offs is None:
        return m_indptr.shape[0] - 1
    raise TypeError(f"{fn}: pass exactly one of offs [E] (group ends) or m_indptr [E+1]")


def grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, offs: Optional[torch.Tensor] = None, *,
                     m_indptr: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y[g] = x[g] @ w[e].T`` for each group: x ``[sum_m, K]``, w ``[E, N, K]`` -> ``[sum_m, N]``.

    ``offs`` int32 ``[E]`` (group ends; ``[E + 1]`` is read as m_indptr) or ``m_indptr`` int32
    ``[E + 1]``, on x's device. Output in x's dtype; rows past the last group end are zero.
    """
    warn_experimental(_FEATURE)
    bounds = _bounds("grouped_gemm_fwd", offs, m_indptr, w.shape[0])
    return _fwd(x, w, bounds)


def grouped_gemm_dgrad(grad_out: torch.Tensor, w: torch.Tensor, offs: Optional[torch.Tensor] = None, *,
                       m_indptr: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dx[g] = grad_out[g] @ w[e]``: grad_out ``[sum_m, N]``, w ``[E, N, K]`` -> ``[sum_m, K]``.

    w is read in place (no transposed copy). Boundaries as in :func:`grouped_gemm_fwd`.
    """
    warn_experimental(_FEATURE)
    bounds = _bounds("grouped_gemm_dgrad", offs, m_indptr, w.shape[0])
    return _tuned_call("dgrad", torch.ops.cake.grouped_gemm_dgrad, (grad_out, w, bounds),
                       lambda: (w.shape[0], grad_out.shape[0], w.shape[1], w.shape[2]))


def grouped_gemm_wgrad(grad_out: torch.Tensor, x: torch.Tensor, offs: Optional[torch.Tensor] = None, *,
                       m_indptr: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``dw[e] = grad_out[g].T @ x[g]``: grad_out ``[sum_m, N]``, x ``[sum_m, K]`` -> ``[E, N, K]``.

    E is ``len(offs)`` or ``len(m_indptr) - 1``. ``out_dtype`` is x's dtype (default) or
    ``torch.float32``. Bitwise deterministic; empty groups give exact zeros.
    """
    warn_experimental(_FEATURE)
    num_groups = _num_groups("grouped_gemm_wgrad", offs, m_indptr)
    out_dtype = out_dtype if out_dtype is not None else x.dtype
    args = (grad_out, x, _bounds("grouped_gemm_wgrad", offs, m_indptr, None), num_groups, out_dtype)
    return _tuned_call(_wgrad_family(out_dtype), torch.ops.cake.grouped_gemm_wgrad, args,
                       lambda: (num_groups, x.shape[0], grad_out.shape[1], x.shape[1]))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype cake's GEMM ops compute t in: inside a torch.autocast region of t's device, autocast's dtype
    for a floating, non-float64 t (the ops' autocast rule, csrc/grouped_gemm_autocast.cpp: torch.mm's); else
    t's own."""
    dev = t.device.type  # the autocast test first: ~1 us of host time a call outside a region
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and t.is_floating_point() \
            and t.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _weight_grad_dtype(w: torch.Tensor) -> Optional[torch.dtype]:
    """float32 for a float32 weight (autocast runs its GEMMs in bf16): wgrad then writes its gradient in float32,
    unrounded and with no bf16 -> float32 cast pass after it; None (the GEMM's dtype) otherwise."""
    return torch.float32 if w.dtype == torch.float32 else None


def _autocast(t: torch.Tensor) -> torch.Tensor:
    """t as cake's GEMM ops compute it (:func:`_compute_dtype`): a cast inside torch.autocast, else t itself.
    For autograd.Functions, whose backward runs outside the region: the casts are made, and saved, in forward."""
    dtype = _compute_dtype(t)
    return t if dtype == t.dtype else t.to(dtype)  # not t.to(t.dtype): ~2.5 us of host time for nothing


def _fwd_family(dtype):
    return "fwd_f16" if dtype == torch.float16 else "fwd"


def _wgrad_family(out_dtype):
    return "wgrad_f32" if out_dtype == torch.float32 else "wgrad"


def _tuned_call(family, op, args, dims):
    """Run op(*args); inside cake_ops.autotune() first tune its bucket, dims() = (E, sum_m, N, K)."""
    if tuning_active():
        tune_grouped_gemm(family, dims, lambda: _call(op, args), args[0].device)
    return _call(op, args)


def _fwd(x, w, offs):
    """cake::grouped_gemm_fwd(x, w, offs), tuned inside cake_ops.autotune()."""
    return _tuned_call(_fwd_family(_compute_dtype(x)), torch.ops.cake.grouped_gemm_fwd, (x, w, offs),
                       lambda: (w.shape[0], x.shape[0], w.shape[1], w.shape[2]))


def _fwd_grads(grad, x, w, offs, need_x, need_w, w_grad_dtype=None):
    """The gradients (x's, w's; None where not needed) of ``grouped_gemm_fwd(x, w, offs)`` given the output's
    contiguous ``grad``: the dgrad and (deterministic) wgrad kernels, tuned inside cake_ops.autotune(); w's in
    ``w_grad_dtype`` (w's dtype or float32; None: w's)."""
    e, n, k = w.shape
    w_grad_dtype = w_grad_dtype or w.dtype
    dims = lambda: (e, x.shape[0], n, k)  # noqa: E731
    dx = _tuned_call("dgrad", torch.ops.cake.grouped_gemm_dgrad, (grad, w, offs), dims) if need_x else None
    dw = (_tuned_call(_wgrad_family(w_grad_dtype), torch.ops.cake.grouped_gemm_wgrad, (grad, x, offs, e, w_grad_dtype),
                      dims)
          if need_w else None)
    return dx, dw


def _call(op, args):
    """op(*args), straight to the backend kernel when no autograd graph is being recorded (in
    autograd.Function.forward, in a backward without create_graph): the op's Python autograd
    wrapper would only redispatch, at tens of microseconds of host time per call."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


# ---------------------------------------------------------------------------------------------
# Autograd: the op cake::grouped_gemm_fwd differentiates through dgrad and wgrad, and those two
# through the other ops of the family, so double backward works too.


def _fwd_setup_context(ctx, inputs, output):
    x, w, offs = inputs[:3]
    ctx.save_for_backward(x, w, offs)


def _fwd_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    return (*_fwd_grads(grad.contiguous(), x, w, offs, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                        getattr(ctx, "w_grad_dtype", None)), None)


def _dgrad_backward(ctx, grad):
    grad_out, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    d_grad_out = torch.ops.cake.grouped_gemm_fwd(grad, w, offs) if ctx.needs_input_grad[0] else None
    dw = (torch.ops.cake.grouped_gemm_wgrad(grad_out, grad, offs, w.shape[0], w.dtype)
          if ctx.needs_input_grad[1] else None)
    return d_grad_out, dw, None


def _wgrad_setup_context(ctx, inputs, output):
    grad_out, x, offs = inputs[:3]
    ctx.save_for_backward(grad_out, x, offs)


def _wgrad_backward(ctx, grad):
    grad_out, x, offs = ctx.saved_tensors
    grad = grad.to(x.dtype).contiguous()
    d_grad_out = torch.ops.cake.grouped_gemm_fwd(x, grad, offs) if ctx.needs_input_grad[0] else None
    dx = torch.ops.cake.grouped_gemm_dgrad(grad_out, grad, offs) if ctx.needs_input_grad[1] else None
    return d_grad_out, dx, None, None, None


torch.library.register_autograd("cake::grouped_gemm_fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("cake::grouped_gemm_dgrad", _dgrad_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("cake::grouped_gemm_wgrad", _wgrad_backward,
                                setup_context=_wgrad_setup_context)


class CakeGroupedMm(torch.autograd.Function):
    """``y = x @ w[e].T`` per group, with backward through the dgrad and wgrad ops.

    ``CakeGroupedMm.apply(x, w, offs, deterministic)``: x.grad comes from the dgrad op and w.grad
    from the wgrad op in w's dtype. The kernels always reduce in a fixed order, so
    ``deterministic=False`` runs the same (deterministic) kernels. The forward takes ``ctx``
    (no separate setup_context): that form skips a signature binding per call, about 50 us of
    host time that eager training would otherwise pay on every layer.
    """

    @staticmethod
    def forward(ctx, x, w, offs, deterministic=True):
        ctx.w_grad_dtype = _weight_grad_dtype(w)
        x, w = _autocast(x), _autocast(w)
        _fwd_setup_context(ctx, (x, w, offs), None)
        return _fwd(x, w, offs)

    @staticmethod
    def backward(ctx, grad):
        return (*_fwd_backward(ctx, grad), None)


def cake_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                    deterministic: bool = True) -> torch.Tensor:
    """Differentiable grouped GEMM ``y[g] = x[g] @ w[e].T`` (see :class:`CakeGroupedMm`).

    x ``[sum_m, K]``, w ``[E, N, K]``, offs int32 ``[E]`` or m_indptr ``[E + 1]`` -> ``[sum_m, N]``.
    Traces under ``torch.compile(fullgraph=True)``. For an fp32 weight gradient call
    :func:`grouped_gemm_wgrad` with ``out_dtype=torch.float32``.
    """
    warn_experimental(_FEATURE)
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(offs, torch.Tensor)):
        raise TypeError(f"cake_grouped_mm: x, w and offs must be tensors, got {type(x).__name__}, "
                        f"{type(w).__name__} and {type(offs).__name__}")
    return CakeGroupedMm.apply(x, w, offs, deterministic)


# ---------------------------------------------------------------------------------------------
# Prepared launches


class GroupedGemmLaunch:
    """One validated grouped GEMM bound to its tensors, its output and its workspace.

    ``launch()`` runs it on the current stream: it allocates nothing and never synchronises,
    so it can be captured in a CUDA graph. Offsets and values are read at launch, so the launch
    stays valid when new offsets or data are written into the bound tensors in place.
    """

    __slots__ = ("_op", "_args", "out", "workspace")

    def __init__(self, op, args, out: torch.Tensor, workspace: torch.Tensor):
        self._op = op
        self._args = args
        self.out = out
        self.workspace = workspace

    def launch(self) -> torch.Tensor:
        self._op(*self._args, self.out, self.workspace)
        return self.out

    def __call__(self) -> torch.Tensor:
        return self.launch()


def _bind(fn, out_op, args, out, shape, dtype, like, num_groups) -> GroupedGemmLaunch:
    """A launch of out_op(*args, out, workspace); out (made if None) checked against shape/dtype."""
    out = like.new_empty(shape, dtype=dtype) if out is None else out
    _fake.check_out(out, shape, dtype, like, fn)
    workspace = torch.empty(_C.grouped_gemm_workspace_size(num_groups), dtype=torch.uint8, device=like.device)
    return GroupedGemmLaunch(out_op, args, out, workspace)


def prepare_grouped_gemm_fwd(x, w, offs=None, *, m_indptr=None, out=None) -> GroupedGemmLaunch:
    """Validate and bind a :func:`grouped_gemm_fwd`; ``out`` ``[sum_m, N]`` is made if not given."""
    warn_experimental(_FEATURE)
    fn = "prepare_grouped_gemm_fwd"
    bounds = _bounds(fn, offs, m_indptr, w.shape[0])
    shape = _fake.check_fwd(x, w, bounds, fn)
    return _bind(fn, torch.ops.cake.grouped_gemm_fwd_out.default, (x, w, bounds), out, shape, x.dtype, x,
                 w.shape[0])


def prepare_grouped_gemm_dgrad(grad_out, w, offs=None, *, m_indptr=None, out=None) -> GroupedGemmLaunch:
    """Validate and bind a :func:`grouped_gemm_dgrad`; ``out`` ``[sum_m, K]`` is made if not given."""
    warn_experimental(_FEATURE)
    fn = "prepare_grouped_gemm_dgrad"
    bounds = _bounds(fn, offs, m_indptr, w.shape[0])
    shape = _fake.check_dgrad(grad_out, w, bounds, fn)
    return _bind(fn, torch.ops.cake.grouped_gemm_dgrad_out.default, (grad_out, w, bounds), out, shape,
                 grad_out.dtype, grad_out, w.shape[0])


def prepare_grouped_gemm_wgrad(grad_out, x, offs=None, *, m_indptr=None, out=None,
                               out_dtype: Optional[torch.dtype] = None) -> GroupedGemmLaunch:
    """Validate and bind a :func:`grouped_gemm_wgrad`; ``out`` ``[E, N, K]`` is made if not given."""
    warn_experimental(_FEATURE)
    fn = "prepare_grouped_gemm_wgrad"
    num_groups = _num_groups(fn, offs, m_indptr)
    bounds = _bounds(fn, offs, m_indptr, None)
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else x.dtype
    shape = _fake.check_wgrad(grad_out, x, bounds, num_groups, out_dtype, fn)
    return _bind(fn, torch.ops.cake.grouped_gemm_wgrad_out.default, (grad_out, x, bounds), out, shape,
                 out_dtype, x, num_groups)


# ---------------------------------------------------------------------------------------------
# torch._grouped_mm's ragged forms


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch._grouped_mm`` (same arguments) in the two ragged forms MoE layers use, on cake's kernels:

    - ``mat_a [sum_m, K]``, ``mat_b [E, K, N]``: ``out[g] = mat_a[g] @ mat_b[e]`` -> ``[sum_m, N]``. A
      weight stored ``[E, N, K]`` and passed transposed (``w.transpose(-2, -1)``, as torchtitan does) runs
      the fwd kernel; a contiguous ``[E, K, N]`` one the dgrad kernel. Neither copies the weights.
    - ``mat_a [M, sum_k]``, ``mat_b [sum_k, N]``: ``out[e] = mat_a[:, g] @ mat_b[g]`` -> ``[E, M, N]`` (the
      weight gradient's form) on the wgrad kernel; ``out_dtype=torch.float32`` gives a float32 result.

    ``offs`` int32 ``[E]``: cumulative group ends along the ragged dimension. Differentiable (the backward
    runs the other kernels of the family) and traceable by ``torch.compile``. Unlike torch's, output rows
    past the last group end are zeros. Not served: ``bias``, and the forms without ``offs`` (both operands
    3-D: ``torch.bmm``) or with a 3-D ``mat_a``.
    """
    fn = "cake_ops.grouped_mm"
    if not (isinstance(mat_a, torch.Tensor) and isinstance(mat_b, torch.Tensor) and isinstance(offs, torch.Tensor)):
        raise TypeError(f"{fn}: mat_a, mat_b and offs must be tensors (the ragged forms need offs), got "
                        f"{type(mat_a).__name__}, {type(mat_b).__name__} and {type(offs).__name__}")
    if bias is not None:
        raise ValueError(f"{fn}: bias is not supported, got a {type(bias).__name__}; add it to the output")
    dtype = _compute_dtype(mat_a)  # inside torch.autocast: its dtype, as for torch.mm
    if _compute_dtype(mat_b) != dtype:
        raise ValueError(f"{fn}: mat_a and mat_b must have one dtype, got {mat_a.dtype} and {mat_b.dtype}")
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"{fn}: offs must be a 1-D int32 tensor of group ends, got {offs.dtype} {list(offs.shape)}")
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        if out_dtype not in (None, dtype):
            raise ValueError(f"{fn}: the [sum_m, K] x [E, K, N] form returns mat_a's dtype {dtype}, "
                             f"got out_dtype={out_dtype}")
        if offs.shape[0] != mat_b.shape[0] or mat_a.shape[1] != mat_b.shape[1]:
            raise ValueError(f"{fn}: mat_a [sum_m, K], mat_b [E, K, N] and offs [E] must agree, got "
                             f"{list(mat_a.shape)}, {list(mat_b.shape)} and {list(offs.shape)}")
        w = mat_b.transpose(-2, -1)
        if not w.is_contiguous() and mat_b.is_contiguous():
            return grouped_gemm_dgrad(mat_a.contiguous(), mat_b, offs)
        return grouped_gemm_fwd(mat_a.contiguous(), w.contiguous(), offs)
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        if out_dtype not in (None, dtype, torch.float32):
            raise ValueError(f"{fn}: the [M, sum_k] x [sum_k, N] form returns mat_a's dtype {dtype} or "
                             f"float32, got out_dtype={out_dtype}")
        if mat_a.shape[1] != mat_b.shape[0]:
            raise ValueError(f"{fn}: mat_a [M, sum_k] and mat_b [sum_k, N] must agree on sum_k, got "
                             f"{list(mat_a.shape)} and {list(mat_b.shape)}")
        return grouped_gemm_wgrad(mat_a.transpose(0, 1).contiguous(), mat_b.contiguous(), offs,
                                  out_dtype=out_dtype if out_dtype is not None else dtype)
    raise ValueError(f"{fn}: serves mat_a [sum_m, K] x mat_b [E, K, N] and mat_a [M, sum_k] x mat_b [sum_k, N] "
                     f"with offs, got {mat_a.dim()}-D x {mat_b.dim()}-D")


# ---------------------------------------------------------------------------------------------
# Stable entry point


def grouped_mm_bf16(a: torch.Tensor, b: torch.Tensor, m_indptr: torch.Tensor, *,
                    backend: str = "cake") -> torch.Tensor:
    """Ragged bf16 grouped GEMM ``out[g] = a[g] @ b[e].T``: a ``[cum_m, K]``, b ``[E, N, K]``,
    m_indptr int32 ``[E + 1]`` with a leading zero -> bfloat16 ``[cum_m, N]``.

    ``backend="cake"`` (experimental, warns once) runs cake_ops' kernels; ``backend="torch"``
    runs ``torch._grouped_mm`` for comparison.
    """
    fn = "grouped_mm_bf16"
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"{fn}: a and b must be bfloat16, got {a.dtype} and {b.dtype}")
    if b.dim() != 3 or m_indptr.dim() != 1 or m_indptr.shape[0] != b.shape[0] + 1:
        raise ValueError(f"{fn}: expected b [E, N, K] and m_indptr [E+1], got b {list(b.shape)} "
                         f"and m_indptr {list(m_indptr.shape)}")
    if backend == "cake":
        warn_experimental(_FEATURE)
        return torch.ops.cake.grouped_gemm_fwd(a, b, m_indptr)
    if backend == "torch":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=m_indptr[1:])
    raise ValueError(f"{fn}: backend must be 'cake' or 'torch', got {backend!r}")
