"""`find_executable_batch_size`: retries at smaller sizes on an out-of-memory error, with an injected OOM."""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from _launch import output_of, run_workers

import accelfn as af
from accelfn.batch_size import find_executable_batch_size, is_out_of_memory


def oom_above(limit: int, tried: list[int]):
    def train(batch_size: int, *args, **kwargs):
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} GiB")
        return batch_size, args, kwargs

    return train


def test_halves_until_the_function_fits_and_returns_its_result():
    tried: list[int] = []
    run = find_executable_batch_size(oom_above(20, tried), starting_batch_size=128)
    assert run("a", k=1) == (16, ("a",), {"k": 1})
    assert tried == [128, 64, 32, 16]


def test_bare_decorator_starts_at_128():
    tried: list[int] = []

    @find_executable_batch_size
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 100:
            raise torch.OutOfMemoryError("out of memory")
        return batch_size

    assert train() == 64 and tried == [128, 64]


def test_each_call_starts_again_at_the_starting_size():
    tried: list[int] = []
    run = find_executable_batch_size(oom_above(8, tried), starting_batch_size=32)
    assert run()[0] == 8 and run()[0] == 8
    assert tried == [32, 16, 8, 32, 16, 8]


def test_a_real_cpu_allocator_failure_is_retried():
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        tried.append(batch_size)
        nbytes = (1 << 50) if batch_size > 4 else 1024  # a petabyte: DefaultCPUAllocator refuses at once
        return torch.empty(nbytes, dtype=torch.uint8).numel()

    assert train() == 1024 and tried == [16, 8, 4]


def test_factor_other_than_a_half_and_a_floor_at_min_batch_size():
    tried: list[int] = []
    run = find_executable_batch_size(
        oom_above(5, tried), starting_batch_size=10, factor=0.9, min_batch_size=7
    )
    with pytest.raises(RuntimeError):
        run()
    assert tried == [10, 9, 8, 7]  # int(10 * 0.9) = 9, then at least one less each time, never below 7


def test_min_batch_size_failing_names_every_size_tried_and_chains_the_oom():
    run = find_executable_batch_size(oom_above(0, []), starting_batch_size=32, min_batch_size=4)
    with pytest.raises(RuntimeError, match=re.escape("(32, 16, 8, 4; min_batch_size=4)")) as info:
        run()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_other_exceptions_pass_through_at_once():
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        raise ValueError("bad label")

    with pytest.raises(ValueError, match="bad label"):
        train()
    assert tried == [64]


def test_the_failed_attempts_tensors_are_freed_and_the_cache_emptied_between_attempts(monkeypatch):
    emptied: list[int] = []
    monkeypatch.setattr(type(af.platforms.get("cpu")), "empty_cache", lambda self: emptied.append(1))
    refs: list[weakref.ref] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size):
        activations = torch.ones(1000)
        refs.append(weakref.ref(activations))
        if batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [r() is None for r in refs[:-1]]

    assert train() == [True, True]
    assert len(emptied) == 2


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("cuda", "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.11 GiB total capacity)"),
        ("cuda", "HIP out of memory. Tried to allocate 2.00 GiB"),
        (
            "cuda",
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        ),
        ("xpu", "XPU out of memory. Tried to allocate 1.00 GiB"),
        ("xpu", "level_zero backend failed with error: 40 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)"),
        ("npu", "NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity)"),
        ("mlu", "MLU out of memory. Tried to allocate 512.00 MiB"),
        ("xla", "RESOURCE_EXHAUSTED: Attempting to reserve 12.00G at the bottom of memory."),
        (
            "cpu",
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes",
        ),
    ],
)
def test_each_platform_recognises_its_out_of_memory_messages(kind, message):
    platform = af.platforms.get(kind)
    assert platform.is_out_of_memory(RuntimeError(message))
    assert platform.is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert not platform.is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))
    assert not platform.is_out_of_memory(ValueError(message))


def test_cpu_also_recognises_python_memory_error():
    assert af.platforms.get("cpu").is_out_of_memory(MemoryError())
    assert not af.platforms.get("cuda").is_out_of_memory(MemoryError())
    assert is_out_of_memory(MemoryError(), af.platforms.get("cuda"))  # host memory counts on any device


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"factor": 1.0}, "factor"),
        ({"factor": 0}, "factor"),
        ({"min_batch_size": 0}, "min_batch_size"),
        ({"starting_batch_size": 4, "min_batch_size": 8}, "below min_batch_size"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_executable_batch_size(lambda b: b, **kwargs)


@pytest.mark.slow
def test_two_ranks_agree_on_the_size_the_smaller_one_fits():
    proc = run_workers("batch_size_worker.py", 2, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, output_of(proc)
    for rank in (0, 1):
        # rank 0 fits 64 but retries with rank 1 until 16; the all-reduce inside the function pairs up
        assert f"AGREE rank={rank} tried=[128, 64, 32, 16] all_reduced=32" in out, output_of(proc)
        assert f"EXHAUSTED rank={rank} tried=[8, 4, 2]" in out, output_of(proc)
        assert "(8, 4, 2; min_batch_size=2)" in out
    assert "FAILED rank=0 ValueError: bad data" in out, output_of(proc)
    assert "FAILED rank=1 RuntimeError: find_executable_batch_size('broken'): another rank raised" in out
