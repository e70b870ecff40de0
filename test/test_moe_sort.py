"""cake::moe_sort (routing permutation) and the SM90 weight interleave."""
import expecttest
import pytest
import torch

import cake_ops  # noqa: F401
from cake_ops.fused_moe import interleave_up_gate_sm90


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


CASES = {
    "balanced": (64, 8, 32, 32, 0),
    "hot_expert": (50, 2, 8, 8, 0),
    "ep_shard": (40, 8, 64, 16, 16),
    "top1": (33, 1, 16, 16, 0),
    "one_token": (1, 8, 128, 128, 0),
    "no_tokens": (0, 8, 16, 16, 0),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tile", [64, 128])
def test_moe_sort_matches_contract(name, tile):
    t, k, e, e_local, offset = CASES[name]
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    if name == "hot_expert":
        ids[:, 0] = 3
    if t > 2:
        ids[1, 0] = -1  # dropped routes (padding ids, ids past num_experts) contribute nothing
        ids[2, k - 1] = e + 5
    out = torch.ops.cake.moe_sort(ids, e, e_local, offset, tile)
    for got, want in zip(out, sort_reference(ids, e, e_local, offset, tile)):
        assert torch.equal(got, want)


def test_moe_sort_opcheck():
    ids = torch.randint(0, 16, (20, 4), dtype=torch.int32)
    torch.library.opcheck(torch.ops.cake.moe_sort, (ids, 16, 8, 8, 64))


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
