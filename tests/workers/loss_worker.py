"""Worker: af.losses.cross_entropy on logits split over the vocabulary (loss parallel) == one process.

    accelfn launch --nproc-per-node 2 --cpu tests/workers/loss_worker.py

Every rank builds the same whole logits, computes torch's cross entropy on them (the one-process reference),
then splits them over the vocabulary (a DTensor `Shard(-1)`, 97 classes: uneven shards) and computes the loss
inside torch's `loss_parallel`, as `af.shard(..., loss_parallel=True)` runs it. Checks value and gradient, and
the memory: this rank's gradient shard plus one fp32 chunk of the shard (torch's path: about four fp32 copies).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the live-bytes counter
from _live_bytes import LiveBytes  # noqa: E402

import accelfn as af  # noqa: E402

B, T, V, CHUNK = 3, 17, 97, 8


def shifted(logits, labels, shift):
    """Next-token prediction's slices (`logits[:, :-1]`, `labels[:, 1:]`), or the tensors as they are."""
    return (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)


def reference(logits, labels, shift):
    leaf = logits.detach().requires_grad_()
    x, y = shifted(leaf, labels, shift)
    total = F.cross_entropy(x.float().reshape(-1, V), y.reshape(-1), reduction="sum")
    total.backward()
    return total.detach(), leaf.grad


def sharded(logits, mesh, labels, shift, **kw):
    """The loss on the vocabulary shards: its value, the whole gradient, this rank's peak new bytes."""
    x = distribute_tensor(logits.detach(), mesh, [Shard(-1)]).requires_grad_()
    with LiveBytes() as live, loss_parallel():
        loss = af.losses.cross_entropy(*shifted(x, labels, shift), **kw)
        loss.total.backward()
    total = loss.total.full_tensor() if hasattr(loss.total, "full_tensor") else loss.total
    return total.detach(), x.grad.full_tensor(), x.grad.to_local(), live.peak


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        logits = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
        labels = torch.randint(0, V, (B, T), generator=g)
        labels[0, 5:] = -100
        labels[2, :3] = -100
        for shift in (True, False):
            ref_total, ref_grad = reference(logits, labels, shift)
            total, grad, local_grad, peak = sharded(logits, mesh, labels, shift, chunk_rows=CHUNK)
            assert type(total) is torch.Tensor, type(total)  # a plain replicated value, not a DTensor
            torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
            rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
            assert grad.dtype == dtype
            torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-6)
            shard = local_grad.numel()  # this rank's vocabulary shard of the (B, T, V) logits
            grads = (2 if shift else 1) * shard * local_grad.element_size()  # a slice's backward: one more
            bound = grads + CHUNK * local_grad.shape[-1] * 4 + 64 * B * T
            assert peak <= bound, (dtype, shift, peak, bound)
            torch_total, _, _, torch_peak = sharded(logits, mesh, labels, shift, impl="plain")
            torch.testing.assert_close(torch_total, ref_total, rtol=1e-6, atol=1e-5)
            assert torch_peak >= 3 * shard * 4, (dtype, torch_peak)  # what torch's loss_parallel holds
            print(
                f"rank {rank} {dtype} {'logits[:, :-1]' if shift else 'logits'}: peak {peak / (shard * 4):.2f} "
                f"fp32 shards (torch's loss_parallel {torch_peak / (shard * 4):.2f})",
                flush=True,
            )
    # the gradient written over the logits' shard: no gradient buffer, one fp32 chunk
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(2)
        logits, labels = (
            (3 * torch.randn(B, T, V, generator=g)).to(dtype),
            torch.randint(0, V, (B, T), generator=g),
        )
        ref_total, ref_grad = reference(logits, labels, False)
        total, grad, local_grad, peak = sharded(
            logits, mesh, labels, False, chunk_rows=CHUNK, inplace_backward=True
        )
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
        rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-6)
        assert peak <= CHUNK * local_grad.shape[-1] * 4 + 64 * B * T, (dtype, "inplace", peak)
    # next-token slices in 3-D chunks of two whole sequences (16 rows each, 40 rows a chunk): the same loss
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    ref_total, ref_grad = reference(logits, labels, True)
    total, grad, _, _ = sharded(logits, mesh, labels, True, chunk_rows=2 * (T - 1) + 8)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # labels as a replicated DTensor (torch's loss_parallel accepts them so)
    g = torch.Generator().manual_seed(1)  # the same on every rank
    logits, labels = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    ref_total, ref_grad = reference(logits, labels, False)
    total, grad, _, _ = sharded(logits, mesh, distribute_tensor(labels, mesh, [Replicate()]), False)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # all rows ignored: zero, with a zero gradient
    labels = torch.full((B, T), -100)
    total, grad, _, _ = sharded(torch.randn(B, T, V), mesh, labels, True, chunk_rows=CHUNK)
    assert float(total) == 0.0 and not grad.any()
    print(f"OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
