"""``freescale.table_init``: a table's initial values do not depend on how it is cut into shards."""

from __future__ import annotations

import pytest
import torch

from freescale.table_init import BLOCK_ROWS, init_tables


class _Meta:
    def __init__(self, offsets: list[int]) -> None:
        self.shard_offsets = offsets


class _Shard:
    def __init__(self, tensor: torch.Tensor, offsets: list[int]) -> None:
        self.tensor, self.metadata = tensor, _Meta(offsets)


class _Sharded:
    """The two things ``init_tables`` reads of a torchrec ShardedTensor: its global size and its local shards."""

    def __init__(self, rows: int, width: int, shards: list[_Shard]) -> None:
        self._size, self._shards = torch.Size([rows, width]), shards

    def size(self, dim: int) -> int:
        return self._size[dim]

    def local_shards(self) -> list[_Shard]:
        return self._shards


@pytest.mark.parametrize("cut", ["rows", "columns", "both"])
def test_a_table_cut_any_way_holds_the_values_of_the_whole_table(cut: str) -> None:
    rows, width = 2 * BLOCK_ROWS + 123, 8
    whole = torch.zeros(rows, width)
    not_a_table = torch.zeros(2, 2)  # a dense layer that happens to share the table's name
    init_tables({"ebc.embedding_bags.item_table.weight": whole, "mlp.item_table.weight": not_a_table},
                {"item_table": (-0.1, 0.1)}, seed=7)
    assert not not_a_table.any()
    assert whole.abs().max() <= 0.1 and whole.std() > 0.05
    row_cuts = [0, 1000, BLOCK_ROWS + 5, rows] if cut != "columns" else [0, rows]
    col_cuts = [0, 3, width] if cut != "rows" else [0, width]
    shards = [_Shard(torch.zeros(r1 - r0, c1 - c0), [r0, c0])
              for r0, r1 in zip(row_cuts, row_cuts[1:]) for c0, c1 in zip(col_cuts, col_cuts[1:])]
    init_tables({"sharded.embedding_bags.item_table.weight": _Sharded(rows, width, shards)},
                {"item_table": (-0.1, 0.1)}, seed=7)
    for shard in shards:
        r0, c0 = shard.metadata.shard_offsets
        assert torch.equal(shard.tensor, whole[r0:r0 + shard.tensor.size(0), c0:c0 + shard.tensor.size(1)])
    other = torch.zeros(rows, width)
    init_tables({"x.embedding_bags.item_table.weight": other}, {"item_table": (-0.1, 0.1)}, seed=8)
    assert not torch.equal(other, whole), "the seed should change the values"
