"""cake_ops.fused_moe.fused_moe_bf16 against the float32 reference MoE: ragged routing, EP shards,
both finalize paths, bf16 and fp16, num_tokens 0 and 1, preallocated buffers, graphs, compile and
bad inputs."""
import copy

import expecttest
import pytest
import torch
import torch._dynamo.testing

from cake_ops import nn as cake_ops_nn
from cake_ops import reference
import cake_ops
from cake_ops.fused_moe import (default_tile_size, expected_routes, fused_moe_bf16, interleave_up_gate_sm90,
                               override_tactic)
from moe_problems import ROUTING_CASES, RecordOps, moe_problem, rel_err

HAS_CUDA = torch.cuda.is_available()

def problem(case, device, dtype, hidden=128, inter=96):
    t, k, e, e_local, offset = ROUTING_CASES[case]
    x, ids, scales, w1, w2 = moe_problem(t, k, e, e_local, hidden, inter, device, dtype)
    if case == "hot_expert":
        ids[:, 0] = 3  # every token's first choice: one hot expert, most others get few or none
    if case == "ep_shard":
        ids[0] = torch.arange(k)  # token 0 routes only to experts of other shards
    return x, ids, scales, w1, w2, e, k, e_local, offset


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused_finalize", [True, False])
@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_matches_float32_reference(device, dtype, fused_finalize, case):
    x, ids, scales, w1, w2, e, k, e_local, offset = problem(case, device, dtype)
    out = fused_moe_bf16(x, ids, scales, interleave_up_gate_sm90(w1), w2, e, k, e_local, offset,
                         use_fused_finalize=fused_finalize)
    expected = reference.moe_forward(x, ids, scales, w1, w2, e_local, offset)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    if x.shape[0]:
        err = (out.float() - expected).norm() / expected.norm().clamp_min(1e-30)
        assert err < 2e-2, err
    if case == "ep_shard":  # tokens with no route into the shard get exact zeros
        outside = ((ids < offset) | (ids >= offset + e_local)).all(dim=1)
        assert outside.any() and (out[outside] == 0).all()


@pytest.mark.parametrize("fused_finalize", [True, False])
@pytest.mark.parametrize("case", ["top8", "hot_expert", "ep_shard", "one_token", "no_tokens"])
def test_gate_up_weights_as_they_are(device, fused_finalize, case):
    """w1_layout="gate_up": the [gate; up] halves (transformers' gate_up_proj) without interleaving them, with the
    interleaved weights' numbers, bit for bit on the deterministic path (bf16 GEMM1 tiles have gate-up twins: the
    same products, other columns), and the reference's."""
    x, ids, scales, w1, w2, e, k, e_local, offset = problem(case, device, torch.bfloat16)
    got = fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=fused_finalize,
                         w1_layout="gate_up")
    want = fused_moe_bf16(x, ids, scales, interleave_up_gate_sm90(w1), w2, e, k, e_local, offset,
                          use_fused_finalize=fused_finalize)
    assert got.shape == want.shape and got.dtype == want.dtype
    if fused_finalize:  # atomics: the k routes of a token add in any order
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, want)
    if x.shape[0]:
        assert rel_err(got, reference.moe_forward(x, ids, scales, w1, w2, e_local, offset)) < 2e-2


@pytest.mark.skipif(not HAS_CUDA, reason="the layer kernel is CUDA's")
def test_gate_up_weights_in_the_layer_kernel():
    """T=1 runs the one-launch layer kernel on either layout: the same wgmmas on the same rows, bit for bit."""
    x, ids, scales, w1, w2 = moe_problem(1, 8, 128, 128, 512, 256, "cuda", torch.bfloat16)
    assert cake_ops.fused_moe.runs_layer_kernel(1, 8, 128, 128)
    got = fused_moe_bf16(x, ids, scales, w1, w2, 128, 8, w1_layout="gate_up")
    assert torch.equal(got, fused_moe_bf16(x, ids, scales, interleave_up_gate_sm90(w1), w2, 128, 8))


def test_deterministic_path_is_bitwise_reproducible(device):
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top8", device, torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    runs = [fused_moe_bf16(x, ids, scales, w1, w2, e, k, use_fused_finalize=False) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_preallocated_output_and_intermediate(device):
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top2", device, torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    expected = fused_moe_bf16(x, ids, scales, w1, w2, e, k)
    out = torch.full_like(x, float("nan"))
    inter = torch.full((x.shape[0] * k, w2.shape[2]), float("nan"), dtype=x.dtype, device=device)
    got = fused_moe_bf16(x, ids, scales, w1, w2, e, k, moe_output=out, intermediate_buffer=inter)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, expected)
    assert torch.isfinite(inter.float()).all()  # GEMM1 wrote every permuted row


@pytest.mark.parametrize("fused_finalize", [True, False])
def test_unwritten_intermediate_tail_is_never_read(device, fused_finalize):
    """On CUDA GEMM1 leaves the rows past the shard's kept routes unwritten (zero_tail=False): a NaN-filled
    intermediate_buffer must not reach the output, so GEMM2 and the finalize read the kept rows only."""
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("ep_shard", device, torch.bfloat16, inter=128)
    w1 = interleave_up_gate_sm90(w1)
    tiles = dict(tile_size=128, gemm1_tile_n=256)  # a tile with a SwiGLU twin: the path that skips the tail
    expected = fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False, **tiles)
    inter = torch.full((x.shape[0] * k, w2.shape[2]), float("nan"), dtype=x.dtype, device=device)
    got = fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=fused_finalize,
                         intermediate_buffer=inter, **tiles)
    kept = int(((ids >= offset) & (ids < offset + e_local)).sum())
    assert 0 < kept < inter.shape[0] and torch.isfinite(inter[:kept].float()).all()
    if fused_finalize:  # atomics: any order of the route adds
        assert torch.isfinite(got.float()).all()
        assert (got.float() - expected.float()).norm() / expected.float().norm() < 1e-2
    else:
        assert torch.equal(got, expected)


def test_non_contiguous_routing_and_activations():
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top2", "cpu", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    expected = fused_moe_bf16(x, ids, scales, w1, w2, e, k)
    got = fused_moe_bf16(x.t().contiguous().t(), ids.t().contiguous().t(), scales.t().contiguous().t(), w1, w2, e, k)
    assert torch.equal(got, expected)


def test_expected_routes():
    assert expected_routes(8192, 48, 384) == 1024   # Kimi-K2 EP8 shard, T=1024, top-8
    assert expected_routes(8, 48, 384) == 1         # rounded up
    assert expected_routes(8192, 128, 128) == -1    # every expert: every row
    assert expected_routes(0, 4, 32) == 0


def test_default_tile_size():
    assert default_tile_size(16, 8, 128, 768) == 64      # decode: 1 row per expert
    assert default_tile_size(8192, 8, 128, 768) == 128   # 512 rows per expert
    assert default_tile_size(256, 8, 128, 128) == 128    # 16 rows per expert, tiny I
    assert default_tile_size(256, 8, 128, 768) == 64


has_tactics = pytest.mark.skipif(not hasattr(cake_ops._C, "grouped_gemm_tactics"),
                                 reason="built without CUDA kernels (no tactic tables)")


@has_tactics
def test_overrides_pick_the_grouped_gemm_tactic():
    names = cake_ops._C.grouped_gemm_tactics("fwd")
    assert override_tactic("fwd", "GEMM1") == -1  # no override: the tuned or heuristic choice
    # The fixed-operand configuration of a tile where there is one (same numbers, faster).
    assert names[override_tactic("fwd", "GEMM1", 64, 256)] == "fwd_bf16_fixed_ping_64x256x64_c1x1"
    assert names[override_tactic("fwd", "GEMM2", 128, 256, 64, (1, 2), False)] == \
        "fwd_bf16_fixed_coop_128x256x64_c1x2_rasterN"
    assert names[override_tactic("fwd", "GEMM2", 128, 128, None, (1, 1), True)] == "fwd_bf16_fixed_ping_128x128x64_c1x1"
    assert names[override_tactic("fwd", "GEMM2", 128, 128, None, (1, 2), True)] == "fwd_bf16_fixed_ping_128x128x64_c1x2"
    assert names[override_tactic("fwd", "GEMM1", 256, 128)] == "fwd_bf16_coop_256x128x64_c2x1"  # ptr-array only
    assert cake_ops._C.grouped_gemm_tactics("fwd_f16")[override_tactic("fwd_f16", "GEMM1", 128, 128)] == \
        "fwd_f16_ping_128x128x64_c1x1"
    with pytest.raises(ValueError, match=r"cake_ops.fused_moe_bf16: no GEMM2 kernel configuration has tile_m=128, "
                                         r"tile_k=32; this build's fwd tiles .*128x128x64 c1x1"):
        override_tactic("fwd", "GEMM2", 128, None, 32)


@pytest.mark.skipif(not HAS_CUDA, reason="the overrides choose CUDA kernels")
def test_overrides_run_the_chosen_kernels():
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top8", "cuda", torch.bfloat16, hidden=512, inter=128)
    w1i = interleave_up_gate_sm90(w1)
    expected = reference.moe_forward(x, ids, scales, w1, w2)
    for overrides in (dict(tile_size=64, gemm1_tile_n=256), dict(tile_size=128, gemm2_tile_n=256, gemm2_cluster_shape_mn=(1, 2)),
                      dict(gemm2_tile_n=128, gemm2_raster_along_m=False, gemm2_cluster_shape_mn=(1, 1))):
        out = fused_moe_bf16(x, ids, scales, w1i, w2, e, k, **overrides)
        assert (out.float() - expected).norm() / expected.norm() < 2e-2, overrides


def test_compiles_fullgraph():
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("ep_shard", "cpu", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)

    def moe(x, ids, scales):
        return fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ids, scales), moe(x, ids, scales))

    def into_buffers(x, ids, scales, out, inter):  # the out-variant ops under functionalization
        return fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False,
                              moe_output=out, intermediate_buffer=inter)
    out, inter = torch.empty_like(x), x.new_empty(x.shape[0] * k, w2.shape[2])
    got = torch.compile(into_buffers, fullgraph=True, backend="aot_eager")(x, ids, scales, out, inter)
    assert torch.equal(got, moe(x, ids, scales)) and torch.equal(out, got)


@pytest.mark.parametrize("case", ["top8", "ep_shard"])
def test_compiles_once_for_any_token_count(device, case):
    """A serving loop's batch size changes every step: dynamic-shape graphs serve them, one per plan
    bucket (T=1; the layer kernel's decode sizes on CUDA; the tile size), not one per T, bitwise as
    eager. A shard's expected_routes hint grows with T: a SymInt argument, not a specialization."""
    x, ids, scales, w1, w2, e, k, e_local, offset = problem(case, device, torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)

    def moe(x, ids, scales):
        return fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend=counter)
    tokens = (5, 37, 1, 19, 2, 33, 11, 3, 4, 27)
    for t in tokens:
        assert torch.equal(compiled(x[:t], ids[:t], scales[:t]), moe(x[:t], ids[:t], scales[:t])), t

    def bucket(t):  # the size rules fused_moe_bf16 branches on (the layer kernel's on CUDA only)
        cuda = x.is_cuda
        return (t == 1, cuda and t <= cake_ops.fused_moe.LAYER_MAX_TOKENS,
                cuda and cake_ops.fused_moe.runs_layer_kernel(t, k, e_local, e),
                default_tile_size(t, k, e_local, w2.shape[2]))
    assert counter.frame_count <= len({bucket(t) for t in tokens}) < len(tokens), counter.frame_count


@pytest.mark.skipif(not HAS_CUDA, reason="inductor and CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiles_fullgraph_on_gpu(mode):
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("ep_shard", "cuda", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)

    def moe(x, ids, scales):
        return fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False)
    compiled = torch.compile(moe, fullgraph=True, mode=mode)
    expected = moe(x, ids, scales)
    for _ in range(3):  # reduce-overhead: warm-up, record, then replay
        got = compiled(x, ids, scales)
        assert torch.equal(got, expected)


@pytest.mark.skipif(not HAS_CUDA, reason="the autotuner times kernels on the GPU")
def test_autotune_tunes_both_gemms_and_keeps_the_winners(tmp_path):
    import sys

    import cake_ops
    tuner = sys.modules["cake_ops.autotune"]  # the module (cake_ops.autotune is the context)
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top8", "cuda", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    expected = fused_moe_bf16(x, ids, scales, w1, w2, e, k)
    cache = tmp_path / "tuning.json"
    cake_ops.clear_tuning()
    try:
        with cake_ops.autotune(cache_file=str(cache)):
            tuned = fused_moe_bf16(x, ids, scales, w1, w2, e, k)
            tuned_det = fused_moe_bf16(x, ids, scales, w1, w2, e, k, use_fused_finalize=False)
        rows, (h, inter) = x.shape[0] * k, (x.shape[1], w2.shape[2])
        # GEMM1 as its SwiGLU twin, GEMM2 as the scatter twin (fused finalize) and as the plain GEMM
        # (deterministic path): three buckets, each timed as it runs.
        keys = {tuner._key("fwd", e, rows, 2 * inter, h, "swiglu"), tuner._key("fwd", e, rows, h, inter, "scatter"),
                tuner._key("fwd", e, rows, h, inter)}
        assert keys <= set(tuner._tuned) and cache.exists()
        names = cake_ops._C.grouped_gemm_tactics("fwd")
        assert cake_ops._C.grouped_gemm_tactic_for("fwd", e, rows, h, inter, -1, "scatter") == names.index(
            tuner._tuned[tuner._key("fwd", e, rows, h, inter, "scatter")])
        after = fused_moe_bf16(x, ids, scales, w1, w2, e, k)  # outside the context: the winners
        for out in (tuned, after, tuned_det):
            assert (out.float() - expected.float()).norm() / expected.float().norm() < 1e-2
    finally:
        cake_ops.clear_tuning()


@pytest.mark.skipif(not HAS_CUDA, reason="PDL is a CUDA launch attribute")
def test_pdl_changes_no_number():
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top8", "cuda", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    with_pdl = fused_moe_bf16(x, ids, scales, w1, w2, e, k, enable_pdl=True)
    assert torch.equal(with_pdl, fused_moe_bf16(x, ids, scales, w1, w2, e, k, enable_pdl=False))


def test_layer_kernel_rule():
    """The layer kernel up to T=2, and on a shard while it expects at most 8 routes (the Kimi-K2 EP8 shard,
    48 of 384 experts, to T=8); staged ops past that, and for the whole expert set from T=4."""
    runs = cake_ops.fused_moe.runs_layer_kernel
    assert runs(1, 8, 128, 128) and runs(2, 8, 128, 128) and runs(2, 2, 8, 8)
    assert not runs(4, 8, 128, 128) and not runs(4, 2, 8, 8)
    assert runs(4, 8, 48, 384) and runs(8, 8, 48, 384) and not runs(9, 8, 48, 384)
    assert runs(2, 8, 64, 128) and not runs(3, 8, 64, 128)  # an EP2 shard: 8 of 16 routes at T=2, 12 at T=3


@pytest.mark.skipif(not HAS_CUDA, reason="the layer kernel is CUDA's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["one_token", "ep_shard_one_token", "two_tokens", "ep_shard_eight_routes"])
def test_one_token_runs_the_layer_kernel(dtype, case, monkeypatch):
    """T <= 2 on CUDA, or a shard expecting at most 8 of the routes (here 8 tokens x 8 x 8 / 64), is one
    moe_forward_out launch (the layer kernel takes H=512, I=256); it matches the float32 reference and the
    staged ops (LAYER_MAX_TOKENS = LAYER_MAX_SHARD_ROUTES = 0) within their tolerance."""
    t, k, e, e_local, offset = {"one_token": (1, 8, 128, 128, 0), "ep_shard_one_token": (1, 8, 64, 16, 16),
                                "two_tokens": (2, 8, 128, 128, 0), "ep_shard_eight_routes": (8, 8, 64, 8, 16)}[case]
    assert cake_ops.fused_moe.runs_layer_kernel(t, k, e_local, e)
    x, ids, scales, w1, w2 = moe_problem(t, k, e, e_local, 512, 256, "cuda", dtype)
    ids[0, :3] = torch.tensor([16, 17, 40])  # three routes in the shard (ep), the rest mostly outside
    w1i = interleave_up_gate_sm90(w1)
    assert cake_ops._C.moe_forward_layer_fits(t * k, 512, 256, 2)
    out = fused_moe_bf16(x, ids, scales, w1i, w2, e, k, e_local, offset)
    layer = torch.empty_like(x)
    torch.ops.cake.moe_forward_out(x, ids, scales, w1i, w2, offset, layer, torch.empty(0, dtype=torch.uint8,
                                                                                       device="cuda"))
    assert torch.equal(out, layer)
    want = reference.moe_forward(x, ids, scales, w1, w2, e_local, offset)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(cake_ops.fused_moe, "LAYER_MAX_TOKENS", 0)
    monkeypatch.setattr(cake_ops.fused_moe, "LAYER_MAX_SHARD_ROUTES", 0)
    torch.testing.assert_close(fused_moe_bf16(x, ids, scales, w1i, w2, e, k, e_local, offset, use_fused_finalize=False),
                               out, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_routing():
    x, ids, scales, w1, w2, e, k, e_local, offset = problem("top8", "cuda", torch.bfloat16)
    w1 = interleave_up_gate_sm90(w1)
    out = torch.empty_like(x)
    fused_moe_bf16(x, ids, scales, w1, w2, e, k, moe_output=out)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe_bf16(x, ids, scales, w1, w2, e, k, moe_output=out)
    for _ in range(2):  # new tokens and routes in the captured buffers
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(x.shape[0])]).to(ids))
        scales.copy_(torch.softmax(torch.randn_like(scales), -1))
        g.replay()
        assert torch.equal(out, fused_moe_bf16(x, ids, scales, w1, w2, e, k))


class TestErrors(expecttest.TestCase):
    def error(self, **changes):
        x, ids, scales, w1, w2, e, k, e_local, offset = problem("top2", "cpu", torch.bfloat16)
        args = dict(x=x, token_selected_experts=ids, token_final_scales=scales,
                    w1_weight=interleave_up_gate_sm90(w1), w2_weight=w2, num_experts=e, top_k=k)
        args.update(changes)
        with self.assertRaises(ValueError) as ctx:
            fused_moe_bf16(**args)
        return str(ctx.exception)

    def test_errors(self):
        x = torch.randn(64, 128).bfloat16()
        self.assertExpectedInline(self.error(x=x.float()), """cake_ops.fused_moe_bf16: x must be bfloat16 or float16, got torch.float32""")
        self.assertExpectedInline(self.error(w1_layout="up_gate"), """cake_ops.fused_moe_bf16: w1_layout must be one of ('interleaved', 'gate_up'), got 'up_gate'""")
        self.assertExpectedInline(self.error(x=x[0]), """cake_ops.fused_moe_bf16: x must be a 2-D [num_tokens, hidden] tensor, got shape [128]""")
        self.assertExpectedInline(self.error(top_k=3), """cake_ops.fused_moe_bf16: token_selected_experts must have shape [num_tokens, top_k] = [64, 3], got [64, 2]""")
        self.assertExpectedInline(self.error(token_selected_experts=torch.zeros(64, 2, dtype=torch.int64)), """cake_ops.fused_moe_bf16: token_selected_experts must be int32, got torch.int64""")
        self.assertExpectedInline(self.error(token_final_scales=torch.zeros(64, 2).bfloat16()), """cake_ops.fused_moe_bf16: token_final_scales must be float32, got torch.bfloat16""")
        self.assertExpectedInline(self.error(num_local_experts=4, local_expert_offset=6), """cake_ops.fused_moe_bf16: the shard [local_expert_offset, local_expert_offset + num_local_experts) = [6, 10) must lie within [0, num_experts=8)""")
        self.assertExpectedInline(self.error(num_local_experts=4), """cake_ops.fused_moe_bf16: w1_weight must be [num_local_experts=4, 2I, hidden=128], got [8, 192, 128]""")
        self.assertExpectedInline(self.error(w2_weight=torch.zeros(8, 128, 64).bfloat16()), """cake_ops.fused_moe_bf16: w2_weight must be [num_local_experts, hidden, I] = [8, 128, 96] (I = w1_weight.shape[1] // 2, w1_weight being [8, 192, 128]), got [8, 128, 64]""")
        self.assertExpectedInline(self.error(w2_weight=torch.zeros(8, 128, 96).half()), """cake_ops.fused_moe_bf16: w2_weight must have x's dtype torch.bfloat16, got torch.float16""")
        self.assertExpectedInline(self.error(x=torch.randn(64, 96).bfloat16(), w1_weight=torch.zeros(8, 192, 96).bfloat16(), w2_weight=torch.zeros(8, 96, 96).bfloat16()), """cake_ops.fused_moe_bf16: hidden must be a multiple of 64, got 96""")
        self.assertExpectedInline(self.error(w1_weight=torch.zeros(8, 80, 128).bfloat16(), w2_weight=torch.zeros(8, 128, 40).bfloat16()), """cake_ops.fused_moe_bf16: 2I must be a multiple of 64 (I % 32 == 0), got 2I=80""")
        self.assertExpectedInline(self.error(moe_output=torch.zeros(64, 128)), """cake_ops.fused_moe_bf16: moe_output must have x's dtype torch.bfloat16, got torch.float32""")
        self.assertExpectedInline(self.error(intermediate_buffer=torch.zeros(64, 96).bfloat16()), """cake_ops.fused_moe_bf16: intermediate_buffer must have shape [128, 96], got [64, 96]""")
        self.assertExpectedInline(self.error(tile_size=32), """cake_ops.fused_moe_bf16: tile_size must be 64 or 128, got 32""")
        self.assertExpectedInline(self.error(gemm2_tile_k=64), """cake_ops.fused_moe_bf16: gemm2_tile_k must be 32 or 64 and divide I=96, got 64""")
        self.assertExpectedInline(self.error(gemm1_tile_n=96), """cake_ops.fused_moe_bf16: gemm1_tile_n must be 64, 128 or 256 and divide 2I=192, got 96""")
        self.assertExpectedInline(self.error(gemm2_tile_n=256), """cake_ops.fused_moe_bf16: gemm2_tile_n must be 64, 128 or 256 and divide hidden=128, got 256""")
        self.assertExpectedInline(self.error(gemm2_cluster_shape_mn=(2, 1)), """cake_ops.fused_moe_bf16: gemm2_cluster_shape_mn must be (1, 1) or (1, 2), got (2, 1)""")
        self.assertExpectedInline(self.error(gemm2_cluster_shape_mn=(1, 2), gemm2_tile_n=128), """cake_ops.fused_moe_bf16: gemm2_cluster_shape_mn=(1, 2) needs an even number of GEMM2 N tiles, got hidden=128 / gemm2_tile_n=128 = 1""")
        self.assertExpectedInline(self.error(w2_weight=torch.zeros(8, 96, 128).bfloat16().transpose(1, 2)), """cake_ops.fused_moe_bf16: w2_weight must be contiguous (prepare it once with the model's weights)""")
        self.assertExpectedInline(self.error(gemm2_raster_along_m=1), """cake_ops.fused_moe_bf16: gemm2_raster_along_m must be a bool or None, got 1""")
        with self.assertRaisesRegex(TypeError, "cake_ops.fused_moe_bf16: token_selected_experts must be a tensor, got list"):
            fused_moe_bf16(torch.zeros(64, 128).bfloat16(), [[0, 1]] * 64, torch.zeros(64, 2), torch.zeros(8, 192, 128).bfloat16(),
                           torch.zeros(8, 128, 96).bfloat16(), 8, 2)
        with self.assertRaisesRegex(TypeError, "interleave_up_gate_sm90: w_gate_up must be a tensor, got list"):
            interleave_up_gate_sm90([[0.0]])

    def test_out_of_range_expert_ids_contribute_zero(self):
        x, ids, scales, w1, w2, e, k, e_local, offset = problem("top2", "cpu", torch.bfloat16)
        w1 = interleave_up_gate_sm90(w1)
        bad = ids.clone()
        bad[:, 1] = torch.tensor([-1, e, e + 7, 1 << 30]).repeat(16)  # padding / out-of-range ids
        out = fused_moe_bf16(x, bad, scales, w1, w2, e, k)
        keep = scales.clone()
        keep[:, 1] = 0
        assert torch.equal(out, fused_moe_bf16(x, bad.clamp(0, e - 1), keep, w1, w2, e, k))


# ----------------------------------------------------------------------------------------------
# cake_ops.nn.FusedMoE in place of a Hugging Face-style sparse MoE block


class Expert(torch.nn.Module):
    def __init__(self, hidden, inter, names):
        super().__init__()
        self.names = names
        for name, (i, o) in zip(names, [(hidden, inter), (hidden, inter), (inter, hidden)]):
            setattr(self, name, torch.nn.Linear(i, o, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(torch.nn.functional.silu(gate(x)) * up(x))


class SparseMoeBlock(torch.nn.Module):
    """The plain PyTorch block (as Mixtral's and Qwen3-MoE's): softmax router, top-k, loop over experts."""

    def __init__(self, hidden, inter, num_experts, top_k, names, norm_topk_prob):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(hidden, inter, names) for _ in range(num_experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]).float() * weights[tok, slot, None])
        return out.to(x.dtype).view(shape), logits


@pytest.mark.parametrize("names,norm", [(("w1", "w3", "w2"), True), (("gate_proj", "up_proj", "down_proj"), False)])
def test_fused_moe_module_matches_plain_block(device, names, norm):
    block = SparseMoeBlock(128, 96, 16, 4, names, norm).to(device, torch.bfloat16)
    moe = cake_ops_nn.FusedMoE.from_sparse_moe_block(block)
    x = torch.randn(2, 24, 128, device=device).bfloat16()
    with torch.no_grad():
        want, want_logits = block(x)
        got, logits = moe(x)
    assert got.shape == x.shape and torch.equal(logits, want_logits)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, err


def test_fused_moe_module_expert_parallel_shards_sum_to_the_block():
    block = SparseMoeBlock(128, 64, 16, 4, ("w1", "w3", "w2"), True).bfloat16()
    x = torch.randn(40, 128).bfloat16()
    with torch.no_grad():
        want, _ = block(x)
        shards = [cake_ops_nn.FusedMoE.from_sparse_moe_block(block, num_local_experts=4, local_expert_offset=o)
                  for o in (0, 4, 8, 12)]
        total = sum(s(x)[0].float() for s in shards)
    assert (total - want.float()).norm() / want.float().norm() < 2e-2


def transformers_block(kind, device):
    """A sparse MoE block of transformers >= 5 (experts as 3-D tensors, the router a module), random weights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=128, intermediate_size=96, num_local_experts=8,
                                                    num_experts_per_tok=2))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=16,
                                                      num_experts_per_tok=4, norm_topk_prob=kind == "qwen3_norm"))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block.to(device, torch.bfloat16)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_norm", "qwen3"])
def test_fused_moe_module_matches_transformers_blocks(device, kind):
    block = transformers_block(kind, device)
    moe = cake_ops_nn.FusedMoE.from_sparse_moe_block(block)
    assert (moe.top_k, moe.norm_topk_prob) == ((2, True) if kind == "mixtral" else (4, kind == "qwen3_norm"))
    x = torch.randn(3, 17, 128, device=device).bfloat16()
    with torch.no_grad():
        want, got = block(x), moe(x)
    assert isinstance(got, torch.Tensor) and got.shape == x.shape, "a transformers >= 5 block returns the output alone"
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_replace_sparse_moe_blocks_in_a_transformers_model(device, family):
    model = tiny_transformers_model(family, device).eval()
    ids = torch.randint(0, 101, (2, 9), device=device)
    with torch.no_grad():
        want = model(ids).logits.float()
        assert cake_ops_nn.replace_sparse_moe_blocks(model) == 2
        got = model(ids).logits.float()
    assert sum(isinstance(m, cake_ops_nn.FusedMoE) for m in model.modules()) == 2
    assert rel_err(got, want) < 5e-2  # two layers of bf16 rounding apart


def tiny_transformers_model(family, device):
    from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=8, **common))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                                                   head_dim=32, **common))
    else:  # weights stored [E, in, out], biases, its own clamped gate
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                               head_dim=32, **common))
    return model.to(device, torch.bfloat16)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_transformers_experts_implementation_infers_like_eager(device, family):
    """Inference (no_grad): Mixtral's and Qwen3-MoE's experts run fused_moe_bf16 on their own weights, gpt-oss's
    (biases, its own clamped gate) the grouped_mm path; the logits of each are eager's, bf16 rounding apart."""
    cake_ops_nn.register_transformers_experts()
    model = tiny_transformers_model(family, device).eval()
    ids = torch.randint(0, 101, (2, 9), device=device)
    logits = {}
    with torch.no_grad():
        for impl in ("eager", "cake"):
            model.set_experts_implementation(impl)
            with RecordOps() as record:
                logits[impl] = model(ids).logits.float()
    fused_calls = record.ops.count("cake.moe_gemm1_swiglu.default")
    assert fused_calls == (0 if family == "gpt_oss" else 2)
    assert rel_err(logits["cake"], logits["eager"]) < 2e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_transformers_experts_implementation_trains_like_eager(device, family):
    cake_ops_nn.register_transformers_experts()
    model = tiny_transformers_model(family, device)
    ids = torch.randint(0, 101, (2, 9), device=device)
    runs = {}
    for impl in ("eager", "cake"):
        model.set_experts_implementation(impl)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        runs[impl] = [out.logits] + [p.grad for name, p in model.named_parameters() if ".experts." in name]
    assert len(runs["cake"]) > 2
    for want, got in zip(runs["eager"], runs["cake"]):
        assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_transformers_experts_forward_compiles_with_backward(device, family, autocast):
    """fullgraph, forward and backward (gpt-oss: grouped_mm and its own gate; Mixtral: the SwiGLU experts' one
    autograd node), in bf16 or under torch.autocast with float32 weights and inputs; aot_eager runs the same
    kernels, so bitwise as eager."""
    torch._dynamo.reset()
    experts = tiny_transformers_model(family, device).model.layers[0].mlp.experts
    dtype = torch.float32 if autocast else torch.bfloat16
    experts.to(dtype)

    def step(fn, x, ids, weights):
        experts.zero_grad()
        x = x.detach().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = fn(experts, x, ids, weights)
        out.float().square().mean().backward()
        return [out.detach(), x.grad] + [p.grad for p in experts.parameters()]

    args = (torch.randn(10, 128, device=device).to(dtype), torch.randint(0, 8, (10, 2), device=device),
            torch.rand(10, 2, device=device))
    eager = step(cake_ops_nn.transformers_experts_forward, *args)
    compiled = step(torch.compile(cake_ops_nn.transformers_experts_forward, fullgraph=True, backend="aot_eager"), *args)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_transformers_experts_gradients_match_float64_eager(device, family):
    """Training through the cake implementation: the hidden states', routing weights' and expert weights'
    gradients against transformers' eager experts forward in float64 on the same weights. Sentinel routes
    (ids >= num_experts) are eager's routes to expert 0 with weight 0 there: they add nothing to either side, and
    their routing weights' gradients are zero on cake's."""
    experts = tiny_transformers_model(family, device).model.layers[0].mlp.experts
    eager64 = copy.deepcopy(experts).double()
    eager64.config._experts_implementation = "eager"
    t, k = 37, 2
    x = torch.randn(t, 128, device=device).bfloat16()
    ids = torch.randint(0, 8, (t, k), device=device)
    ids[::5, 1] = 8  # sentinels
    sentinel = ids >= 8
    weights = torch.rand(t, k, device=device)
    grad_out = torch.randn(t, 128, device=device)

    def grads(module, fn, dtype, ids, weights):
        module.zero_grad(set_to_none=True)
        xg = x.to(dtype).requires_grad_()
        wg = weights.detach().clone().requires_grad_()
        out = fn(module, xg, ids, wg)
        out.backward(grad_out.to(out.dtype))
        return [out, xg.grad, wg.grad] + [p.grad for p in module.parameters()]

    want = grads(eager64, lambda m, *args: m(*args), torch.float64, ids.masked_fill(sentinel, 0),
                 weights.double().masked_fill(sentinel, 0))
    got = grads(experts, cake_ops_nn.transformers_experts_forward, torch.bfloat16, ids, weights)
    assert not got[2][sentinel].any()
    want[2] = want[2].masked_fill(sentinel, 0)
    names = ["out", "hidden states", "routing weights"] + [n for n, _ in experts.named_parameters()]
    assert len(got) == len(names) > 4
    for name, w, g in zip(names, want, got):
        assert rel_err(g, w) < 2e-2, name


class ExpertsGradients:
    """One experts module on 29 random tokens (top-2 of 8 experts): ``run(fn, dtype)`` is fn(module, x, ids,
    weights) on a copy of the module in dtype (the module itself in bf16) -> [output, the hidden states', routing
    weights' and the module's parameters' gradients]; ``eager(dtype)`` the module's eager forward's."""

    def __init__(self, experts, device):
        self.experts, self.names = experts, ["out", "hidden states", "routing weights"] + [
            n for n, _ in experts.named_parameters()]
        self.x = torch.randn(29, 128, device=device).bfloat16()
        self.ids = torch.stack([torch.randperm(8)[:2] for _ in range(29)]).to(device)
        self.weights = torch.rand(29, 2, device=device)
        self.grad_out = torch.randn(29, 128, device=device)

    def run(self, fn, dtype=torch.bfloat16):
        module = self.experts if dtype == torch.bfloat16 and fn is not None else copy.deepcopy(self.experts).to(dtype)
        module.zero_grad(set_to_none=True)
        x, w = self.x.to(dtype, copy=True).requires_grad_(), self.weights.to(dtype, copy=True).requires_grad_()
        out = fn(module, x, self.ids, w) if fn is not None else module(x, self.ids, w)
        out.backward(self.grad_out.to(out.dtype))
        return [out, x.grad, w.grad] + [p.grad for p in module.parameters()]

    def eager(self, dtype):
        self.experts.config._experts_implementation = "eager"
        return self.run(None, dtype)


def swiglu_gate_experts(family, device):
    """Experts modules of transformers >= 5 whose gate cake::swiglu computes besides the default one: DeepSeek-V4's,
    GLM-5's and HY-V4's clamped SwiGLU (silu(min(gate, L)) * clamp(up, -L, L)), with a limit that bites on about a
    fifth of the values here (1.55: no bf16 value equals it, so no test value sits on a bound, where torch 2.11's clamp
    passes the gradient and 2.14's does not), and LFM2's (F.silu as its act_fn)."""
    import transformers
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4Experts
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts
    sizes = dict(hidden_size=128, num_local_experts=8, swiglu_limit=1.55)
    if family == "deepseek_v4":
        experts = DeepseekV4Experts(transformers.DeepseekV4Config(intermediate_size=64, **sizes))
    elif family == "glm5_next":
        experts = Glm5NextTextExperts(transformers.Glm5NextTextConfig(moe_intermediate_size=64, **sizes))
    elif family == "hy_v4":
        experts = HYV4Experts(transformers.HYV4Config(moe_intermediate_size=64, **sizes))
    else:
        experts = Lfm2MoeExperts(transformers.Lfm2MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=8))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return experts.to(device, torch.bfloat16)


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next", "hy_v4", "lfm2_moe"])
def test_transformers_experts_swiglu_gates_match_float64_eager(device, family):
    """The clamped SwiGLU gates (and LFM2's F.silu one) run as cake::swiglu, with the module's limit, in the SwiGLU
    experts' one autograd node, training and in inference; output and every gradient against the module's eager
    forward in float64, and in bf16. Where the clamp bites, a value within a bf16 rounding of +-L takes the other
    side of the clamp's gradient than in float64: cake's gate_up and hidden-state gradients are up to 3% off
    float64 over 24 cases (torch 2.11 and 2.14 alike): 6% there, 2% elsewhere. Eager's own bf16 gradients are as
    far off in torch 2.11, up to 9% in 2.14: they bound the clamped families' output only.
    test_swiglu_matches_float64 checks the kernels' clamped arithmetic on identical inputs to one rounding."""
    experts = swiglu_gate_experts(family, device)
    clamped = family != "lfm2_moe"
    assert (getattr(experts, "limit", None) or getattr(experts, "swiglu_limit", None)) == (1.55 if clamped else None)
    case = ExpertsGradients(experts, device)
    want, want16 = case.eager(torch.float64), case.eager(torch.bfloat16)
    with RecordOps(args=True) as record:
        got = case.run(cake_ops_nn.transformers_experts_forward)
    def limit(op, args):  # swiglu(gate_up, limit), swiglu_backward(grad, gate_up, limit); a None may be left out
        i = 2 if "backward" in op else 1
        return args[i] if len(args) > i else None

    limits = [(op, limit(op, args)) for op, args in record.calls if op.startswith("cake.swiglu")]
    assert limits == [(op, 1.55 if clamped else None) for op in ("cake.swiglu.default", "cake.swiglu_backward.default")]
    assert case.names == ["out", "hidden states", "routing weights", "gate_up_proj", "down_proj"]
    for name, w, w16, g in zip(case.names, want, want16, got):
        assert rel_err(g, w) < (6e-2 if clamped else 2e-2), name
        if name == "out" or not clamped:
            assert rel_err(g, w16) < 2e-2, name
    torch._dynamo.reset()  # fullgraph with backward (aot_eager runs the same kernels): eager's bits
    compiled = torch.compile(cake_ops_nn.transformers_experts_forward, fullgraph=True, backend="aot_eager")
    for name, c, g in zip(case.names, case.run(compiled), got):
        assert torch.equal(c, g), name
    with torch.no_grad(), RecordOps() as record:
        out = cake_ops_nn.transformers_experts_forward(experts, case.x, case.ids, case.weights)
    # inference: the clamped gates through the same kernels, LFM2's as one fused_moe_bf16 call
    assert ("cake.moe_gemm1_swiglu.default" in record.ops) != clamped
    assert ("cake.swiglu.default" in record.ops) == clamped
    assert rel_err(out, want[0]) < 2e-2


def other_gate_experts(family, device):
    """Experts modules of transformers >= 5 that the SwiGLU node does not take: Nemotron-H's (no gate: relu^2 of
    up_proj alone), Gemma-4's (the default gate on gelu), OpenAI privacy filter's (weights [E, in, out], biases,
    its own clamped (up + 1) * gate * sigmoid(alpha * gate))."""
    import transformers
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
    from transformers.models.openai_privacy_filter.modeling_openai_privacy_filter import OpenAIPrivacyFilterExperts
    if family == "nemotron_h":
        experts = NemotronHExperts(transformers.NemotronHConfig(hidden_size=128, moe_intermediate_size=64,
                                                                n_routed_experts=8))
    elif family == "gemma4":
        experts = Gemma4TextExperts(transformers.Gemma4TextConfig(hidden_size=128, moe_intermediate_size=64,
                                                                  num_experts=8))
    else:
        experts = OpenAIPrivacyFilterExperts(transformers.OpenAIPrivacyFilterConfig(
            hidden_size=128, intermediate_size=64, num_local_experts=8))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return experts.to(device, torch.bfloat16)


@pytest.mark.parametrize("family", ["nemotron_h", "gemma4", "openai_privacy_filter"])
def test_transformers_experts_other_gates_match_eager(device, family):
    """Experts the SwiGLU node does not take run grouped_mm and the module's own gate or activation: output and
    every gradient (biases included) against the module's eager forward in bf16, and in float64 where no clamp
    bites (see test_transformers_experts_swiglu_gates_match_float64_eager)."""
    case = ExpertsGradients(other_gate_experts(family, device), device)
    want64, want16 = case.eager(torch.float64), case.eager(torch.bfloat16)
    with RecordOps() as record:
        got = case.run(cake_ops_nn.transformers_experts_forward)
    assert "cake.grouped_gemm_fwd.default" in record.ops and "cake.swiglu.default" not in record.ops
    assert len(got) == len(case.names) >= 5
    for name, w64, w16, g in zip(case.names, want64, want16, got):
        assert rel_err(g, w16) < 2e-2, name
        if family != "openai_privacy_filter":  # its gate clamps at the config's limit
            assert rel_err(g, w64) < 2e-2, name


def test_transformers_experts_trains_a_subset(device):
    """Frozen parts get no gradient, and the trained ones the same as when everything trains (the SwiGLU experts'
    node runs only the backward GEMMs some input needs)."""
    experts = tiny_transformers_model("mixtral", device).model.layers[0].mlp.experts
    x = torch.randn(11, 128, device=device).bfloat16()
    ids, weights = torch.randint(0, 8, (11, 2), device=device), torch.rand(11, 2, device=device)

    def grads(trained):
        experts.zero_grad(set_to_none=True)
        for name, p in experts.named_parameters():
            p.requires_grad_(name in trained)
        xg = x.detach().requires_grad_("x" in trained)
        cake_ops_nn.transformers_experts_forward(experts, xg, ids, weights).float().square().sum().backward()
        return {"x": xg.grad, **{name: p.grad for name, p in experts.named_parameters()}}

    everything = grads({"x", "gate_up_proj", "down_proj"})
    try:
        for trained in ({"down_proj"}, {"gate_up_proj"}, {"x"}):
            for name, grad in grads(trained).items():
                assert (grad is not None) == (name in trained), (trained, name)
                assert grad is None or torch.equal(grad, everything[name]), (trained, name)
    finally:
        experts.requires_grad_(True)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_transformers_experts_under_autocast(device, family, weights):
    """A training step under torch.autocast with float32 hidden states (a LayerNorm's output) and float32 (master)
    or bf16 weights: the experts run in bf16 as the same step on bf16 casts does, gradients in each tensor's
    dtype: bit for bit that step (its output rounded to bf16: autocast's stays float32), Mixtral's SwiGLU experts'
    node and gpt-oss's grouped_mm path with its biases (cast, as F.linear's are) and own gate. The SwiGLU node's
    float32 weights get wgrad's float32 output: that step's gradient before its bf16 rounding."""
    experts = tiny_transformers_model(family, device).model.layers[0].mlp.experts.to(getattr(torch, weights))
    x = torch.randn(13, 128, device=device)
    ids, scales = torch.randint(0, 8, (13, 2), device=device), torch.rand(13, 2, device=device)
    grad = torch.randn(13, 128, device=device).bfloat16().float()  # the same in both runs' dtypes

    def run(module, x, autocast):
        module.zero_grad(set_to_none=True)
        xg, sg = x.detach().requires_grad_(), scales.detach().clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = cake_ops_nn.transformers_experts_forward(module, xg, ids, sg)
        out.backward(grad.to(out.dtype))
        return [out, xg.grad, sg.grad] + [p.grad for p in module.parameters()]

    got = run(experts, x, True)
    want = run(copy.deepcopy(experts).bfloat16(), x.bfloat16(), False)
    assert [g.dtype for g in got] == [torch.float32, torch.float32, torch.float32] + [
        p.dtype for p in experts.parameters()]
    for name, g, w in zip(["out", "hidden states", "routing weights"] + [n for n, _ in experts.named_parameters()],
                          got, want):
        if family == "mixtral" and name.endswith("_proj") and weights == "float32":
            assert torch.equal(g.bfloat16(), w) if device == "cpu" else rel_err(g, w) < 1e-2, name
            assert not torch.equal(g, g.bfloat16().float()), name  # not a bf16 gradient cast up
        else:
            assert torch.equal(g.to(w.dtype), w), name
    if family == "mixtral":  # inference: fused_moe_bf16 on the casts
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16), RecordOps() as record:
            out = cake_ops_nn.transformers_experts_forward(experts, x, ids, scales)
        assert "cake.moe_gemm1_swiglu.default" in record.ops and out.dtype == torch.float32
        with torch.no_grad():
            want = cake_ops_nn.transformers_experts_forward(copy.deepcopy(experts).bfloat16(), x.bfloat16(), ids,
                                                            scales)
        assert torch.equal(out.bfloat16(), want)


def test_fused_moe_module_under_autocast(device):
    """FusedMoE (bf16 weights) takes float32 hidden states inside torch.autocast as a Linear does: cast to bf16."""
    moe = cake_ops_nn.FusedMoE.from_sparse_moe_block(transformers_block("mixtral", device))
    x = torch.randn(2, 9, 128, device=device)
    with torch.no_grad():
        with torch.autocast(device, dtype=torch.bfloat16):
            got = moe(x)
        want = moe(x.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="FusedMoE: hidden_states must be"):
        moe(x)  # outside autocast a float32 input is refused


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_transformers_experts_forward_runs_cake_ops_and_drops_sentinels(grad):
    """Expert-parallel sentinels (ids >= num_experts) contribute zero; the sort, GEMMs and combine are cake's:
    grouped_mm and moe_finalize where a gradient is wanted, fused_moe_bf16's ops (on the [gate; up] weights as
    they are) in inference."""
    experts = tiny_transformers_model("mixtral", "cpu").model.layers[0].mlp.experts
    x = torch.randn(6, 128).bfloat16()
    ids = torch.tensor([[0, 3], [8, 1], [3, 8], [8, 8], [7, 0], [2, 5]])
    weights = torch.rand(6, 2)
    with torch.set_grad_enabled(grad), RecordOps() as record:
        got = cake_ops_nn.transformers_experts_forward(experts, x, ids, weights)
    assert got.requires_grad == grad
    fused = {"cake.moe_sort.default", "cake.moe_gemm1_swiglu.default", "cake.moe_gemm2.default",
             "cake.moe_finalize.default"}
    if grad:  # the sort, grouped GEMMs, swiglu and moe_finalize (differentiable), not the fused GEMMs
        trained = {"cake.moe_sort.default", "cake.grouped_gemm_fwd.default", "cake.swiglu.default",
                   "cake.moe_finalize.default"}
        assert trained <= set(record.ops)
        assert not (fused - trained) & set(record.ops)
    else:
        assert fused <= set(record.ops) and "cake.grouped_gemm_fwd.default" not in record.ops
    got = got.detach()
    want = torch.zeros(6, 128)
    for t in range(6):
        for j in range(2):
            e = int(ids[t, j])
            if e < 8:
                gate, up = (x[t].float() @ experts.gate_up_proj[e].float().T).chunk(2)
                want[t] += weights[t, j] * (experts.down_proj[e].float() @ (torch.nn.functional.silu(gate) * up))
    assert rel_err(got, want) < 2e-2
    assert torch.equal(got[3], torch.zeros(128, dtype=got.dtype)), "a token whose routes are all sentinels gets zero"
    none = cake_ops_nn.transformers_experts_forward(experts, x[:0], ids[:0], weights[:0])
    assert none.shape == (0, 128) and none.dtype == x.dtype


def test_fused_moe_module_errors():
    class NoNames(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(64, 4, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
            self.top_k = 2
    with pytest.raises(ValueError, match="experts must have gate_proj/up_proj/down_proj or w1/w3/w2"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(NoNames())
    block = SparseMoeBlock(64, 64, 4, 2, ("w1", "w3", "w2"), True)
    with pytest.raises(ValueError, match=r"the shard \[2, 6\) is not within the block's 4 experts"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(block, num_local_experts=4, local_expert_offset=2)
    with pytest.raises(ValueError, match=r"the block must have a router `gate` with a weight \[E, H\] and `experts`"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(torch.nn.Linear(64, 4))
    with pytest.raises(ValueError, match=r"FusedMoE: top_k must be in \[1, num_experts=4\], got 5"):
        cake_ops_nn.FusedMoE(64, 64, 4, 5)
    with pytest.raises(ValueError, match=r"FusedMoE: the shard \[3, 5\) must lie within \[0, num_experts=4\)"):
        cake_ops_nn.FusedMoE(64, 64, 4, 2, num_local_experts=2, local_expert_offset=3)
    with pytest.raises(ValueError, match="FusedMoE: needs hidden_size % 64 == 0 and intermediate_size % 32 == 0, got 64 and 48"):
        cake_ops_nn.FusedMoE(64, 48, 4, 2)
    moe = cake_ops_nn.FusedMoE(64, 64, 4, 2)
    with pytest.raises(ValueError, match=r"FusedMoE.load_experts: down_weight must be \[4, 64, 64\], got \[4, 64, 32\]"):
        moe.load_experts(torch.zeros(4, 64, 64), torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    with pytest.raises(ValueError, match=r"FusedMoE: hidden_states must be \[..., hidden=64\] torch.bfloat16, got \[2, 3, 64\] torch.float32"):
        moe(torch.zeros(2, 3, 64))


def test_fused_moe_module_refuses_what_it_does_not_compute():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    shared = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=8,
                                                   num_experts_per_tok=2, shared_expert_intermediate_size=64))
    with pytest.raises(ValueError, match=r"the block has shared experts \(shared_expert, shared_expert_gate\)"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(shared.bfloat16())

    class SigmoidRouted(SparseMoeBlock):  # DeepSeek-V3-style scores: not softmax top-k
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            weights, ids = torch.topk(torch.sigmoid(self.gate(x).float()), self.top_k, dim=-1)
            out = torch.zeros_like(x, dtype=torch.float32)
            for e, expert in enumerate(self.experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, expert(x[tok]).float() * weights[tok, slot, None])
            return out.to(x.dtype).view(hidden_states.shape)

    block = SigmoidRouted(64, 64, 8, 2, ("w1", "w3", "w2"), False).bfloat16()
    with pytest.raises(ValueError, match=r"does not reproduce SigmoidRouted \(relative error"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(block)
    cake_ops_nn.FusedMoE.from_sparse_moe_block(block, check=False)  # the caller's call
    with pytest.raises(ValueError, match="replace_sparse_moe_blocks: Linear has no sparse MoE block"):
        cake_ops_nn.replace_sparse_moe_blocks(torch.nn.Linear(4, 4))
    biased = SparseMoeBlock(64, 64, 4, 2, ("w1", "w3", "w2"), True)
    biased.experts[1].w2 = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="expert projections with a bias are not supported"):
        cake_ops_nn.FusedMoE.from_sparse_moe_block(biased.bfloat16())
