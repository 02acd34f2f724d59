"""Shared option aliases, so every command spells the same option the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
Seq = Annotated[int, typer.Option(min=0, metavar="SEQ")]
