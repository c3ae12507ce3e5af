"""Every ```python block in README.md and docs/*.md runs (blocks of one file share a namespace).

A block preceded by a line `<!-- no-test ... -->` is skipped (e.g. one that needs `accelfn launch`).
"""

import ast
import contextlib
import io
import re
import tokenize
import types
from pathlib import Path

import pytest
import torch.distributed

import accelfn as af

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- no-test[^\n]*-->\n)?```python\n(.*?)```", re.S)


def print_comments(code: str) -> list[str]:
    """The comments at the end of the `print(...)` statements of `code`, on one line or several (the comment
    after the closing parenthesis): `print(1)  # 1`, and `print(` ... `)  # 2` over three lines, give ["1", "2"].
    """
    ends = {
        node.end_lineno
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "print"
    }
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.COMMENT
    }
    return [comments[line] for line in sorted(ends) if line in comments]


def expected_output(comment: str) -> re.Pattern:
    """`# a b ... c (note)` after a print: the words a, b, c must be printed in that order; a trailing
    parenthesised note is prose."""
    comment = re.sub(r"\s+\([^()]*\)\s*$", "", comment)
    words = [w for w in comment.replace("...", " ").split() if w]
    return re.compile(".*?".join(re.escape(w) for w in words), re.S)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_python_blocks_run_and_print_what_they_say(path, tmp_path, monkeypatch):
    # Each block runs; a `print(...)  # text` line promises output: the words of `text` must be printed
    # (in order) by that block — so an example that shows an error message fails if no error is raised.
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for skip, code in BLOCK.findall(path.read_text()):
        if skip:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{path.name}", "exec"), namespace)
        printed = out.getvalue()
        for comment in print_comments(code):
            assert expected_output(comment).search(printed), (
                f"{path.name}: a block says it prints {comment!r} but printed:\n{printed}"
            )
    # a page's examples leave no process group behind (the next test file starts unlaunched)
    leaked = torch.distributed.is_initialized()
    if leaked:
        torch.distributed.destroy_process_group()
    assert not leaked, f"{path.name}: its examples leave a process group open (close the mesh)"


# Public subpackages whose `__all__` the API reference must cover (every module `accelfn/__init__.py` exports).
SUBPACKAGES = [
    "optim",
    "checkpoint",
    "data",
    "dist",
    "big",
    "losses",
    "random",
    "tree",
    "platforms",
    "trackers",
]


def test_every_public_subpackage_is_checked():
    exported = {n for n in af.__all__ if isinstance(getattr(af, n), types.ModuleType)}
    assert exported == set(SUBPACKAGES), "update SUBPACKAGES"


def test_api_reference_lists_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    names = [n for n in af.__all__ if not n.startswith("_")]
    names += [f"{sub}.{n}" for sub in SUBPACKAGES for n in getattr(af, sub).__all__]
    prefixes = "|".join(rf"{sub}\." for sub in SUBPACKAGES)
    missing = [
        n for n in names if not re.search(rf"`(af\.)?({prefixes})?{re.escape(n.split('.')[-1])}\b", text)
    ]
    assert not missing, f"docs/api.md does not document: {missing}"


def test_a_print_over_several_lines_promises_its_closing_comment():
    code = "print(1)  # one\nx = 2  # not a print\nprint(\n    x,\n)  # two\nfor i in ():\n    print(i)  # three\n"
    assert print_comments(code) == ["one", "two", "three"]
