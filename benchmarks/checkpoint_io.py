"""Checkpoint save/load throughput: accelfn vs torch.save/torch.load vs accelerate's save_state/load_state,
against raw sequential file I/O, on a ~1 GiB float32 state (params + AdamW moments).

    python benchmarks/checkpoint_io.py [--gib 1.0 --dir /tmp/ckpt-bench --rounds 2]

Saves include fsync of every file (accelerate does not fsync: its files are fsynced after, in the timing).
Loads touch every byte: cold = after `posix_fadvise(DONTNEED)` on the files, warm = right after.
Also reports the time training is blocked by `async_save=True` vs a synchronous save, and the peak RSS
growth during a synchronous save. Prints a markdown table (best of `--rounds`).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import accelfn as af


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]


def drop_cache(path: Path) -> None:
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_all(path: Path) -> None:
    for f in files_under(path):
        af.checkpoint.io.fsync_path(f)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in files_under(path))


def touch(tree: object) -> float:
    return float(
        sum(
            float(x.detach().reshape(-1)[::1024].sum())
            for x in af.tree.leaves(tree)
            if isinstance(x, torch.Tensor)
        )
    )


class Model(nn.Module):
    def __init__(self, n: int, parts: int = 8) -> None:
        super().__init__()
        self.layers = nn.ParameterList(
            [nn.Parameter(torch.randn(n // parts // 1024, 1024)) for _ in range(parts)]
        )


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_during(fn: Callable[[], object]) -> tuple[float, int]:
    base, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    return dt, max(0, peak[0] - base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="total state size (params are a third)")
    ap.add_argument("--dir", default="/tmp/ckpt-bench")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(1)

    n = int(args.gib * 2**30 / 4 / 3)
    torch.manual_seed(0)
    model = Model(n)
    step = af.train_step(lambda m, b: sum((p * b).sum() for p in m.parameters()), af.optim.adamw(1e-3))
    state = step.init(model)
    state, _ = step(state, torch.ones(()))
    nbytes = sum(x.numel() * x.element_size() for x in af.tree.leaves(state) if isinstance(x, torch.Tensor))

    import accelerate

    acc = accelerate.Accelerator(cpu=True)
    ref_model = Model(n)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    torch.stack([p.sum() for p in ref_model.parameters()]).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ref_model, opt = acc.prepare(ref_model, opt)
    # torch.load(weights_only=True) refuses accelfn's NamedTuples, so torch gets the flat {path: tensor} dict
    torch_obj = {p: x for p, x in af.tree.flatten_with_path(state) if isinstance(x, torch.Tensor)}

    def raw_write(path: Path) -> None:
        block = memoryview(os.urandom(64 << 20))
        with open(path, "wb") as f:
            for i in range(0, nbytes, len(block)):
                f.write(block[: min(len(block), nbytes - i)])
            f.flush()
            os.fdatasync(f.fileno())

    def raw_read(path: Path) -> None:
        buf = bytearray(64 << 20)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def torch_save(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(torch_obj, f)
            f.flush()
            os.fsync(f.fileno())

    def acc_save(path: Path) -> None:
        acc.save_state(str(path))
        fsync_all(path)

    runners: dict[str, tuple[Callable[[Path], object], Callable[[Path], object]]] = {
        "raw file (dd-like, fdatasync)": (raw_write, raw_read),
        "accelfn": (
            lambda p: af.checkpoint.save(p, state),
            lambda p: touch(af.checkpoint.load(p, like=state)),
        ),
        "torch.save / torch.load": (torch_save, lambda p: touch(torch.load(p, weights_only=True))),
        "accelerate save_state / load_state": (acc_save, lambda p: acc.load_state(str(p))),
    }
    results: dict[str, dict[str, float]] = {k: {"save": 1e9, "cold": 1e9, "warm": 1e9} for k in runners}
    sizes: dict[str, int] = {}
    for r in range(args.rounds):
        for name, (save, load) in runners.items():
            path = root / f"{name.split()[0].strip('.')}-{r}"
            t0 = time.perf_counter()
            save(path)
            results[name]["save"] = min(results[name]["save"], time.perf_counter() - t0)
            sizes[name] = size_of(path)
            drop_cache(path)
            for kind in ("cold", "warm"):
                t0 = time.perf_counter()
                load(path)
                results[name][kind] = min(results[name][kind], time.perf_counter() - t0)
            shutil.rmtree(path) if path.is_dir() else path.unlink()

    # async vs sync, and the RSS growth of a synchronous save
    sync_s, sync_rss = peak_rss_during(lambda: af.checkpoint.save(root / "sync", state))
    blocked, total_async = [], []
    for i in range(2):  # the first async save allocates the staging buffers; later ones reuse them
        t0 = time.perf_counter()
        handle = af.checkpoint.save(root / f"async-{i}", state, async_save=True)
        blocked.append(time.perf_counter() - t0)
        handle.result()
        total_async.append(time.perf_counter() - t0)

    gb = 1e9
    base = results["raw file (dd-like, fdatasync)"]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}, accelerate {accelerate.__version__}; "
          f"state {nbytes / 2**30:.2f} GiB float32 (params {n * 4 / 2**30:.2f} GiB + AdamW moments); "
          f"best of {args.rounds}\n")  # fmt: skip
    print("| method | size (GB) | save GB/s | save vs raw | cold load GB/s | cold vs raw | warm load GB/s |")
    print("|---|---|---|---|---|---|---|")
    raw_gbs = {k: sizes[next(iter(sizes))] / gb / base[k] for k in ("save", "cold", "warm")}
    for name, t in results.items():
        g = {k: sizes[name] / gb / t[k] for k in ("save", "cold", "warm")}
        print(f"| {name} | {sizes[name] / gb:.2f} | {g['save']:.2f} | {g['save'] / raw_gbs['save']:.2f} "
              f"| {g['cold']:.2f} | {g['cold'] / raw_gbs['cold']:.2f} | {g['warm']:.2f} |")  # fmt: skip
    print(f"\nsynchronous accelfn save: {sync_s:.2f} s, peak RSS growth {sync_rss / 2**20:.0f} MiB; "
          f"async_save=True blocks training {blocked[0] * 1000:.0f} ms on the first save (allocating staging "
          f"buffers), {blocked[1] * 1000:.0f} ms on the next ({sync_s / blocked[1]:.0f}x less than the "
          f"synchronous save); the background writes took {total_async[0]:.2f} s and {total_async[1]:.2f} s")  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
