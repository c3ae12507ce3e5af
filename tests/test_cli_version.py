"""`accelfn --version`: accelfn's version with torch's and Python's, exit code 0, no subcommand needed."""

from __future__ import annotations

import platform
import subprocess
import sys

import torch

import accelfn
from accelfn.cli.main import version_line


def test_version_line_names_accelfn_torch_and_python():
    assert (
        version_line()
        == f"accelfn {accelfn.__version__} (torch {torch.__version__}, Python {platform.python_version()})"
    )


def test_version_flag_prints_it_and_exits_zero():
    for flag in ("--version", "-V"):
        proc = subprocess.run(
            [sys.executable, "-m", "accelfn.cli.main", flag], capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == version_line()
