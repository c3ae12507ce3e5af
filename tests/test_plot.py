"""`accelfn plot`: runs' metrics.jsonl drawn as one PNG; bad folders and a missing matplotlib are clear errors."""

from __future__ import annotations

import json
import math
import struct
import sys
import warnings
from pathlib import Path

import pytest

from accelfn.cli.main import main

pytest.importorskip("matplotlib")


def write_run(
    folder: Path, *, speed: float, loss_floor: float, steps: int = 60, truncate: bool = False
) -> Path:
    """A synthetic run: loss decays to `loss_floor`, warm-up then cosine lr, `speed` tokens/s; memory is logged
    every 10 steps only (other records lack it)."""
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step, "time": 0.5 * step, "loss": loss_floor + 4 * math.exp(-step / 12),
            "lr": 3e-4 * min(1.0, step / 10) * 0.5 * (1 + math.cos(math.pi * step / steps)),
            "tokens_per_s": speed * (1 + 0.02 * math.sin(step)),
        }  # fmt: skip
        if step % 10 == 0:
            record["memory_peak"] = (2 + 0.01 * step) * 2**30
            record["memory_reserved"] = 3 * 2**30
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    if truncate:
        text += '{"step": 61, "loss": 1.2'  # a run killed mid-write
    (folder / "metrics.jsonl").write_text(text)
    return folder


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_two_runs_are_drawn_into_one_png(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", speed=41_000, loss_floor=1.9)
    fp8 = write_run(tmp_path / "fp8", speed=63_000, loss_floor=1.95, truncate=True)
    out = tmp_path / "compare.png"
    assert main(["plot", str(bf16), str(fp8), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height = png_size(out)
    assert (width, height) == (1280, 720)  # 2 x 2 panels of 6.4 x 3.6 inches at 100 dpi
    assert out.stat().st_size > 20_000  # four panels of lines, not an empty canvas


def test_one_run_goes_to_its_folder_by_default(tmp_path):
    run = write_run(tmp_path / "only", speed=1000, loss_floor=2.0)
    assert main(["plot", str(run), "--metrics", "loss"]) == 0
    assert png_size(run / "plot.png") == (640, 360)


def test_several_runs_go_to_the_working_folder_by_default(tmp_path, monkeypatch):
    a = write_run(tmp_path / "a", speed=1000, loss_floor=2.0)
    b = write_run(tmp_path / "b", speed=2000, loss_floor=2.0)
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b), "--metrics", "loss,lr"]) == 0
    assert png_size(tmp_path / "plot.png")[0] == 1280


def test_a_folder_without_metrics_is_an_error_naming_it(tmp_path, capsys):
    good = write_run(tmp_path / "good", speed=1000, loss_floor=2.0)
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["plot", str(good), str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"{empty}: no metrics.jsonl in this folder" in err
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such run folder" in capsys.readouterr().err
    assert not (tmp_path / "plot.png").exists()


def test_a_corrupt_line_before_the_last_is_an_error_naming_the_line(tmp_path, capsys):
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{"step": 2, "lo\n{"step": 3, "loss": 1}\n')
    assert main(["plot", str(run)]) == 2
    assert "metrics.jsonl:2: not a JSON object" in capsys.readouterr().err


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "run", speed=1000, loss_floor=2.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(run)]) == 2
    assert "pip install 'accelfn[plot]'" in capsys.readouterr().err


def test_a_file_of_runs_appended_one_after_another_draws_the_last_with_a_warning(tmp_path):
    from accelfn.cli.plot import read_metrics

    lines = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 1, 2, 3, 4, 1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.warns(
        UserWarning, match=r"holds 3 runs \(the step goes back from 4 to 1\): drawing the last one"
    ):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:3]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one run: no warning
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        # a run resumed from step 2's checkpoint that logged again from step 3 (appended): one run, 3 replaced
        resumed = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 3, 4, 5)]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in resumed))
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
