"""Shell completion: `upr --install-completion` in bash, zsh and fish (Typer's, the shell
found from the process tree) installs a script under $HOME that the shell loads, and
`upr ba<TAB>` then offers `backup` and `upr info --re<TAB>` offers `--repo`. Each test
runs the real shell (installed with apt, as root, when missing) on the files the
install wrote, in a HOME of its own, with `upr` on PATH running this work tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def need_shell(name: str) -> str:
    """The shell's path (installed with apt as root when missing), else skip."""
    if shutil.which(name) is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-qq", name], capture_output=True,
                       env=env, check=False)  # fmt: skip
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (the test installs it when run as root)")
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A HOME of its own and `upr` first on PATH: this work tree's, by this Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    upr = bin_dir / "upr"
    upr.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m upr_cli "$@"\n')
    upr.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("_UPR", "_TYPER"))}
    return {**keep, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(home / ".config")}  # fmt: skip


def run(shell: str, script: str, env: dict[str, str], *, interactive: bool = False) -> str:
    """`shell -c SCRIPT` (-i: it reads its rc files), in HOME: its stdout."""
    args = [need_shell(shell), "-ic" if interactive else "-c", script]
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=env["HOME"],
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def install(shell: str, env: dict[str, str]) -> str:
    """`upr --install-completion` run from `shell` (`; true`: the shell stays its parent,
    which is how Typer tells the shell): what it said."""
    out = run(shell, "upr --install-completion; true", env)
    assert f"{shell} completion installed in" in out, out
    return out


def test_bash(env: dict[str, str]) -> None:
    install("bash", env)
    assert "source" in Path(env["HOME"], ".bashrc").read_text()
    out = run("bash", 'COMP_WORDS=(upr ba); COMP_CWORD=1; _upr_completion upr; '
              'printf "%s\\n" "${COMPREPLY[@]}"; echo --; '
              'COMP_WORDS=(upr info --re); COMP_CWORD=2; _upr_completion upr; '
              'printf "%s\\n" "${COMPREPLY[@]}"', env, interactive=True)  # fmt: skip
    commands, options = out.split("--\n")
    assert commands.split() == ["backup"]
    assert options.split() == ["--repo"]


def test_zsh(env: dict[str, str]) -> None:
    install("zsh", env)
    # the rc file's compinit finds _upr on fpath and registers it for upr; zsh calls
    # _arguments with what to offer, shown here instead of in a menu
    out = run("zsh", 'print -r -- "comps: $_comps[upr]"; _arguments() { print -rl -- "$@" }; '
              'autoload -Uz _upr; _upr; words=(upr ba); CURRENT=2; _upr_completion; '
              'words=(upr info --re); CURRENT=3; _upr_completion', env,
              interactive=True)  # fmt: skip
    assert "comps: _upr" in out
    assert '*: :(("backup":"Back up a bucket' in out
    assert '"--repo":"The backup repository' in out
    assert '"restore"' not in out


def test_fish(env: dict[str, str]) -> None:
    install("fish", env)
    # fish asks upr twice a completion (whether to complete, then what): one is enough
    out = run("fish", 'complete -C "upr ba"', env)
    assert [line.split("\t") for line in out.splitlines()] == [
        ["backup", "Back up a bucket into a repository,..."]
    ]


def test_show_completion_names_the_env_var(env: dict[str, str]) -> None:
    out = run("bash", "upr --show-completion; true", env)
    assert "_UPR_COMPLETE=complete_bash" in out and "complete -o default -F" in out
