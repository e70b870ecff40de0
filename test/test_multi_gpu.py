"""Operands on a second GPU while the current device is the first: every op must launch on the
operands' device (its stream, its SM count and bandwidth for the tactic choice) and allocate
nothing on the current one. Runs where two GPUs are present (device calls on a two-GPU machine)."""
import importlib
import warnings

import pytest
import torch

import cake_ops
from cake_ops import grouped_gemm as gg
from cake_ops import reference as ref
from cake_ops import stepfun_moe as sm
from cake_ops.fused_moe import fused_moe_bf16, interleave_up_gate_sm90
from moe_problems import moe_problem, rel_err

tuning = importlib.import_module("cake_ops.autotune")  # the module (cake_ops.autotune is its context manager)
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture(autouse=True)
def current_device_is_the_first():
    warnings.simplefilter("ignore")
    with torch.cuda.device(0):
        yield


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def grouped_problem():
    sizes = [0, 1, 130, 7, 0, 300, 64]
    x = torch.randn(sum(sizes) + 5, 256).bfloat16()
    w = (torch.randn(len(sizes), 192, 256) / 16).bfloat16()
    g = torch.randn(x.shape[0], 192).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w, g, offs


def test_grouped_gemm_runs_on_the_operands_device():
    x, w, g, offs = grouped_problem()
    results = {}
    for device in ("cuda:0", "cuda:1"):
        xd, wd, gd, od = on(device, x, w, g, offs)
        outs = (gg.grouped_gemm_fwd(xd, wd, od), gg.grouped_gemm_dgrad(gd, wd, od),
                gg.grouped_gemm_wgrad(gd, xd, od, out_dtype=torch.float32))
        assert all(o.device == torch.device(device) for o in outs)
        results[device] = [o.cpu() for o in outs]
    fwd, dgrad, wgrad = results["cuda:1"]
    assert rel_err(fwd, ref.grouped_gemm_fwd(x, w, offs)) < 1e-2
    assert rel_err(dgrad, ref.grouped_gemm_dgrad(g, w, offs)) < 1e-2
    assert rel_err(wgrad, ref.grouped_gemm_wgrad(g, x, offs, w.shape[0])) < 1e-2
    for a, b in zip(results["cuda:0"], results["cuda:1"]):  # the same kernels on the same kind of card
        assert torch.equal(a, b)


def test_grouped_mm_autograd_and_prepared_launch_on_the_second_gpu():
    x, w, g, offs = on("cuda:1", *grouped_problem())
    x.requires_grad_()
    w.requires_grad_()
    y = gg.cake_grouped_mm(x, w, offs)
    y.backward(g)
    assert x.grad.device == w.grad.device == torch.device("cuda:1")
    xc, wc, gc, oc = on("cpu", x.detach(), w.detach(), g, offs)
    assert rel_err(x.grad, ref.grouped_gemm_dgrad(gc, wc, oc)) < 1e-2
    assert rel_err(w.grad, ref.grouped_gemm_wgrad(gc, xc, oc, wc.shape[0])) < 1e-2
    launch = gg.prepare_grouped_gemm_fwd(x.detach(), w.detach(), offs)
    out = launch.launch()
    torch.cuda.synchronize(1)
    assert out.device == torch.device("cuda:1") and torch.equal(out, y.detach())


def test_fused_moe_runs_on_the_operands_device():
    x, ids, scales, w1, w2 = moe_problem(37, 8, 32, 32, 256, 128, "cpu")
    w1i = interleave_up_gate_sm90(w1)
    expected = ref.moe_forward(x, ids, scales, w1, w2, 32, 0)
    outs = {}
    for device in ("cuda:0", "cuda:1"):
        args = on(device, x, ids, scales, w1i, w2)
        for t in (37, 1):  # the staged ops and the one-launch layer kernel
            for fused in (True, False):
                outs[device, t, fused] = fused_moe_bf16(args[0][:t], args[1][:t], args[2][:t], *args[3:], 32, 8,
                                                        use_fused_finalize=fused)
    for (device, t, fused), out in outs.items():
        assert out.device == torch.device(device)
        assert rel_err(out, expected[:t]) < 2e-2
    for t in (37, 1):  # the deterministic path is bitwise the same on either card
        assert torch.equal(outs["cuda:0", t, False].cpu(), outs["cuda:1", t, False].cpu())


@pytest.mark.parametrize("family", ["bf16", "fp8"])
def test_stepfun_moe_runs_on_the_operands_device(family):
    hidden, inter, e, k = 256, 128, 16, 4
    x = (12 * torch.randn(20, hidden)).bfloat16()
    logits = torch.randn(20, e)
    w1 = (torch.randn(e, 2 * inter, hidden) / hidden**0.5).bfloat16()
    w2 = (torch.randn(e, hidden, inter) / inter**0.5).bfloat16()
    outs = {}
    for device in ("cuda:0", "cuda:1"):
        xd, ld, w1d, w2d = on(device, x, logits, w1, w2)
        weights = sm.prepare_weights(w1d, w2d, 7.0, family=family)
        for t in (20, 1):
            outs[device, t] = sm.stepfun_moe(xd[:t], weights, ld[:t], top_k=k)
        launch = sm.prepare_stepfun_moe(xd, weights, ld, top_k=k)
        assert torch.equal(launch.launch(), outs[device, 20])
    for t in (20, 1):
        assert outs["cuda:1", t].device == torch.device("cuda:1")
        assert torch.equal(outs["cuda:0", t].cpu(), outs["cuda:1", t].cpu())


def test_nothing_lands_on_the_current_device():
    x, w, g, offs = on("cuda:1", *grouped_problem())
    mx, ids, scales, w1, w2 = on("cuda:1", *moe_problem(37, 8, 32, 32, 256, 128, "cpu"))
    w1 = interleave_up_gate_sm90(w1)
    weights = sm.prepare_weights(*on("cuda:1", w1, w2), 7.0, family="fp8")
    logits = torch.randn(37, 32, device="cuda:1")
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    outs = [gg.grouped_gemm_fwd(x, w, offs), gg.grouped_gemm_wgrad(g, x, offs),
            fused_moe_bf16(mx, ids, scales, w1, w2, 32, 8), fused_moe_bf16(mx[:1], ids[:1], scales[:1], w1, w2, 32, 8),
            sm.stepfun_moe(mx, weights, logits, top_k=8)]
    torch.cuda.synchronize(1)
    assert all(o.device == torch.device("cuda:1") for o in outs)
    assert torch.cuda.memory_allocated(0) == before


def test_autotune_times_the_tactics_on_the_operands_device(monkeypatch):
    """Events on the current device's stream would time an idle stream (~0 ms) and pick at random."""
    x, w = torch.randn(8192, 4096, device="cuda:1").bfloat16(), torch.randn(4, 4096, 4096, device="cuda:1").bfloat16()
    offs = torch.tensor([2048, 4096, 6144, 8192], dtype=torch.int32, device="cuda:1")
    timed = []
    time_tactics = tuning._time_tactics
    monkeypatch.setattr(tuning, "_time_tactics", lambda *a, **kw: timed.append(time_tactics(*a, **kw)) or timed[-1])
    tuning.clear_tuning()
    try:
        with cake_ops.autotune():
            gg.grouped_gemm_fwd(x, w, offs)
        assert len(timed) == 1
        with torch.cuda.device(1):  # the tuned launch, timed on its own stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gg.grouped_gemm_fwd(x, w, offs)
            end.record()
            end.synchronize()
        assert min(timed[0].values()) > 0.5 * start.elapsed_time(end), (min(timed[0].values()), start.elapsed_time(end))
    finally:
        tuning.clear_tuning()
