"""What a person sees while a tool runs: one progress bar, the frameworks' logs in a file.

:func:`quiet` sends everything written to stdout/stderr (mmengine's and detectron2's logs,
environment and config dumps, C-level prints) to a log file, and keeps the terminal for
:func:`progress` bars and the lines the tools print through :func:`say`. Every adapter shows
progress through :func:`progress`, so all of them look the same. Ranks other than 0 show
nothing.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Iterable, Iterator, Optional

__all__ = ["quiet", "progress", "say", "set_label", "is_main_rank", "first_paragraph"]

_terminal: Optional[IO[str]] = None  # the real terminal while quiet() is active
_label: str = ""


def first_paragraph(doc: str) -> str:
    """A module docstring's first paragraph on one line: a command's ``--help`` description (its
    first line alone can stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def is_main_rank() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:  # noqa: BLE001
        return True


def _out() -> IO[str]:
    return _terminal if _terminal is not None else sys.stderr


def say(line: str) -> None:
    """Prints a line to the terminal (also while :func:`quiet` is active), on rank 0 only."""
    if is_main_rank():
        print(line, file=_out(), flush=True)


def set_label(label: str) -> None:
    """A prefix for the progress bars that follow (e.g. the main job's row name)."""
    global _label
    _label = label


def progress(it: Iterable, total: int, desc: str) -> Iterator:
    """Iterates over ``it`` showing one ``rich`` progress bar on the terminal (rank 0 only)."""
    if not is_main_rank():
        yield from it
        return
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is optional for the library
        yield from it
        return
    text = f"[latte] {_label + ': ' if _label else ''}{desc}"
    console = Console(file=_out())
    if not console.is_terminal:  # a log file or a pipe: no bar (it would only leave blank lines)
        yield from it
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(escape(text), total=total)  # "[latte]" is not rich markup
        for x in it:
            yield x
            bar.advance(task)


@contextlib.contextmanager
def quiet(log_path: Optional[str], enabled: bool = True) -> Iterator[Optional[str]]:
    """Redirects file descriptors 1 and 2 (and ``sys.stdout``/``sys.stderr``) to ``log_path``
    for the duration; :func:`say` and :func:`progress` still reach the terminal.

    Yields the log path (``None`` when not enabled).
    """
    global _terminal
    if not enabled or log_path is None:
        yield None
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    saved_out = os.dup(1)
    log = open(log_path, "a", buffering=1, encoding="utf-8")
    terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8")
    old_streams = sys.stdout, sys.stderr
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        _terminal = terminal
        yield log_path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _terminal = None
        sys.stdout, sys.stderr = old_streams
        os.dup2(saved_out, 1)
        os.dup2(saved, 2)
        os.close(saved)
        os.close(saved_out)
        terminal.close()
        log.close()
