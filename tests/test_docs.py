"""Every ```python block in README.md and docs/*.md runs (blocks of one file share a namespace).

A block preceded by a line `<!-- no-test ... -->` is skipped (e.g. one that needs `accelfn launch`).
"""

import re
from pathlib import Path

import pytest

import accelfn as af

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- no-test[^\n]*-->\n)?```python\n(.*?)```", re.S)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for skip, code in BLOCK.findall(path.read_text()):
        if skip:
            continue
        exec(compile(code, f"{path.name}", "exec"), namespace)


def test_api_reference_lists_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    names = [n for n in af.__all__ if not n.startswith("_")]
    names += [f"optim.{n}" for n in af.optim.__all__]
    missing = [n for n in names if not re.search(rf"`(af\.)?(optim\.|dist\.|data\.)?{n.split('.')[-1]}\b", text)]
    assert not missing, f"docs/api.md does not document: {missing}"
