"""Every module of the package is collected by pytest (its doctests run) and linted by ruff.

Both tools skip some folder names by default (`dist`, `build`, `venv`, ...): a package folder with such a
name silently drops its doctests and its lint (as `accelfn/dist` once did).
"""

import fnmatch
import shutil
import subprocess
from pathlib import Path

import pytest

import accelfn

PACKAGE = Path(accelfn.__file__).parent
ROOT = PACKAGE.parent


def modules() -> list[Path]:
    found = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(found) > 100  # the package, not an empty glob
    return found


def test_every_module_is_collected_by_pytest(pytestconfig):
    assert "--doctest-modules" in pytestconfig.getini("addopts")
    assert "accelfn" in pytestconfig.getini("testpaths")
    patterns = pytestconfig.getini("norecursedirs")
    skipped = [
        str(path.relative_to(ROOT))
        for path in modules()
        for folder in path.relative_to(ROOT).parts[:-1]
        if any(fnmatch.fnmatch(folder, pattern) for pattern in patterns)
    ]
    assert not skipped, f"pytest's norecursedirs {patterns} skips {skipped}"


def test_every_module_is_linted_by_ruff():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a test dependency (pip install -e '.[test]'); it is not on PATH")
    out = subprocess.run(
        [ruff, "check", "--show-files", str(PACKAGE)], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    linted = {
        Path(line.strip()).resolve() for line in out.stdout.splitlines() if line.strip().endswith(".py")
    }
    missing = [str(p.relative_to(ROOT)) for p in modules() if p.resolve() not in linted]
    assert not missing, f"ruff does not lint {missing}"
