"""torchtitan's published Llama 3.1 8B configurations (docs/performance.md, Tables 1 and 3: 8 and 128 H100s of
96 GB) dry-run at their real world size: each lowers, fits, and its peak is within 15% of the published memory
(torchtitan's max reserved memory; the dry run's is live bytes). The rows, commands and figures are read from
accelfn/dryrun/published_runs.json (issue 31 item 7)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._published import ROWS, outcome

GIB = 2**30


def _rows(prefix: str) -> list[dict[str, Any]]:
    return [r for r in ROWS.values() if r["id"].startswith(prefix)]


CONFIGS = _rows("torchtitan-t1-") + _rows("torchtitan-t3-")


@pytest.mark.slow
@pytest.mark.parametrize("row", CONFIGS, ids=lambda r: r["id"])
def test_torchtitan_8b_configuration_fits_within_15_percent_of_published_memory(row: dict[str, Any]) -> None:
    got = outcome(row["id"])  # the row's own command (shared with tests/test_published_runs.py)
    assert got.world_size == row["config"]["gpus"] and got.fits
    published = row["published"]["memory_gib"]
    predicted = got.peak_bytes / GIB
    assert 0.85 <= predicted / published <= 1.15, (row["id"], predicted, published)


def test_float8_tensors_count_their_fp8_data_not_their_reported_dtype() -> None:
    # a torchao float8 training tensor reports bf16 and has a placeholder storage of bf16's size; its memory is
    # its 1-byte data (and scale): the tracker counts those only (it counted both: 1.21x on Table 3's fp8 row)
    import torch
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    from accelfn.dryrun.tracker import StepTracker

    w = torch.randn(256, 512, dtype=torch.bfloat16)
    f = hp_tensor_and_scale_to_float8(w, torch.tensor(1.0), torch.float8_e4m3fn)
    assert f.untyped_storage().nbytes() == 256 * 512 * 2  # the placeholder
    with StepTracker() as t:  # a view of f's data (first seen here), then a copy: 1 byte an element each
        g = f.t().contiguous()
    assert type(g).__name__ == "Float8TrainingTensor"
    scale = g._scale.untyped_storage().nbytes()
    assert t.peak_bytes == 2 * 256 * 512 + scale, t.peak_bytes  # counting the placeholders: + 2 x 262,144
