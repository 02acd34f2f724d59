"""`upr repo`: manage a repository itself: its keys, its lock, copies of it."""

from __future__ import annotations

import typer

from upr_cli.cli import repo_copy, repo_keys, repo_unlock

HELP = """Manage a repository itself: its keys, its lock, copies of it.

Create a repository encrypted, add, remove and rotate its keys, release the lock of a
backup that died, copy a repository (into object storage, or encrypting it).

Example (an encrypted repository, its key in a file; keep a second key):

  upr repo init --repo /backups/cb --encrypt --key-file ~/.upr/cb.key
"""

app = typer.Typer(name="repo", help=HELP, no_args_is_help=True)
repo_keys.register(app)
repo_copy.register(app)
repo_unlock.register(app)


def register(root: typer.Typer) -> None:
    """Add the `repo` command group to the app."""
    root.add_typer(app, name="repo")
