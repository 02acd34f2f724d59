"""Docs are tested: every command has help with an example, a paragraph in the README
linking its page in docs/commands/ (tests/test_command_pages.py checks the pages), and a
man page; the README shows exactly the two set-up commands and stays short."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer

from upr_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[str]:
    group = typer.main.get_command(app)
    return sorted(group.commands)  # type: ignore[attr-defined]


def test_there_are_commands() -> None:
    assert "rollback-point" in commands()


@pytest.mark.parametrize("name", commands())
def test_help_has_an_example(name: str) -> None:
    cmd = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    assert "Example" in (cmd.help or ""), f"`upr {name} --help` shows no example"


@pytest.mark.parametrize("name", commands())
def test_readme_paragraph(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    link = f"**[`upr {name}`](docs/commands/{name}.md)**"
    assert link in readme, f"README lacks a paragraph on `upr {name}` linking its page"
    page = (ROOT / "docs" / "commands" / f"{name}.md").read_text()
    assert page.startswith(f"# `upr {name}`\n"), f"docs/commands/{name}.md is not its page"


def test_readme_is_what_a_newcomer_reads_to_the_end() -> None:
    """At most 250 lines; the sections a newcomer and an operator look for are there."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    sections = re.findall(r"^## (.+)$", readme, re.M)
    for wanted in ("Quick start", "Commands", "Performance", "Errors and exit codes",
                   "Monitoring", "Read on"):  # fmt: skip
        assert wanted in sections, f"README has no section {wanted!r}"


def test_readme_monitoring_names_the_alerts() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Monitoring") :]
    section = section[: section.index("\n## ", 1)]
    for needed in ("--metrics-port 9464", "scrape_configs:", "upr_follow_lag_seconds",
                   "upr_last_result{command=\"backup\"} == 0",
                   "upr_last_success_timestamp_seconds",
                   "increase(upr_lost_writes_total[1h]) > 0",
                   "docs/metrics.md", "examples/prometheus/"):  # fmt: skip
        assert needed in section, f"README's Monitoring section lacks {needed}"


def _monitoring_yaml() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Monitoring") :]
    return re.findall(r"```yaml\n(.*?)```", section[: section.index("\n## ", 1)], re.S)


def test_readme_metrics_are_documented() -> None:
    """Every metric the README's scrape config and alert rules name is in docs/metrics.md."""
    documented = (ROOT / "docs" / "metrics.md").read_text()
    named = set(re.findall(r"\bupr_[a-z_]+", "".join(_monitoring_yaml())))
    assert named, "the README's Monitoring section names no metric"
    assert not [m for m in sorted(named) if m not in documented]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus)")
def test_readme_alert_rules_pass_promtool(tmp_path: Path) -> None:
    config, rules = _monitoring_yaml()
    (tmp_path / "alerts.yml").write_text(rules)
    (tmp_path / "prometheus.yml").write_text(config)
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        done = subprocess.run(["promtool", *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", commands())
def test_man_page(name: str) -> None:
    page = ROOT / "man" / f"upr-{name}.1"
    assert page.exists(), f"missing {page.relative_to(ROOT)}"
    text = page.read_text()
    assert ".SH EXAMPLES" in text and ".SH EXIT STATUS" in text
    assert f"upr-{name}" in (ROOT / "man" / "upr.1").read_text().replace("\\-", "-")


def test_readme_quick_start_is_make_demo_and_make_test() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```sh\n(.*?)```", readme, re.S)
    assert block and block.group(1).split("\n")[:2] == ["make demo", "make test"]
    assert "PERF_TABLE" not in readme


def test_ci_runs_make_test() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_formats_are_indexed() -> None:
    index = (ROOT / "formats" / "README.md").read_text()
    for spec in (ROOT / "formats").glob("*.md"):
        if spec.name != "README.md":
            assert spec.name in index, f"formats/README.md does not list {spec.name}"


def test_every_document_stamps_a_manifests_uid_on_its_last_event_only() -> None:
    """How a node stamps the manifest uid on the system events of one change is said in
    three documents; the node does it as kv_engine does (only the change's last event
    in a partition carries the new uid: tests/node/test_producer_collections.py), and so
    must each of them."""
    docs = ("docs/protocol.md", "formats/collections.md", "formats/wire.md")
    said = {doc: " ".join((ROOT / doc).read_text().split()) for doc in docs}
    assert not [doc for doc, text in said.items() if "stamps every event" in text]
    node = "A upr node stamps them the same way: the change's last event in a partition"
    assert f"{node} carries the new uid" in said["docs/protocol.md"]
    last = "The change's last event in a partition carries the new manifest's uid"
    assert last in said["formats/collections.md"]
