"""The MoE pipeline ops: cake::moe_sort, cake::moe_gemm1_swiglu, cake::moe_finalize, and the SM90
weight interleave, against the float32 reference MoE."""
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
    counts = [sum(1 for e in local if e == x) for x in range(num_local)]
    offsets = [0]
    tiles = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
        tiles.append(tiles[-1] + -(-c // tile))
    p2e = [r for x in range(num_local) for r, e in enumerate(local) if e == x]
    e2p = [-1] * len(flat)
    for p, r in enumerate(p2e):
        e2p[r] = p
    p2e += [-1] * (len(flat) - len(p2e))
    return [torch.tensor(v, dtype=torch.int32) for v in (counts, offsets, p2e, e2p, tiles)]


@pytest.mark.parametrize("name", list(ROUTING_CASES))
@pytest.mark.parametrize("tile", [64, 128])
def test_moe_sort_matches_contract(name, tile):
    t, k, e, e_local, offset = ROUTING_CASES[name]
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    if name == "hot_expert":
        ids[:, 0] = 3
    if t > 2:
        ids[1, 0] = -1  # dropped routes (padding ids, ids past num_experts) contribute nothing
        ids[2, k - 1] = e + 5
    out = torch.ops.cake.moe_sort(ids, e, e_local, offset, tile)
    for got, want in zip(out, sort_reference(ids, e, e_local, offset, tile)):
        assert torch.equal(got, want)


def run_pipeline(x, ids, scales, w1_interleaved, w2, num_experts, num_local, offset):
    """sort -> GEMM1 + SwiGLU -> GEMM2 (the grouped GEMM) -> deterministic finalize."""
    top_k = ids.shape[1]
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, num_experts, num_local, offset, 128)
    inter = torch.ops.cake.moe_gemm1_swiglu(x, w1_interleaved, p2e, offsets, top_k)
    rows = torch.ops.cake.grouped_gemm_fwd(inter, w2, offsets)
    return torch.ops.cake.moe_finalize(rows, e2p, scales)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU"))])
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
    # Bitwise reproducible: fixed-order fp32 combine, no atomics.
    again = run_pipeline(x, ids, scales, interleave_up_gate_sm90(w1), w2, e, e_local, offset)
    assert torch.equal(out, again)


def test_moe_ops_opcheck():
    ids = torch.randint(0, 16, (20, 4), dtype=torch.int32)
    torch.library.opcheck(torch.ops.cake.moe_sort, (ids, 16, 8, 8, 64))
    x, ids, scales, w1, w2 = moe_problem(12, 4, 16, 16, 64, 32, "cpu")
    _, offsets, p2e, e2p, _ = torch.ops.cake.moe_sort(ids, 16, 16, 0, 64)
    torch.library.opcheck(torch.ops.cake.moe_gemm1_swiglu, (x, interleave_up_gate_sm90(w1), p2e, offsets, 4))
    rows = torch.randn(48, 64).bfloat16()
    torch.library.opcheck(torch.ops.cake.moe_finalize, (rows, e2p, scales))


class TestMoeSortErrors(expecttest.TestCase):
    def error(self, *args):
        with self.assertRaises(RuntimeError) as ctx:
            torch.ops.cake.moe_sort(*args)
        return str(ctx.exception).split("\n")[0]

    def test_errors(self):
        ids = torch.zeros(4, 2, dtype=torch.int32)
        self.assertExpectedInline(self.error(ids.long(), 8, 8, 0, 64), """cake::moe_sort: token_selected_experts must be int32, got Long""")
        self.assertExpectedInline(self.error(ids[0], 8, 8, 0, 64), """cake::moe_sort: token_selected_experts must be a 2-D [num_tokens, top_k] tensor, got shape [2]""")
        self.assertExpectedInline(self.error(ids, 8, 4, 6, 64), """cake::moe_sort: the shard [local_expert_offset, local_expert_offset + num_local_experts) = [6, 10) must lie within [0, num_experts=8)""")
        self.assertExpectedInline(self.error(ids, 8, 9, 0, 64), """cake::moe_sort: num_local_experts must be in [1, num_experts=8], got 9""")
        self.assertExpectedInline(self.error(ids, 8, 8, 0, 0), """cake::moe_sort: tile_size must be positive, got 0""")


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
