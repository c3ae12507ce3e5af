"""The dry run's lazy FSDP2 chunks (`accelfn.dryrun.world._LazyChunks`): the chunks FSDP reads, equal to
`torch.chunk`'s, without making one view per rank of the shard group (1,024 fake views per parameter)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param
from torch.utils._python_dispatch import TorchDispatchMode

from accelfn.dryrun.world import _LazyChunks, fake_world


@pytest.mark.parametrize(
    ("shape", "chunks", "dim"),
    [((5, 3), 4, 0), ((4, 6), 16, 0), ((4, 32), 16, 1), ((1024, 7), 1024, 0), ((3,), 8, 0), ((2, 3), 1, 0)],
)
def test_lazy_chunks_are_torch_chunks_views_padded_with_empties(
    shape: tuple[int, ...], chunks: int, dim: int
) -> None:
    t = torch.randn(*shape)
    ref = _fsdp_common._chunk_with_empty(t, chunks, dim)  # torch.chunk, then empties up to `chunks`
    lazy = _LazyChunks(t, chunks, dim)
    assert len(lazy) == len(ref) == chunks
    for i in [*range(chunks), -1]:
        a, b = lazy[i], ref[i]
        assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset()), i
        assert torch.equal(a, b), i
        assert b.numel() == 0 or a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view
    with pytest.raises(IndexError, match="chunk 4 of 4"):
        _LazyChunks(t, 4, 0)[4]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_fully_shard_at_4096_ranks_makes_a_few_ops_per_parameter_not_one_per_rank() -> None:
    """In the fake world of 4,096 ranks, FSDP2 shards a Linear with a handful of ops (it made 4,096 views and
    4,000 empties of each parameter before); outside it, FSDP2's own `_chunk_with_empty` is back."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    with fake_world(4096, 5, 8, None):
        layer = torch.nn.Linear(64, 100)
        with unset_fake_temporarily():  # a mesh's rank map is a real tensor (as `af.Mesh` builds it)
            ranks = torch.arange(4096)
        mesh = DeviceMesh("cpu", ranks)
        ops = _Ops()
        with ops:
            fully_shard(layer, mesh=mesh)
        shard = layer.weight.to_local()
    assert ops.count < 200, ops.count
    assert shard.shape == (1, 64)  # rank 5 of 4,096: row 5 of 100 (ranks 100 and above hold none)
    assert _fsdp_param._chunk_with_empty is _fsdp_common._chunk_with_empty
