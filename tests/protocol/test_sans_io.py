"""upr_cli.protocol is sans-IO: no socket, asyncio, file or OS API is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import upr_cli.protocol

FORBIDDEN = {
    "socket", "asyncio", "selectors", "ssl", "io", "os", "pathlib", "shutil", "tempfile",
    "subprocess", "threading", "multiprocessing", "mmap", "sqlite3", "open",
}  # fmt: skip
ALLOWED_OURS = {"upr_cli.errors", "upr_cli.protocol"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
            names.add("open")
    return names


def test_protocol_imports_no_io() -> None:
    files = sorted(Path(upr_cli.protocol.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN, f"{path.name} imports {name}"
            if top == "upr_cli":
                assert any(name == o or name.startswith(o + ".") for o in ALLOWED_OURS), (
                    f"{path.name} imports {name}: protocol may import only errors and itself"
                )
