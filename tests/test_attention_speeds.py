"""Which SDPA kernel a torch build runs on an H100 (accelfn.dryrun.attention_speeds.sdpa_backend): releases by
version and CUDA build, main-branch nightlies by their date, each side of every boundary the module cites."""

from __future__ import annotations

import datetime

import pytest

from accelfn.dryrun.attention_speeds import MAIN_BRANCH, sdpa_backend


def _day(date: int, days: int) -> str:
    d = datetime.date(date // 10000, date // 100 % 100, date % 100) + datetime.timedelta(days=days)
    return d.strftime("%Y%m%d")


OPT_IN, BUILT_WITH, RUNTIME, CU128_BUMP = MAIN_BRANCH.values()


def test_the_boundaries_are_the_cited_merge_dates() -> None:
    # pytorch#138522 merged 2024-10-22; #162073 2025-09-04; #171627 on main by 2026-01-07 (its cherry-pick #171895
    # opened that day); #172680 (CUDA 12.8 builds to cuDNN 9.15.1) 2026-01-17
    assert (OPT_IN, BUILT_WITH, RUNTIME, CU128_BUMP) == (20241022, 20250904, 20260107, 20260117)


@pytest.mark.parametrize(
    "nightly, backend",
    [
        # pytorch#138522: cuDNN last from its merge
        (f"2.6.0.dev{_day(OPT_IN, -1)}", "cudnn"),
        (f"2.6.0.dev{OPT_IN}", "flash2"),
        ("2.6.0.dev20241223", "flash2"),  # torch 1963fc8: torchtitan's published Llama 3.1 runs
        ("2.9.0.dev20250801", "flash2"),
        # pytorch#162073: cuDNN first where the build's cuDNN >= 9.9 (CUDA 12.9: 9.10.2, 13.0: 9.13; 12.8: 9.8.0)
        (f"2.9.0.dev{_day(BUILT_WITH, -1)}+cu130", "flash2"),
        (f"2.9.0.dev{BUILT_WITH}+cu130", "cudnn"),
        (f"2.9.0.dev{BUILT_WITH}+cu129", "cudnn"),
        (f"2.9.0.dev{BUILT_WITH}+cu128", "flash2"),  # pytorch#165801: built against cuDNN 9.8.0
        ("2.10.0.dev20251015", "flash2"),  # no CUDA tag: the 12.8 build
        ("2.10.0.dev20251015+cu130", "cudnn"),
        # pytorch#171627: the runtime cuDNN > 9.15.0: 13.0 builds bundle 9.15.1 (pytorch#169412), 12.x 9.10.2
        (f"2.11.0.dev{_day(RUNTIME, -1)}+cu129", "cudnn"),
        (f"2.11.0.dev{RUNTIME}+cu129", "flash2"),
        (f"2.11.0.dev{RUNTIME}+cu130", "cudnn"),
        (f"2.11.0.dev{RUNTIME}+cu128", "flash2"),
        # pytorch#172680: CUDA 12.8 builds bundle cuDNN 9.15.1
        (f"2.11.0.dev{_day(CU128_BUMP, -1)}+cu128", "flash2"),
        (f"2.11.0.dev{CU128_BUMP}+cu128", "cudnn"),
        (f"2.11.0.dev{CU128_BUMP}", "cudnn"),
    ],
)
def test_a_nightly_follows_the_main_branch_on_its_date(nightly: str, backend: str) -> None:
    assert sdpa_backend(nightly, "h100-sxm") == backend
    assert sdpa_backend(nightly, "a100-80gb") == "flash2"  # sm80: FlashAttention-2 on every date


@pytest.mark.parametrize(
    "version, backend",
    [
        ("2.9.0", "flash2"),  # PyPI's CUDA 12.8 wheel, built against cuDNN 9.8.0 (pytorch#165801)
        ("2.9.1+cu128", "flash2"),
        ("2.9.0+cu129", "cudnn"),
        ("2.9.1+cu130", "cudnn"),
        ("2.10.0", "flash2"),  # cuDNN 9.10.2 bundled, not > 9.15.0
        ("2.10.0+cu126", "flash2"),
        ("2.10.0+cu130", "cudnn"),  # cuDNN 9.15.1 bundled (pytorch#171189)
        ("2.11.0", "cudnn"),
        ("2.11.0+cu128", "cudnn"),
        ("2.8.0a0+5228986c39", "flash2"),  # NGC 25.05's build: no date, taken as 2.8
    ],
)
def test_a_release_follows_its_version_and_cuda_build(version: str, backend: str) -> None:
    assert sdpa_backend(version, "h100-96gb") == backend


@pytest.mark.parametrize(
    "version",
    ["nightly", "2.10.0.dev20251015cu130", "2.1O.0", "2.11.0.dev2026011", "2.11.0 beta", "2.11.0+"],
)
def test_a_bad_version_is_named(version: str) -> None:
    """Refused whole, not read by its prefix (a missing "+" before the CUDA tag would take the 12.8 build)."""
    with pytest.raises(ValueError, match="is not a torch version"):
        sdpa_backend(version, "h100-sxm")


@pytest.mark.parametrize(
    "version",
    ["2.6.0.dev20241223+cu124", "2.8.0a0+5228986c39", "2.10.0a0+git123abc", "2.11.0+cpu", "2.6.0rc1"],
)
def test_builds_with_local_tags_are_versions(version: str) -> None:
    assert sdpa_backend(version, "h100-sxm") in ("flash2", "cudnn")
