"""Where output goes: data to stdout (pipeable), messages and errors to stderr (STYLE 11)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# Piped output gets room: a table cut at 80 columns is no use to a script or a log.
stdout = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, soft_wrap=True, highlight=False)


def print_json(obj: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def error_line(message: str) -> None:
    """One line on stderr, prefixed so it is recognisable in scripts' logs."""
    first = " ".join(str(message).split())
    sys.stderr.write(f"upr: error: {first}\n")
    sys.stderr.flush()
