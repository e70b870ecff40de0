"""The StepFun MoE pipeline (cake_ops.stepfun_moe) and the unified MoE API (cake_ops.moe): each stage
and the whole forward against the float32 reference with the SwiGLUStep clamp biting (input
amplitude 12), in the bf16 and fp8 families (the fp8 reference applies the same quantization),
both routing modes, the pipeline bitwise equal to its stages, graphs, compile and errors. On the
GPU the issue's geometry (H=4096, I=1536, E=64, top-k 8); on the CPU a small one."""
import warnings

import expecttest
import pytest
import torch
import torch._dynamo.testing

import cake_ops
from cake_ops import moe, reference
from cake_ops import stepfun_moe as sm

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
AMPLITUDE = 12.0
families = pytest.mark.parametrize("family", ["bf16", "fp8"])
# opcheck's test_schema compares tensors with allclose, which float8 tensors do not implement.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def geometry(device):
    # (hidden, intermediate, experts, top_k, token counts)
    return (4096, 1536, 64, 8, (8, 64, 512, 2048)) if device == "cuda" else (128, 64, 16, 4, (8, 64))


def limits_for(kind, e):
    if kind == "mixed":
        return torch.tensor([7.0, 16.0, 3.0, 30.0] * (e // 4), dtype=torch.float32)
    return float(kind)


def make_inputs(device, t, hidden, e, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (AMPLITUDE * torch.randn(t, hidden, generator=g, device=device)).bfloat16()
    return x, torch.randn(t, e, generator=g, device=device)


def make_weights(device, hidden, inter, e, seed=0):
    # Drawn where they are used: the GPU geometry's weights are 600M numbers.
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randn(e, 2 * inter, hidden, generator=g, device=device) / hidden**0.5).bfloat16()
    w2 = (torch.randn(e, hidden, inter, generator=g, device=device) / inter**0.5).bfloat16()
    return w1, w2


def make(device, t, hidden, inter, e, k, seed=0):
    return (*make_inputs(device, t, hidden, e, seed), *make_weights(device, hidden, inter, e, seed))


def topk_reference(logits, k):
    """Top-k by (value desc, id asc) with NaN as -inf, softmax over the k in float64."""
    ids, weights = [], []
    for row in logits.double().cpu().tolist():
        row = [float("-inf") if v != v else v for v in row]
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        top = torch.tensor([row[i] for i in order], dtype=torch.float64)
        ids.append(order)
        weights.append(torch.softmax(top, 0).tolist())
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# On CUDA up to 64 tokens over up to 512 experts route and sort in one kernel, others in two; the
# top-k warps hold 2, 4, 8, 16 or 32 experts per lane by E (<= 64, 128, 256, 512, 1024).
@pytest.mark.parametrize("t,e,k,shard", [(50, 64, 8, False), (50, 64, 8, True), (300, 64, 8, True),
                                         (20, 600, 4, False), (3, 40, 6, False), (3, 128, 8, False),
                                         (8, 256, 8, True), (33, 384, 8, False), (100, 200, 8, False),
                                         (70, 1000, 8, False)])
def test_routing_from_logits_matches_reference(device, dtype, t, e, k, shard):
    logits = torch.randint(-4, 5, (t, e)).float()  # many ties: the lower id wins
    logits[0, :] = 1.0
    logits[1, 7] = float("nan")
    logits[2, :] = float("-inf")
    logits[2, 9] = 0.0
    logits = logits.to(dtype)
    local, offset = (e // 4, e // 4) if shard else (e, 0)
    routed = sm.routing(logits.to(device), top_k=k, num_experts=e, num_local_experts=local,
                        local_expert_offset=offset, tile_size=64)
    ids, weights = topk_reference(logits, k)
    assert torch.equal(routed.expert_ids.cpu(), ids)
    torch.testing.assert_close(routed.expert_weights.cpu().double(), weights, rtol=1e-5, atol=1e-6)
    sort = torch.ops.cake.moe_sort(ids, e, local, offset, 64)
    for got, want in zip([routed.expert_counts, routed.expert_offsets, routed.permuted_idx_to_expanded_idx,
                          routed.expanded_idx_to_permuted_idx, routed.expert_tile_offsets], sort):
        assert torch.equal(got.cpu(), want)


def test_routing_unpacked_precomputed_takes_ids_and_weights_as_given(device):
    ids = torch.stack([torch.randperm(32)[:4] for _ in range(20)]).int()
    weights = torch.rand(20, 4)
    routed = sm.routing(topk_ids=ids.to(device), topk_weights=weights.to(device), top_k=4, num_experts=32,
                        num_local_experts=8, local_expert_offset=8)
    assert torch.equal(routed.expert_ids.cpu(), ids) and torch.equal(routed.expert_weights.cpu(), weights)
    assert routed.expert_ids.data_ptr() != ids.data_ptr()
    kept = ((ids >= 8) & (ids < 16)).flatten()
    assert torch.equal(routed.expanded_idx_to_permuted_idx.cpu() >= 0, kept)


def run_reference(x, logits, w1, w2, limits, k):
    ids, weights = topk_reference(logits.float(), k)
    e = w1.shape[0]
    lim = torch.as_tensor(limits, dtype=torch.float32).expand(e)
    return reference.moe_forward(x, ids.to(x.device), weights.float().to(x.device), w1, w2, limit=lim).cpu()


@pytest.mark.parametrize("limits", ["7", "16", "mixed"])
def test_pipeline_matches_float32_reference_with_the_clamp_biting(device, limits):
    hidden, inter, e, k, token_counts = geometry(device)
    w1, w2 = make_weights(device, hidden, inter, e)
    lim = limits_for(limits, e)
    weights = sm.prepare_weights(w1, w2, lim)
    for t in token_counts:
        x, logits = make_inputs(device, t, hidden, e, seed=t)
        out = sm.stepfun_moe(x, weights, logits, top_k=k)
        expected = run_reference(x, logits, w1, w2, lim, k)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        err = (out.cpu().float() - expected).norm() / expected.norm()
        assert err < 2e-2, (t, float(err))
        # The clamp matters here: without it the answer is far off.
        unclamped = run_reference(x, logits, w1, w2, 1e30, k)
        assert (unclamped - expected).norm() / expected.norm() > 0.1


def e4m3_reference(x, scale):
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 129), (301, 257)])  # odd sizes: the vector loop's tail
def test_quantize_fp8_matches_reference(device, dtype, shape):
    # On CUDA a dynamic scale takes one block up to 65536 elements and three grid kernels above.
    g = torch.Generator().manual_seed(1)
    base = AMPLITUDE * torch.randn(*shape, generator=g)
    base[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -3e4])
    for x in (base.to(dtype), base.to(dtype).flatten()[1:]):  # the second is not 16-byte aligned
        x_dev = x.to(device)
        amax = x.float().abs().max()
        for scale in (None, torch.tensor([0.05]), torch.tensor([1e-3])):  # 1e-3: most values saturate
            want_scale = (amax.clamp_min(1e-12) / torch.tensor(448.0)).reshape(1) if scale is None else scale
            q, used = torch.ops.cake.quantize_fp8(x_dev, None if scale is None else scale.to(device))
            assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
            assert torch.equal(used.cpu(), want_scale)
            assert torch.equal(q.cpu().view(torch.uint8), e4m3_reference(x, want_scale).view(torch.uint8))
            out = torch.full(x.shape, 7.0, device=device).to(torch.float8_e4m3fn)
            scale_out = torch.zeros(1, device=device)
            torch.ops.cake.quantize_fp8_out(x_dev, None if scale is None else scale.to(device), out, scale_out)
            assert torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_out, used)
    q, used = torch.ops.cake.quantize_fp8(torch.zeros(3, 16, dtype=dtype, device=device))
    assert float(used) == pytest.approx(1e-12 / 448) and not q.float().any()
    q, used = torch.ops.cake.quantize_fp8(torch.zeros(0, 16, dtype=dtype, device=device))
    assert q.shape == (0, 16) and float(used) == pytest.approx(1e-12 / 448)


def quantize_per_expert(w):
    """Dequantized e4m3 weights with one scale per expert, max(|w[e]|) / 448, and the scales."""
    amax = w.float().abs().amax(dim=(1, 2)).clamp_min(1e-12)
    scale = amax / torch.full_like(amax, 448)
    return e4m3_reference(w, scale.view(-1, 1, 1)).float() * scale.view(-1, 1, 1), scale


def fp8_reference(x, logits, w1, w2, limits, k, fc1_scale=None, fc2_scale=True):
    """The float32 MoE on the fp8 family's quantized operands: x per tensor, the weights per expert
    and GEMM2's input per tensor (dynamic scales unless given)."""
    ids, weights = topk_reference(logits.float(), k)
    lim = torch.as_tensor(limits, dtype=torch.float32).expand(w1.shape[0])
    x_dq, _ = reference.quantize_fp8(x, fc1_scale)
    return reference.moe_forward(x_dq, ids.to(x.device), weights.float().to(x.device), quantize_per_expert(w1)[0],
                                 quantize_per_expert(w2)[0], limit=lim, fp8_activations=fc2_scale).cpu()


@pytest.mark.parametrize("limits", ["7", "16", "mixed"])
def test_fp8_pipeline_matches_float32_reference_with_the_clamp_biting(device, limits):
    hidden, inter, e, k, token_counts = geometry(device)
    w1, w2 = make_weights(device, hidden, inter, e)
    lim = limits_for(limits, e)
    weights = sm.prepare_weights(w1, w2, lim, family="fp8")
    assert weights.w1.dtype == weights.w2.dtype == torch.float8_e4m3fn
    assert torch.equal(weights.w1_scale, quantize_per_expert(w1)[1])
    for t in token_counts:
        x, logits = make_inputs(device, t, hidden, e, seed=t)
        out = sm.stepfun_moe(x, weights, logits, top_k=k)
        expected = fp8_reference(x, logits, w1, w2, lim, k)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        err = float((out.cpu().float() - expected).norm() / expected.norm())
        assert err < 2e-2, (t, err)
        # The reference's quantization is the one the pipeline applies: the unquantized MoE is farther.
        plain = run_reference(x, logits, w1, w2, lim, k)
        assert float((plain - expected).norm() / expected.norm()) > 2 * err, t


def test_fp8_stages_match_float32_reference(device):
    """fc1, requant and fc2 one by one, in permuted row order, against float32 on the same
    quantized operands."""
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 64, hidden, inter, e, k)
    lim = limits_for("mixed", e).to(device)
    weights = sm.prepare_weights(w1, w2, lim, family="fp8")
    routed = sm.routing(logits, top_k=k, num_experts=e)
    kept = int(routed.expert_offsets[-1])
    tokens = routed.permuted_idx_to_expanded_idx[:kept].long() // k
    ends = routed.expert_offsets.tolist()
    w1_dq, w2_dq = quantize_per_expert(w1)[0], quantize_per_expert(w2)[0]

    def per_expert(rows, weight):  # rows[p] @ weight[e(p)].T in float32
        return torch.cat([rows[ends[j]:ends[j + 1]] @ weight[j].T for j in range(e)])

    def rel(got, want):
        return float((got.float() - want).norm() / want.norm())
    act = sm.fc1(x, weights, routed)
    h = per_expert(reference.quantize_fp8(x)[0][tokens], w1_dq)
    limit = torch.cat([lim[j].expand(ends[j + 1] - ends[j]) for j in range(e)])[:, None]
    want = torch.nn.functional.silu(h[:, :inter]).clamp(max=limit) * torch.maximum(torch.minimum(h[:, inter:], limit),
                                                                                  -limit)
    assert act.dtype == torch.bfloat16 and rel(act[:kept], want) < 1e-2
    q = sm.requant(act, weights)
    # A tensor divisor: CUDA divides by a Python scalar as a multiplication by its reciprocal.
    amax = act.float().abs().max().clamp_min(1e-12).reshape(1)
    want_scale = amax / torch.full_like(amax, 448)
    assert torch.equal(q.scale, want_scale)
    assert torch.equal(q.values.view(torch.uint8), e4m3_reference(act, want_scale).view(torch.uint8))
    rows = sm.fc2(q, weights, routed)
    assert rows.dtype == torch.bfloat16 and rel(rows[:kept], per_expert(q.values.float() * q.scale, w2_dq)) < 1e-2


@cuda_only
@pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactics"), reason="built without CUDA kernels")
def test_every_fp8_kernel_configuration_matches_float64():
    # Each fwd_e4m3 tactic is its own kernel: all of them, on ragged groups (empty, one row, not a
    # tile multiple, one hot expert), against float64 on the same e4m3 operands and scales.
    sizes = [0, 1, 130, 7, 0, 300, 64, 1000]
    e, n, k = len(sizes), 136, 784  # K: 3 x 256 + 16, a partial last K tile for every configuration
    g = torch.Generator().manual_seed(3)
    a = (4 * torch.randn(sum(sizes) + 9, k, generator=g)).to(torch.float8_e4m3fn).cuda()
    w = (4 * torch.randn(e, n, k, generator=g)).to(torch.float8_e4m3fn).cuda()
    a_scale, w_scale = torch.tensor([0.03]).cuda(), (0.01 + torch.rand(e, generator=g)).cuda()
    offsets = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    ends = offsets.tolist()
    want = torch.zeros(ends[-1], n, dtype=torch.float64)
    for j in range(e):
        rows = a[ends[j]:ends[j + 1]].double().cpu()
        want[ends[j]:ends[j + 1]] = rows @ w[j].double().cpu().T * float(a_scale) * float(w_scale[j])
    names = cake_ops._C.grouped_gemm_tactics("fwd_e4m3")
    for i, name in enumerate(names):
        got = torch.ops.cake.moe_gemm2(a, w, offsets, True, i, a_scale, w_scale).double().cpu()[:ends[-1]]
        assert float((got - want).norm() / want.norm()) < 1e-2, name  # later rows: no route


# On CUDA a dynamic scale over x of 300 x 256 takes an amax kernel first.
@pytest.mark.parametrize("t", [4, 300])
def test_gemm1_quantizes_bf16_x_as_quantize_fp8(device, t):
    check_gemm1_quantizes_bf16_x(device, t)


@cuda_only
def test_gemm1_quantizes_a_16mb_bf16_x_in_token_order():
    # x of 32768 x 256 (16 MB) is gathered in token order; GPU only (the CPU op is the t=300 case's,
    # and takes minutes at this size).
    check_gemm1_quantizes_bf16_x("cuda", 32768)


def check_gemm1_quantizes_bf16_x(device, t):
    # bf16 x with e4m3 w1: x quantized on its way into the gather, bit for bit quantize_fp8 then
    # the e4m3 path, with a static scale and a dynamic one, one-shot and into caller buffers.
    hidden, inter, e, k = 256, 64, 4, 2
    x, logits, w1, w2 = make(device, t, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, 7.0, family="fp8")
    routed = sm.routing(logits, top_k=k, num_experts=e)
    args = (routed.permuted_idx_to_expanded_idx, routed.expert_offsets, k, True, weights.gemm1_clamp_limit, -1)
    for scale in (None, torch.tensor([0.02], device=device)):
        x_q, x_scale = torch.ops.cake.quantize_fp8(x, scale)
        want = torch.ops.cake.moe_gemm1_swiglu(x_q, weights.w1, *args, x_scale, weights.w1_scale)
        got = torch.ops.cake.moe_gemm1_swiglu(x, weights.w1, *args, scale, weights.w1_scale)
        kept = int(routed.expert_offsets[-1])
        assert got.dtype == torch.bfloat16 and torch.equal(got[:kept], want[:kept])
        out = torch.empty_like(got)
        workspace = torch.empty(cake_ops._C.moe_gemm1_workspace_size(t * k, hidden, inter, e, 1), dtype=torch.uint8,
                                device=device)
        torch.ops.cake.moe_gemm1_swiglu_out(x, weights.w1, *args[:3], out, workspace, *args[3:], scale,
                                            weights.w1_scale)
        assert torch.equal(out[:kept], want[:kept])


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_fc2_quantizing_its_input_is_requant_then_fc2(device, t, static):
    # Decode plans fold requant into fc2 (moe_gemm2 takes fc1's bf16 output with e4m3 w2): bit
    # for bit quantize_fp8 then the e4m3 GEMM, stage by stage and for the whole forward.
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, t, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, limits_for("mixed", e).to(device), family="fp8",
                                 fc2_input_scale=49.0 / 448 if static else None)
    plan = sm.default_plan("fp8", t, k, e, inter)
    assert "requant" not in plan.stages
    routed = sm.routing(logits, top_k=k, num_experts=e, tile_size=plan.tile_size)
    act = sm.fc1(x, weights, routed)
    kept = int(routed.expert_offsets[-1])
    staged = sm.fc2(sm.requant(act, weights), weights, routed)
    assert torch.equal(sm.fc2(act, weights, routed)[:kept], staged[:kept])
    with_requant = sm.Plan("fp8", plan.tile_size, ("routing", "fc1", "requant", "fc2", "finalize"))
    want = sm.stepfun_moe(x, weights, logits, top_k=k, plan=with_requant)
    assert torch.equal(sm.stepfun_moe(x, weights, logits, top_k=k), want)
    assert torch.equal(sm.prepare_stepfun_moe(x, weights, logits, top_k=k).launch(), want)


def test_fp8_static_scales_and_e4m3_hidden_states(device):
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 64, hidden, inter, e, k)
    fc1_scale, fc2_scale = float(x.float().abs().max()) / 448, 49.0 / 448  # 49: the clamp's bound L * L
    weights = sm.prepare_weights(w1, w2, 7.0, family="fp8", fc1_input_scale=fc1_scale, fc2_input_scale=fc2_scale)
    out = sm.stepfun_moe(x, weights, logits, top_k=k)
    expected = fp8_reference(x, logits, w1, w2, 7.0, k, fc1_scale, fc2_scale)
    assert float((out.cpu().float() - expected).norm() / expected.norm()) < 2e-2
    # Hidden states quantized by the caller with the same scale give the same answer, bit for bit.
    x_q, x_scale = torch.ops.cake.quantize_fp8(x, weights.fc1_input_scale)
    assert torch.equal(sm.stepfun_moe(x_q, weights, logits, top_k=k, hidden_states_scale=x_scale), out)
    launch = sm.prepare_stepfun_moe(x_q, weights, logits, top_k=k, hidden_states_scale=x_scale)
    assert torch.equal(launch.launch(), out)
    # Weights given in e4m3 with their scales are taken as they are.
    again = sm.prepare_weights(weights.w1, weights.w2, 7.0, family="fp8", w1_scale=weights.w1_scale,
                               w2_scale=weights.w2_scale, fc1_input_scale=fc1_scale, fc2_input_scale=fc2_scale)
    assert again.w2 is weights.w2


@families
def test_pipeline_is_bitwise_the_stages(device, family):
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 64, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, limits_for("mixed", e).to(device), family=family)
    plan = sm.default_plan(family, 64, k, e, inter)
    assert ("requant" in plan.stages) == (family == "fp8")
    routed = sm.routing(logits, top_k=k, num_experts=e, tile_size=plan.tile_size)
    act = sm.requant(sm.fc1(x, weights, routed), weights)
    if family == "fp8":
        assert act.values.dtype == torch.float8_e4m3fn and act.scale.shape == (1,)
    rows = sm.fc2(act, weights, routed)
    staged = sm.finalize(rows, routed.expert_weights, routed.expanded_idx_to_permuted_idx)
    assert torch.equal(sm.stepfun_moe(x, weights, logits, top_k=k, plan=plan), staged)
    gemm2_output, expert_weights, e2p = sm.stepfun_moe(x, weights, logits, top_k=k, plan=plan, do_finalize=False)
    assert gemm2_output.dtype == torch.bfloat16 and torch.equal(sm.finalize(gemm2_output, expert_weights, e2p), staged)
    into = torch.empty_like(staged)
    assert sm.finalize(gemm2_output, expert_weights, e2p, out=into) is into and torch.equal(into, staged)


@families
@pytest.mark.parametrize("shard", [False, True])
def test_layer_plan_is_bitwise_the_staged_plan(device, family, shard):
    """T=1's default plan runs fc1 -> requant -> fc2 -> finalize as one unit (moe_forward_out: on
    CUDA the layer kernel, with the decode kernel's numbers): the same bits as the staged plan,
    one-shot and prepared."""
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 1, hidden, inter, e, k)
    lo, n = (e // 4, e // 2) if shard else (0, e)
    weights = sm.prepare_weights(w1[lo:lo + n], w2[lo:lo + n], limits_for("mixed", n).to(device), family=family,
                                 num_experts=e, local_expert_offset=lo)
    plan = sm.default_plan(family, 1, k, n, inter)
    assert plan.stages == sm.LAYER_STAGES
    staged = next(p for p in sm.plans_for(family) if p.tile_size == 64 and p.stages != sm.LAYER_STAGES and
                  ("requant" in p.stages) == (family == "fp8"))
    want = sm.stepfun_moe(x, weights, logits, top_k=k, plan=staged)
    got = sm.stepfun_moe(x, weights, logits, top_k=k)
    assert torch.equal(got, want)
    assert torch.equal(sm.prepare_stepfun_moe(x, weights, logits, top_k=k).launch(), want)
    # UnpackedPrecomputed: the ids and weights go to the layer op as they are (no routing launch).
    routed = sm.routing(logits, top_k=k, num_experts=e)
    pre = dict(topk_ids=routed.expert_ids, topk_weights=routed.expert_weights, top_k=k)
    assert torch.equal(sm.stepfun_moe(x, weights, **pre), want)
    assert torch.equal(sm.prepare_stepfun_moe(x, weights, **pre).launch(), want)
    with pytest.raises(ValueError, match=rf"topk_ids and topk_weights must be \[num_tokens, top_k={k}\]"):
        sm.stepfun_moe(x, weights, topk_ids=routed.expert_ids[:, 1:], topk_weights=routed.expert_weights[:, 1:],
                       top_k=k)
    with pytest.raises(ValueError, match="router_logits must be"):
        sm.stepfun_moe(x, weights, logits[:, :-1], top_k=k)
    with pytest.raises(ValueError, match="not both"):
        sm.stepfun_moe(x, weights, logits, **pre)
    # What the layer unit cannot do falls back to the staged plan by default, and is an error if asked.
    rows, expert_weights, e2p = sm.stepfun_moe(x, weights, logits, top_k=k, do_finalize=False)
    assert torch.equal(sm.finalize(rows, expert_weights, e2p), want)
    with pytest.raises(ValueError, match="the layer plan cannot run with do_finalize=False"):
        sm.stepfun_moe(x, weights, logits, top_k=k, plan=plan, do_finalize=False)


@families
def test_expert_parallel_shards_sum_to_the_whole(device, family):
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 16, hidden, inter, e, k)
    # fp8: static activation scales, so that every shard quantizes like the whole.
    scales = dict(fc1_input_scale=AMPLITUDE * 5 / 448, fc2_input_scale=49 / 448) if family == "fp8" else {}
    whole = sm.stepfun_moe(x, sm.prepare_weights(w1, w2, 7.0, family=family, **scales), logits, top_k=k).float()
    half = e // 2
    parts = [sm.stepfun_moe(x, sm.prepare_weights(w1[o:o + half], w2[o:o + half], 7.0, family=family,
                                                  num_experts=e, local_expert_offset=o, **scales),
                            logits, top_k=k).float()
             for o in (0, half)]
    assert ((parts[0] + parts[1] - whole).norm() / whole.norm()) < 2e-2


@families
@pytest.mark.parametrize("mode", ["logits", "precomputed"])
def test_prepared_launch_matches_one_shot_and_reads_new_inputs(device, mode, family):
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 32, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, limits_for("mixed", e).to(device), family=family)
    routed = sm.routing(logits, top_k=k, num_experts=e)
    ids, scales = routed.expert_ids.clone(), routed.expert_weights.clone()
    inputs = dict(router_logits=logits) if mode == "logits" else dict(topk_ids=ids, topk_weights=scales)

    def one_shot():
        return sm.stepfun_moe(x, weights, top_k=k, **inputs)
    launch = sm.prepare_stepfun_moe(x, weights, top_k=k, **inputs)
    out = launch.launch()
    assert launch.outputs() == [out] and torch.equal(out, one_shot())
    x.copy_(AMPLITUDE * torch.randn_like(x))  # new tokens and routes in the bound tensors
    logits.copy_(torch.randn_like(logits))
    fresh = sm.routing(logits, top_k=k, num_experts=e)
    ids.copy_(fresh.expert_ids)
    scales.copy_(fresh.expert_weights)
    assert launch.launch() is out and torch.equal(out, one_shot())
    rows, expert_weights, e2p = sm.prepare_stepfun_moe(x, weights, top_k=k, do_finalize=False, **inputs).launch()
    assert torch.equal(sm.finalize(rows, expert_weights, e2p), out)


@families
def test_prepared_stages_on_caller_buffers(device, family):
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 16, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, 7.0, family=family)
    routed = sm.empty_routing_output(16, k, e, device)
    routing = sm.prepare_routing(logits, top_k=k, num_experts=e, out=routed)
    act = torch.empty(16 * k, inter, dtype=torch.bfloat16, device=device)
    fc1 = sm.prepare_fc1(x, weights, routed, out=act)
    requant = sm.prepare_requant(act, weights)
    fc2 = sm.prepare_fc2(requant.outputs()[0], weights, routed)
    final = sm.prepare_finalize(fc2.outputs()[0], routed.expert_weights, routed.expanded_idx_to_permuted_idx)
    for stage in (routing, fc1, requant, fc2, final):
        stage.launch()
    assert routing.outputs() == [routed] and fc1.outputs()[0] is act
    assert (requant.launch()[0] is act) == (family == "bf16")
    assert torch.equal(final.outputs()[0], sm.stepfun_moe(x, weights, logits, top_k=k))


@cuda_only
@families
@pytest.mark.parametrize("t", [1, 64])  # fp8 at T=1: fc2 quantizing its input (the decode kernel)
def test_prepared_launch_allocates_nothing_and_replays_in_a_graph(family, t):
    hidden, inter, e, k, _ = geometry("cuda")
    x, logits, w1, w2 = make("cuda", t, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, 7.0, family=family)
    launch = sm.prepare_stepfun_moe(x, weights, logits, top_k=k)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    launch.launch()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = launch.launch()
    x.copy_(AMPLITUDE * torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    g.replay()
    assert torch.equal(out, sm.stepfun_moe(x, weights, logits, top_k=k))


@families
@pytest.mark.parametrize("t", [1, 8])  # T=1: the layer plan (moe_forward_from_logits_out)
def test_compiles_fullgraph(family, t):
    hidden, inter, e, k, _ = geometry("cpu")
    x, logits, w1, w2 = make("cpu", t, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, 7.0, family=family)

    def forward(x, logits):
        return sm.stepfun_moe(x, weights, logits, top_k=k)
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, logits), forward(x, logits))


@families
@pytest.mark.parametrize("shard", [False, True])
def test_compiles_once_for_any_token_count(device, family, shard):
    """Dynamic token counts share graphs: one per plan bucket (T=1 and its layer plan, fp8's fc2 that
    quantizes its input up to 16 rows, the tile size), not one per T (a shard's hint is a SymInt)."""
    hidden, inter, e, k, _ = geometry(device)
    x, logits, w1, w2 = make(device, 40, hidden, inter, e, k)
    part = dict(num_experts=e, local_expert_offset=e // 2) if shard else {}
    weights = sm.prepare_weights(w1[e // 2:] if shard else w1, w2[e // 2:] if shard else w2, 7.0, family=family,
                                 **part)

    def forward(x, logits):
        return sm.stepfun_moe(x, weights, logits, top_k=k)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=counter)
    for t in (3, 40, 1, 21, 8, 33, 2, 13, 27, 36):
        assert torch.equal(compiled(x[:t], logits[:t]), forward(x[:t], logits[:t])), t
    assert counter.frame_count <= 4, counter.frame_count


@cuda_only
@families
def test_cuda_graph_replay_with_new_logits(family):
    hidden, inter, e, k, _ = geometry("cuda")
    x, logits, w1, w2 = make("cuda", 64, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, 7.0, family=family)
    out = sm.stepfun_moe(x, weights, logits, top_k=k)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sm.stepfun_moe(x, weights, logits, top_k=k)
    for _ in range(2):
        x.copy_(AMPLITUDE * torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        g.replay()
        assert torch.equal(out, sm.stepfun_moe(x, weights, logits, top_k=k))


@cuda_only
@families
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("t", [1, 64])
def test_compiles_fullgraph_on_gpu(mode, family, t):
    hidden, inter, e, k, _ = geometry("cuda")
    x, logits, w1, w2 = make("cuda", t, hidden, inter, e, k)
    weights = sm.prepare_weights(w1, w2, limits_for("mixed", e).cuda(), family=family)

    def forward(x, logits):
        return sm.stepfun_moe(x, weights, logits, top_k=k)
    compiled = torch.compile(forward, fullgraph=True, mode=mode)
    expected = forward(x, logits)
    for _ in range(3):
        assert torch.equal(compiled(x, logits), expected)


def test_ops_opcheck():
    logits = torch.randn(12, 16)
    torch.library.opcheck(torch.ops.cake.moe_routing, (logits, None, None, 4, 16, 8, 4, 64))
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(12)]).int()
    torch.library.opcheck(torch.ops.cake.moe_routing, (None, ids, torch.rand(12, 4), 4, 16, 16, 0, 64))
    x, _, w1, w2 = make("cpu", 12, 64, 32, 16, 4)
    routed = sm.routing(logits, top_k=4, num_experts=16, tile_size=64)
    weights = sm.prepare_weights(w1, w2, 3.0)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu,
                          (x, weights.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, 4, True,
                           weights.gemm1_clamp_limit))
    out = sm.empty_routing_output(12, 4, 8, "cpu")
    workspace = torch.empty(cake_ops._C.moe_routing_workspace_size(48, 8), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.cake.moe_routing_out,
                          (logits, None, None, 4, 16, 8, 4, 64, *[getattr(out, f) for f in (
                              "expert_ids", "expert_weights", "expert_counts", "expert_offsets",
                              "permuted_idx_to_expanded_idx", "expanded_idx_to_permuted_idx", "expert_tile_offsets")],
                           workspace))
    act = torch.empty(48, 32, dtype=torch.bfloat16)
    workspace = torch.empty(cake_ops._C.moe_gemm1_workspace_size(48, 64, 32, 16, 2), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu_out,
                          (x, weights.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, 4, act, workspace,
                           True, weights.gemm1_clamp_limit))
    torch.library.opcheck(torch.ops.cake.moe_gemm2_out, (x.new_ones(48, 32), w2, routed.expert_offsets, x.new_empty(48, 64),
                                                         torch.empty(0, dtype=torch.uint8)))
    # fp8
    for scale in (None, torch.tensor([0.1])):
        torch.library.opcheck(torch.ops.cake.quantize_fp8, (x, scale))
        torch.library.opcheck(torch.ops.cake.quantize_fp8_out,
                              (x, scale, x.new_empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(1)),
                              test_utils=FP8_OPCHECKS)
    fp8 = sm.prepare_weights(w1, w2, 3.0, family="fp8")
    x_q, x_scale = torch.ops.cake.quantize_fp8(x)
    gemm1 = (x_q, fp8.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, 4, True, fp8.gemm1_clamp_limit,
             -1, x_scale, fp8.w1_scale)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu, gemm1, test_utils=FP8_OPCHECKS)
    workspace = torch.empty(cake_ops._C.moe_gemm1_workspace_size(48, 64, 32, 16, 1), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu_out, (*gemm1[:5], act, workspace, *gemm1[5:]),
                          test_utils=FP8_OPCHECKS)
    for scale in (None, torch.tensor([0.1])):  # bf16 x quantized on the way in
        torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu, (x, *gemm1[1:8], scale, fp8.w1_scale),
                              test_utils=FP8_OPCHECKS)
    a_q, a_scale = torch.ops.cake.quantize_fp8(torch.ops.cake.moe_gemm1_swiglu(*gemm1))
    torch.library.opcheck(torch.ops.cake.moe_gemm2, (a_q, fp8.w2, routed.expert_offsets, True, -1, a_scale,
                                                     fp8.w2_scale), test_utils=FP8_OPCHECKS)
    torch.library.opcheck(torch.ops.cake.moe_gemm2_out, (a_q, fp8.w2, routed.expert_offsets, x.new_empty(48, 64),
                                                         torch.empty(0, dtype=torch.uint8), True, -1, a_scale,
                                                         fp8.w2_scale), test_utils=FP8_OPCHECKS)
    act_bf16 = torch.ops.cake.moe_gemm1_swiglu(*gemm1)
    for scale in (None, torch.tensor([0.1])):  # bf16 intermediate quantized on the way in (requant folded)
        torch.library.opcheck(torch.ops.cake.moe_gemm2, (act_bf16, fp8.w2, routed.expert_offsets, True, -1, scale,
                                                         fp8.w2_scale), test_utils=FP8_OPCHECKS)


def test_plans():
    plans = sm.plans_for("bf16")
    assert [p.tile_size for p in plans] == [64, 128, 64]
    assert [p.stages for p in plans] == [("routing", "fc1", "fc2", "finalize")] * 2 + [sm.LAYER_STAGES]
    assert sm.default_plan("bf16", 8, 8, 64, 1536).tile_size == 64
    assert sm.default_plan("bf16", 2048, 8, 64, 1536).tile_size == 128
    assert [p.stages for p in sm.plans_for("fp8")] == ([("routing", "fc1", "requant", "fc2", "finalize")] * 2 +
                                                       [("routing", "fc1", "fc2", "finalize")] * 2 + [sm.LAYER_STAGES])
    # A decode token: the layer plan (routing, then one unit); a few: fc2 quantizes fc1's output
    # itself (one launch fewer); larger: requant.
    assert sm.default_plan("fp8", 1, 8, 64, 1536).stages == sm.LAYER_STAGES
    assert "requant" not in sm.default_plan("fp8", 2, 8, 64, 1536).stages
    assert "requant" in sm.default_plan("fp8", 8, 8, 64, 1536).stages
    with pytest.raises(NotImplementedError, match="'nvfp4' weight family is not implemented yet"):
        sm.plans_for("nvfp4")
    with pytest.raises(ValueError, match="family must be one of"):
        sm.plans_for("int4")


class TestErrors(expecttest.TestCase):
    def message(self, error, fn, *args, **kwargs):
        with self.assertRaises(error) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception).split("\n")[0]

    def test_routing_errors(self):
        logits = torch.randn(4, 8)
        ids = torch.zeros(4, 2, dtype=torch.int32)
        self.assertExpectedInline(self.message(RuntimeError, sm.routing, logits, topk_ids=ids, top_k=2, num_experts=8), """cake::moe_routing: give either router_logits (FromLogits) or topk_ids and topk_weights (UnpackedPrecomputed), got router_logits and precomputed top-k""")
        self.assertExpectedInline(self.message(ValueError, sm.routing, topk_ids=ids, top_k=2, num_experts=8), """cake_ops.stepfun_moe.routing: give router_logits (FromLogits) or both topk_ids and topk_weights (UnpackedPrecomputed)""")
        self.assertExpectedInline(self.message(RuntimeError, sm.routing, logits, top_k=9, num_experts=8), """cake::moe_routing: top_k must be in [1, num_experts=8], got 9""")
        self.assertExpectedInline(self.message(RuntimeError, sm.routing, logits[:, :6], top_k=2, num_experts=8), """cake::moe_routing: router_logits must be [num_tokens, num_experts=8], got shape [4, 6]""")
        self.assertExpectedInline(self.message(RuntimeError, sm.routing, topk_ids=ids, topk_weights=torch.rand(4, 3), top_k=2, num_experts=8), """cake::moe_routing: topk_weights must be float32 with topk_ids' shape [4, 2], got Float [4, 3]""")

    def test_weight_errors(self):
        w1, w2 = torch.zeros(4, 128, 64).bfloat16(), torch.zeros(4, 64, 64).bfloat16()
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1, w2[:, :, :32], 7.0), """cake_ops.stepfun_moe.prepare_weights: w2 must be [E_local, H, I] = [4, 64, 64], got [4, 64, 32]""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1, w2, [7.0, 7.0]), """cake_ops.stepfun_moe.prepare_weights: gemm1_clamp_limit must be a number or [E_local=4] limits, got shape [2]""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1, w2, 0.0), """cake_ops.stepfun_moe.prepare_weights: gemm1_clamp_limit must be positive""")
        self.assertExpectedInline(self.message(TypeError, sm.prepare_weights, w1, w2, "7"), """cake_ops.stepfun_moe.prepare_weights: gemm1_clamp_limit must be a number, a sequence of numbers or a tensor, got str""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1.float(), w2, 7.0), """cake_ops.stepfun_moe.prepare_weights: the bf16 family takes bfloat16 weights, got torch.float32 and torch.bfloat16""")
        self.assertExpectedInline(self.message(NotImplementedError, sm.prepare_weights, w1, w2, 7.0, family="mxfp8"), """cake_ops.stepfun_moe.prepare_weights: the 'mxfp8' weight family is not implemented yet (runs: ('bf16', 'fp8'))""")
        self.assertExpectedInline(self.message(TypeError, sm.fc1, torch.zeros(2, 64), (w1, w2), None), """cake_ops.stepfun_moe.fc1: weights must be the cake_stepfun view from prepare_weights, got tuple""")

    def test_prepare_errors(self):
        x, logits, w1, w2 = make("cpu", 4, 64, 32, 4, 2)
        weights = sm.prepare_weights(w1, w2, 7.0)
        self.assertExpectedInline(self.message(ValueError, sm.prepare_routing, top_k=2, num_experts=4), """cake_ops.stepfun_moe.prepare_routing: give router_logits (FromLogits) or both topk_ids and topk_weights (UnpackedPrecomputed)""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_stepfun_moe, x.t(), weights, logits, top_k=2), """cake_ops.stepfun_moe.prepare_stepfun_moe: hidden_states must be a contiguous [num_tokens, hidden=64] tensor, got [64, 4]""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_stepfun_moe, x, weights, logits[:3], top_k=2), """cake_ops.stepfun_moe.prepare_stepfun_moe: router_logits must have a row per token of hidden_states (4), got shape [3, 4]""")
        self.assertExpectedInline(self.message(ValueError, sm.stepfun_moe, x[:1], weights, logits[:2], top_k=2), """cake_ops.stepfun_moe.stepfun_moe: router_logits must have a row per token of hidden_states (1), got shape [2, 4]""")
        ids = torch.zeros(5, 2, dtype=torch.int32)
        self.assertExpectedInline(self.message(ValueError, sm.stepfun_moe, x, weights, topk_ids=ids, topk_weights=torch.ones(5, 2), top_k=2), """cake_ops.stepfun_moe.stepfun_moe: topk_ids must have a row per token of hidden_states (4), got shape [5, 2]""")
        other = sm.routing(logits[:3], top_k=2, num_experts=4)
        self.assertExpectedInline(self.message(ValueError, sm.fc1, x, weights, other), """cake_ops.stepfun_moe.fc1: routed is the routing of 3 tokens, hidden_states has 4""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_fc1, x, weights, other), """cake_ops.stepfun_moe.prepare_fc1: routed is the routing of 3 tokens, hidden_states has 4""")
        routed = sm.empty_routing_output(4, 2, 4, "cpu")
        self.assertExpectedInline(self.message(RuntimeError, sm.prepare_routing, logits, top_k=2, num_experts=4, out=routed, workspace=torch.empty(0, dtype=torch.uint8)), """cake::moe_routing_out: workspace must be a contiguous uint8 tensor of at least 16 bytes on cpu (cake_ops._C.moe_routing_workspace_size), got Byte [0]""")

    def test_fp8_errors(self):
        x, logits, w1, w2 = make("cpu", 4, 64, 32, 4, 2)
        routed = sm.routing(logits, top_k=2, num_experts=4)
        fp8 = sm.prepare_weights(w1, w2, 7.0, family="fp8")
        x_q, x_scale = torch.ops.cake.quantize_fp8(x)
        gemm1 = torch.ops.cake.moe_gemm1_swiglu
        args = (fp8.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, 2, True, None, -1)
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x_q, *args), """cake::moe_gemm1_swiglu: float8_e4m3fn x and weights need their scales (a per-tensor x scale and one weight scale per local expert)""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x_q, *args, x_scale, torch.ones(3)), """cake::moe_gemm1_swiglu: the weight scales must be float32 [E_local] = [4] on cpu, got Float [3] on cpu""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x_q, *args, torch.ones(2), fp8.w1_scale), """cake::moe_gemm1_swiglu: the x scale must be one float32 value on cpu, got Float [2] on cpu""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x, sm.prepare_weights(w1, w2, 7.0).w1, *args[1:], x_scale, fp8.w1_scale), """cake::moe_gemm1_swiglu: scales apply to float8_e4m3fn x and weights only, got BFloat16""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x, *args), """cake::moe_gemm1_swiglu: float8_e4m3fn w1 needs its scales (one per local expert)""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x, *args, torch.ones(2), fp8.w1_scale), """cake::moe_gemm1_swiglu: the x scale must be one float32 value on cpu, got Float [2] on cpu""")
        self.assertExpectedInline(self.message(RuntimeError, gemm1, x.half(), *args, None, fp8.w1_scale), """cake::moe_gemm1_swiglu: x and w1 must have the same dtype (or bfloat16 x with float8_e4m3fn w1), got Half and Float8_e4m3fn""")
        self.assertExpectedInline(self.message(RuntimeError, torch.ops.cake.quantize_fp8, x.int()), """cake::quantize_fp8: x must be bfloat16, float16 or float32, got Int""")
        self.assertExpectedInline(self.message(RuntimeError, torch.ops.cake.quantize_fp8, x, torch.ones(2)), """cake::quantize_fp8: scale must be one float32 value on cpu (or None for a dynamic scale), got Float [2] on cpu""")
        self.assertExpectedInline(self.message(RuntimeError, torch.ops.cake.quantize_fp8_out, x, None, torch.empty(4, 64), torch.empty(1)), """cake::quantize_fp8_out: out must be a contiguous float8_e4m3fn tensor of x's shape [4, 64] on cpu, got Float [4, 64] on cpu""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, fp8.w1, fp8.w2, 7.0, family="fp8"), """cake_ops.stepfun_moe.prepare_weights: e4m3 weights need w1_scale as float32 [E_local=4] on cpu, got None""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1, w2, 7.0, family="fp8", fc2_input_scale=-1.0), """cake_ops.stepfun_moe.prepare_weights: fc2_input_scale must be one positive finite number, got -1.0""")
        self.assertExpectedInline(self.message(ValueError, sm.prepare_weights, w1, w2, 7.0, fc1_input_scale=1.0), """cake_ops.stepfun_moe.prepare_weights: the bf16 family takes no scales""")
        self.assertExpectedInline(self.message(ValueError, sm.stepfun_moe, x_q, fp8, logits, top_k=2), """cake_ops.stepfun_moe.stepfun_moe: hidden_states_scale goes with float8_e4m3fn hidden_states (and only with them)""")
        self.assertExpectedInline(self.message(TypeError, sm.fc2, torch.zeros(8, 32), fp8, routed), """cake_ops.stepfun_moe.fc2: the fp8 family's fc2 takes requant's QuantizedActivations or fc1's bfloat16 output, got torch.float32 Tensor""")

    def test_clamp_limit_errors(self):
        x, _, w1, w2 = make("cpu", 4, 64, 32, 4, 2)
        routed = sm.routing(torch.randn(4, 4), top_k=2, num_experts=4)
        weights = sm.prepare_weights(w1, w2, 7.0)
        self.assertExpectedInline(self.message(RuntimeError, torch.ops.cake.moe_gemm1_swiglu, x, weights.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, 2, True, torch.ones(3)), """cake::moe_gemm1_swiglu: clamp_limits must be float32 [E_local] = [4], got Float [3]""")


class TestUnifiedApi(expecttest.TestCase):
    def setUp(self):
        self.config = moe.MoEConfig(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32,
                                    activation=moe.SwiGLUStep(limit=7.0),
                                    backend=moe.CakeStepFunConfig(backend="cake_stepfun"))
        self.x, self.logits, self.w1, self.w2 = make("cpu", 8, 64, 32, 16, 4)

    def message(self, error, fn, *args, **kwargs):
        with self.assertRaises(error) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception).split("\n")[0]

    def test_forward_matches_the_pipeline_and_warns_once(self):
        import cake_ops._experimental as exp
        exp._warned.discard("the cake_stepfun MoE backend")
        weights = self.config.prepare_weights(self.w1, self.w2)
        assert weights.view == "cake_stepfun" and torch.equal(weights.gemm1_clamp_limit, torch.full((16,), 7.0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = moe.moe_forward(self.config, weights, self.x, self.logits)
            moe.moe_forward(self.config, weights, self.x, self.logits)
        assert sum(issubclass(w.category, cake_ops.ExperimentalWarning) and "cake_stepfun MoE backend" in str(w.message)
                   for w in caught) == 1
        assert torch.equal(out, sm.stepfun_moe(self.x, weights, self.logits, top_k=4))

    def test_fp8_family(self):
        config = moe.MoEConfig(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32,
                               activation=moe.SwiGLUStep(limit=7.0),
                               backend=moe.CakeStepFunConfig(backend="cake_stepfun", family="fp8"))
        weights = config.prepare_weights(self.w1, self.w2, fc2_input_scale=49 / 448)
        assert weights.family == "fp8" and weights.w1.dtype == torch.float8_e4m3fn
        assert float(weights.fc2_input_scale) == pytest.approx(49 / 448) and weights.fc1_input_scale is None
        out = moe.moe_forward(config, weights, self.x, self.logits)
        assert torch.equal(out, sm.stepfun_moe(self.x, weights, self.logits, top_k=4))
        x_q, x_scale = torch.ops.cake.quantize_fp8(self.x)
        assert torch.equal(moe.moe_forward(config, weights, x_q, self.logits, hidden_states_scale=x_scale), out)
        self.assertExpectedInline(self.message(ValueError, moe.moe_forward, self.config, weights, self.x, self.logits), """moe_forward: the weights (fp8, 16 experts) do not match the config (bf16, 16 experts)""")

    def test_unpacked_precomputed(self):
        config = moe.MoEConfig(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32,
                               routing_input_mode=moe.RoutingInputMode.UnpackedPrecomputed)
        weights = config.prepare_weights(self.w1, self.w2, torch.linspace(2, 20, 16))
        routed = sm.routing(self.logits, top_k=4, num_experts=16)
        out = moe.moe_forward(config, weights, self.x, topk_ids=routed.expert_ids, topk_weights=routed.expert_weights)
        assert torch.equal(out, sm.stepfun_moe(self.x, weights, self.logits, top_k=4))
        self.assertExpectedInline(self.message(ValueError, moe.moe_forward, config, weights, self.x, self.logits), """moe_forward: RoutingInputMode.UnpackedPrecomputed takes topk_ids and topk_weights only""")

    def test_full_path_env(self):
        weights = self.config.prepare_weights(self.w1, self.w2)
        with pytest.MonkeyPatch.context() as mp:
            for value in ("auto", "1"):
                mp.setenv(moe.FULL_PATH_ENV, value)
                moe.moe_forward(self.config, weights, self.x, self.logits)
            mp.setenv(moe.FULL_PATH_ENV, "0")
            self.assertExpectedInline(self.message(NotImplementedError, moe.moe_forward, self.config, weights, self.x, self.logits), """CAKE_STEPFUN_FULL_PATH=0 asked for the FC1-only hybrid path, which the cake_stepfun backend no longer has; unset it or set auto / 1""")
            mp.setenv(moe.FULL_PATH_ENV, "yes")
            self.assertExpectedInline(self.message(ValueError, moe.moe_forward, self.config, weights, self.x, self.logits), """CAKE_STEPFUN_FULL_PATH must be auto, 1 or 0, got 'yes'""")

    def test_config_rejections(self):
        base = dict(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32)
        self.assertExpectedInline(self.message(ValueError, moe.MoEConfig, **base, num_fused_shared_experts=1), """MoEConfig: the cake_stepfun backend does not support fused shared experts, got num_fused_shared_experts=1 (run shared experts separately)""")
        self.assertExpectedInline(self.message(ValueError, moe.MoEConfig, **base, lora=object()), """MoEConfig: the cake_stepfun backend does not support LoRA deltas on the experts""")
        self.assertExpectedInline(self.message(ValueError, moe.CakeStepFunConfig, backend="trtllm"), """CakeStepFunConfig: backend must be 'cake_stepfun', got 'trtllm'""")
        self.assertExpectedInline(self.message(ValueError, moe.SwiGLUStep, limit=-1.0), """SwiGLUStep: limit must be a positive number, got -1.0""")
        self.assertExpectedInline(self.message(ValueError, moe.SwiGLUStep, limit="7"), """SwiGLUStep: limit must be a positive number, got '7'""")
        self.assertExpectedInline(self.message(ValueError, moe.MoEConfig, **{**base, "hidden_size": -64}), """MoEConfig: hidden_size must be a positive int, got -64""")
        self.assertExpectedInline(self.message(TypeError, moe.moe_forward, self.config, (self.w1, self.w2), self.x, self.logits), """moe_forward: weights must be the cake_stepfun view from CakeStepFunConfig.prepare_weights, got tuple""")
