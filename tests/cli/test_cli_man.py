"""`man upr` and `man upr-COMMAND` where a user has upr: in the venv `make demo` sets up
(its `man-pages` step, for a shell that ran `. .venv/bin/activate`), and after a `pip
install` of the package, whose wheel carries the pages as data files. man finds them by
the MANPATH it derives from PATH (`.venv/bin` -> `.venv/share/man`), so the tests run
`man -w` with MANPATH unset and the prefix's bin first on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(p.name for p in (ROOT / "man").glob("*.1"))


def need_man() -> str:
    """The man command (man-db installed as root when missing), else skip."""
    if shutil.which("man") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-qq", "man-db"], capture_output=True,
                       env=env, check=False)  # fmt: skip
    man = shutil.which("man")
    if man is None:
        pytest.skip("man is not installed (make system-deps installs man-db as root)")
    return man


def man_w(prefix: Path, page: str) -> subprocess.CompletedProcess[str]:
    """`man -w PAGE` in a shell whose PATH starts with PREFIX/bin, MANPATH unset."""
    env = {k: v for k, v in os.environ.items() if k != "MANPATH"}
    env["PATH"] = f"{prefix / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run([need_man(), "-w", page], capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip


def test_make_installs_the_pages_into_the_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    assert man_w(venv, "upr-backup").returncode != 0  # not there before the step
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "man-pages", f"VENV={venv}"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (venv / "share/man/man1").iterdir()) == PAGES
    for page in ("upr", "upr-backup", "upr-repo-unlock"):
        found = man_w(venv, page)
        assert found.returncode == 0, found.stderr
        assert found.stdout.strip() == str(venv / "share/man/man1" / f"{page}.1")


def test_make_demo_and_test_run_the_step() -> None:
    rules = (ROOT / "Makefile").read_text()
    for target in ("demo:", "test:"):
        line = next(x for x in rules.splitlines() if x.startswith(target))
        assert "man-pages" in line.split(), line
    assert 'need="$$need man-db"' in rules


def test_the_wheel_carries_the_pages_and_pip_installs_them(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building in the work tree would leave build/ there
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "pyspark_upr.py"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("man", "formats", "upr_cli"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist")],
        cwd=src, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("upr-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    data = sorted(n.rsplit("/", 1)[1] for n in names if "/data/share/man/man1/" in n)
    assert data == PAGES and all(n.split("/")[0].endswith(".data") for n in names
                                 if "/man1/" in n)  # fmt: skip
    prefix = tmp_path / "prefix"
    installed = subprocess.run(
        # --ignore-installed: the venv running the test has upr already (editable)
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--ignore-installed", "--disable-pip-version-check", "--prefix", str(prefix),
         str(wheel)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    assert (prefix / "bin" / "upr").exists()
    found = man_w(prefix, "upr-examine")
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(prefix / "share/man/man1/upr-examine.1")
