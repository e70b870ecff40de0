"""The MoE pipeline ops: cake::moe_sort, cake::moe_gemm1_swiglu, cake::moe_gemm2, cake::moe_finalize,
and the SM90 weight interleave, against the float32 reference MoE; the CUDA kernels also against
the CPU implementations on the same inputs."""
import subprocess
import sys
import textwrap

import expecttest
import pytest
import torch

import cake_ops  # noqa: F401
from cake_ops import reference
from cake_ops.fused_moe import interleave_up_gate_sm90
from moe_problems import ROUTING_CASES, moe_problem

HAS_CUDA = torch.cuda.is_available()


def sort_reference(ids, num_experts, num_local, offset, tile):
    """The contract, written out: stable by expanded index within each local expert."""
    flat = ids.flatten().tolist()
    local = [e - offset if 0 <= e < num_experts and offset <= e < offset + num_local else -1 for e in flat]
    counts = [0] * num_local
    for e in local:
        if e >= 0:
            counts[e] += 1
    offsets = [0]
    tiles = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
        tiles.append(tiles[-1] + -(-c // tile))
    p2e = [r for _, r in sorted((e, r) for r, e in enumerate(local) if e >= 0)]
    e2p = [-1] * len(flat)
    for p, r in enumerate(p2e):
        e2p[r] = p
    p2e += [-1] * (len(flat) - len(p2e))
    return [torch.tensor(v, dtype=torch.int32) for v in (counts, offsets, p2e, e2p, tiles)]


# Larger than one warp's segment, and many experts (fewer sorting warps fit in shared memory).
# On CUDA: qwen3_t1024 two blocks (E=128), qwen3_t16384 32, many_experts 10 (one cooperative launch);
# past_one_grid 157 one-warp chunks of 16384 experts, more than an H200 holds at once (132): the
# count, scan and place kernels.
SORT_CASES = dict(ROUTING_CASES, kimi_ep8_shard=(4096, 8, 384, 48, 96), many_experts=(3000, 4, 4096, 4096, 0),
                  all_dropped=(50, 4, 64, 8, 56), qwen3_t1024=(1024, 8, 128, 128, 0),
                  qwen3_t16384=(16384, 8, 128, 128, 0), past_one_grid=(5000, 4, 16384, 16384, 0))
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(SORT_CASES))
@pytest.mark.parametrize("tile", [64, 128])
def test_moe_sort_matches_contract(device, name, tile):
    t, k, e, e_local, offset = SORT_CASES[name]
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    if name == "all_dropped":
        ids = ids % 56  # every id below the shard [56, 64)
    if name == "hot_expert":
        ids[:, 0] = 3
    if t > 2:
        ids[1, 0] = -1  # dropped routes (padding ids, ids past num_experts) contribute nothing
        ids[2, k - 1] = e + 5
    out = torch.ops.cake.moe_sort(ids.to(device), e, e_local, offset, tile)
    for got, want in zip(out, sort_reference(ids, e, e_local, offset, tile)):
        assert got.device.type == device and torch.equal(got.cpu(), want)


@cuda_only
def test_multi_block_sort_replays_in_a_cuda_graph():
    """16384 routes over 128 experts: four blocks (one cooperative launch on an H200), captured once
    and replayed on new ids."""
    t, k, e = 2048, 8, 128
    ids = torch.randint(0, e, (t, k), dtype=torch.int32, device="cuda")
    torch.ops.cake.moe_sort(ids, e, e, 0, 128)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.cake.moe_sort(ids, e, e, 0, 128)
    for _ in range(2):
        ids.copy_(torch.randint(0, e, (t, k), dtype=torch.int32))
        g.replay()
        for got, want in zip(out, sort_reference(ids.cpu(), e, e, 0, 128)):
            assert torch.equal(got.cpu(), want)


def run_pipeline(x, ids, scales, w1_interleaved, w2, num_experts, num_local, offset, pdl=True):
    """sort -> GEMM1 + SwiGLU -> GEMM2 -> deterministic finalize."""
    top_k = ids.shape[1]
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, num_experts, num_local, offset, 128)
    inter = torch.ops.cake.moe_gemm1_swiglu(x, w1_interleaved, p2e, offsets, top_k, pdl)
    rows = torch.ops.cake.moe_gemm2(inter, w2, offsets, pdl)
    return torch.ops.cake.moe_finalize(rows, e2p, scales, pdl)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(ROUTING_CASES.values()), ids=list(ROUTING_CASES))
def test_pipeline_matches_float32_reference(device, case):
    t, k, e, e_local, offset = case
    x, ids, scales, w1, w2 = moe_problem(t, k, e, e_local, 128, 96, device)
    out = run_pipeline(x, ids, scales, interleave_up_gate_sm90(w1), w2, e, e_local, offset)
    expected = reference.moe_forward(x, ids, scales, w1, w2, e_local, offset)
    assert out.shape == x.shape and out.dtype == x.dtype
    if t:
        assert torch.isfinite(out.float()).all()
        err = (out.float() - expected).norm() / expected.norm().clamp_min(1e-30)
        assert err < 2e-2, err
    # Bitwise reproducible: fixed-order fp32 combine, no atomics; PDL changes no number.
    again = run_pipeline(x, ids, scales, interleave_up_gate_sm90(w1), w2, e, e_local, offset, pdl=False)
    assert torch.equal(out, again)


@cuda_only
@pytest.mark.parametrize("t", [1, 3, 700])
@pytest.mark.parametrize("shard", [False, True], ids=["local", "ep_shard"])
def test_cuda_finalize_sums_routes_in_order(t, shard):
    """A few tokens spread each row over several CTAs (hidden 2400: 300 vectors, cut in 3 at T=1);
    each output element is still the fp32 sum over the routes in route order, bit for bit. An
    expert-parallel shard keeps ~1 route in 8 (some tokens none: their rows are zeros)."""
    k, hidden = 8, 2400
    g = torch.Generator().manual_seed(t)
    rows = torch.randn(t * k, hidden, generator=g).bfloat16()
    e2p = torch.randperm(t * k, generator=g).int()
    if shard:
        e2p[torch.rand(t * k, generator=g) > 0.125] = -1
    else:
        e2p[::5] = -1  # dropped routes add nothing
    scales = torch.rand(t, k, generator=g)
    out = torch.ops.cake.moe_finalize(rows.cuda(), e2p.cuda(), scales.cuda()).cpu()
    want = torch.zeros(t, hidden)
    routes = e2p.view(t, k)
    for j in range(k):
        term = rows.float()[routes[:, j].clamp_min(0).long()] * scales[:, j:j + 1]
        want = torch.where(routes[:, j:j + 1] >= 0, want + term, want)
    assert torch.equal(out, want.bfloat16())


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), ("cpu", torch.float32)] + [
    pytest.param("cuda", dtype, marks=cuda_only) for dtype in (torch.bfloat16, torch.float16)])  # 16-bit on CUDA
@pytest.mark.parametrize("t,k,extra_rows,hidden", [(7, 3, 0, 40), (1, 8, 0, 40), (5, 4, 6, 1032), (0, 2, 0, 40)])
def test_finalize_backward_matches_float64_autograd(device, dtype, t, k, extra_rows, hidden):
    """moe_finalize's autograd formula (cake::moe_finalize_backward): row gradients (one rounding of scale x output
    gradient; zero for rows no kept route reads, dropped routes' and spare rows past the routes') and scale
    gradients (float32 dot products; zero for dropped routes) against float64 autograd through the same combine,
    bitwise across runs; without permuted_rows the op gives the same row gradients and no scale gradients."""
    g = torch.Generator().manual_seed(1000 * t + k)
    routes = t * k
    rows = torch.randn(routes + extra_rows, hidden, generator=g).to(dtype)
    e2p = torch.randperm(routes + extra_rows, generator=g)[:routes].int()
    e2p[::3] = -1
    scales = torch.rand(t, k, generator=g)
    grad = torch.randn(t, hidden, generator=g).to(dtype)

    def grads():
        r = rows.to(device).requires_grad_()
        s = scales.to(device).requires_grad_()
        out = torch.ops.cake.moe_finalize(r, e2p.to(device), s)
        return torch.autograd.grad(out, (r, s), grad.to(device))

    d_rows, d_scales = grads()
    assert d_rows.dtype == dtype and d_scales.dtype == torch.float32
    r64, s64 = rows.double().requires_grad_(), scales.double().requires_grad_()
    kept = (e2p >= 0).view(t, k)
    want = (r64[e2p.clamp_min(0).long()].view(t, k, hidden) * torch.where(kept, s64, 0).unsqueeze(-1)).sum(1)
    want_rows, want_scales = torch.autograd.grad(want, (r64, s64), grad.double())
    assert torch.equal(d_rows.cpu(), want_rows.to(dtype)), "one rounding of the float32 product"
    torch.testing.assert_close(d_scales.cpu().double(), want_scales, rtol=1e-5, atol=1e-5)
    unread = torch.ones(routes + extra_rows, dtype=torch.bool)
    unread[e2p[e2p >= 0].long()] = False
    assert not d_rows[unread.to(device)].any() and not d_scales[~kept.to(device)].any()
    assert all(torch.equal(a, b) for a, b in zip(grads(), (d_rows, d_scales)))
    rows_only = torch.ops.cake.moe_finalize_backward(grad.to(device), e2p.to(device), scales.to(device), rows.shape[0])
    assert torch.equal(rows_only[0], d_rows) and rows_only[1].shape == (0,)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(ROUTING_CASES.values()), ids=list(ROUTING_CASES))
def test_cuda_stages_match_cpu_stages(case, dtype):
    """Each CUDA stage against the CPU implementation on the same inputs."""
    t, k, e, e_local, offset = case
    x, ids, scales, w1, w2 = moe_problem(t, k, e, e_local, 128, 96, "cpu", dtype)
    w1 = interleave_up_gate_sm90(w1)
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    inter = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k)
    inter_cuda = torch.ops.cake.moe_gemm1_swiglu(x.cuda(), w1.cuda(), p2e.cuda(), offsets.cuda(), k)
    # The same fp32 products in another order, then one bf16 rounding each for h and the SwiGLU.
    torch.testing.assert_close(inter_cuda.cpu(), inter, rtol=2e-2, atol=2e-2)
    kept = int(offsets[-1])
    assert torch.equal(inter_cuda[kept:].cpu(), torch.zeros_like(inter[kept:]))
    rows = torch.ops.cake.moe_gemm2(inter, w2, offsets)
    rows_cuda = torch.ops.cake.moe_gemm2(inter.cuda(), w2.cuda(), offsets.cuda())
    # Rows past the last expert's end belong to no route: unwritten on CUDA.
    torch.testing.assert_close(rows_cuda[:kept].cpu(), rows[:kept], rtol=2e-2, atol=2e-2)
    out = torch.ops.cake.moe_finalize(rows, e2p, scales)
    out_cuda = torch.ops.cake.moe_finalize(rows.cuda(), e2p.cuda(), scales.cuda())
    torch.testing.assert_close(out_cuda.cpu(), out, rtol=1e-2, atol=1e-5)
    into = torch.full_like(out_cuda, float("nan"))
    torch.ops.cake.moe_finalize_out(rows.cuda(), e2p.cuda(), scales.cuda(), into)
    assert torch.equal(into, out_cuda)


@cuda_only
@pytest.mark.parametrize("mapping", ["sorted", "duplicate_row"])
def test_gemm1_gathers_a_large_x_in_token_order(mapping):
    """x of 16 MB or more is gathered in token order (read once) when the rows are a permutation of the kept
    routes, and row by row otherwise (two rows naming one route); an EP shard drops some routes. Against the
    CPU op."""
    t, k, e, e_local, offset, hidden, inter = 4096, 2, 16, 8, 4, 2048, 64
    x, ids, _, w1, _ = moe_problem(t, k, e, e_local, hidden, inter, "cpu", torch.bfloat16)
    assert x.numel() * x.element_size() >= 16 << 20  # the token-order threshold (kTokenOrderMinXBytes)
    w1 = interleave_up_gate_sm90(w1)
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    kept = int(offsets[-1])
    assert 0 < kept < t * k
    if mapping == "duplicate_row":
        p2e = p2e.clone()
        p2e[1] = p2e[0]
    want = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k)
    got = torch.ops.cake.moe_gemm1_swiglu(x.cuda(), w1.cuda(), p2e.cuda(), offsets.cuda(), k).cpu()
    torch.testing.assert_close(got[:kept], want[:kept], rtol=2e-2, atol=2e-2)


@cuda_only
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gemm1_token_order_through_the_sort_inverse(w_dtype):
    """Given moe_sort's expanded_to_permuted, a large x is gathered in token order through it (no inverse built on
    the way): bit for bit the op without it, on an EP shard (dropped routes) with a hot expert and an empty one;
    e4m3 w1 quantizes x in the same gather (a dynamic scale)."""
    t, k, e, e_local, offset, hidden, inter = 4096, 2, 16, 8, 4, 2048, 64
    x, _, _, w1, _ = moe_problem(t, k, e, e_local, hidden, inter, "cuda", torch.bfloat16)
    assert x.numel() * x.element_size() >= 16 << 20  # the token-order threshold (kTokenOrderMinXBytes)
    ids = torch.randint(0, e, (t, k), dtype=torch.int32, device="cuda")
    ids[: t // 2, 0] = offset + 1  # a hot expert
    ids[ids == offset + 5] = offset + 6  # an empty one
    w1 = interleave_up_gate_sm90(w1)
    opt = {}
    if w_dtype == torch.float8_e4m3fn:
        w1, opt["w1_scale"] = quantize_per_expert(w1)
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    kept = int(offsets[-1])
    assert 0 < kept < t * k and int(offsets[6] - offsets[5]) == 0
    want = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, **opt)
    got = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, expanded_to_permuted=e2p, **opt)
    assert torch.equal(got[:kept], want[:kept])
    ref = torch.ops.cake.moe_gemm1_swiglu(x.cpu(), w1.cpu(), p2e.cpu(), offsets.cpu(), k,
                                          expanded_to_permuted=e2p.cpu(), **{n: v.cpu() for n, v in opt.items()})
    torch.testing.assert_close(got[:kept].cpu().float(), ref[:kept].float(), rtol=5e-2, atol=5e-2)


@cuda_only
def test_gemm1_rejects_a_wrong_sort_inverse_on_gpu():
    """An expanded_to_permuted that is not permuted_to_expanded's inverse (two kept routes swapped) stops the
    token-order gather with the op's message (a device-side assert ends the CUDA context: a child process).
    256 rows per expert: the 64x256 tile, which has no gathering mainloop, so the gather kernel runs."""
    script = textwrap.dedent("""
        import torch, cake_ops
        from cake_ops.fused_moe import interleave_up_gate_sm90
        t, k, e, hidden = 4096, 2, 32, 2048
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        w1 = interleave_up_gate_sm90(torch.randn(e, 128, hidden, device="cuda", dtype=torch.bfloat16))
        ids = torch.randint(0, e, (t, k), dtype=torch.int32, device="cuda")
        _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e, 0, 64)
        e2p = e2p.clone()
        e2p[[0, 1]] = e2p[[1, 0]]
        torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, expanded_to_permuted=e2p)
        torch.cuda.synchronize()
        print("no error")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no error" not in output, output
    assert "cake::moe_gemm1_swiglu: expanded_to_permuted must be the inverse of permuted_to_expanded" in output, output


# GEMM1's SwiGLU twins (configs_sm90.inc): the fwd tiles whose epilogue applies the SwiGLU(Step) and stores
# [rows, I] directly. Per family: (tactic name prefix, tiles with a twin).
SWIGLU_TWINS = {torch.bfloat16: ("fwd", "fwd_bf16_", ["ping_64x256x64_c1x1", "ping_128x128x64_c1x1",
                                                      "coop_128x256x64_c1x2", "coop_128x256x64_c2x1",
                                                      "fixed_ping_64x256x64_c1x1", "fixed_ping_128x128x64_c1x1",
                                                      "fixed_coop_128x256x64_c1x2", "fixed_coop_128x256x64_c2x1",
                                                      "fixed_ping_128x128x64_c1x2"]),
                torch.float16: ("fwd_f16", "fwd_f16_", ["ping_128x128x64_c1x1", "coop_128x256x64_c1x2",
                                                        "coop_128x256x64_c2x1"]),
                torch.float8_e4m3fn: ("fwd_e4m3", "fwd_e4m3_", ["ping_64x256x128_c1x1", "coop_128x256x128_c1x2",
                                                                "coop_128x256x128_c2x1"])}


def ragged_gemm1_problem(dtype, limits, hidden=256, inter=192):
    """Routes already sorted by expert: 6 local experts with 0, 1, 130, 7, 300 (hot) and 45 rows, 117 of the
    600 routes dropped (an EP shard: the rows past the last expert's end); hidden 256 (or any multiple of 16
    bytes), I = 192 (2I = 384 is not a multiple of a 256-column tile)."""
    t, k = 300, 2
    counts = [0, 1, 130, 7, 300, 45]
    kept = sum(counts)
    x = torch.randn(t, hidden).to(dtype if dtype != torch.float8_e4m3fn else torch.bfloat16)
    w1 = interleave_up_gate_sm90((torch.randn(len(counts), 2 * inter, hidden) / hidden**0.5).to(x.dtype))
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    p2e = torch.cat([torch.randperm(t * k)[:kept], torch.full((t * k - kept,), -1)]).int()
    lim = torch.tensor([7.0, 16.0, 0.5, 3.0, 7.0, 1.0]) if limits else None
    scales = ()
    if dtype == torch.float8_e4m3fn:
        x, x_scale = torch.ops.cake.quantize_fp8(4 * x, None)
        w1, w1_scale = quantize_per_expert(w1)
        scales = (x_scale, w1_scale)
    return x, w1, p2e, offsets, k, lim, scales, kept, inter


@cuda_only
@pytest.mark.parametrize("limits", [False, True], ids=["swiglu", "swiglu_step"])
@pytest.mark.parametrize("dtype,hidden,inter", [(torch.bfloat16, 256, 192), (torch.float16, 256, 192),
                                                (torch.float8_e4m3fn, 256, 192), (torch.bfloat16, 200, 192),
                                                (torch.float16, 200, 192), (torch.bfloat16, 256, 1056),
                                                (torch.float16, 200, 1056)],
                         ids=["bf16", "f16", "e4m3", "bf16_hidden200", "f16_hidden200", "bf16_wide", "f16_wide"])
def test_gemm1_swiglu_in_the_gemm_epilogue(dtype, hidden, inter, limits):
    """Each tile with a SwiGLU twin, forced: SwiGLU(Step) in the grouped GEMM's epilogue against the same tile's
    fwd GEMM (h rounded as it is stored) then the activation in float32 (16-bit families), and against the CPU
    op; empty, one-row, non-tile-multiple and hot groups; zero rows past the last expert's end. Hidden 200:
    the last K block is partial (the TMA zero-fills the columns past K, the gathering mainloop its chunks).
    I = 192: the cooperative tiles' gathering twins run (16-bit x, 2I <= 2048); I = 1056 (2I = 2112): the
    SwiGLU twins over a gathered copy of x."""
    family, prefix, tiles = SWIGLU_TWINS[dtype]
    x, w1, p2e, offsets, k, lim, scales, kept, inter = ragged_gemm1_problem(dtype, limits, hidden, inter)
    want_cpu = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, lim, -1, *scales)
    cuda = [v.cuda() for v in (x, w1, p2e, offsets)]
    lim_cuda = lim.cuda() if limits else None
    scales_cuda = [v.cuda() for v in scales]
    names = cake_ops._C.grouped_gemm_tactics(family)
    for tile in tiles:
        tactic = names.index(prefix + tile)
        got = torch.ops.cake.moe_gemm1_swiglu(*cuda, k, True, lim_cuda, tactic, *scales_cuda)
        assert got.shape == (p2e.numel(), inter) and torch.equal(got[kept:].cpu(), torch.zeros_like(got[kept:].cpu()))
        # The e4m3 GEMM accumulates with less than float32's precision: atol relative to the output's size.
        atol = 3e-3 * want_cpu.float().abs().max().item() if dtype == torch.float8_e4m3fn else 2e-2
        torch.testing.assert_close(got.cpu(), want_cpu, rtol=2e-2, atol=atol, msg=lambda m: f"{tile}: {m}")
        if dtype == torch.float8_e4m3fn:
            continue  # no public e4m3 grouped GEMM to compare the unfused product with
        gathered = cuda[0][cuda[2][:kept].long() // k]
        cake_ops._C.set_grouped_gemm_tactic(family, tactic)
        try:
            h = torch.ops.cake.grouped_gemm_fwd(gathered, cuda[1], cuda[3][1:]).float()
        finally:
            cake_ops._C.set_grouped_gemm_tactic(family, -1)
        up, gate = h.view(kept, -1, 2, 32).unbind(2)
        silu = gate / (1 + torch.exp(-gate))
        if limits:
            row_limit = lim_cuda.repeat_interleave(torch.diff(cuda[3].long()))[:, None, None]
            act = torch.minimum(silu, row_limit) * torch.minimum(up, row_limit).maximum(-row_limit)
        else:
            act = silu * up
        want = act.reshape(kept, inter).to(dtype)
        # The same accumulators and float32 steps: equal, but for the odd last-bit difference of exp.
        same = (got[:kept] == want).float().mean().item()
        assert same > 0.999, (tile, same)
        torch.testing.assert_close(got[:kept], want, rtol=2**-7, atol=1e-6, msg=lambda m: f"{tile}: {m}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_gemm1_zero_tail_false_leaves_only_the_tail(device):
    """zero_tail=False (fused_moe_bf16's GEMM1): the kept rows are bit for bit the default's; on CUDA the twin
    tiles leave the rows past the last expert's end as they were (NaN here), the CPU writes its zeros."""
    x, w1, p2e, offsets, k, lim, scales, kept, inter = ragged_gemm1_problem(torch.bfloat16, True)
    x, w1, p2e, offsets, lim = (v.to(device) for v in (x, w1, p2e, offsets, lim))
    empty = x.new_empty(0, dtype=torch.uint8)
    family, prefix, tiles = SWIGLU_TWINS[torch.bfloat16]
    tactics = [-1]
    if device == "cuda":
        tactics += [cake_ops._C.grouped_gemm_tactics(family).index(prefix + tile) for tile in tiles]
    for tactic in tactics:
        want = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, lim, tactic)
        out = torch.full((p2e.numel(), inter), float("nan"), dtype=x.dtype, device=device)
        torch.ops.cake.moe_gemm1_swiglu_out(x, w1, p2e, offsets, k, out, empty, True, lim, tactic, zero_tail=False)
        assert torch.equal(out[:kept], want[:kept]), tactic
        if device == "cpu":
            assert torch.equal(out[kept:], torch.zeros_like(out[kept:]))
        elif tactic >= 0:
            assert out[kept:].isnan().all(), tactic


def gate_up_halves(w1):
    """interleave_up_gate_sm90's inverse: the [gate; up] halves of up/gate interleaved w1 [E, 2I, H] (any dtype)."""
    e, two_i, h = w1.shape
    up, gate = w1.view(torch.uint8).view(e, two_i // 64, 2, 32, -1).unbind(2)
    return torch.cat([gate.reshape(e, two_i // 2, -1), up.reshape(e, two_i // 2, -1)], 1).view(w1.dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("limits", [False, True], ids=["swiglu", "swiglu_step"])
@pytest.mark.parametrize("dtype,hidden,inter", [(torch.bfloat16, 256, 192), (torch.float16, 256, 192),
                                                (torch.float8_e4m3fn, 256, 192), (torch.bfloat16, 200, 1056)],
                         ids=["bf16", "f16", "e4m3", "bf16_wide"])
def test_gemm1_reads_gate_up_halves(device, dtype, hidden, inter, limits):
    """w1_gate_up=True: w1 as [gate; up] halves gives the interleaved weights' numbers on every path. The CPU;
    on CUDA the decode kernel (tactic -2: the same wgmmas, bit for bit), each tile with a SwiGLU twin and the
    automatic choice. bf16: the tile's gate-up twin (gathering up to 2I = 2048, I = 192; not past it, I = 1056),
    whose two weight boxes a stage land the same rows' products in the other columns, so bit for bit too; I % 128
    != 0 in both, so the 256-column tiles' last gate box runs into the up half. fp16 / e4m3: the tile's plain GEMM,
    then the SwiGLU kernel (equal but for the odd last bit of exp, as in test_gemm1_swiglu_in_the_gemm_epilogue).
    The _out op writes the same."""
    x, w1, p2e, offsets, k, lim, scales, kept, inter = ragged_gemm1_problem(dtype, limits, hidden, inter)
    halves = gate_up_halves(w1)
    assert torch.equal(interleave_up_gate_sm90(halves.view(torch.uint8)), w1.view(torch.uint8))
    move = (lambda v: v.to(device) if v is not None else None)
    x, w1, halves, p2e, offsets, lim = (move(v) for v in (x, w1, halves, p2e, offsets, lim))
    scales = [move(v) for v in scales]
    tactics = [-1]
    if device == "cuda":
        family, prefix, tiles = SWIGLU_TWINS[dtype]
        names = cake_ops._C.grouped_gemm_tactics(family)
        decode = [-2] if hidden * x.element_size() % 256 == 0 else []  # the decode kernel's K rule
        tactics += decode + [names.index(prefix + tile) for tile in tiles]
    for tactic in tactics:
        want = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, lim, tactic, *scales)
        got = torch.ops.cake.moe_gemm1_swiglu(x, halves, p2e, offsets, k, True, lim, tactic, *scales, w1_gate_up=True)
        assert torch.equal(got[kept:], torch.zeros_like(got[kept:])), tactic
        if tactic == -2 or dtype == torch.bfloat16:
            assert torch.equal(got, want), tactic
        else:
            same = (got[:kept] == want[:kept]).float().mean().item()
            assert same > 0.999, (tactic, same)
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6, msg=lambda m: f"tactic {tactic}: {m}")
        into = torch.full_like(got, float("nan"))
        torch.ops.cake.moe_gemm1_swiglu_out(x, halves, p2e, offsets, k, into, x.new_empty(0, dtype=torch.uint8), True,
                                            lim, tactic, *scales, w1_gate_up=True)
        assert torch.equal(into, got), tactic


# GEMM2's scatter twins: the same 16-bit tiles with the fused finalize as their epilogue (no e4m3: the fp8
# StepFun pipeline finalizes in a fixed order by its specification).
# Not the ptr-array 64x256 pingpong tile (configs_sm90.inc says why).
SCATTER_TWINS = {torch.bfloat16: ("fwd", "fwd_bf16_", ["ping_128x128x64_c1x1", "coop_128x256x64_c1x2",
                                                       "coop_128x256x64_c2x1", "fixed_ping_128x128x64_c1x1",
                                                       "fixed_ping_64x256x64_c1x1", "fixed_coop_128x256x64_c1x2",
                                                       "fixed_coop_128x256x64_c2x1", "fixed_ping_128x128x64_c1x2"]),
                 torch.float16: SWIGLU_TWINS[torch.float16]}


# GEMM1's gathering twins: the 16-bit cooperative SwiGLU twins whose mainloop reads the routes' rows of x itself
# (moe_gemm1_swiglu runs them up to 2I = 2048 instead of gathering x into a copy first; e4m3 x is quantized by that
# gather).
GATHER_TWINS = {torch.bfloat16: ("fwd", "fwd_bf16_", ["coop_128x256x64_c1x2", "coop_128x256x64_c2x1",
                                                      "fixed_coop_128x256x64_c1x2", "fixed_coop_128x256x64_c2x1"]),
                torch.float16: ("fwd_f16", "fwd_f16_", ["coop_128x256x64_c1x2", "coop_128x256x64_c2x1"])}


# The gate-up twins (w1 as [gate; up] halves): every bf16 SwiGLU and gathering twin's tile has one (fixed operands,
# serving the ptr-array tile of the same shape too).
GATE_UP_TWINS = {torch.bfloat16: SWIGLU_TWINS[torch.bfloat16]}
GATHER_GATE_UP_TWINS = {torch.bfloat16: GATHER_TWINS[torch.bfloat16]}


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_epilogue_twins"), reason="built without CUDA kernels")
@pytest.mark.parametrize("kind,twins", [("swiglu", SWIGLU_TWINS), ("scatter", SCATTER_TWINS),
                                        ("gather_swiglu", GATHER_TWINS), ("swiglu_gu", GATE_UP_TWINS),
                                        ("gather_swiglu_gu", GATHER_GATE_UP_TWINS)])
def test_epilogue_twins_pair_with_their_fwd_tiles(kind, twins):
    """Twins are found by name (a fwd configuration's, swiglu_ / scatter_ for fwd_; the gate-up ones swiglu_gu_ /
    gather_swiglu_gu_ for fwd_ and fwd_fixed_): each listed tile has one in every tile order, and no other tile does
    (a renamed configuration would silently lose its twin)."""
    orders = ["", "_rasterN", "_swz4", "_rasterN_swz4"]
    for dtype, (family, prefix, _) in SWIGLU_TWINS.items():
        tiles = twins[dtype][2] if dtype in twins else []
        assert sorted(cake_ops._C.grouped_gemm_epilogue_twins(family, kind)) == sorted(
            prefix + tile + order for tile in tiles for order in orders), (family, kind)


def finalize_in_route_order(rows, e2p, scales, dtype):
    """The fused finalize's numbers with the additions in route order: each router-scaled row rounded to the
    output dtype, each sum too."""
    t, k = scales.shape
    routes = e2p.view(t, k)
    out = torch.zeros(t, rows.shape[1], dtype=dtype)
    for j in range(k):
        term = (rows[routes[:, j].clamp_min(0).long()].float() * scales[:, j:j + 1]).to(dtype)
        out = torch.where(routes[:, j:j + 1] >= 0, (out.float() + term.float()).to(dtype), out)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(ROUTING_CASES.values()), ids=list(ROUTING_CASES))
def test_gemm2_finalize_matches_gemm2_then_finalize(device, dtype, case):
    """GEMM2 with the fused finalize: on the CPU exactly the route-order additions with one rounding each; on
    CUDA (atomics in any order, or the fixed-order fallback at these sizes) within their rounding of the
    float32 combine; out is overwritten (NaN before), tokens without a local route are zero."""
    t, k, e, e_local, offset = case
    x, ids, scales, w1, w2 = moe_problem(t, k, e, e_local, 128, 96, "cpu", dtype)
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    inter = torch.ops.cake.moe_gemm1_swiglu(x, interleave_up_gate_sm90(w1), p2e, offsets, k)
    rows = torch.ops.cake.moe_gemm2(inter, w2, offsets)
    args = [v.to(device) for v in (inter, w2, offsets, p2e, e2p, scales)]
    out = torch.full((t, 128), float("nan"), dtype=dtype, device=device)
    torch.ops.cake.moe_gemm2_finalize_out(*args, out)
    if device == "cpu":
        assert torch.equal(out, finalize_in_route_order(rows, e2p, scales, dtype))
    else:
        torch.testing.assert_close(out.cpu(), torch.ops.cake.moe_finalize(rows, e2p, scales), rtol=2e-2, atol=2e-2)
    if t:
        no_local_route = (e2p.view(t, k) < 0).all(1)
        assert torch.equal(out.cpu()[no_local_route], torch.zeros_like(out.cpu()[no_local_route]))


@cuda_only
@pytest.mark.parametrize("dtype", list(SCATTER_TWINS), ids=["bf16", "f16"])
def test_gemm2_fused_finalize_in_the_gemm_epilogue(dtype):
    """Each tile with a scatter twin, forced, on ragged groups (empty, one row, not a tile multiple, hot) with an
    EP shard's dropped routes: the atomic combine against the same rows added in route order (each tile's GEMM2
    rows: the atomics' order changes only the roundings of the sums) and against the float32 combine. hidden
    320: the last 256-column tile is mostly past N."""
    family, prefix, tiles = SCATTER_TWINS[dtype]
    t, k, hidden, inter_size = 300, 2, 320, 192
    counts = [0, 1, 130, 7, 300, 45]
    kept = sum(counts)
    inter = torch.randn(t * k, inter_size).to(dtype)
    w2 = (torch.randn(len(counts), hidden, inter_size) / inter_size**0.5).to(dtype)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    p2e = torch.cat([torch.randperm(t * k)[:kept], torch.full((t * k - kept,), -1)]).int()
    e2p = torch.full((t * k,), -1, dtype=torch.int32)
    e2p[p2e[:kept].long()] = torch.arange(kept, dtype=torch.int32)
    scales = torch.softmax(torch.randn(t, k), -1)
    cuda = [v.cuda() for v in (inter, w2, offsets, p2e, e2p, scales)]
    names = cake_ops._C.grouped_gemm_tactics(family)
    for tile in tiles:
        tactic = names.index(prefix + tile)
        rows = torch.ops.cake.moe_gemm2(cuda[0], cuda[1], cuda[2], True, tactic).cpu()
        out = torch.full((t, hidden), float("nan"), dtype=dtype, device="cuda")
        torch.ops.cake.moe_gemm2_finalize_out(*cuda, out, True, tactic)
        out = out.cpu()
        in_order = finalize_in_route_order(rows, e2p, scales, dtype)
        # k = 2: a token's two additions in either order give the same bits (0 + a + b == 0 + b + a).
        assert torch.equal(out, in_order), tile
        torch.testing.assert_close(out, torch.ops.cake.moe_finalize(rows, e2p, scales), rtol=2e-2, atol=2e-2)


@cuda_only
def test_gemm2_fused_finalize_past_the_pingpong_twins_k_bound():
    """The 64x256 pingpong tile's scatter twin runs up to K = 4096 (at Mixtral's K = 14336 it was slower than the
    plain GEMM2 and the finalize kernel): past it the fused finalize of that tile is bitwise moe_gemm2 then
    moe_finalize (the fixed-order float32 combine), up to it the twin's atomics add the rounded terms in route
    order (k = 2: any order gives those bits)."""
    t, k, hidden = 64, 2, 256
    counts = [0, 1, 70, 57]
    family, prefix, _ = SCATTER_TWINS[torch.bfloat16]
    tactic = cake_ops._C.grouped_gemm_tactics(family).index(prefix + "fixed_ping_64x256x64_c1x1")
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    p2e = torch.randperm(t * k, device="cuda").int()
    e2p = torch.empty_like(p2e)
    e2p[p2e.long()] = torch.arange(t * k, dtype=torch.int32, device="cuda")
    scales = torch.softmax(torch.randn(t, k, device="cuda"), -1)
    for inter_size, twin in ((4096, True), (4160, False)):
        inter = torch.randn(t * k, inter_size, device="cuda").bfloat16()
        w2 = (torch.randn(len(counts), hidden, inter_size, device="cuda") / inter_size**0.5).bfloat16()
        rows = torch.ops.cake.moe_gemm2(inter, w2, offsets, True, tactic)
        out = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        torch.ops.cake.moe_gemm2_finalize_out(inter, w2, offsets, p2e, e2p, scales, out, True, tactic)
        fixed_order = torch.ops.cake.moe_finalize(rows, e2p, scales)
        in_order = finalize_in_route_order(rows.cpu(), e2p.cpu(), scales.cpu(), torch.bfloat16)
        assert torch.equal(out.cpu(), in_order if twin else fixed_order.cpu()), inter_size
        assert not torch.equal(in_order, fixed_order.cpu())  # the two combines tell the paths apart


def test_gemm2_finalize_rejects_bad_inputs():
    x, ids, scales, w1, w2 = moe_problem(4, 2, 8, 8, 64, 32, "cpu")
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 8, 8, 0, 64)
    inter = torch.randn(8, 32).bfloat16()
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    op = torch.ops.cake.moe_gemm2_finalize_out
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm2_finalize_out: the fused finalize takes bfloat16 or "
                                           r"float16 operands, got Float"):
        op(inter.float(), w2.float(), offsets, p2e, e2p, scales, out.float())
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm2_finalize_out: out must have shape \[num_tokens, hidden\] "
                                           r"= \[4, 64\], got \[4, 32\]"):
        op(inter, w2, offsets, p2e, e2p, scales, out[:, :32])
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm2_finalize_out: intermediate must have num_tokens \* "
                                           r"top_k = 6 rows"):
        op(inter, w2, offsets, p2e[:6], e2p[:6], scales[:3], out[:3])


# The decode kernel (tactic -2; chosen automatically for up to 4 rows per expert for GEMM1 and 2 for GEMM2)
# against the CPU ops: a hot expert (two 32-row passes), an EP shard (dropped routes: zeroed tail rows), top-1,
# one token, 4 rows per expert (GEMM1 on the decode kernel, GEMM2 not); hidden 2560 bf16 stages B in several K chunks.
DECODE_CASES = {"one_token": (1, 8, 64, 64, 0), "hot_expert": (40, 2, 8, 8, 0), "ep_shard": (12, 8, 64, 16, 16),
                "top1": (5, 1, 16, 16, 0), "four_per_expert": (40, 4, 40, 40, 0)}


def decode_is_automatic(rows, num_experts, n, rows_per_expert):
    """tactic -1's rule (moe_cuda.cpp): up to `rows_per_expert` rows per expert on average (GEMM1 4,
    GEMM2 2), and a grid of CTAs that covers the SMs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return rows <= rows_per_expert * num_experts and min(rows, num_experts) * (n // 64) >= sms


def quantize_per_expert(w):
    scale = w.float().abs().amax((1, 2)) / 448
    return (w.float() / scale[:, None, None]).to(torch.float8_e4m3fn), scale


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("limits", [False, True])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel_matches_cpu(case, dtype, limits):
    tactic = -2
    t, k, e, e_local, offset = DECODE_CASES[case]
    fp8 = dtype == torch.float8_e4m3fn
    x, ids, _, w1, w2 = moe_problem(t, k, e, e_local, 2560, 256, "cpu", torch.bfloat16 if fp8 else dtype)
    if case == "hot_expert":
        ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
        ids[:, 0] = 3
    w1 = interleave_up_gate_sm90(w1)
    x_scale = w1_scale = w2_scale = None
    if fp8:
        x, x_scale = torch.ops.cake.quantize_fp8(x)
        (w1, w1_scale), (w2, w2_scale) = quantize_per_expert(w1), quantize_per_expert(w2)
    lim = torch.linspace(0.2, 2.0, e_local) if limits else None
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    kept = int(offsets[-1])
    cuda = [v.cuda() if v is not None else None for v in (x, w1, p2e, offsets, lim, x_scale, w1_scale)]

    want = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, k, True, lim, -1, x_scale, w1_scale)
    got = torch.ops.cake.moe_gemm1_swiglu(*cuda[:4], k, True, cuda[4], tactic, *cuda[5:])
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(got[kept:].cpu(), torch.zeros_like(want[kept:]))
    into = torch.full_like(got, float("nan"))
    torch.ops.cake.moe_gemm1_swiglu_out(*cuda[:4], k, into, torch.empty(0, dtype=torch.uint8, device="cuda"), True,
                                        cuda[4], tactic, *cuda[5:])
    assert torch.equal(into, got)
    if decode_is_automatic(t * k, e_local, 2 * 256, rows_per_expert=4):
        auto = torch.ops.cake.moe_gemm1_swiglu(*cuda[:4], k, True, cuda[4], -1, *cuda[5:])
        assert torch.equal(auto, got)

    a, a_scale = (torch.ops.cake.quantize_fp8(want) if fp8 else (want, None))
    want2 = torch.ops.cake.moe_gemm2(a, w2, offsets, True, -1, a_scale, w2_scale)
    args2 = [a.cuda(), w2.cuda(), offsets.cuda()]
    scales2 = [v.cuda() if v is not None else None for v in (a_scale, w2_scale)]
    got2 = torch.ops.cake.moe_gemm2(*args2, True, tactic, *scales2)
    torch.testing.assert_close(got2[:kept].cpu(), want2[:kept], rtol=2e-2, atol=2e-2)
    if decode_is_automatic(t * k, e_local, 2560, rows_per_expert=2):
        assert torch.equal(torch.ops.cake.moe_gemm2(*args2, True, -1, *scales2)[:kept], got2[:kept])


@cuda_only
@pytest.mark.parametrize("static_scale", [False, True])
@pytest.mark.parametrize("case", ["one_token", "ep_shard"])
def test_decode_kernel_quantizes_bf16_x(case, static_scale):
    """bfloat16 x with e4m3 w1: the decode kernel quantizes x while staging it (a static scale,
    or each CTA's own amax over x), bit for bit quantize_fp8 then the e4m3 path."""
    tactic = -2
    t, k, e, e_local, offset = DECODE_CASES[case]
    x, ids, _, w1, _ = moe_problem(t, k, e, e_local, 2560, 256, "cpu")
    x = 12 * x  # amplitude: the scale matters
    w1, w1_scale = quantize_per_expert(interleave_up_gate_sm90(w1))
    x_scale = torch.tensor([0.05]) if static_scale else None
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, e, e_local, offset, 64)
    x_q, x_q_scale = torch.ops.cake.quantize_fp8(x, x_scale)
    want = torch.ops.cake.moe_gemm1_swiglu(x_q, w1, p2e, offsets, k, True, None, -1, x_q_scale, w1_scale)
    cuda = [v.cuda() for v in (x, w1, p2e, offsets)]
    got = torch.ops.cake.moe_gemm1_swiglu(*cuda, k, True, None, tactic,
                                          x_scale.cuda() if static_scale else None, w1_scale.cuda())
    # The same quantized operand as the e4m3 path through the same kernel: bitwise.
    same = torch.ops.cake.moe_gemm1_swiglu(x_q.cuda(), w1.cuda(), p2e.cuda(), offsets.cuda(), k, True, None, tactic,
                                           x_q_scale.cuda(), w1_scale.cuda())
    assert torch.equal(got, same)
    # QGMMA accumulates with less than float32's precision, so the error grows with the output (the
    # amplitude 12 makes h ~144x that of test_decode_kernel_matches_cpu): atol relative to its size.
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=3e-3 * want.abs().max().item())


@cuda_only
@pytest.mark.parametrize("tactic", [0, "fwd_bf16_coop_128x256x64_c1x2", -2], ids=["gather_kernel", "gemm_gathers", "decode"])
def test_bad_gather_indices_on_gpu_fail_loudly(tactic):
    """A permuted_to_expanded index out of range stops the kernel (never a silent answer): the
    gather kernel (before a tile without a gathering twin) asserts with the op's message; the
    gathering GEMM and the decode kernel trap (a call such as an assert's would serialize their
    wgmmas, ptxas C7510), an unspecified launch failure. Either ends the CUDA context, so this runs
    in a child process."""
    if isinstance(tactic, str):
        tactic = cake_ops._C.grouped_gemm_tactics("fwd").index(tactic)
    script = textwrap.dedent(f"""
        import torch, cake_ops
        from cake_ops.fused_moe import interleave_up_gate_sm90
        x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
        w1 = interleave_up_gate_sm90(torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16))
        offsets = torch.tensor([0, 2, 2, 4, 4], dtype=torch.int32, device="cuda")
        p2e = torch.tensor([0, 1, 9, 3], dtype=torch.int32, device="cuda")  # 9 >= 2 tokens * top_k 2
        torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, 2, True, None, {tactic})
        torch.cuda.synchronize()
        print("no error")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no error" not in output, output
    if tactic == 0:
        assert "cake::moe_gemm1_swiglu: permuted_to_expanded must hold route indices" in output, output
    else:
        assert "CUDA error" in output, output


@cuda_only
def test_decode_kernel_rejects_what_it_cannot_run():
    x, ids, _, w1, w2 = moe_problem(2, 2, 8, 8, 64, 96, "cuda")
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, 8, 8, 0, 64)
    inter = torch.randn(4, 96, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm2: tactic -2 \(the decode kernel\) needs N % 64 == 0 and "
                                           r"K \* element_size % 256 == 0, got N=64 and 192 bytes of K"):
        torch.ops.cake.moe_gemm2(inter, w2, offsets, True, -2)
    with pytest.raises(RuntimeError, match="cake::moe_gemm1_swiglu: tactic must be -2 .* got -3"):
        torch.ops.cake.moe_gemm1_swiglu(x, interleave_up_gate_sm90(w1), p2e, offsets, 2, True, None, -3)


@cuda_only
def test_cuda_kernels_reject_what_they_cannot_run():
    x, ids, scales, w1, w2 = moe_problem(4, 2, 8, 8, 64, 32, "cuda", dtype=torch.float32)
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 8, 8, 0, 64)
    with pytest.raises(RuntimeError, match="cake::moe_gemm1_swiglu: CUDA kernels take bfloat16, float16 or float8_e4m3fn"):
        torch.ops.cake.moe_gemm1_swiglu(x, interleave_up_gate_sm90(w1), p2e, offsets, 2)
    rows = torch.randn(8, 60, device="cuda").bfloat16()
    with pytest.raises(RuntimeError, match="cake::moe_finalize: CUDA kernels need hidden % 8 == 0"):
        torch.ops.cake.moe_finalize(rows[:, :12], e2p, scales)


@pytest.mark.parametrize("device", DEVICES)
def test_expected_routes_is_a_hint(device):
    """An expert-parallel shard's expected_routes changes the tile choice, never the result (a
    shard of 4 of 32 experts: ~1/8 of the routes are local); below -1 it is rejected by each op."""
    x, ids, scales, w1, w2 = moe_problem(200, 4, 32, 4, 64, 64, device)
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 32, 4, 8, 64)
    w1 = interleave_up_gate_sm90(w1)
    hint = 100  # 800 routes, 4 of 32 experts
    inter = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, 4)
    inter_hint = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, 4, expected_routes=hint)
    kept = int(offsets[-1])
    torch.testing.assert_close(inter_hint[:kept], inter[:kept], rtol=1e-2, atol=1e-2)
    rows = torch.ops.cake.moe_gemm2(inter, w2, offsets)
    rows_hint = torch.ops.cake.moe_gemm2(inter, w2, offsets, expected_routes=hint)
    torch.testing.assert_close(rows_hint[:kept], rows[:kept], rtol=1e-2, atol=1e-2)
    out, out_hint = (torch.empty(200, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.ops.cake.moe_gemm2_finalize_out(inter, w2, offsets, p2e, e2p, scales, out)
    torch.ops.cake.moe_gemm2_finalize_out(inter, w2, offsets, p2e, e2p, scales, out_hint, True, -1, hint)
    torch.testing.assert_close(out_hint, out, rtol=2e-2, atol=2e-2)
    if device == "cpu":  # the CPU implementations ignore the hint exactly
        assert torch.equal(inter_hint, inter) and torch.equal(rows_hint, rows) and torch.equal(out_hint, out)
    gemm1_ws = torch.empty(0, dtype=torch.uint8, device=device)
    calls = {
        "moe_gemm1_swiglu": lambda: torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, 4, expected_routes=-2),
        "moe_gemm1_swiglu_out": lambda: torch.ops.cake.moe_gemm1_swiglu_out(
            x, w1, p2e, offsets, 4, inter.clone(), gemm1_ws, expected_routes=-2),
        "moe_gemm2": lambda: torch.ops.cake.moe_gemm2(inter, w2, offsets, expected_routes=-2),
        "moe_gemm2_out": lambda: torch.ops.cake.moe_gemm2_out(inter, w2, offsets, rows.clone(), gemm1_ws,
                                                              expected_routes=-2),
        "moe_gemm2_finalize_out": lambda: torch.ops.cake.moe_gemm2_finalize_out(
            inter, w2, offsets, p2e, e2p, scales, out, True, -1, -2),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"cake::{name}: expected_routes must be -1 \\(every row\\) or a "
                                               "route count >= 0, got -2"):
            call()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_gemm1_out_errors_name_the_out_op(device):
    """The checks moe_gemm1_swiglu_out shares with moe_gemm1_swiglu (clamp limits, activation scales) and its own
    (out, workspace) name moe_gemm1_swiglu_out."""
    x, ids, _, w1, _ = moe_problem(8, 2, 4, 4, 64, 32, device)
    _, offsets, p2e, _, _ = torch.ops.cake.moe_sort(ids, 4, 4, 0, 64)
    w1 = interleave_up_gate_sm90(w1)
    out = torch.empty(16, 32, dtype=torch.bfloat16, device=device)
    ws = torch.empty(0, dtype=torch.uint8, device=device)
    call = torch.ops.cake.moe_gemm1_swiglu_out
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm1_swiglu_out: clamp_limits must be float32 \[E_local\] = \[4\], "
                                           r"got Float \[3\]"):
        call(x, w1, p2e, offsets, 2, out, ws, True, torch.ones(3, device=device))
    with pytest.raises(RuntimeError, match="cake::moe_gemm1_swiglu_out: scales apply to float8_e4m3fn x and weights only"):
        call(x, w1, p2e, offsets, 2, out, ws, True, None, -1, torch.ones(1, device=device))
    with pytest.raises(RuntimeError, match=r"cake::moe_gemm1_swiglu_out: out must have shape \[16, 32\]"):
        call(x, w1, p2e, offsets, 2, out[:8], ws)
    with pytest.raises(RuntimeError, match="cake::moe_gemm1_swiglu_out: workspace must be a (contiguous )?uint8 tensor"):
        call(x, w1, p2e, offsets, 2, out, torch.empty(4, dtype=torch.float32, device=device))


def test_moe_ops_opcheck():
    ids = torch.randint(0, 16, (20, 4), dtype=torch.int32)
    torch.library.opcheck(torch.ops.cake.moe_sort, (ids, 16, 8, 8, 64))
    x, ids, scales, w1, w2 = moe_problem(12, 4, 16, 16, 64, 32, "cpu")
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 16, 16, 0, 64)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu, (x, interleave_up_gate_sm90(w1), p2e, offsets, 4))
    inter = torch.ops.cake.moe_gemm1_swiglu(x, interleave_up_gate_sm90(w1), p2e, offsets, 4)
    torch.library.opcheck(torch.ops.cake.moe_gemm2, (inter, w2, offsets))
    torch.library.opcheck(torch.ops.cake.moe_gemm2, (inter, w2, offsets), {"expected_routes": 12})
    rows = torch.randn(48, 64).bfloat16().requires_grad_()
    torch.library.opcheck(torch.ops.cake.moe_finalize, (rows, e2p, scales.requires_grad_()))
    rows = rows.detach()
    scales = scales.detach()
    gate_up = torch.randn(10, 64).bfloat16()
    torch.library.opcheck(torch.ops.cake.swiglu, (gate_up.requires_grad_(),))
    torch.library.opcheck(torch.ops.cake.swiglu, (gate_up, 0.5))
    torch.library.opcheck(torch.ops.cake.swiglu_backward, (torch.randn(10, 32).bfloat16(), gate_up.detach()))
    torch.library.opcheck(torch.ops.cake.swiglu_backward, (torch.randn(10, 32).bfloat16(), gate_up.detach(), 0.5))
    torch.library.opcheck(torch.ops.cake.moe_finalize_out, (rows, e2p, scales, torch.empty(12, 64).bfloat16()))
    grad = torch.randn(12, 64).bfloat16()
    torch.library.opcheck(torch.ops.cake.moe_finalize_backward, (grad, e2p, scales, 48, rows))
    torch.library.opcheck(torch.ops.cake.moe_finalize_backward, (grad, e2p, scales, 48))
    torch.library.opcheck(torch.ops.cake.moe_gemm2_finalize_out,
                          (inter, w2, offsets, p2e, e2p, scales, torch.empty(12, 64).bfloat16()))


class OpErrorCase(expecttest.TestCase):
    """The first line of the RuntimeError that `op` raises for the given arguments."""
    op = None

    def error(self, *args, **kwargs):
        with self.assertRaises(RuntimeError) as ctx:
            self.op(*args, **kwargs)
        return str(ctx.exception).split("\n")[0]


class TestMoeSortErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.moe_sort)

    def test_errors(self):
        ids = torch.zeros(4, 2, dtype=torch.int32)
        self.assertExpectedInline(self.error(ids.long(), 8, 8, 0, 64), """cake::moe_sort: token_selected_experts must be int32, got Long""")
        self.assertExpectedInline(self.error(ids[0], 8, 8, 0, 64), """cake::moe_sort: token_selected_experts must be a 2-D [num_tokens, top_k] tensor, got shape [2]""")
        self.assertExpectedInline(self.error(ids, 8, 4, 6, 64), """cake::moe_sort: the shard [local_expert_offset, local_expert_offset + num_local_experts) = [6, 10) must lie within [0, num_experts=8)""")
        self.assertExpectedInline(self.error(ids, 8, 9, 0, 64), """cake::moe_sort: num_local_experts must be in [1, num_experts=8], got 9""")
        self.assertExpectedInline(self.error(ids, 8, 8, 0, 0), """cake::moe_sort: tile_size must be positive, got 0""")


class TestMoeGemm1InverseErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.moe_gemm1_swiglu)

    def test_errors(self):
        x, ids, _, w1, _ = moe_problem(4, 2, 4, 4, 64, 32, "cpu", torch.bfloat16)
        _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 4, 4, 0, 64)
        args = (x, interleave_up_gate_sm90(w1), p2e, offsets, 2)
        self.assertExpectedInline(self.error(*args, expanded_to_permuted=e2p.long()), """cake::moe_gemm1_swiglu: expanded_to_permuted must be int32 [num_tokens * top_k] = [8] on cpu (moe_sort's), got Long [8] on cpu""")
        self.assertExpectedInline(self.error(*args, expanded_to_permuted=e2p[:6]), """cake::moe_gemm1_swiglu: expanded_to_permuted must be int32 [num_tokens * top_k] = [8] on cpu (moe_sort's), got Int [6] on cpu""")
        with self.assertRaisesRegex(RuntimeError, r"must be int32 \[num_tokens \* top_k\] = \[8\]"):
            self.op(*(a.to("meta") for a in args[:4]), 2, expanded_to_permuted=e2p[:6].to("meta"))


class TestMoeFinalizeBackwardErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.moe_finalize_backward)

    def test_errors(self):
        grad, scales, rows = torch.randn(3, 16).bfloat16(), torch.rand(3, 2), torch.randn(8, 16).bfloat16()
        e2p = torch.tensor([0, 5, -1, 2, 7, 1], dtype=torch.int32)
        self.assertExpectedInline(self.error(grad[0], e2p, scales, 8), """cake::moe_finalize_backward: grad_output must be 2-D [rows, hidden], got shape [16]""")
        self.assertExpectedInline(self.error(grad[:2], e2p, scales, 8), """cake::moe_finalize_backward: grad_output must have num_tokens = 3 rows (token_final_scales is [3, 2]), got [2, 16]""")
        self.assertExpectedInline(self.error(grad, e2p.long(), scales, 8), """cake::moe_finalize_backward: expanded_to_permuted must be int32 [num_tokens * top_k] = [6], got Long [6]""")
        self.assertExpectedInline(self.error(grad, e2p, scales, -1), """cake::moe_finalize_backward: num_rows must be >= 0, got -1""")
        self.assertExpectedInline(self.error(grad, e2p, scales, 7), """cake::moe_finalize_backward: expanded_to_permuted must hold -1 or row indices below num_rows = 7, got values in [-1, 7]""")
        self.assertExpectedInline(self.error(grad, e2p, scales, 8, rows.half()), """cake::moe_finalize_backward: permuted_rows must be [num_rows, hidden] = [8, 16] BFloat16 on cpu (grad_output's dtype and device), got Half [8, 16] on cpu""")
        twice = e2p.clone()
        twice[3] = 5
        self.assertExpectedInline(self.error(grad, twice, scales, 8), """cake::moe_finalize_backward: the kept routes of expanded_to_permuted must read distinct rows (as moe_sort's do); a row read twice has no single route to take its gradient from""")
        with self.assertRaisesRegex(RuntimeError, r"permuted_rows must be \[num_rows, hidden\] = \[8, 16\]"):  # the fake too
            self.op(*(a.to("meta") for a in (grad, e2p, scales)), 8, rows[:4].to("meta"))

    @cuda_only
    def test_cuda_errors(self):
        grad, scales, e2p = torch.randn(3, 16, device="cuda"), torch.rand(3, 2, device="cuda"), torch.arange(6, device="cuda").int()
        with self.assertRaisesRegex(RuntimeError, "cake::moe_finalize_backward: CUDA kernels take bfloat16 or float16 grad_output, got Float"):
            self.op(grad, e2p, scales, 6)
        with self.assertRaisesRegex(RuntimeError, r"cake::moe_finalize_backward: CUDA kernels need hidden % 8 == 0 \(16-byte rows\), got 12"):
            self.op(grad[:, :12].bfloat16(), e2p, scales, 6)


class TestSwigluErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.swiglu)

    def test_errors(self):
        gate_up = torch.randn(4, 32).bfloat16()
        self.assertExpectedInline(self.error(gate_up[:, :31]), """cake::swiglu: gate_up must be 2-D [rows, 2I] ([gate | up] halves), got shape [4, 31]""")
        self.assertExpectedInline(self.error(gate_up[0]), """cake::swiglu: gate_up must be 2-D [rows, 2I] ([gate | up] halves), got shape [32]""")
        self.assertExpectedInline(self.error(gate_up.int()), """cake::swiglu: gate_up must be bfloat16, float16, float32 or float64, got Int""")
        backward = torch.ops.cake.swiglu_backward
        with self.assertRaisesRegex(RuntimeError, r"cake::swiglu_backward: grad_out must be \[rows, I\] = \[4, 16\], got shape \[4, 32\]"):
            backward(gate_up, gate_up)
        with self.assertRaisesRegex(RuntimeError, "cake::swiglu_backward: grad_out must have gate_up's dtype and device"):
            backward(gate_up[:, :16].float(), gate_up)
        for meta in (True, False):  # the fakes say the same
            args = [t.to("meta") if meta else t for t in (gate_up[:, :16].half(), gate_up)]
            with self.assertRaisesRegex(RuntimeError, r"grad_out must have gate_up's dtype and device \(torch.bfloat16|BFloat16"):
                backward(*args)
            limit_error = (r"limit must be positive \(the clamp of silu\(min\(gate, limit\)\) \* clamp\(up, -limit, "
                           r"limit\)\), got (-2|0|nan)")
            for limit in (-2.0, 0.0, float("nan")):
                gu = gate_up.to("meta") if meta else gate_up
                with self.assertRaisesRegex(RuntimeError, "cake::swiglu: " + limit_error):
                    self.op(gu, limit)
                with self.assertRaisesRegex(RuntimeError, "cake::swiglu_backward: " + limit_error):
                    backward(gu[:, :16], gu, limit)

    @cuda_only
    def test_cuda_errors(self):
        with self.assertRaisesRegex(RuntimeError, "cake::swiglu: CUDA kernels take bfloat16 or float16, got Float"):
            self.op(torch.randn(4, 32, device="cuda"))
        with self.assertRaisesRegex(RuntimeError, r"cake::swiglu_backward: CUDA kernels need I % 8 == 0 \(16-byte halves\), got I = 12"):
            torch.ops.cake.swiglu_backward(torch.randn(4, 12, device="cuda").half(), torch.randn(4, 24, device="cuda").half())


def swiglu_float64(gate_up, limit=None):
    gate, up = gate_up.double().chunk(2, dim=-1)
    if limit is not None:  # DeepSeek-V4's clamped SwiGLU; no gradient at the bounds (torch 2.14's clamp; 2.11's passed it)
        gate = torch.where(gate < limit, gate, torch.full_like(gate, limit))
        up = torch.where(up.abs() < limit, up, up.sign().detach() * limit)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), ("cpu", torch.float32)] + [
    pytest.param("cuda", dtype, marks=cuda_only) for dtype in (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("rows,inter", [(37, 64), (1, 8), (0, 16), (300, 200)])
@pytest.mark.parametrize("limit", [None, 2.5, 7.0], ids=["plain", "clamped_tight", "clamped"])
def test_swiglu_matches_float64(device, dtype, rows, inter, limit):
    """cake::swiglu and its gradient (cake::swiglu_backward through the autograd formula) against float64 autograd
    of silu(gate) * up, or with a limit of the clamped silu(min(gate, L)) * clamp(up, -L, L): 16-bit within one
    rounding of the result (float32 math, rounded once); gates of +-90 included (exp overflows: silu and its
    gradients reach their limits, no NaN), and values at +-L exactly (no gradient there, as torch 2.14's clamp). A
    column slice (not contiguous) works."""
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    wide = torch.randn(rows, 2 * inter + 8, generator=g) * 3
    wide[::7, :inter] = 90.0 * torch.sign(wide[::7, :inter])
    if limit is not None:
        wide[1::5, 4::3] = limit * torch.sign(wide[1::5, 4::3])
    gate_up_cpu = wide.to(dtype)
    grad = torch.randn(rows, inter, generator=g).to(dtype)
    gate_up = gate_up_cpu.to(device)[:, 4:-4] if rows % 2 else gate_up_cpu[:, 4:-4].contiguous().to(device)
    leaf = gate_up.detach().requires_grad_()
    out = torch.ops.cake.swiglu(leaf, limit)
    (d_gate_up,) = torch.autograd.grad(out, leaf, grad.to(device))
    assert out.dtype == dtype and out.shape == (rows, inter) and d_gate_up.shape == gate_up.shape

    ref_in = gate_up_cpu[:, 4:-4].double().requires_grad_()
    want = swiglu_float64(ref_in, limit)
    (want_grad,) = torch.autograd.grad(want, ref_in, grad.double())
    eps = torch.finfo(dtype).eps
    for got, ref in ((out, want), (d_gate_up, want_grad)):
        got = got.cpu().double()
        assert torch.isfinite(got).all()
        # 16-bit: one rounding of float32 math. float32: a few roundings of its own, and silu' cancels near its zero
        # (gate ~ -1.28), so an absolute bound at float32's resolution of values ~10.
        sixteen_bit = dtype != torch.float32
        torch.testing.assert_close(got, ref.detach(), rtol=eps if sixteen_bit else 8 * eps,
                                   atol=eps * 1e-3 if sixteen_bit else 1e-6)


class TestMoeIndexValuesOnCpu(OpErrorCase):
    """The CPU raises what the CUDA kernels stop on with a device-side assert (test_bad_gather_indices_on_gpu_fail_loudly)."""

    def test_errors(self):
        x, ids, scales, w1, w2 = moe_problem(4, 2, 4, 4, 64, 32, "cpu", torch.bfloat16)
        _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 4, 4, 0, 64)
        w1 = interleave_up_gate_sm90(w1)
        self.op = torch.ops.cake.moe_gemm1_swiglu
        bad = p2e.clone()
        bad[3] = 8
        self.assertExpectedInline(self.error(x, w1, bad, offsets, 2), """cake::moe_gemm1_swiglu: permuted_to_expanded must hold route indices in [0, num_tokens * top_k) for the rows below expert_offsets[E]; num_tokens * top_k = 8, got values in [0, 8]""")
        self.assertExpectedInline(self.error(x, w1, p2e, torch.tensor([0, 2, 1, 8, 8], dtype=torch.int32), 2), """cake::moe_gemm1_swiglu: group ends must be non-decreasing, got 1 after 2 at group 1""")
        self.op = torch.ops.cake.moe_gemm2
        inter = torch.randn(8, 32).bfloat16()
        self.assertExpectedInline(self.error(inter, w2, torch.tensor([0, 2, 4, 6, 9], dtype=torch.int32)), """cake::moe_gemm2: group end 9 at group 3 is past the 8 packed rows""")
        self.op = torch.ops.cake.moe_finalize
        rows = torch.randn(8, 64).bfloat16()
        bad = e2p.clone()
        bad[0] = 8
        self.assertExpectedInline(self.error(rows, bad, scales), """cake::moe_finalize: expanded_to_permuted must hold -1 or row indices below permuted_rows.size(0) = 8, got values in [0, 8]""")
        self.op = torch.ops.cake.moe_finalize_out
        bad[0] = -2
        self.assertExpectedInline(self.error(rows, bad, scales, torch.empty(4, 64).bfloat16()), """cake::moe_finalize_out: expanded_to_permuted must hold -1 or row indices below permuted_rows.size(0) = 8, got values in [-2, 7]""")


def test_interleave_up_gate_sm90():
    e, inter, h = 3, 96, 16
    w = torch.randn(e, 2 * inter, h)
    out = interleave_up_gate_sm90(w)
    gate, up = w[:, :inter], w[:, inter:]
    for c in range(inter // 32):
        assert torch.equal(out[:, 64 * c:64 * c + 32], up[:, 32 * c:32 * (c + 1)])
        assert torch.equal(out[:, 64 * c + 32:64 * (c + 1)], gate[:, 32 * c:32 * (c + 1)])
    with pytest.raises(ValueError, match="I % 32 == 0"):
        interleave_up_gate_sm90(torch.randn(2, 40, 8))


# ---- moe_forward_out: the whole layer (on CUDA, the one-launch layer kernel at decode sizes) ----
# name -> (num_tokens, top_k, num_experts, num_local_experts, local_expert_offset); "many_routes"
# has 80 routes, past the layer kernel's 64: CUDA runs the four ops there.
FORWARD_CASES = {"one_token": (1, 8, 64, 64, 0), "ep_shard": (1, 8, 64, 16, 16), "ep_shard_4": (1, 8, 64, 4, 16),
                 "three_tokens": (3, 4, 16, 16, 0),
                 "top1": (2, 1, 8, 8, 0), "no_tokens": (0, 8, 16, 16, 0), "many_routes": (20, 4, 16, 16, 0)}


def forward_problem(case, dtype, limits, static_scales, device, hidden=512, inter=256):
    """moe_forward_out's arguments (gate-first w1 kept for the reference): e4m3 weights take
    bfloat16 x at amplitude 12 (the scales and the limits matter)."""
    t, k, e, e_local, offset = FORWARD_CASES[case]
    fp8 = dtype == torch.float8_e4m3fn
    x, ids, scales, w1_gate_up, w2 = moe_problem(t, k, e, e_local, hidden, inter, "cpu",
                                                 torch.bfloat16 if fp8 else dtype)
    w1 = interleave_up_gate_sm90(w1_gate_up)
    opt = dict(clamp_limits=torch.linspace(0.2, 2.0, e_local) if limits else None, x_scale=None, w1_scale=None,
               fc2_scale=None, w2_scale=None)
    if fp8:
        x = 12 * x
        (w1, opt["w1_scale"]), (w2, opt["w2_scale"]) = quantize_per_expert(w1), quantize_per_expert(w2)
        if static_scales:
            opt["x_scale"], opt["fc2_scale"] = torch.tensor([0.06]), torch.tensor([0.02])
    move = (lambda v: v.to(device) if v is not None else None)
    args = [move(v) for v in (x, ids, scales, w1, w2)]
    return args, {n: move(v) for n, v in opt.items()}, (w1_gate_up, offset, e_local)


def staged_forward(x, ids, scales, w1, w2, offset, tactic=-1, clamp_limits=None, x_scale=None, w1_scale=None,
                   fc2_scale=None, w2_scale=None):
    """moe_sort -> moe_gemm1_swiglu -> moe_gemm2 -> moe_finalize, as separate ops."""
    e_local = w1.shape[0]
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, offset + e_local, e_local, offset, 64)
    h = torch.ops.cake.moe_gemm1_swiglu(x, w1, p2e, offsets, ids.shape[1], True, clamp_limits, tactic, x_scale,
                                        w1_scale)
    rows = torch.ops.cake.moe_gemm2(h, w2, offsets, True, tactic, fc2_scale, w2_scale)
    return torch.ops.cake.moe_finalize(rows, e2p, scales)


def forward_out(args, opt, offset, workspace=None, expected_routes=-1):
    x = args[0]
    out = torch.full_like(x, float("nan"))
    ws = torch.empty(0, dtype=torch.uint8, device=x.device) if workspace is None else workspace
    torch.ops.cake.moe_forward_out(*args, offset, out, ws, True, **opt, expected_routes=expected_routes)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_moe_forward_out_is_the_four_ops(case, dtype):
    """On the CPU: bit for bit the four ops it stands for, and close to the float32 reference MoE."""
    fp8 = dtype == torch.float8_e4m3fn
    args, opt, (w1_gate_up, offset, e_local) = forward_problem(case, dtype, True, fp8, "cpu")
    got = forward_out(args, opt, offset)
    assert torch.equal(got, staged_forward(*args, offset, **opt))
    if not fp8:  # e4m3 weights: their rounding is the error (the four ops' own tests bound it)
        x, ids, scales, _, w2 = args
        want = reference.moe_forward(x, ids, scales, w1_gate_up, w2, e_local, offset, opt["clamp_limits"])
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@cuda_only
@pytest.mark.parametrize("limits", [False, True])
@pytest.mark.parametrize("dtype,static_scales", [(torch.bfloat16, False), (torch.float16, False),
                                                 (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True)])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_moe_forward_out_layer_kernel(case, dtype, static_scales, limits):
    """The layer kernel (T * top_k <= 64) is bit for bit the four ops on the decode kernel (tactic
    -2: the same wgmma sequence per 64 weight rows, the same roundings and fp8 scales); the rest
    runs the four ops. Both agree with the CPU op."""
    fp8 = dtype == torch.float8_e4m3fn
    args, opt, (_, offset, _) = forward_problem(case, dtype, limits, static_scales, "cuda")
    t, k = args[1].shape
    got = forward_out(args, opt, offset)
    if 0 < t * k <= 64:
        assert cake_ops._C.moe_forward_layer_fits(t * k, 512, 256, args[3].element_size())
        assert torch.equal(got, staged_forward(*args, offset, tactic=-2, **opt))
    else:
        assert torch.equal(got, staged_forward(*args, offset, **opt))
    cpu_args = [a.cpu() for a in args]
    cpu_opt = {n: v.cpu() if v is not None else None for n, v in opt.items()}
    want = forward_out(cpu_args, cpu_opt, offset)
    tol = 5e-2 if fp8 else 2e-2
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol * scale)
    # A caller-owned workspace gives the same bits.
    ws = torch.empty(cake_ops._C.moe_forward_workspace_size(t * k, 512, 256), dtype=torch.uint8, device="cuda")
    assert torch.equal(forward_out(args, opt, offset, ws), got)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", ["one_token", "ep_shard", "many_routes"])
def test_moe_forward_out_reads_gate_up_halves(device, case, dtype):
    """moe_forward_out with w1_gate_up=True on w1's [gate; up] halves: the interleaved weights' numbers, bit for
    bit where both run the layer kernel (CUDA, T * top_k <= 64) or the CPU ops; past the layer kernel the
    grouped GEMM1 stores h and the SwiGLU kernel follows (its exp may differ in the odd last bit)."""
    args, opt, (_, offset, _) = forward_problem(case, dtype, True, False, device)
    t, k = args[1].shape
    want = forward_out(args, opt, offset)
    halves = list(args)
    halves[3] = gate_up_halves(args[3])
    got = forward_out(halves, {**opt, "w1_gate_up": True}, offset)
    if device == "cpu" or t * k <= 64:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@cuda_only
@pytest.mark.parametrize("dtype,static_scales", [(torch.bfloat16, False), (torch.float16, False),
                                                 (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True)])
@pytest.mark.parametrize("local_routes", [1, 2, 4])
def test_layer_kernel_spreads_few_items_over_the_grid(dtype, static_scales, local_routes):
    """An EP shard's token with H=4096, I=2048 (16-bit K: 4 slices in GEMM1, 2 in GEMM2; e4m3: 2 and
    1): one or two local routes (64 or 128 GEMM1 items for ~264 CTAs) make the layer kernel that
    expected_routes selects spread each item's K slices over CTAs; four routes do not (the control).
    The same bits as the kernel without spreading (no hint) and as the decode kernel, which sum every
    slice in one CTA, and close to the CPU op."""
    hidden, inter = 4096, 2048
    args, opt, (_, offset, e_local) = forward_problem("ep_shard_4", dtype, True, static_scales, "cuda", hidden, inter)
    local = [offset + j for j in range(local_routes)]
    others = [e for e in range(64) if not offset <= e < offset + e_local][:8 - local_routes]
    args[1].copy_(torch.tensor([local + others], dtype=torch.int32)[:, torch.randperm(8)])
    assert cake_ops._C.moe_forward_layer_fits(8, hidden, inter, args[3].element_size())
    got = forward_out(args, opt, offset, expected_routes=local_routes)
    assert torch.equal(got, forward_out(args, opt, offset))
    assert torch.equal(got, staged_forward(*args, offset, tactic=-2, **opt))
    want = forward_out([a.cpu() for a in args], {n: v.cpu() if v is not None else None for n, v in opt.items()}, offset)
    tol = 5e-2 if dtype == torch.float8_e4m3fn else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_moe_forward_workspace_size_is_the_fakes():
    """The fake's workspace rule (Python, traceable) is moe_forward_workspace_size's."""
    from cake_ops._fake import _moe_forward_workspace_bytes
    for routes, hidden, inter in [(1, 512, 256), (8, 4096, 2048), (64, 7168, 2048), (3, 2048, 14336), (5, 64, 32)]:
        assert _moe_forward_workspace_bytes(routes, hidden, inter) == cake_ops._C.moe_forward_workspace_size(
            routes, hidden, inter)


def captured(run):
    """A CUDA graph of run(), after one eager call (allocations and first-launch setup)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


@cuda_only
def test_moe_forward_out_graph_replay():
    """Captured once; new routes, scales and hidden states written into the bound tensors; replayed."""
    args, opt, (_, offset, _) = forward_problem("one_token", torch.float8_e4m3fn, True, False, "cuda")
    x, ids, scales = args[:3]
    out = torch.empty_like(x)
    ws = torch.empty(cake_ops._C.moe_forward_workspace_size(8, 512, 256), dtype=torch.uint8, device="cuda")
    graph = captured(lambda: torch.ops.cake.moe_forward_out(*args, offset, out, ws, True, **opt))
    for _ in range(3):
        x.copy_(12 * torch.randn_like(x, dtype=torch.float32))
        ids.copy_(torch.randperm(64, device="cuda")[:8].view(1, 8).int())
        scales.copy_(torch.softmax(torch.randn_like(scales), -1))
        graph.replay()
        assert torch.equal(out, forward_out(args, opt, offset))


@cuda_only
def test_moe_forward_out_dropped_and_bad_ids():
    """Ids outside the shard (other shards, negative, past num_experts) contribute zero; a token
    with none kept gets zeros."""
    args, opt, (_, offset, _) = forward_problem("ep_shard", torch.bfloat16, False, False, "cuda")
    args[1].copy_(torch.tensor([[-1, 0, 15, 32, 100, 1 << 30, 17, 31]], dtype=torch.int32))
    got = forward_out(args, opt, offset)
    assert torch.equal(got, staged_forward(*args, offset, tactic=-2, **opt))
    args[1].fill_(3)
    assert torch.equal(forward_out(args, opt, offset), torch.zeros_like(got))


@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactics"), reason="built without CUDA kernels")
def test_layer_fits_is_the_cuda_rule():
    """fused_moe.layer_fits (Python, traceable) and the C++ rule the CUDA op applies agree."""
    from cake_ops.fused_moe import layer_fits
    for routes in (0, 1, 8, 16, 64, 65):
        for hidden in (128, 192, 2048, 4096, 7168):
            for inter in (96, 256, 768, 1280, 1536, 2048, 14336):
                for wb in (1, 2):
                    assert layer_fits(routes, hidden, inter, wb) == cake_ops._C.moe_forward_layer_fits(
                        routes, hidden, inter, wb), (routes, hidden, inter, wb)


def test_moe_forward_out_opcheck():
    args, opt, (_, offset, _) = forward_problem("three_tokens", torch.bfloat16, True, False, "cpu")
    out = torch.empty_like(args[0])
    torch.library.opcheck(torch.ops.cake.moe_forward_out, (*args, offset, out, torch.empty(0, dtype=torch.uint8)),
                          opt)


class TestMoeForwardErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.moe_forward_out)

    def test_errors(self):
        args, opt, (_, offset, _) = forward_problem("three_tokens", torch.bfloat16, False, False, "cpu")
        x, ids, scales, w1, w2 = args
        out, ws = torch.empty_like(x), torch.empty(0, dtype=torch.uint8)
        self.assertExpectedInline(self.error(x.float(), ids, scales, w1, w2, 0, out, ws), """cake::moe_forward_out: x must be bfloat16 or float16, got Float""")
        self.assertExpectedInline(self.error(x, ids.long(), scales, w1, w2, 0, out, ws), """cake::moe_forward_out: token_selected_experts must be int32, got Long""")
        self.assertExpectedInline(self.error(x, ids[:2], scales, w1, w2, 0, out, ws), """cake::moe_forward_out: token_selected_experts must be [num_tokens = 3, top_k >= 1], got [2, 4]""")
        self.assertExpectedInline(self.error(x, ids, scales.double(), w1, w2, 0, out, ws), """cake::moe_forward_out: token_final_scales must be float32 [3, 4], got Double [3, 4]""")
        self.assertExpectedInline(self.error(x, ids, scales, w1, w2[:, :, :8], 0, out, ws), """cake::moe_forward_out: w2 must be [E_local, hidden, I] = [16, 512, 256], got [16, 512, 8]""")
        self.assertExpectedInline(self.error(x, ids, scales, w1, w2, -1, out, ws), """cake::moe_forward_out: local_expert_offset must be >= 0, got -1""")
        self.assertExpectedInline(self.error(x, ids, scales, w1.half(), w2.half(), 0, out, ws), """cake::moe_forward_out: w1 must have x's dtype BFloat16 (or be float8_e4m3fn with bfloat16 x), got Half""")
        self.assertExpectedInline(self.error(x, ids, scales, w1, w2, 0, out[:2], ws), """cake::moe_forward_out: out must have shape [num_tokens, hidden] = [3, 512], got [2, 512]""")
        self.assertExpectedInline(self.error(x, ids, scales, w1, w2, 0, out, torch.empty(8, dtype=torch.uint8)), """cake::moe_forward_out: workspace must be a contiguous uint8 tensor of 0 or at least 84992 bytes on cpu, got Byte [8] on cpu""")
        self.assertExpectedInline(self.error(x, ids, scales, w1, w2, 0, out, ws, expected_routes=-2), """cake::moe_forward_out: expected_routes must be -1 (every row) or a route count >= 0, got -2""")
        w1q, w1s = quantize_per_expert(w1)
        w2q, _ = quantize_per_expert(w2)
        self.assertExpectedInline(self.error(x, ids, scales, w1q, w2q, 0, out, ws), """cake::moe_forward_out: float8_e4m3fn w1 needs its scales (one per local expert)""")
        self.assertExpectedInline(self.error(x, ids, scales, w1q, w2q, 0, out, ws, w1_scale=w1s), """cake::moe_forward_out: float8_e4m3fn w2 needs its scales (one per local expert)""")


# ---- moe_forward_from_logits_out: the Renormalize routing, then the layer (StepFun's decode) ----
def logits_problem(case, dtype, logits_dtype, device, num_experts=None):
    """forward_problem's layer with router logits [T, E] in place of the routes: coarse values so
    that ties (to the lower id) occur, and a NaN (never picked)."""
    args, opt, (_, offset, _) = forward_problem(case, dtype, True, False, device)
    t, k = args[1].shape
    e = num_experts or FORWARD_CASES[case][2]
    logits = torch.round(4 * torch.randn(t, e)) / 4
    if t and e > k:
        logits[0, e - 1] = float("nan")
    return args, opt, offset, logits.to(logits_dtype).to(device)


def from_logits_out(args, opt, offset, logits, workspace=None):
    """(out, ids, weights) of moe_forward_from_logits_out."""
    x, ids, _, w1, w2 = args
    out = torch.full_like(x, float("nan"))
    routed_ids, routed_weights = torch.full_like(ids, -7), torch.full(ids.shape, float("nan"), device=x.device)
    ws = torch.empty(0, dtype=torch.uint8, device=x.device) if workspace is None else workspace
    torch.ops.cake.moe_forward_from_logits_out(x, logits, w1, w2, offset, routed_ids, routed_weights, out, ws, True,
                                               **opt)
    return out, routed_ids, routed_weights


def routed_then_forward(args, opt, offset, logits):
    """moe_routing, then moe_forward_out on its ids and weights, as separate ops."""
    x, ids, _, w1, w2 = args
    e_local = w1.shape[0]
    routed = torch.ops.cake.moe_routing(logits, None, None, ids.shape[1], logits.shape[1], e_local, offset, 64)
    return forward_out([x, routed[0], routed[1], w1, w2], opt, offset), routed[0], routed[1]


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_moe_forward_from_logits_is_routing_then_forward(case, dtype, logits_dtype):
    """On every device: bit for bit moe_routing then moe_forward_out, routing outputs included."""
    for device in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        args, opt, offset, logits = logits_problem(case, dtype, logits_dtype, device)
        got = from_logits_out(args, opt, offset, logits)
        want = routed_then_forward(args, opt, offset, logits)
        for g, w in zip(got, want):
            assert torch.equal(g, w), device


@cuda_only
@pytest.mark.parametrize("num_experts", [8, 100, 288, 1024])
def test_moe_forward_from_logits_expert_counts(num_experts):
    """Every experts-per-lane variant of the routing kernel (2 to 32 logits per lane), float16 logits;
    a shard of 16 experts inside the range, or the experts cut to fewer."""
    args, opt, offset, logits = logits_problem("three_tokens", torch.bfloat16, torch.float16, "cuda", num_experts)
    args[1].copy_(torch.zeros_like(args[1]))  # unused: the routes come from the logits
    offset = min(offset, num_experts - args[3].shape[0]) if num_experts >= args[3].shape[0] else None
    if offset is None:  # fewer experts than the shard: the shard's weights cut to the experts
        args[3], args[4] = args[3][:num_experts].contiguous(), args[4][:num_experts].contiguous()
        opt["clamp_limits"] = opt["clamp_limits"][:num_experts].contiguous()
        offset = 0
    got = from_logits_out(args, opt, offset, logits)
    want = routed_then_forward(args, opt, offset, logits)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@cuda_only
def test_moe_forward_from_logits_graph_replay():
    """Captured once; new logits and hidden states written into the bound tensors; replayed."""
    args, opt, offset, logits = logits_problem("one_token", torch.float8_e4m3fn, torch.float32, "cuda")
    x, ids, _, w1, w2 = args
    out, routed_ids, routed_weights = torch.empty_like(x), torch.empty_like(ids), torch.empty(ids.shape, device="cuda")
    ws = torch.empty(cake_ops._C.moe_forward_workspace_size(8, 512, 256), dtype=torch.uint8, device="cuda")
    graph = captured(lambda: torch.ops.cake.moe_forward_from_logits_out(
        x, logits, w1, w2, offset, routed_ids, routed_weights, out, ws, True, **opt))
    for _ in range(3):
        x.copy_(12 * torch.randn_like(x, dtype=torch.float32))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        want = routed_then_forward(args, opt, offset, logits)
        for g, w in zip((out, routed_ids, routed_weights), want):
            assert torch.equal(g, w)


def test_moe_forward_from_logits_opcheck():
    args, opt, offset, logits = logits_problem("three_tokens", torch.bfloat16, torch.float32, "cpu")
    x, ids, scales, w1, w2 = args
    torch.library.opcheck(torch.ops.cake.moe_forward_from_logits_out,
                          (x, logits, w1, w2, offset, torch.empty_like(ids), torch.empty_like(scales),
                           torch.empty_like(x), torch.empty(0, dtype=torch.uint8)), opt)


class TestMoeForwardFromLogitsErrors(OpErrorCase):
    op = staticmethod(torch.ops.cake.moe_forward_from_logits_out)

    def test_errors(self):
        args, _, _, logits = logits_problem("three_tokens", torch.bfloat16, torch.float32, "cpu")
        x, ids, scales, w1, w2 = args
        out, ws = torch.empty_like(x), torch.empty(0, dtype=torch.uint8)
        self.assertExpectedInline(self.error(x, logits[:2], w1, w2, 0, ids, scales, out, ws), """cake::moe_forward_from_logits_out: router_logits must be [num_tokens = 3, num_experts], got shape [2, 16]""")
        self.assertExpectedInline(self.error(x, logits.double(), w1, w2, 0, ids, scales, out, ws), """cake::moe_forward_from_logits_out: router_logits must be float32, bfloat16 or float16, got Double""")
        self.assertExpectedInline(self.error(x, logits[:, :2], w1, w2, 0, ids, scales, out, ws), """cake::moe_forward_from_logits_out: top_k must be in [1, num_experts=2], got 4""")
        self.assertExpectedInline(self.error(x, logits, w1, w2, 8, ids, scales, out, ws), """cake::moe_forward_from_logits_out: the shard [local_expert_offset, local_expert_offset + num_local_experts) = [8, 24) must lie within [0, num_experts=16)""")
        self.assertExpectedInline(self.error(x, logits, w1, w2, 0, ids.t().contiguous().t(), scales, out, ws), """cake::moe_forward_from_logits_out: token_selected_experts and token_final_scales (the routing's outputs) must be contiguous""")
        self.assertExpectedInline(self.error(x, logits, w1, w2, 0, ids, scales.double(), out, ws), """cake::moe_forward_from_logits_out: token_final_scales must be float32 [3, 4], got Double [3, 4]""")
