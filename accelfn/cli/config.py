"""``accelfn config``: write the launcher's YAML config (questionnaire, or ``--default``).

An existing file is replaced by `--default` only when confirmed at the prompt, or with `-y`/`--force`.
End of input (Ctrl-D) or Ctrl-C at a question writes nothing (exit 1).

Example:
    $ accelfn config --default --config-file ./accelfn.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

QUESTIONS = (
    ("device", "Device kind (auto, cpu, cuda, xla, xpu, npu, mlu)", str),
    ("num_processes", "Processes per machine ('auto' = one per device)", str),
    ("num_machines", "Number of machines (N, or MIN:MAX for elastic)", str),
    ("machine_rank", "This machine's rank", int),
    ("rdzv_endpoint", "Rendezvous HOST:PORT (empty on a single machine)", str),
    ("rdzv_backend", "Rendezvous backend (c10d, static)", str),
    ("mixed_precision", "Mixed precision (no, bf16, fp16, fp8)", str),
    ("mesh", "Mesh axes, e.g. dp=-1,tp=2 (empty: data parallel over all)", str),
    ("max_restarts", "Restarts of the process group on failure", int),
    ("log_with", "Experiment trackers, e.g. tensorboard,jsonl (empty: the script's choice)", str),
)


def _coerce(key: str, raw: str, kind: Callable[[str], Any]) -> Any:
    if key in ("num_processes", "num_machines") and raw.strip().isdigit():
        return int(raw)
    return kind(raw)


def ask(input_fn: Callable[[str], str] | None = None, print_fn: Callable[[str], None] = print) -> Any:
    """Ask every question (Enter keeps the default); a bad answer is explained and asked again. `input_fn`
    defaults to `input` (looked up at the call)."""
    input_fn = input_fn or input
    from ..launch.config import Config, ConfigError, Fp8Config

    cfg = Config()
    for key, question, kind in QUESTIONS:
        while True:
            default = getattr(cfg, key)
            raw = input_fn(f"{question} [{default}]: ").strip()
            if not raw:
                break
            try:
                cfg = cfg.replace(**{key: _coerce(key, raw, kind)})
                break
            except (ConfigError, ValueError) as e:
                print_fn(f"  {e}")
    if cfg.mixed_precision == "fp8":
        while True:
            raw = input_fn("FP8 backend (auto, torchao, te) [auto]: ").strip() or "auto"
            try:
                cfg = cfg.replace(
                    fp8=Fp8Config(backend=raw, recipe=input_fn("FP8 recipe [none]: ").strip() or None)
                )
                break
            except ConfigError as e:
                print_fn(f"  {e}")
    return cfg


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "config",
        help="write the launch config (YAML)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--default", action="store_true", help="write the defaults without the questionnaire")
    p.add_argument(
        "-y",
        "--yes",
        "--force",
        dest="force",
        action="store_true",
        help="with --default: replace an existing file without asking",
    )
    p.add_argument(
        "--config-file", help="where to write (default: $XDG_CACHE_HOME/accelfn/default_config.yaml)"
    )
    p.set_defaults(func=_run)


def _confirm(question: str) -> bool:
    """Ask `question` (y/N) on a terminal; anything but yes, end of input or Ctrl-C is no."""
    try:
        return input(f"{question} [y/N]: ").strip().lower() in ("y", "yes")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return False


def _run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from ..launch.config import Config, default_config_path, save

    path = Path(args.config_file) if args.config_file else default_config_path()
    folder_like = bool(args.config_file) and args.config_file.endswith((os.sep, "/"))
    if path.is_dir() or folder_like:
        print(
            f"accelfn config: {args.config_file or path} is a folder; --config-file takes a file path, "
            f"e.g. {path / 'accelfn.yaml'}",
            file=sys.stderr,
        )
        return 2
    if args.default and path.exists() and not args.force:
        # a careful overwrite: asked on a terminal, refused elsewhere (a script says --yes / --force)
        if not (sys.stdin is not None and sys.stdin.isatty()):
            print(
                f"accelfn config: {path} exists; not replaced by the defaults (--force or -y replaces it)",
                file=sys.stderr,
            )
            return 2
        if not _confirm(f"{path} exists. Replace it with the defaults?"):
            print(f"accelfn config: kept {path}", file=sys.stderr)
            return 1
    if not args.default and path.exists():
        print(f"(answers replace {path} when done; Ctrl-D or Ctrl-C keeps it)")
    try:
        cfg = Config() if args.default else ask()
    except (EOFError, KeyboardInterrupt) as e:  # input closed (Ctrl-D, no terminal) or Ctrl-C
        why = "end of input" if isinstance(e, EOFError) else "interrupted"
        print(
            f"\naccelfn config: {why}; nothing written (--default writes the defaults without asking)",
            file=sys.stderr,
        )
        return 1
    replaced = path.exists()
    try:
        save(cfg, path)
    except OSError as e:
        print(f"accelfn config: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"accelfn config: {'replaced' if replaced else 'wrote'} {path}")
    return 0
