"""af.losses.cross_entropy's chunked path: equal to torch's plain cross entropy, and no more memory than the
logits' gradient plus one fp32 chunk (the plain path holds three fp32 copies of the logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _launch import output_of, run_workers
from _live_bytes import LiveBytes

import accelfn as af
from accelfn.losses import chunked

V = 97  # classes: not a multiple of anything the chunks use


def _reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100):
    """torch's cross entropy on the fp32 logits, summed; its value and the gradient of the logits."""
    leaf = logits.detach().requires_grad_()
    total = F.cross_entropy(
        leaf.float().reshape(-1, leaf.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    total.backward()
    return total.detach(), leaf.grad


def _ours(logits: torch.Tensor, labels: torch.Tensor, **kw):
    leaf = logits.detach().requires_grad_()
    loss = af.losses.cross_entropy(leaf, labels, **kw)
    loss.total.backward()
    return af.Loss(loss.total.detach(), loss.count), leaf.grad


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to fp32 round-off; a bf16 gradient may differ by the last bit of its rounding."""
    rtol = 2**-7 if ours.dtype == torch.bfloat16 else 1e-5
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours.float(), ref.float(), rtol=rtol, atol=1e-6)


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    labels.view(-1)[::3] = -100
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37,), (3, 13)])
def test_chunked_equals_torch_cross_entropy_in_value_and_gradient(dtype, shape):
    logits, labels = _data(shape, dtype)
    ref_total, ref_grad = _reference(logits, labels)
    (total, count), grad = _ours(logits, labels, chunk_rows=5)
    assert total.dtype == torch.float32 and int(count) == int((labels != -100).sum())
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    _close(grad, ref_grad)


def test_a_slice_of_the_logits_is_read_without_a_copy_and_its_gradient_is_right():
    logits, labels = _data((3, 14), torch.bfloat16)
    ref_total, ref_grad = _reference(logits[:, :-1], labels[:, 1:])
    leaf = logits.detach().requires_grad_()
    loss = af.losses.cross_entropy(leaf[:, :-1], labels[:, 1:], chunk_rows=4)  # rows cross the slice's blocks
    loss.total.backward()
    torch.testing.assert_close(loss.total, ref_total, rtol=1e-6, atol=1e-5)
    _close(leaf.grad[:, :-1], ref_grad)
    assert not leaf.grad[:, -1].any()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slice_is_chunked_several_sequences_at_a_time_and_equals_the_plain_loss(dtype, inplace):
    """`logits[:, :-1]` (rows that do not flatten into one view) in 3-D chunks of two whole sequences (9 rows
    hold two of 4), the last chunk one: value and gradient equal torch's cross entropy; 4 chunks, not 7."""
    logits, labels = _data((7, 5), dtype)
    ref_total, ref_grad = _reference(logits[:, :-1], labels[:, 1:])
    chunks = list(chunked.row_chunks(logits[:, :-1], 9))
    assert [(start, tuple(x.shape)) for start, x in chunks] == [
        (0, (2, 4, V)), (8, (2, 4, V)), (16, (2, 4, V)), (24, (1, 4, V))
    ]  # fmt: skip
    assert all(x.data_ptr() == logits[2 * i].data_ptr() for i, (_, x) in enumerate(chunks))  # views, no copy
    base = logits.detach().requires_grad_()
    produced = base * 1  # not a leaf: the in-place backward may write over it
    loss = af.losses.cross_entropy(
        produced[:, :-1], labels[:, 1:], chunk_rows=9, impl="chunked", inplace_backward=inplace
    )
    loss.total.backward()
    torch.testing.assert_close(loss.total.detach(), ref_total, rtol=1e-6, atol=1e-5)
    _close(base.grad[:, :-1], ref_grad)
    assert not base.grad[:, -1].any()


def test_one_row_of_logits_with_a_scalar_label():
    logits, _ = _data((), torch.float32)
    label = torch.tensor(5)
    ref_total, ref_grad = _reference(logits, label)
    (total, count), grad = _ours(logits, label)
    torch.testing.assert_close(total, ref_total)
    _close(grad, ref_grad)
    assert int(count) == 1


def test_every_row_ignored_gives_zero_loss_and_zero_gradient():
    logits, labels = _data((4, 5), torch.bfloat16)
    labels[:] = -100
    (total, count), grad = _ours(logits, labels, chunk_rows=3)
    assert float(total) == 0.0 and int(count) == 0
    assert grad is not None and not grad.any()


def test_another_ignore_index_and_a_scaled_gradient():
    logits, labels = _data((20,), torch.float32)
    labels[labels == -100] = 7  # a real class now; 3 is the ignored one
    labels[::4] = 3
    leaf = logits.detach().requires_grad_()
    (2.5 * af.losses.cross_entropy(leaf, labels, ignore_index=3, chunk_rows=6).total).backward()
    ref = logits.detach().requires_grad_()
    (2.5 * F.cross_entropy(ref, labels, ignore_index=3, reduction="sum")).backward()
    _close(leaf.grad, ref.grad)


@pytest.mark.parametrize("chunk_rows", [1, 7, 40, 1000])
def test_the_chunk_size_does_not_change_the_result(chunk_rows):
    logits, labels = _data((40,), torch.float32)
    ref_total, ref_grad = _reference(logits, labels)
    (total, _), grad = _ours(logits, labels, chunk_rows=chunk_rows)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    _close(grad, ref_grad)


def test_the_plain_path_is_torch_cross_entropy_and_differentiates_twice():
    logits, labels = _data((6,), torch.float32)
    leaf = logits.detach().requires_grad_()
    total = af.losses.cross_entropy(leaf, labels, impl="plain").total
    (grad,) = torch.autograd.grad(total, leaf, create_graph=True)
    assert grad.requires_grad
    torch.testing.assert_close(total, _reference(logits, labels)[0])


def test_the_chunked_path_refuses_a_second_derivative_by_name():
    leaf = _data((6,), torch.float32)[0].requires_grad_()
    total = af.losses.cross_entropy(leaf, torch.arange(6)).total
    with pytest.raises(RuntimeError, match="no second derivative.*impl='plain'"):
        torch.autograd.grad(total, leaf, create_graph=True)


def test_bad_arguments_name_themselves():
    logits, labels = _data((4,), torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        af.losses.cross_entropy(logits, labels, impl="fused")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_rows must be a positive number of rows, got 0"):
        af.losses.cross_entropy(logits, labels, chunk_rows=0)
    with pytest.raises(ValueError, match="does not match labels shape"):
        af.losses.cross_entropy(logits, labels[:3])


def test_under_torch_func_auto_takes_the_plain_path_and_chunked_is_refused():
    logits, labels = _data((4,), torch.float32)

    def mean_loss(x, impl="auto"):
        return af.losses.cross_entropy(x, labels, impl=impl).mean()

    grad = torch.func.grad(mean_loss)(logits)
    _close(grad, _reference(logits, labels)[1] / int((labels != -100).sum()))
    with pytest.raises(ValueError, match="torch.func transforms"):
        torch.func.grad(mean_loss)(logits, "chunked")


def test_compiled_equals_eager():
    logits, labels = _data((2, 9), torch.float32)
    ref_total, ref_grad = _reference(logits, labels)
    compiled = torch.compile(
        lambda x, y: af.losses.cross_entropy(x, y, chunk_rows=4).total, backend="aot_eager", fullgraph=True
    )
    leaf = logits.detach().requires_grad_()
    total = compiled(leaf, labels)
    total.backward()
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-5)
    _close(leaf.grad, ref_grad)


def test_fake_tensors_go_through_the_chunked_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        leaf = torch.randn(4, 6, V, dtype=torch.bfloat16, requires_grad=True)
        with LiveBytes(fake=True) as live:
            af.losses.cross_entropy(leaf, torch.randint(0, V, (4, 6)), chunk_rows=6).total.backward()
    assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.shape == leaf.shape
    assert live.peak < leaf.numel() * 2 + 6 * V * 4 + 4096


# ---- memory ---------------------------------------------------------------------------------------------------


def _peak(logits: torch.Tensor, labels: torch.Tensor, **kw) -> int:
    """Bytes allocated by the loss's forward and backward that are alive at once, at most (the logits are not)."""
    leaf = logits.detach().requires_grad_()
    with LiveBytes() as live:
        af.losses.cross_entropy(leaf, labels, **kw).total.backward()
    return live.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_memory_is_the_gradient_plus_one_fp32_chunk(dtype):
    rows, chunk = 256, 32
    logits, labels = _data((rows,), dtype)
    bound = logits.numel() * logits.element_size() + chunk * V * 4 + 64 * rows  # + a few per-row vectors
    assert _peak(logits, labels, chunk_rows=chunk) <= bound
    assert _peak(logits, labels, impl="plain") >= 3 * logits.numel() * 4  # the plain path: 3 fp32 copies


def test_auto_is_chunked_with_chunks_of_chunk_elements(monkeypatch):
    rows, chunk = 256, 16
    logits, labels = _data((rows,), torch.bfloat16)
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", chunk * V)
    assert chunked.default_chunk_rows(V) == chunk
    assert _peak(logits, labels) <= logits.numel() * 2 + chunk * V * 4 + 64 * rows


@pytest.mark.slow
def test_loss_parallel_on_two_processes_equals_one_process_in_a_shard_and_a_chunk():
    """Logits split over the vocabulary (97 classes: uneven shards) under torch's loss_parallel, on 2 processes
    over gloo: value and gradient equal torch's cross entropy on the whole logits, and each rank holds its
    gradient shard and one fp32 chunk (see tests/workers/loss_worker.py)."""
    proc = run_workers("loss_worker.py", 2, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("OK rank") == 2, output_of(proc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_same_gradient_over_the_logits_and_needs_no_buffer(dtype):
    rows, chunk = 256, 32
    logits, labels = _data((2, rows // 2 + 1), dtype)
    ref_total, ref_grad = _reference(logits[:, :-1], labels[:, 1:])
    base = logits.detach().requires_grad_()
    produced = base * 1  # the logits as a layer's output (not a leaf): the loss writes over them
    with LiveBytes() as live:
        loss = af.losses.cross_entropy(
            produced[:, :-1], labels[:, 1:], chunk_rows=chunk, inplace_backward=True
        )
        loss.total.backward()
    torch.testing.assert_close(loss.total.detach(), ref_total, rtol=1e-6, atol=1e-5)
    _close(base.grad[:, :-1], ref_grad)
    _close(produced.detach()[:, :-1], ref_grad)  # the logits now hold their gradient
    # what remains: the slice's backward (a logits-sized gradient) and the mul's; no loss gradient buffer
    assert live.peak <= 2 * logits.numel() * logits.element_size() + chunk * V * 4 + 64 * rows


def test_inplace_backward_under_another_use_of_the_logits_fails_loudly():
    logits, labels = _data((8,), torch.float32)
    leaf = logits.detach().requires_grad_()
    produced = leaf * 1
    other = (produced**2).sum()  # saves the logits; made first, so its backward runs after the loss's
    total = other + af.losses.cross_entropy(produced, labels, inplace_backward=True).total
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


def test_inplace_backward_needs_the_chunked_path():
    logits, labels = _data((4,), torch.float32)
    with pytest.raises(ValueError, match=r"inplace_backward=True\) needs the chunked loss.*impl='plain'"):
        af.losses.cross_entropy(logits, labels, impl="plain", inplace_backward=True)


# ---- linear_cross_entropy -------------------------------------------------------------------------------------


def _linear_data(shape: tuple[int, ...], dtype: torch.dtype, features: int = 16, classes: int = V):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(*shape, features, generator=g).to(dtype)
    weight = (torch.randn(classes, features, generator=g) / features**0.5).to(dtype)
    labels = torch.randint(0, classes, shape, generator=g)
    labels.view(-1)[::4] = -100
    return hidden, weight, labels


def _linear_grads(fn, hidden, weight):
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    total = fn(h, w)
    total.backward()
    return total.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_equals_the_output_layer_then_torch_cross_entropy(dtype):
    hidden, weight, labels = _linear_data((3, 11), dtype)

    def ours(h, w):
        return af.losses.linear_cross_entropy(h[:, :-1], w, labels[:, 1:], chunk_rows=4).total

    def plain(h, w):
        logits = F.linear(h[:, :-1], w).float()
        return F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum")

    (total, gh, gw), (ref, ref_gh, ref_gw) = (
        _linear_grads(ours, hidden, weight),
        _linear_grads(plain, hidden, weight),
    )
    torch.testing.assert_close(total, ref, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)
    assert gh.dtype == gw.dtype == dtype
    _close(gh, ref_gh)
    if dtype == torch.float32:
        torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-6)
    else:  # a sum over chunks of bf16 products, each rounded: equal to bf16 round-off, as a whole
        assert (gw.float() - ref_gw.float()).norm() <= 2**-8 * ref_gw.float().norm()


def test_linear_cross_entropy_under_autocast_equals_the_plain_path_under_autocast():
    hidden, weight, labels = _linear_data((24,), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, gh, gw = _linear_grads(
            lambda h, w: af.losses.linear_cross_entropy(h, w, labels, chunk_rows=5).total, hidden, weight
        )
        ref, ref_gh, ref_gw = _linear_grads(
            lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum"), hidden, weight
        )
    assert gh.dtype == gw.dtype == torch.float32  # through autocast's casts, to the fp32 inputs
    torch.testing.assert_close(total, ref, rtol=2**-7, atol=1e-4)
    for ours, ref_grad in ((gh, ref_gh), (gw, ref_gw)):  # bf16 matmuls, rounded per chunk: bf16 round-off
        assert (ours - ref_grad).norm() <= 2**-8 * ref_grad.norm()


def test_linear_cross_entropy_never_holds_the_logits():
    rows, features, chunk, classes = 1024, 8, 64, 1000
    hidden, weight, labels = _linear_data((rows,), torch.float32, features, classes)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with LiveBytes() as live:
        af.losses.linear_cross_entropy(h, w, labels, chunk_rows=chunk).total.backward()
    grads = h.numel() * 4 + 2 * w.numel() * 4  # the hidden's gradient, the weight's and its fp32 sum
    assert live.peak <= grads + chunk * classes * (4 + 4 + 4) + 64 * rows  # a chunk's logits, fp32, gradient
    assert live.peak < rows * classes * 4 / 4  # a quarter of one fp32 copy of the logits


def test_linear_cross_entropy_compiles():
    hidden, weight, labels = _linear_data((20,), torch.float32)
    eager = _linear_grads(
        lambda h, w: af.losses.linear_cross_entropy(h, w, labels, chunk_rows=6).total, hidden, weight
    )
    compiled = torch.compile(
        lambda h, w: af.losses.linear_cross_entropy(h, w, labels, chunk_rows=6).total,
        backend="aot_eager",
        fullgraph=True,
    )
    for ours, ref in zip(_linear_grads(compiled, hidden, weight), eager, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_linear_cross_entropy_names_bad_shapes_and_dtypes():
    hidden, weight, labels = _linear_data((4,), torch.float32)
    with pytest.raises(ValueError, match=r"weight shape \(16, 97\) must be \(classes, 16\)"):
        af.losses.linear_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="does not match labels shape"):
        af.losses.linear_cross_entropy(hidden, weight, labels[:2])
    with pytest.raises(ValueError, match="hidden is torch.float32 but weight is torch.bfloat16"):
        af.losses.linear_cross_entropy(hidden, weight.bfloat16(), labels)
    with pytest.raises(ValueError, match="chunk_rows must be a positive"):
        af.losses.linear_cross_entropy(hidden, weight, labels, chunk_rows=-1)
