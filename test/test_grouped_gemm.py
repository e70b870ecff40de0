"""cake::grouped_gemm_{fwd,dgrad,wgrad}: numerics against float64, autograd, opcheck, compile,
prepared launches and errors. CUDA variants run when a GPU is present."""
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import expecttest
import pytest
import torch
import torch._dynamo.testing

import cake_ops
from cake_ops import grouped_gemm as gg
from cake_ops import reference as ref
from moe_problems import RecordOps, rel_err

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")

# Ragged group-size patterns: empty groups, one row, sizes that are not tile multiples, one hot
# expert, nothing at all, and rows past the last group end (tail).
SIZES = {
    "ragged": ([0, 1, 130, 7, 0, 300, 64], 0),
    "hot": ([700, 0, 0, 1, 0, 3], 0),
    "all_empty": ([0, 0, 0], 0),
    "zero_rows": ([0, 0], 0),
    "tail": ([5, 0, 200], 37),
    "one_group": ([257], 0),
}


def dtypes_for(device):
    return [torch.bfloat16] if device == "cuda" else [torch.bfloat16, torch.float16, torch.float32]


def make_offs(sizes, device, indptr=False):
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    if indptr:
        ends = torch.cat([torch.zeros(1, dtype=torch.int64), ends])
    return ends.to(torch.int32).to(device)


def rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def tol(dtype):
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]


def problem(name, device, dtype, n=136, k=200):
    sizes, tail = SIZES[name]
    sum_m = sum(sizes) + tail
    e = len(sizes)
    x = rand(sum_m, k, dtype=dtype, device=device)
    w = rand(e, n, k, dtype=dtype, device=device)
    g = rand(sum_m, n, dtype=dtype, device=device)
    return sizes, sum_m, x, w, g, make_offs(sizes, device)


@pytest.mark.parametrize("name", list(SIZES))
def test_fwd_dgrad_wgrad_match_float64(device, name):
    for dtype in dtypes_for(device):
        sizes, sum_m, x, w, g, offs = problem(name, device, dtype)
        last = sum(sizes)
        y = gg.grouped_gemm_fwd(x, w, offs)
        assert y.shape == (sum_m, w.shape[1]) and y.dtype == dtype
        assert rel_err(y, ref.grouped_gemm_fwd(x, w, offs)) < tol(dtype)
        assert (y[last:] == 0).all(), "rows past the last group end must be zeros"

        dx = gg.grouped_gemm_dgrad(g, w, offs)
        assert dx.shape == x.shape and dx.dtype == dtype
        assert rel_err(dx, ref.grouped_gemm_dgrad(g, w, offs)) < tol(dtype)
        assert (dx[last:] == 0).all()

        for out_dtype in (dtype, torch.float32):
            dw = gg.grouped_gemm_wgrad(g, x, offs, out_dtype=out_dtype)
            assert dw.shape == w.shape and dw.dtype == out_dtype
            assert rel_err(dw, ref.grouped_gemm_wgrad(g, x, offs, len(sizes))) < tol(dtype)
            for e, size in enumerate(sizes):
                if size == 0:
                    assert (dw[e] == 0).all(), "empty groups must give exactly zero weight gradients"


@pytest.mark.parametrize("n,k", [(8, 8), (64, 1024), (264, 56)])
def test_shapes_not_tile_multiples(device, n, k):
    sizes = [3, 129, 0, 255]
    x = rand(sum(sizes), k, dtype=torch.bfloat16, device=device)
    w = rand(4, n, k, dtype=torch.bfloat16, device=device)
    offs = make_offs(sizes, device)
    assert rel_err(gg.grouped_gemm_fwd(x, w, offs), ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
    g = rand(sum(sizes), n, dtype=torch.bfloat16, device=device)
    assert rel_err(gg.grouped_gemm_dgrad(g, w, offs), ref.grouped_gemm_dgrad(g, w, offs)) < 1e-2
    assert rel_err(gg.grouped_gemm_wgrad(g, x, offs), ref.grouped_gemm_wgrad(g, x, offs, 4)) < 1e-2


def test_m_indptr_matches_offs(device):
    sizes, sum_m, x, w, g, offs = problem("ragged", device, torch.bfloat16)
    indptr = make_offs(sizes, device, indptr=True)
    assert torch.equal(gg.grouped_gemm_fwd(x, w, offs), gg.grouped_gemm_fwd(x, w, m_indptr=indptr))
    assert torch.equal(gg.grouped_gemm_dgrad(g, w, offs), gg.grouped_gemm_dgrad(g, w, m_indptr=indptr))
    assert torch.equal(gg.grouped_gemm_wgrad(g, x, offs), gg.grouped_gemm_wgrad(g, x, m_indptr=indptr))
    assert torch.equal(gg.grouped_gemm_fwd(x, w, offs), cake_ops.grouped_mm_bf16(x, w, indptr))


def test_no_groups(device):
    x = rand(9, 16, dtype=torch.bfloat16, device=device)
    w = rand(0, 8, 16, dtype=torch.bfloat16, device=device)
    offs = torch.zeros(0, dtype=torch.int32, device=device)
    assert torch.equal(gg.grouped_gemm_fwd(x, w, offs), torch.zeros(9, 8, dtype=torch.bfloat16, device=device))
    assert gg.grouped_gemm_wgrad(rand(9, 8, dtype=torch.bfloat16, device=device), x, offs).shape == (0, 8, 16)


def test_wgrad_bitwise_repeatable(device):
    sizes = [300, 0, 1, 517, 64]
    x = rand(sum(sizes), 256, dtype=torch.bfloat16, device=device)
    g = rand(sum(sizes), 128, dtype=torch.bfloat16, device=device)
    offs = make_offs(sizes, device)
    for out_dtype in (torch.bfloat16, torch.float32):
        first = gg.grouped_gemm_wgrad(g, x, offs, out_dtype=out_dtype)
        for _ in range(3):
            assert torch.equal(first, gg.grouped_gemm_wgrad(g, x, offs, out_dtype=out_dtype))


def test_out_variants_write_every_element(device):
    sizes, sum_m, x, w, g, offs = problem("tail", device, torch.bfloat16)
    for prepare, args, expected in [
        (gg.prepare_grouped_gemm_fwd, (x, w, offs), ref.grouped_gemm_fwd(x, w, offs)),
        (gg.prepare_grouped_gemm_dgrad, (g, w, offs), ref.grouped_gemm_dgrad(g, w, offs)),
        (gg.prepare_grouped_gemm_wgrad, (g, x, offs), ref.grouped_gemm_wgrad(g, x, offs, len(sizes))),
    ]:
        launch = prepare(*args)
        launch.out.fill_(float("nan"))  # poison: every element must be written
        out = launch.launch()
        assert out is launch.out
        assert rel_err(out, expected) < 1e-2


# ----------------------------------------------------------------------------------------------
# Autograd


def test_autograd_matches_float64(device):
    sizes = [33, 0, 1, 90]
    x = rand(sum(sizes) + 5, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    w = rand(4, 48, 64, dtype=torch.bfloat16, device=device).requires_grad_()
    offs = make_offs(sizes, device)
    gy = rand(x.shape[0], 48, dtype=torch.bfloat16, device=device)
    y = gg.cake_grouped_mm(x, w, offs)
    y.backward(gy)

    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    yr = ref.grouped_gemm_fwd(xr, wr, offs)
    yr.backward(gy.double())
    assert rel_err(y, yr.detach()) < 1e-2
    assert rel_err(x.grad, xr.grad) < 1e-2
    assert rel_err(w.grad, wr.grad) < 1e-2
    assert w.grad.dtype == torch.bfloat16
    assert (w.grad[1] == 0).all(), "empty group: exactly zero weight gradient"
    assert (x.grad[sum(sizes):] == 0).all(), "rows in no group get zero gradient"


def test_autograd_function_and_op_agree(device):
    sizes = [20, 3, 0]
    offs = make_offs(sizes, device)
    x = rand(23, 32, dtype=torch.bfloat16, device=device)
    w = rand(3, 16, 32, dtype=torch.bfloat16, device=device)
    gy = rand(23, 16, dtype=torch.bfloat16, device=device)
    grads = []
    for fn in (lambda a, b: gg.CakeGroupedMm.apply(a, b, offs, True),
               lambda a, b: torch.ops.cake.grouped_gemm_fwd(a, b, offs)):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(a, b).backward(gy)
        grads.append((a.grad, b.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_gradcheck_and_gradgradcheck_cpu():
    sizes = [3, 0, 4, 1]
    offs = make_offs(sizes, "cpu")
    x = torch.randn(sum(sizes) + 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    fwd = lambda a, b: torch.ops.cake.grouped_gemm_fwd(a, b, offs)  # noqa: E731
    assert torch.autograd.gradcheck(fwd, (x, w))
    assert torch.autograd.gradgradcheck(fwd, (x, w))
    g = torch.randn(sum(sizes) + 2, 6, dtype=torch.float64, requires_grad=True)
    dgrad = lambda a, b: torch.ops.cake.grouped_gemm_dgrad(a, b, offs)  # noqa: E731
    assert torch.autograd.gradcheck(dgrad, (g, w))
    wgrad = lambda a, b: torch.ops.cake.grouped_gemm_wgrad(a, b, offs, 4, torch.float64)  # noqa: E731
    assert torch.autograd.gradcheck(wgrad, (g, x))


def test_deterministic_gradients_bitwise(device):
    sizes = [400, 0, 77, 1000]
    offs = make_offs(sizes, device)
    x = rand(sum(sizes), 128, dtype=torch.bfloat16, device=device)
    w = rand(4, 64, 128, dtype=torch.bfloat16, device=device)
    gy = rand(sum(sizes), 64, dtype=torch.bfloat16, device=device)
    runs = []
    for _ in range(3):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        gg.cake_grouped_mm(a, b, offs, deterministic=True).backward(gy)
        runs.append((a.grad, b.grad))
    for a_grad, b_grad in runs[1:]:
        assert torch.equal(a_grad, runs[0][0]) and torch.equal(b_grad, runs[0][1])


# ----------------------------------------------------------------------------------------------
# opcheck and torch.compile


def opcheck_samples(device):
    sizes = [5, 0, 1, 10]
    offs = make_offs(sizes, device)
    indptr = make_offs(sizes, device, indptr=True)
    m, n, k, e = sum(sizes) + 2, 16, 24, len(sizes)

    def t(*shape, dtype=torch.bfloat16, grad=False):
        return rand(*shape, dtype=dtype, device=device).requires_grad_(grad)

    ws = torch.empty(cake_ops._C.grouped_gemm_workspace_size(e), dtype=torch.uint8, device=device)
    ops = torch.ops.cake
    return [
        (ops.grouped_gemm_fwd, (t(m, k, grad=True), t(e, n, k, grad=True), offs)),
        (ops.grouped_gemm_fwd, (t(m, k), t(e, n, k), indptr)),
        (ops.grouped_gemm_dgrad, (t(m, n, grad=True), t(e, n, k, grad=True), offs)),
        (ops.grouped_gemm_wgrad, (t(m, n, grad=True), t(m, k, grad=True), offs, e, torch.bfloat16)),
        (ops.grouped_gemm_wgrad, (t(m, n), t(m, k), indptr, e, torch.float32)),
        (ops.grouped_gemm_fwd_out, (t(m, k), t(e, n, k), offs, t(m, n), ws)),
        (ops.grouped_gemm_dgrad_out, (t(m, n), t(e, n, k), offs, t(m, k), ws)),
        (ops.grouped_gemm_wgrad_out, (t(m, n), t(m, k), offs, t(e, n, k, dtype=torch.float32), ws)),
    ]


def test_opcheck_every_op(device):
    checked = set()
    for op, args in opcheck_samples(device):
        torch.library.opcheck(op, args)  # schema, autograd registration, fake tensor, aot dispatch
        checked.add(op._qualified_op_name)
    defined = {getattr(torch.ops.cake, name)._qualified_op_name for name in dir(torch.ops.cake)
               if name.startswith("grouped_gemm") and isinstance(getattr(torch.ops.cake, name), torch._ops.OpOverloadPacket)}
    assert len(defined) == 6
    assert defined <= checked, f"ops without an opcheck sample: {defined - checked}"


class TinyMoE(torch.nn.Module):
    """Two grouped projections with an activation between: the shape of an MoE expert MLP."""

    def __init__(self, e, h, i, device):
        super().__init__()
        self.w1 = torch.nn.Parameter(rand(e, i, h, dtype=torch.bfloat16, device=device) * 0.1)
        self.w2 = torch.nn.Parameter(rand(e, h, i, dtype=torch.bfloat16, device=device) * 0.1)

    def forward(self, x, offs):
        return gg.cake_grouped_mm(torch.nn.functional.silu(gg.cake_grouped_mm(x, self.w1, offs)), self.w2, offs)


def run_moe_step(model, x, offs):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = model(x, offs)
    out.float().square().mean().backward()
    return out.detach(), x.grad, model.w1.grad, model.w2.grad


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fullgraph_moe_with_backward(device, mode):
    if mode is not None and device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    torch._dynamo.reset()
    sizes = [40, 0, 1, 23]
    offs = make_offs(sizes, device)
    model = TinyMoE(4, 32, 48, device)
    x = rand(sum(sizes) + 3, 32, dtype=torch.bfloat16, device=device)
    eager = run_moe_step(model, x, offs)
    compiled_model = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):  # warm-up, recording and replay for CUDA graphs
        compiled = run_moe_step(compiled_model, x, offs)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), "compiled and eager runs of the same kernels must agree bitwise"


def test_compiles_once_for_any_row_count(device):
    """The routed row count changes every step: one dynamic-shape graph, forward and backward."""
    torch._dynamo.reset()
    model = TinyMoE(4, 32, 48, device)
    x = rand(300, 32, dtype=torch.bfloat16, device=device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    compiled_model = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for sizes in ([40, 0, 1, 23], [100, 7, 0, 150], [3, 3, 3, 3], [0, 0, 0, 200]):
        offs = make_offs(sizes, device)
        rows = sum(sizes) + 2
        eager = run_moe_step(model, x[:rows], offs)
        for a, b in zip(eager, run_moe_step(compiled_model, x[:rows], offs)):
            assert torch.equal(a, b)
    assert counter.frame_count <= 2, counter.frame_count


# ----------------------------------------------------------------------------------------------
# cake_ops.grouped_mm: torch._grouped_mm's arguments, ragged forms


GROUPED_MM_FORMS = ["weight_transposed", "weight_k_major", "ragged_k", "ragged_k_float32"]


def grouped_mm_case(form, device, sizes=(0, 1, 130, 7, 0, 300, 64)):
    """(mat_a, mat_b, offs, out_dtype, float64 reference function of mat_a and mat_b) as torch._grouped_mm
    is called in an MoE layer's forward (ragged rows) and in its weight gradient (ragged K)."""
    e, offs, rows = len(sizes), make_offs(list(sizes), device), sum(sizes)
    if form.startswith("ragged_k"):
        grad_out = rand(rows, 48, dtype=torch.bfloat16, device=device)
        mat_a = grad_out.t()  # [N, sum_k]: the transposed view a backward pass hands over
        mat_b = rand(rows, 40, dtype=torch.bfloat16, device=device)
        return (mat_a, mat_b, offs, torch.float32 if form == "ragged_k_float32" else None,
                lambda a, b: ref.grouped_gemm_wgrad(a.t(), b, offs, e))  # out[e] = mat_a[:, g] @ mat_b[g]
    x = rand(rows + 5, 40, dtype=torch.bfloat16, device=device)
    w = rand(e, 48, 40, dtype=torch.bfloat16, device=device)  # [E, N, K], as nn.Linear-style experts store it
    mat_b = w.transpose(-2, -1) if form == "weight_transposed" else w.transpose(-2, -1).contiguous()
    return x, mat_b, offs, None, lambda a, b: ref.grouped_gemm_fwd(a, b.transpose(-2, -1), offs)


@pytest.mark.parametrize("form", GROUPED_MM_FORMS)
def test_grouped_mm_matches_float64_with_gradients(device, form):
    mat_a, mat_b, offs, out_dtype, reference = grouped_mm_case(form, device)
    a, b = mat_a.detach().requires_grad_(), mat_b.detach().requires_grad_()
    out = cake_ops.grouped_mm(a, b, offs, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16)
    grad = rand(*out.shape, dtype=out.dtype, device=device)
    out.backward(grad)
    a64, b64 = mat_a.detach().double().requires_grad_(), mat_b.detach().double().requires_grad_()
    expected = reference(a64, b64)
    expected.backward(grad.double())
    assert rel_err(out, expected.detach()) < 1e-2
    assert rel_err(a.grad, a64.grad) < 1e-2
    assert rel_err(b.grad, b64.grad) < 1e-2
    assert a.grad.shape == mat_a.shape and b.grad.shape == mat_b.shape


@pytest.mark.parametrize("form", ["weight_transposed", "weight_k_major", "ragged_k"])
def test_grouped_mm_agrees_with_torch_grouped_mm(device, form):
    mat_a, mat_b, offs, _, _ = grouped_mm_case(form, device, sizes=(8, 0, 24, 16))  # torch's 16-byte rule on K
    ours, theirs = cake_ops.grouped_mm(mat_a, mat_b, offs), torch._grouped_mm(mat_a, mat_b, offs=offs)
    rows = int(offs[-1]) if form != "ragged_k" else ours.shape[0]  # torch leaves rows past the last group unset
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert rel_err(ours[:rows], theirs[:rows].double()) < 1e-2


@pytest.mark.parametrize("form, kernel", [("weight_transposed", "cake.grouped_gemm_fwd.default"),
                                          ("weight_k_major", "cake.grouped_gemm_dgrad.default"),
                                          ("ragged_k", "cake.grouped_gemm_wgrad.default")])
def test_grouped_mm_runs_one_kernel_and_copies_no_weights(form, kernel):
    """Each form is one op on the caller's tensors (through views): no transposed copy of the weights (or of
    grad_out)."""
    mat_a, mat_b, offs, _, _ = grouped_mm_case(form, "cpu")
    with RecordOps() as record:
        cake_ops.grouped_mm(mat_a, mat_b, offs)
    assert record.ops == [kernel], record.ops


def test_grouped_mm_compiles_with_backward(device):
    torch._dynamo.reset()
    sizes = [40, 0, 1, 23]
    offs = make_offs(sizes, device)
    w1 = (rand(4, 48, 32, dtype=torch.bfloat16, device=device) * 0.1).requires_grad_()
    w2 = (rand(4, 32, 48, dtype=torch.bfloat16, device=device) * 0.1).requires_grad_()

    def experts(x):  # torchtitan's grouped experts, with cake_ops.grouped_mm for torch._grouped_mm
        h = torch.nn.functional.silu(cake_ops.grouped_mm(x, w1.transpose(-2, -1), offs))
        return cake_ops.grouped_mm(h, w2.transpose(-2, -1), offs)

    def step(fn, x):
        w1.grad = w2.grad = None
        x = x.detach().requires_grad_()
        out = fn(x)
        out.float().square().mean().backward()
        return out.detach(), x.grad, w1.grad, w2.grad

    x = rand(sum(sizes) + 3, 32, dtype=torch.bfloat16, device=device)
    eager = step(experts, x)
    compiled = step(torch.compile(experts, fullgraph=True), x)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# torch.autocast: the GEMMs run in its dtype, as torch.mm does, and gradients return in the inputs' dtypes


def cast_run(fn, tensors, dtype, grad):
    """fn(*tensors) and the tensors' gradients for ``grad`` (None where a tensor needs none), the tensors
    taken as leaves, cast to ``dtype`` (None: as they are)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad", "cake_grouped_mm"])
def test_grouped_gemm_ops_under_autocast_compute_in_its_dtype(device, op):
    """float32 operands inside torch.autocast: the bf16 computation on their casts, bit for bit, and float32
    gradients that are the bf16 ones (the casts sit above autograd, or in cake_grouped_mm's forward), but for
    cake_grouped_mm's float32 weight, whose gradient is wgrad's float32 output (no bf16 rounding)."""
    sizes = [0, 1, 130, 7, 0, 64]
    offs, rows, e = make_offs(sizes, device), sum(sizes) + 3, len(sizes)
    a = rand(rows, 48, dtype=torch.float32, device=device).requires_grad_()
    fns = {"fwd": lambda a, b: torch.ops.cake.grouped_gemm_fwd(a, b, offs),
           "dgrad": lambda a, b: torch.ops.cake.grouped_gemm_dgrad(a, b, offs),
           "wgrad": lambda a, b: torch.ops.cake.grouped_gemm_wgrad(a, b, offs, e, torch.float32),
           "cake_grouped_mm": lambda a, b: gg.cake_grouped_mm(a, b, offs)}
    b = rand(*((rows, 40) if op == "wgrad" else (e, 40, 48) if op != "dgrad" else (e, 48, 40)),
             dtype=torch.float32, device=device).requires_grad_()
    grad = rand(*fns[op](a.detach().bfloat16(), b.detach().bfloat16()).shape, dtype=torch.bfloat16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = cast_run(fns[op], (a, b), None, grad)
    want = cast_run(fns[op], (a, b), torch.bfloat16, grad)
    assert got[0].dtype == (torch.float32 if op == "wgrad" else torch.bfloat16)
    assert torch.equal(got[0], want[0].to(got[0].dtype))
    if op == "cake_grouped_mm":
        want[2] = torch.ops.cake.grouped_gemm_wgrad(grad, a.detach().bfloat16(), offs, e, torch.float32)
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == torch.float32 and torch.equal(g, w.float())


def test_grouped_gemm_ops_under_autocast_keep_float64_and_wgrad_out_dtype():
    """autocast leaves float64 alone (as torch.mm; CPU: the CUDA kernels take 16-bit operands), and wgrad's
    out_dtype naming its input's dtype follows the input through the cast."""
    x, w, offs = rand(9, 16, dtype=torch.float64, device="cpu"), rand(2, 8, 16, dtype=torch.float64, device="cpu"), \
        make_offs([4, 5], "cpu")
    g = rand(9, 8, dtype=torch.float16, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.cake.grouped_gemm_fwd(x, w, offs)
        dw = torch.ops.cake.grouped_gemm_wgrad(g, x.half(), offs, 2, torch.float16)
    assert y.dtype == torch.float64 and torch.equal(y, torch.ops.cake.grouped_gemm_fwd(x, w, offs))
    want = torch.ops.cake.grouped_gemm_wgrad(g.bfloat16(), x.half().bfloat16(), offs, 2, torch.bfloat16)
    assert dw.dtype == torch.bfloat16 and torch.equal(dw, want)


@pytest.mark.parametrize("form", GROUPED_MM_FORMS)
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_grouped_mm_under_autocast_matches_the_bf16_run(device, form, weights):
    """As a training step under torch.autocast calls it: float32 activations (a LayerNorm's output) with float32
    or bf16 weights. The result and the gradients are the bf16 call's, the gradients in each input's dtype."""
    mat_a, mat_b, offs, out_dtype, _ = grouped_mm_case(form, device)
    a = mat_a.float().requires_grad_()
    b = mat_b.to(getattr(torch, weights)).requires_grad_()
    fn = lambda a, b: cake_ops.grouped_mm(a, b, offs, out_dtype=out_dtype)  # noqa: E731
    grad = rand(*fn(mat_a, mat_b).shape, dtype=torch.bfloat16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = cast_run(fn, (a, b), None, grad)
    want = cast_run(fn, (a, b), torch.bfloat16, grad)
    assert got[0].dtype == (out_dtype or torch.bfloat16) and torch.equal(got[0], want[0])
    assert got[1].dtype == torch.float32 and torch.equal(got[1], want[1].float())
    assert got[2].dtype == b.dtype and torch.equal(got[2], want[2].to(b.dtype))


def test_grouped_mm_compiles_under_autocast(device):
    """fullgraph with backward inside torch.autocast, float32 weights: bitwise the eager autocast step."""
    torch._dynamo.reset()
    offs = make_offs([40, 0, 1, 23], device)
    w1 = (rand(4, 48, 32, dtype=torch.float32, device=device) * 0.1).requires_grad_()
    w2 = (rand(4, 32, 48, dtype=torch.float32, device=device) * 0.1).requires_grad_()

    def experts(x):
        h = torch.nn.functional.silu(cake_ops.grouped_mm(x, w1.transpose(-2, -1), offs))
        return cake_ops.grouped_mm(h, w2.transpose(-2, -1), offs)

    def step(fn, x):
        w1.grad = w2.grad = None
        x = x.detach().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn(x)
        out.float().square().mean().backward()
        return out.detach(), x.grad, w1.grad, w2.grad

    x = rand(67, 32, dtype=torch.float32, device=device)
    eager = step(experts, x)
    assert eager[0].dtype == torch.bfloat16 and eager[3].dtype == torch.float32
    compiled = step(torch.compile(experts, fullgraph=True), x)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Autotuning


def test_autotune_context_on_cpu_is_a_no_op(tmp_path):
    sizes, sum_m, x, w, g, offs = problem("ragged", "cpu", torch.float32)
    cache = tmp_path / "tuning.json"
    with cake_ops.autotune(cache_file=str(cache)):
        y = gg.grouped_gemm_fwd(x, w, offs)
    assert rel_err(y, ref.grouped_gemm_fwd(x, w, offs)) < 1e-5
    assert json.loads(cache.read_text())["grouped_gemm"] == {}


def test_autotune_cache_file_folder_is_checked_on_entry(tmp_path):
    with pytest.raises(FileNotFoundError, match="cake_ops.autotune: cache_file .* is in no existing folder"):
        with cake_ops.autotune(cache_file=str(tmp_path / "missing" / "tuning.json")):
            pass


def test_load_tuning_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="cake_ops.load_tuning: .*bad.json is not JSON"):
        cake_ops.load_tuning(str(bad))
    for text in ("[1, 2]", json.dumps({"grouped_gemm": [1]})):
        bad.write_text(text)
        with pytest.raises(ValueError, match="is not a tuning file written by cake_ops.save_tuning"):
            cake_ops.load_tuning(str(bad))


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
def test_tuning_files_are_kept_per_kind_of_gpu(tmp_path, monkeypatch):
    """A cache tuned on one card is not applied on another (no GPU needed: the names are faked)."""
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    cache = tmp_path / "tuning.json"
    cache.write_text(json.dumps({"version": 1, "device": "NVIDIA H200",
                                 "grouped_gemm": {"fwd|8|4096|1024|1024": names[0]}}))
    tuning = importlib.import_module("cake_ops.autotune")  # the module (cake_ops.autotune is its context manager)
    cake_ops.clear_tuning()
    try:
        monkeypatch.setattr(tuning, "_device_name", lambda: "NVIDIA H100 80GB HBM3")
        with pytest.warns(UserWarning, match="tuned on NVIDIA H200, this is NVIDIA H100 80GB HBM3: not loaded"):
            assert cake_ops.load_tuning(str(cache)) == 0
        monkeypatch.setattr(tuning, "_device_name", lambda: "NVIDIA H200")
        assert cake_ops.load_tuning(str(cache)) == 1
        cake_ops.save_tuning(str(cache))
        assert json.loads(cache.read_text())["device"] == "NVIDIA H200"
    finally:
        cake_ops.clear_tuning()


@cuda_only
def test_autotune_keeps_the_fastest_tactic_per_bucket(tmp_path):
    cake_ops.clear_tuning()
    sizes = [300, 0, 17, 1024, 5]
    x = rand(sum(sizes), 512, dtype=torch.bfloat16, device="cuda")
    w = rand(len(sizes), 256, 512, dtype=torch.bfloat16, device="cuda")
    g = rand(sum(sizes), 256, dtype=torch.bfloat16, device="cuda")
    offs = make_offs(sizes, "cuda")
    e, n, k, m = len(sizes), 256, 512, sum(sizes)
    heuristic = cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k)
    cache = tmp_path / "tuning.json"
    try:
        with cake_ops.autotune(cache_file=str(cache)):
            y = gg.grouped_gemm_fwd(x, w, offs)
            dw = gg.grouped_gemm_wgrad(g, x, offs, out_dtype=torch.float32)
        assert rel_err(y, ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
        assert rel_err(dw, ref.grouped_gemm_wgrad(g, x, offs, e)) < 1e-2
        entries = json.loads(cache.read_text())["grouped_gemm"]
        rows = 2048  # sum_m 1346 rounded up to a power of two
        fwd_name = entries[f"fwd|{e}|{rows}|{n}|{k}"]
        assert f"wgrad_f32|{e}|{rows}|{n}|{k}" in entries
        names = cake_ops._C.grouped_gemm_tactics("fwd")
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k) == names.index(fwd_name)
        cake_ops.clear_tuning()
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k) == heuristic
        assert cake_ops.load_tuning(str(cache)) == 2
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k) == names.index(fwd_name)
        assert torch.equal(gg.grouped_gemm_fwd(x, w, offs), y)  # the tuned kernel runs outside the context
    finally:
        cake_ops.clear_tuning()


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
def test_tuned_choices_are_kept_per_epilogue(tmp_path):
    """A tuned choice holds for the epilogue it was timed with (the MoE GEMMs' SwiGLU and scatter
    twins apart from the plain GEMM of the same sizes); cache files keep the epilogue in the key,
    and keys without one (older files) are the plain GEMM's. No GPU needed: choices only."""
    e, m, n, k = 64, 4096, 4096, 1536
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    heuristic = {ep: cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k, -1, ep)
                 for ep in ("none", "swiglu", "scatter")}
    tuned_scatter = next(i for i in range(len(names)) if i != heuristic["scatter"])
    tuned_plain = next(i for i in range(len(names)) if i not in (heuristic["none"], tuned_scatter))
    cache = tmp_path / "tuning.json"
    cache.write_text(json.dumps({"version": 1, "grouped_gemm": {
        f"fwd|{e}|{m}|{n}|{k}|scatter": names[tuned_scatter],
        f"fwd|{e}|{m}|{n}|{k}": names[tuned_plain],
        f"fwd|{e}|{m}|{n}|{k}|gelu": names[0],  # no such epilogue: ignored
    }}))
    cake_ops.clear_tuning()
    try:
        assert cake_ops.load_tuning(str(cache)) == 2
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k, -1, "scatter") == tuned_scatter
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k, -1, "none") == tuned_plain
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k, -1, "swiglu") == heuristic["swiglu"]  # untuned
        with pytest.raises(ValueError, match="epilogue must be none, swiglu, gather_swiglu, swiglu_gu, gather_swiglu_gu or scatter, got 'gelu'"):
            cake_ops._C.set_grouped_gemm_tuned_tactic("fwd", e, m, n, k, 0, "gelu")
        cake_ops.clear_tuning()
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, m, n, k, -1, "scatter") == heuristic["scatter"]
    finally:
        cake_ops.clear_tuning()


H200_DRAM_TBPS = 4.8  # the heuristic's rules were measured on the H200


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
@pytest.mark.parametrize("family,e,sum_m,n,k,expected", [
    ("fwd", 128, 128, 1536, 2048, "fwd_bf16_swapab_coop_128x32x128_c1x1"),       # decode
    ("dgrad", 128, 1024, 1536, 2048, "dgrad_bf16_ping_64x256x64_c1x1"),
    ("wgrad", 128, 128, 1536, 2048, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),
    ("fwd", 128, 65536, 1536, 2048, "fwd_bf16_fixed_ping_64x256x64_c1x1"),        # Qwen3 experts (512 rows)
    ("fwd", 128, 8192, 2048, 768, "fwd_bf16_fixed_ping_128x128x64_c1x2"),          # 64 rows: weight-bound
    ("fwd", 128, 8192, 1408, 768, "fwd_bf16_fixed_ping_128x128x64_c1x1"),          # ... 11 N tiles: no pairs
    ("dgrad", 128, 65536, 2048, 768, "dgrad_bf16_fixed_ping_64x256x64_c1x1"),
    ("dgrad", 128, 131072, 2048, 768, "dgrad_bf16_fixed_coop_128x256x64_c2x1"),   # 3 N (= K) tiles
    ("dgrad", 8, 16384, 4096, 14336, "dgrad_bf16_fixed_coop_128x256x64_c1x2"),    # Mixtral
    ("fwd", 4, 112576, 4096, 6144, "fwd_bf16_fixed_coop_128x256x64_c1x2"),        # large groups
    ("fwd", 4, 112576, 4352, 6144, "fwd_bf16_fixed_coop_128x256x64_c2x1"),        # 17 N tiles
    ("fwd_f16", 128, 65536, 1536, 2048, "fwd_f16_coop_128x256x64_c1x2"),          # float16: ptr-array tiles
    ("fwd", 4, 112576, 6144, 2048, "fwd_bf16_ping_128x128x64_c1x1_rasterN"),      # w[e] fits in L2
    ("fwd_f16", 128, 128, 1536, 2048, "fwd_f16_swapab_coop_128x32x128_c1x1"),     # float16: same rules
    ("fwd_f16", 4, 112576, 4096, 6144, "fwd_f16_coop_128x256x64_c1x2_rasterN_swz4"),
    ("fwd_e4m3", 64, 512, 3072, 4096, "fwd_e4m3_swapab_coop_128x32x256_c1x1"),     # fp8: StepFun decode
    # T=1: 8 experts x 24 tiles of 128 rows fill 2 waves of 132 SMs to 73%; 64-row tiles 97%
    ("fwd_e4m3", 64, 8, 3072, 4096, "fwd_e4m3_swapab_ping_64x16x512_c1x1"),
    ("fwd", 64, 8, 3072, 4096, "fwd_bf16_swapab_ping_64x16x256_c1x1"),
    ("fwd", 2, 64, 1536, 2048, "fwd_bf16_fixed_ping_128x128x64_c1x2"),  # 32 rows an expert: a 128-row tile
    ("fwd_e4m3", 64, 8, 4096, 1536, "fwd_e4m3_swapab_coop_128x32x256_c1x1"),      # 256 tiles: 97% either way
    ("fwd_e4m3", 64, 16384, 3072, 4096, "fwd_e4m3_ping_64x256x128_c1x1"),  # 256 rows / expert
    ("fwd_e4m3", 288, 16384, 4096, 1280, "fwd_e4m3_ping_64x256x128_c1x1"),          # 57 rows / expert
    ("fwd_e4m3", 288, 131072, 4096, 1280, "fwd_e4m3_coop_128x256x128_c1x2_rasterN_swz4"),  # 455 rows
    ("fwd_e4m3", 64, 65536, 4352, 1536, "fwd_e4m3_coop_128x256x128_c2x1"),         # 17 N tiles
    ("dgrad", 4, 112576, 6144, 2048, "dgrad_bf16_fixed_coop_128x256x64_c1x2"),
    ("wgrad", 128, 65536, 2048, 768, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),    # 512 rows: fixed operands
    ("wgrad", 128, 8192, 1536, 2048, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),     # 64 rows
    ("wgrad", 8, 131072, 4096, 6144, "wgrad_bf16_fixed_coop_128x256x64_c1x2"),     # large groups
    ("wgrad", 8, 131072, 4096, 6152, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),     # 25 N (= K) tiles
    # Mixtral fc1, 2048 rows: a group's grad_out (117 MB) overflows L2, its x (17 MB) fits: along K's side first
    ("wgrad_f32", 8, 16384, 28672, 4096, "wgrad_f32_fixed_coop_128x256x64_c2x1_rasterN"),
    ("wgrad", 8, 16384, 28672, 4096, "wgrad_bf16_fixed_coop_128x256x64_c2x1_rasterN"),
    ("wgrad", 8, 8192, 28672, 4096, "wgrad_bf16_fixed_coop_128x256x64_c2x1_rasterN"),   # 1024 rows: 59 MB
    ("wgrad", 8, 4096, 28672, 4096, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),    # 512 rows: 29 MB fit in L2
    ("wgrad", 8, 16384, 4096, 14336, "wgrad_bf16_fixed_coop_128x256x64_c2x1"),   # Mixtral fc2: x is the large one
    ("wgrad", 8, 32768, 28672, 4096, "wgrad_bf16_fixed_coop_128x256x64_c1x2"),   # 4096 rows: large groups
    ("wgrad_f32", 128, 128, 1536, 2048, "wgrad_f32_fixed_coop_128x256x64_c2x1"),   # decode
])
def test_heuristic_choices(family, e, sum_m, n, k, expected):
    """The rules as measured on the H200 (its DRAM bandwidth given, whatever GPU runs the test)."""
    names = cake_ops._C.grouped_gemm_tactics(family)
    assert names[cake_ops._C.grouped_gemm_tactic_for(family, e, sum_m, n, k, -1, "none", H200_DRAM_TBPS)] == expected


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
def test_weight_in_l2_rule_needs_the_h200s_dram():
    """The E=4 "down" shape's weight fits in L2, but the 128x128 rasterN tile's re-reads of it mostly miss:
    with an H100's 3.35 TB/s it ran at 0.75-0.78x torch._grouped_mm, so there the large-groups tile runs."""
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    shape = ("fwd", 4, 112576, 6144, 2048, -1, "none")
    tactic_for = cake_ops._C.grouped_gemm_tactic_for
    assert names[tactic_for(*shape, H200_DRAM_TBPS)] == "fwd_bf16_ping_128x128x64_c1x1_rasterN"
    assert names[tactic_for(*shape, 3.35)] == "fwd_bf16_fixed_coop_128x256x64_c1x2"
    with pytest.raises(ValueError, match=r"grouped_gemm_tactic_for: dram_tbps must be >= 0 .*got -1"):
        tactic_for(*shape, -1.0)


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
@pytest.mark.parametrize("family,e,sum_m,n,k,expected,epilogue", [
    ("fwd", 128, 32768, 1536, 2048, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),   # Qwen3-30B T=4096 GEMM1
    ("fwd", 128, 32768, 4096, 1536, "fwd_bf16_fixed_ping_64x256x64_c1x1", "none"),     # Qwen3-235B T=4096 GEMM2
    ("fwd", 128, 32768, 2048, 768, "fwd_bf16_fixed_ping_64x256x64_c1x1", "scatter"),   # Qwen3-30B: its twin
    ("fwd", 128, 131072, 2048, 768, "fwd_bf16_fixed_ping_64x256x64_c1x1", "scatter"),  # 1024 rows: its twin
    ("fwd", 128, 131072, 2048, 768, "fwd_bf16_fixed_coop_128x256x64_c1x2", "none"),    # ... the plain GEMM
    ("fwd", 8, 2048, 4096, 14336, "fwd_bf16_fixed_ping_64x256x64_c1x1", "scatter"),    # Mixtral T=1024: no twin
    ("fwd", 8, 8192, 4096, 14336, "fwd_bf16_fixed_coop_128x256x64_c1x2", "scatter"),   # ... T=4096, 1024 rows
    ("fwd", 8, 2048, 28672, 4096, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),     # Mixtral T=1024 GEMM1
    ("fwd", 128, 65536, 1536, 2048, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),   # 512 rows per group
    ("fwd", 8, 8192, 28672, 4096, "fwd_bf16_fixed_coop_128x256x64_c1x2", "swiglu"),    # 1024 rows per group
    ("fwd", 128, 8192, 1536, 2048, "fwd_bf16_fixed_ping_128x128x64_c1x2", "swiglu"),   # 64: weight-bound
    ("fwd", 128, 8192, 2048, 768, "fwd_bf16_fixed_ping_128x128x64_c1x2", "scatter"),   # it has a scatter twin
    ("fwd", 128, 8192, 2176, 768, "fwd_bf16_fixed_ping_128x128x64_c1x1", "scatter"),   # 17 N tiles: no cluster
    ("fwd", 48, 16384, 4096, 7168, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),    # any K (Kimi-K2 shard)
    ("fwd", 128, 2048, 2048, 768, "fwd_bf16_fixed_ping_64x256x64_c1x1", "scatter"),   # 16 rows: its scatter twin
    ("fwd", 128, 2048, 2048, 768, "fwd_bf16_swapab_coop_128x32x128_c1x1", "none"),     # ... the plain GEMM
    ("fwd", 128, 2048, 1536, 2048, "fwd_bf16_swapab_coop_128x32x128_c1x1", "swiglu"),   # 16 rows: swap-AB
    ("fwd", 128, 3328, 1536, 2048, "fwd_bf16_swapab_coop_128x32x128_c1x1", "swiglu"),   # 26: 26 + sqrt(26) <= 32
    ("fwd", 128, 3456, 1536, 2048, "fwd_bf16_fixed_ping_128x128x64_c1x2", "swiglu"),   # 27 rows: a 128-row tile
    ("fwd", 128, 4096, 1536, 2048, "fwd_bf16_fixed_ping_128x128x64_c1x2", "swiglu"),   # 32 rows (Qwen3-30B T=512)
    ("fwd", 128, 14976, 1536, 2048, "fwd_bf16_fixed_ping_128x128x64_c1x2", "swiglu"),  # 117: 117 + sqrt(117) <= 128
    ("fwd", 128, 15104, 1536, 2048, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),   # 118 rows: 64-row tiles
    ("fwd", 128, 16384, 1536, 2048, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),   # 128 (Qwen3-30B T=2048)
    ("fwd", 8, 192, 28672, 4096, "fwd_bf16_swapab_coop_128x32x128_c1x1", "swiglu"),    # 24 rows (Mixtral T=96)
    ("fwd", 8, 256, 28672, 4096, "fwd_bf16_fixed_ping_128x128x64_c1x2", "swiglu"),     # 32 rows (Mixtral T=128)
    ("fwd", 8, 256, 4096, 14336, "fwd_bf16_fixed_ping_128x128x64_c1x2", "scatter"),    # ... GEMM2 past the K bound
    # Mixtral GEMM2 (K = 14336): the cooperative tile where 128-row tiles pad no more than 64-row ones
    ("fwd", 8, 1536, 4096, 14336, "fwd_bf16_coop_128x256x64_c2x1_swz4", "none"),       # 192 rows: 256 either way
    ("fwd", 8, 1536, 4096, 14336, "fwd_bf16_coop_128x256x64_c2x1_swz4", "scatter"),
    ("fwd", 8, 2560, 4096, 14336, "fwd_bf16_coop_128x256x64_c1x2_rasterN", "none"),    # 320 rows: 384, 3 row tiles
    ("fwd", 8, 1280, 4096, 14336, "fwd_bf16_fixed_ping_64x256x64_c1x1", "none"),       # 160 rows: 192 vs 256
    ("fwd", 8, 2048, 4096, 14336, "fwd_bf16_fixed_ping_64x256x64_c1x1", "none"),       # 256 rows: 320 vs 384
    ("fwd", 8, 1536, 28672, 4096, "fwd_bf16_fixed_ping_64x256x64_c1x1", "swiglu"),     # GEMM1 (K = 4096): 64x256
    ("fwd_e4m3", 64, 1536, 3072, 4096, "fwd_e4m3_swapab_coop_128x32x256_c1x1", "swiglu"),  # e4m3 24 rows: swap-AB
    ("fwd_e4m3", 64, 2048, 3072, 4096, "fwd_e4m3_ping_64x256x128_c1x1", "swiglu"),  # 32 rows: swap-AB overflows
    ("fwd_e4m3", 64, 4096, 4096, 1536, "fwd_e4m3_ping_64x256x128_c1x1", "none"),    # 64 rows
    ("fwd", 8, 128, 4096, 14336, "fwd_bf16_swapab_coop_128x32x128_c1x1", "scatter"),   # past the twin's K bound
    ("fwd", 8, 128, 2048, 768, "fwd_bf16_swapab_coop_128x32x128_c1x1", "scatter"),     # 64 tiles: SMs left idle
    ("fwd_f16", 128, 32768, 1536, 2048, "fwd_f16_coop_128x256x64_c1x2", "none"),   # float16: no such tile
    ("fwd_e4m3", 64, 16384, 3072, 4096, "fwd_e4m3_ping_64x256x128_c1x1", "swiglu"),   # StepFun fp8 T=2048 GEMM1
    ("fwd_e4m3", 64, 16384, 4096, 1536, "fwd_e4m3_ping_64x256x128_c1x1", "none"),     # ... GEMM2
])
def test_heuristic_small_groups(family, e, sum_m, n, k, expected, epilogue):
    """bfloat16: under the fused finalize from 1 row per group the 64x256 tile's scatter twin where it runs and its
    tiles cover the SMs (else swap-AB up to 26 rows per group, GEMM2 and the finalize kernel); otherwise swap-AB up
    to 26 rows per group (while its 32-row token tiles hold the mean plus its square root); then up to 117 rows per
    group 128x128 pingpong (the same margin in 128 rows; in a 1x2 cluster where its N tiles pair up), then up to 640
    rows 64x256 pingpong, both with fixed operands, for every epilogue; under the fused finalize the 64x256 tile up
    to 1024 rows where K <= 4096 (its scatter twin's bound; past it, up to 640 rows, the plain GEMM and the finalize
    kernel), but from K = 8192 the 128x256 cooperative tile where the groups fill no more 128-row tiles than they pad
    64-row ones to (2x1 cluster where those pair up, else 1x2); e4m3 fwd: swap-AB up to 26 rows, then to 384 rows
    64x256 pingpong."""
    names = cake_ops._C.grouped_gemm_tactics(family)
    assert names[cake_ops._C.grouped_gemm_tactic_for(family, e, sum_m, n, k, -1, epilogue, H200_DRAM_TBPS)] == expected


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactic_for"), reason="built without CUDA kernels")
def test_heuristic_expected_rows():
    """The MoE GEMMs' expected_routes: a Kimi-K2 EP8 shard (48 of 384 experts) at T=1024, top-8, runs
    GEMM1 over 8192 rows of which ~1024 are its own: 21 per expert, the swap-AB regime (its 32-row token
    tiles hold 21 + sqrt(21) rows)."""
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    tactic_for = cake_ops._C.grouped_gemm_tactic_for
    # Without the hint: 170 rows per expert, the small-groups rule's 64x256 pingpong tile.
    assert names[tactic_for("fwd", 48, 8192, 4096, 7168)] == "fwd_bf16_fixed_ping_64x256x64_c1x1"
    # T=4096: 85 rows per expert, weight-bound: one 128-row tile per expert, not the 64-row tiles.
    assert names[tactic_for("fwd", 48, 32768, 4096, 7168, 4096)] == "fwd_bf16_fixed_ping_128x128x64_c1x2"
    assert names[tactic_for("fwd", 48, 8192, 4096, 7168, 1024)] == "fwd_bf16_swapab_coop_128x32x128_c1x1"
    # T=1536: 32 per expert, more than swap-AB's 32-row token tiles hold for the fuller experts.
    assert names[tactic_for("fwd", 48, 12288, 4096, 7168, 1536)] == "fwd_bf16_fixed_ping_128x128x64_c1x2"
    assert tactic_for("fwd", 48, 8192, 4096, 7168, -1) == tactic_for("fwd", 48, 8192, 4096, 7168)
    # A hint above sum_m counts as sum_m.
    assert tactic_for("fwd", 48, 1024, 4096, 7168, 8192) == tactic_for("fwd", 48, 1024, 4096, 7168)
    with pytest.raises(ValueError, match="epilogue must be none, swiglu, gather_swiglu, swiglu_gu, gather_swiglu_gu or scatter, got 'gelu'"):
        tactic_for("fwd", 48, 1024, 4096, 7168, -1, "gelu")


# ----------------------------------------------------------------------------------------------
# Experimental warning


def test_experimental_warning_once(monkeypatch):
    from cake_ops import _experimental

    monkeypatch.setattr(_experimental, "_warned", set())
    x = torch.randn(4, 8)
    w = torch.randn(2, 8, 8)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gg.grouped_gemm_fwd(x, w, offs)
        gg.grouped_gemm_dgrad(torch.randn(4, 8), w, offs)
        cake_ops.grouped_mm_bf16(x.bfloat16(), w.bfloat16(), torch.tensor([0, 1, 4], dtype=torch.int32))
    assert [type(c.message) for c in caught] == [cake_ops.ExperimentalWarning]


# ----------------------------------------------------------------------------------------------
# Errors: each names the op, what it expected and what it got.


class TestErrors(expecttest.TestCase):
    def setUp(self):
        self.x = torch.randn(10, 16, dtype=torch.bfloat16)
        self.w = torch.randn(3, 8, 16, dtype=torch.bfloat16)
        self.g = torch.randn(10, 8, dtype=torch.bfloat16)
        self.offs = torch.tensor([2, 2, 9], dtype=torch.int32)

    def error(self, fn, *args):
        with self.assertRaises(RuntimeError) as ctx:
            fn(*args)
        return str(ctx.exception).split("\n")[0]

    def test_dtype(self):
        fwd = torch.ops.cake.grouped_gemm_fwd
        self.assertExpectedInline(self.error(fwd, self.x.float(), self.w, self.offs), """cake::grouped_gemm_fwd: x and w must have the same dtype, got Float and BFloat16""")
        self.assertExpectedInline(self.error(fwd, self.x.int(), self.w.int(), self.offs), """cake::grouped_gemm_fwd: x must be bfloat16, float16, float32 or float64, got Int""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w, self.offs.long()), """cake::grouped_gemm_fwd: offs must be int32, got Long""")
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_wgrad, self.g, self.x, self.offs, 3, torch.float16), """cake::grouped_gemm_wgrad: out_dtype must be the input dtype (BFloat16) or float32, got Half""")

    def test_shapes(self):
        fwd = torch.ops.cake.grouped_gemm_fwd
        self.assertExpectedInline(self.error(fwd, self.x[:, :8], self.w[:, :, :8].contiguous(), self.offs), """cake::grouped_gemm_fwd: x must be contiguous (row-major [sum_m, K]), got strides [16, 1]; call .contiguous() first""")
        self.assertExpectedInline(self.error(fwd, self.x[:, :12].contiguous(), self.w, self.offs), """cake::grouped_gemm_fwd: K mismatch: x is [sum_m, K] with K=12 but w is [E, N, K] with K=16""")
        self.assertExpectedInline(self.error(fwd, self.x[None], self.w, self.offs), """cake::grouped_gemm_fwd: x must be a 2-D [sum_m, K] tensor, got shape [1, 10, 16]""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w, self.offs[:2]), """cake::grouped_gemm_fwd: offs must be 1-D with E=3 entries (cumulative group ends) or E+1=4 (m_indptr with a leading zero), got shape [2]""")
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_dgrad, self.x, self.w, self.offs), """cake::grouped_gemm_dgrad: N mismatch: grad_out is [sum_m, N] with N=16 but w is [E, N, K] with N=8""")
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_wgrad, self.g[:9], self.x, self.offs, 3, torch.float32), """cake::grouped_gemm_wgrad: sum_m mismatch: grad_out has 9 rows but x has 10""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w.transpose(1, 2).contiguous().transpose(1, 2), self.offs), """cake::grouped_gemm_fwd: w must be contiguous (row-major [E, N, K]), got strides [128, 1, 8]; call .contiguous() first""")

    def test_offset_values(self):
        fwd = torch.ops.cake.grouped_gemm_fwd
        self.assertExpectedInline(self.error(fwd, self.x, self.w, torch.tensor([2, 1, 9], dtype=torch.int32)), """cake::grouped_gemm_fwd: group ends must be non-decreasing, got 1 after 2 at group 1""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w, torch.tensor([2, 2, 11], dtype=torch.int32)), """cake::grouped_gemm_fwd: group end 11 at group 2 is past the 10 packed rows""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w, torch.tensor([1, 2, 2, 9], dtype=torch.int32)), """cake::grouped_gemm_fwd: m_indptr[0] must be 0, got 1""")
        self.assertExpectedInline(self.error(fwd, self.x, self.w, torch.tensor([-1, 2, 9], dtype=torch.int32)), """cake::grouped_gemm_fwd: group ends must be non-decreasing, got -1 after 0 at group 0""")

    def test_out_and_workspace(self):
        ws = torch.empty(cake_ops._C.grouped_gemm_workspace_size(3), dtype=torch.uint8)
        out = torch.empty(10, 9, dtype=torch.bfloat16)
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_fwd_out, self.x, self.w, self.offs, out, ws), """cake::grouped_gemm_fwd_out: out must have shape [10, 8], got [10, 9]""")
        out = torch.empty(10, 8, dtype=torch.float32)
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_fwd_out, self.x, self.w, self.offs, out, ws), """cake::grouped_gemm_fwd_out: out must be BFloat16, got Float""")

    def test_device_mismatch_reported_by_fake(self):
        # Without a GPU, a meta tensor stands in for "another device": the fake raises.
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_fwd, self.x, self.w, self.offs.to("meta")), """cake::grouped_gemm_fwd: offs must be on the operands' device cpu, got meta""")
        self.assertExpectedInline(self.error(torch.ops.cake.grouped_gemm_fwd, self.x, self.w.to("meta"), self.offs), """cake::grouped_gemm_fwd: x and w must be on the same device, got cpu and meta""")

    def test_python_api(self):
        with self.assertRaises(TypeError) as ctx:
            gg.grouped_gemm_fwd(self.x, self.w)
        self.assertExpectedInline(str(ctx.exception), """grouped_gemm_fwd: pass exactly one of offs [E] (group ends) or m_indptr [E+1]""")
        with self.assertRaises(ValueError) as ctx:
            gg.grouped_gemm_fwd(self.x, self.w, m_indptr=self.offs)
        self.assertExpectedInline(str(ctx.exception), """grouped_gemm_fwd: m_indptr must have E+1=4 entries, got 3""")
        with self.assertRaises(TypeError) as ctx:
            cake_ops.grouped_mm_bf16(self.x.float(), self.w, self.offs)
        self.assertExpectedInline(str(ctx.exception), """grouped_mm_bf16: a and b must be bfloat16, got torch.float32 and torch.bfloat16""")
        with self.assertRaises(ValueError) as ctx:
            cake_ops.grouped_mm_bf16(self.x, self.w, torch.tensor([0, 2, 2, 9], dtype=torch.int32), backend="cudnn")
        self.assertExpectedInline(str(ctx.exception), """grouped_mm_bf16: backend must be 'cake' or 'torch', got 'cudnn'""")
        with self.assertRaises(TypeError) as ctx:
            gg.cake_grouped_mm(self.x.tolist(), self.w, self.offs)
        self.assertExpectedInline(str(ctx.exception), """cake_grouped_mm: x, w and offs must be tensors, got list, Tensor and Tensor""")

    def test_grouped_mm(self):
        mat_b = self.w.transpose(-2, -1)

        def error(*args, **kwargs):
            with self.assertRaises((TypeError, ValueError, RuntimeError)) as ctx:
                cake_ops.grouped_mm(*args, **kwargs)
            return str(ctx.exception)

        self.assertExpectedInline(error(self.x, mat_b), """cake_ops.grouped_mm: mat_a, mat_b and offs must be tensors (the ragged forms need offs), got Tensor, Tensor and NoneType""")
        self.assertExpectedInline(error(self.x, mat_b, self.offs, bias=torch.zeros(8)), """cake_ops.grouped_mm: bias is not supported, got a Tensor; add it to the output""")
        self.assertExpectedInline(error(self.x.float(), mat_b, self.offs), """cake_ops.grouped_mm: mat_a and mat_b must have one dtype, got torch.float32 and torch.bfloat16""")
        self.assertExpectedInline(error(self.x, mat_b, self.offs.long()), """cake_ops.grouped_mm: offs must be a 1-D int32 tensor of group ends, got torch.int64 [3]""")
        self.assertExpectedInline(error(self.x, mat_b, self.offs, out_dtype=torch.float32), """cake_ops.grouped_mm: the [sum_m, K] x [E, K, N] form returns mat_a's dtype torch.bfloat16, got out_dtype=torch.float32""")
        self.assertExpectedInline(error(self.x, mat_b, self.offs[:2]), """cake_ops.grouped_mm: mat_a [sum_m, K], mat_b [E, K, N] and offs [E] must agree, got [10, 16], [3, 16, 8] and [2]""")
        self.assertExpectedInline(error(self.x[:, :8], mat_b, self.offs), """cake_ops.grouped_mm: mat_a [sum_m, K], mat_b [E, K, N] and offs [E] must agree, got [10, 8], [3, 16, 8] and [3]""")
        self.assertExpectedInline(error(self.g.t(), self.x[:9], self.offs), """cake_ops.grouped_mm: mat_a [M, sum_k] and mat_b [sum_k, N] must agree on sum_k, got [8, 10] and [9, 16]""")
        self.assertExpectedInline(error(self.g.t(), self.x, self.offs, out_dtype=torch.float16), """cake_ops.grouped_mm: the [M, sum_k] x [sum_k, N] form returns mat_a's dtype torch.bfloat16 or float32, got out_dtype=torch.float16""")
        self.assertExpectedInline(error(self.x[None].expand(3, 10, 16), mat_b, self.offs), """cake_ops.grouped_mm: serves mat_a [sum_m, K] x mat_b [E, K, N] and mat_a [M, sum_k] x mat_b [sum_k, N] with offs, got 3-D x 3-D""")
        # The kernels' own checks name the op that runs.
        self.assertExpectedInline(error(self.x, mat_b, torch.tensor([2, 1, 9], dtype=torch.int32)), """cake::grouped_gemm_fwd: group ends must be non-decreasing, got 1 after 2 at group 1""")


# ----------------------------------------------------------------------------------------------
# GPU only: no host sync, graphs, large problems, device-side offset checks, the build itself.


@cuda_only
def test_no_host_sync_on_gpu():
    sizes, sum_m, x, w, g, offs = problem("ragged", "cuda", torch.bfloat16)
    launch = gg.prepare_grouped_gemm_fwd(x, w, offs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gg.grouped_gemm_fwd(x, w, offs)
        gg.grouped_gemm_dgrad(g, w, offs)
        gg.grouped_gemm_wgrad(g, x, offs, out_dtype=torch.float32)
        launch.launch()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@cuda_only
def test_prepared_launches_replay_in_cuda_graph_with_new_offsets_and_data():
    e, n, k = 6, 256, 512
    capacity = 1500
    x = rand(capacity, k, dtype=torch.bfloat16, device="cuda")
    w = rand(e, n, k, dtype=torch.bfloat16, device="cuda")
    g = rand(capacity, n, dtype=torch.bfloat16, device="cuda")
    offs = make_offs([100, 0, 3, 700, 1, 200], "cuda")
    launches = [gg.prepare_grouped_gemm_fwd(x, w, offs), gg.prepare_grouped_gemm_dgrad(g, w, offs),
                gg.prepare_grouped_gemm_wgrad(g, x, offs, out_dtype=torch.float32)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:
            launch.launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch.launch()
    for sizes in ([0, 0, 1499, 0, 0, 1], [250] * 6, [0] * 6, [1, 2, 3, 4, 5, 1000]):
        offs.copy_(make_offs(sizes, "cuda"))
        x.copy_(rand(capacity, k, dtype=torch.bfloat16, device="cuda"))
        g.copy_(rand(capacity, n, dtype=torch.bfloat16, device="cuda"))
        for launch in launches:
            launch.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(launches[0].out, ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
        assert rel_err(launches[1].out, ref.grouped_gemm_dgrad(g, w, offs)) < 1e-2
        assert rel_err(launches[2].out, ref.grouped_gemm_wgrad(g, x, offs, e)) < 1e-2


@cuda_only
def test_many_groups_and_long_rows():
    e = 1024
    sizes = torch.randint(0, 40, (e,))
    sizes[::7] = 0
    sizes[5] = 3000
    x = rand(int(sizes.sum()), 64, dtype=torch.bfloat16, device="cuda")
    w = rand(e, 32, 64, dtype=torch.bfloat16, device="cuda")
    offs = make_offs(sizes.tolist(), "cuda")
    assert rel_err(gg.grouped_gemm_fwd(x, w, offs), ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
    g = rand(x.shape[0], 32, dtype=torch.bfloat16, device="cuda")
    assert rel_err(gg.grouped_gemm_wgrad(g, x, offs), ref.grouped_gemm_wgrad(g, x, offs, e)) < 1e-2


@cuda_only
def test_64bit_indexing():
    # 2^20 + 5 packed rows, and a weight tensor of more than 2^31 elements whose last experts
    # start past the 32-bit element offset.
    rows = [2**20 - 7, 0, 12]
    x = rand(sum(rows), 64, dtype=torch.bfloat16, device="cuda")
    w = rand(3, 64, 64, dtype=torch.bfloat16, device="cuda")
    offs = make_offs(rows, "cuda")
    assert rel_err(gg.grouped_gemm_fwd(x, w, offs), ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
    g = rand(sum(rows), 64, dtype=torch.bfloat16, device="cuda")
    assert rel_err(gg.grouped_gemm_wgrad(g, x, offs), ref.grouped_gemm_wgrad(g, x, offs, 3)) < 1e-2

    e, n, k = 130, 4096, 4096  # 2.18e9 elements
    big = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
    big[-2:].copy_(rand(2, n, k, dtype=torch.bfloat16, device="cuda"))
    sizes = [0] * (e - 2) + [5, 9]
    xs = rand(14, k, dtype=torch.bfloat16, device="cuda")
    offs = make_offs(sizes, "cuda")
    y = gg.grouped_gemm_fwd(xs, big, offs)
    expected = torch.cat([xs[:5].double() @ big[-2].double().T, xs[5:].double() @ big[-1].double().T])
    assert rel_err(y, expected) < 1e-2
    gs = rand(14, n, dtype=torch.bfloat16, device="cuda")
    dx = gg.grouped_gemm_dgrad(gs, big, offs)
    expected = torch.cat([gs[:5].double() @ big[-2].double(), gs[5:].double() @ big[-1].double()])
    assert rel_err(dx, expected) < 1e-2
    del big


@cuda_only
@pytest.mark.parametrize("family", ["fwd", "dgrad", "wgrad", "wgrad_f32", "fwd_f16"])
def test_every_kernel_configuration_matches_float64(family):
    # Each tactic is its own kernel: check all of them, not only the heuristic's choice. The rows past the
    # last group are NaN: the fixed-operand tiles read them (fwd / dgrad compute them into rows they drop,
    # wgrad zeroes them in shared memory), and none may reach the output.
    sizes = [0, 1, 130, 7, 0, 300, 64, 1000]
    dtype = torch.float16 if family == "fwd_f16" else torch.bfloat16
    x = rand(sum(sizes) + 9, 264, dtype=dtype, device="cuda")
    w = rand(len(sizes), 136, 264, dtype=dtype, device="cuda")
    g = rand(x.shape[0], 136, dtype=dtype, device="cuda")
    x[sum(sizes):] = float("nan")
    g[sum(sizes):] = float("nan")
    offs = make_offs(sizes, "cuda")
    run, expected = {
        "fwd": (lambda: gg.grouped_gemm_fwd(x, w, offs), ref.grouped_gemm_fwd(x, w, offs)),
        "fwd_f16": (lambda: gg.grouped_gemm_fwd(x, w, offs), ref.grouped_gemm_fwd(x, w, offs)),
        "dgrad": (lambda: gg.grouped_gemm_dgrad(g, w, offs), ref.grouped_gemm_dgrad(g, w, offs)),
        "wgrad": (lambda: gg.grouped_gemm_wgrad(g, x, offs), ref.grouped_gemm_wgrad(g, x, offs, len(sizes))),
        "wgrad_f32": (lambda: gg.grouped_gemm_wgrad(g, x, offs, out_dtype=torch.float32),
                      ref.grouped_gemm_wgrad(g, x, offs, len(sizes))),
    }[family]
    names = cake_ops._C.grouped_gemm_tactics(family)
    assert len(names) >= 3
    try:
        for i, name in enumerate(names):
            cake_ops._C.set_grouped_gemm_tactic(family, i)
            out = run()
            assert rel_err(out, expected) < 1e-2, name
            if family.startswith("wgrad"):
                assert (out[0] == 0).all() and (out[4] == 0).all(), name
                for e, size in enumerate(sizes):  # each group on its own (1 row next to 1000)
                    if size:
                        assert rel_err(out[e], expected[e]) < 1e-2, (name, e)
            else:
                assert (out[sum(sizes):] == 0).all(), name
    finally:
        cake_ops._C.set_grouped_gemm_tactic(family, -1)
    with pytest.raises(ValueError, match=r"tactic must be -1 or in \[0, "):
        cake_ops._C.set_grouped_gemm_tactic(family, len(names))


@cuda_only
def test_cuda_errors():
    x = rand(10, 16, dtype=torch.bfloat16, device="cuda")
    w = rand(3, 8, 16, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"cake::grouped_gemm_fwd: offs must be on the operands' device cuda:0, got cpu"):
        torch.ops.cake.grouped_gemm_fwd(x, w, offs)
    with pytest.raises(RuntimeError, match=r"cake::grouped_gemm_fwd: x and w must be on the same device, got cuda:0 and cpu"):
        torch.ops.cake.grouped_gemm_fwd(x, w.cpu(), offs.cuda())
    with pytest.raises(RuntimeError, match=r"cake::grouped_gemm_dgrad: CUDA kernels take bfloat16 operands \(fwd also float16\), got Half"):
        torch.ops.cake.grouped_gemm_dgrad(x[:, :8].half(), w.half(), offs.cuda())
    with pytest.raises(RuntimeError, match=r"cake::grouped_gemm_fwd: CUDA kernels need N and K to be multiples of 8.*N=8 and K=12"):
        torch.ops.cake.grouped_gemm_fwd(x[:, :12].contiguous(), w[:, :, :12].contiguous(), offs.cuda())


@cuda_only
def test_bad_offsets_on_gpu_fail_loudly():
    # The GPU path never reads offsets on the host; invalid values trip a device-side assert
    # naming the op (which ends the CUDA context, so this runs in a child process).
    script = textwrap.dedent("""
        import torch, cake_ops
        x = torch.randn(10, 16, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(3, 8, 16, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([2, 1, 9], dtype=torch.int32, device="cuda")
        torch.ops.cake.grouped_gemm_fwd(x, w, offs)
        torch.cuda.synchronize()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cake::grouped_gemm_fwd: offs must be non-decreasing" in proc.stdout + proc.stderr


def find_cuobjdump():
    candidates = [shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.path.exists(c)), None)


def test_grouped_gemm_kernels_are_hopper_wgmma():
    # Needs no GPU: disassemble the built extension and check that every CUTLASS grouped GEMM
    # kernel in it issues wgmma, i.e. runs on Hopper's tensor cores: HGMMA for 16-bit inputs,
    # QGMMA for the e4m3 ones (fwd_e4m3).
    if "90a" not in cake_ops.build_info()["cuda_archs"]:
        pytest.skip("this build has no sm_90a kernels")
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    proc = subprocess.run([tool, "--dump-sass", cake_ops._C.__file__], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    functions = proc.stdout.split("Function : ")[1:]
    gemms = [f for f in functions if "GemmUniversal" in f.split("\n")[0]]
    # One kernel per configuration; each configuration appears as several tactics (tile orders). The
    # MoE GEMMs' epilogue twins of fwd configurations (SwiGLU, fused finalize) are kernels of their own.
    def configs(tactics):
        return {name.split("_raster")[0].split("_swz")[0] for name in tactics}

    def twin_kernels(family, kind):
        names = configs(cake_ops._C.grouped_gemm_epilogue_twins(family, kind))
        # A gate-up twin (fixed operands) serves both the ptr-array and the fixed fwd configuration of its tile.
        return len({n.replace("fixed_", "") for n in names} if kind.endswith("_gu") else names)

    families = ("fwd", "dgrad", "wgrad", "wgrad_f32", "fwd_f16", "fwd_e4m3")
    twins = {f: sum(twin_kernels(f, kind) for kind in ("swiglu", "scatter", "gather_swiglu", "swiglu_gu", "gather_swiglu_gu"))
             for f in ("fwd", "fwd_f16", "fwd_e4m3")}
    expected = len(configs(name for f in families for name in cake_ops._C.grouped_gemm_tactics(f))) + sum(twins.values())
    assert len(gemms) == expected, f"expected {expected} grouped GEMM kernels, found {len(gemms)}"
    fp8 = [body for body in gemms if "float_e4m3" in body.split("\n")[0]]
    assert len(fp8) == len(cake_ops._C.grouped_gemm_tactics("fwd_e4m3")) // 4 + twins["fwd_e4m3"]
    for body in gemms:
        instruction = "QGMMA" if body in fp8 else "HGMMA"
        assert instruction in body, f"no {instruction} in {body.splitlines()[0][:120]}"
        # Pipelined wgmmas wait for all of theirs once per tile (mma_tail). When ptxas cannot keep
        # them in flight (its warning C7515: non-wgmma code defining accumulator registers) every
        # wgmma waits for the one before: ~10% slower on the H200, and nothing else would notice.
        waits = body.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
        assert waits <= 2, f"wgmmas serialized ({waits} full waits) in {body.splitlines()[0][:120]}"
    # The MoE decode kernels: the one-GEMM kernel (3 element types x SwiGLU or not) and the layer
    # kernel (3 element types x spreading few items over the grid or not).
    decode = [f for f in functions if "moe_decode_" in f.split("\n")[0]]
    assert len(decode) == 12, [f.split("\n")[0] for f in decode]
    for body in decode:
        instruction = "QGMMA" if "E4m3" in body.split("\n")[0] else "HGMMA"
        assert instruction in body, f"no {instruction} in {body.splitlines()[0][:120]}"


def test_build_has_cuda_kernels_when_ci_says_so():
    # CI builds against a CUDA torch with nvcc present: the sm_90a kernels must be in the build.
    if os.environ.get("CAKE_EXPECT_CUDA_ARCHS") is None:
        pytest.skip("set CAKE_EXPECT_CUDA_ARCHS to check the built targets")
    assert cake_ops.build_info()["cuda_archs"] == os.environ["CAKE_EXPECT_CUDA_ARCHS"].split(",")
