"""Command output (docs/output.md): tables that fit 80 columns, summaries instead of
floods, the one progress bar, the JSON convention of the jobs' summaries, and the
smaller fixes (restore --at by prefix)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from tests.cli.json_convention import problems
from upr_cli.cli import backup as backup_cli
from upr_cli.cli import diff as diff_cli
from upr_cli.cli import examine as examine_cli
from upr_cli.cli import inspect as inspect_cli
from upr_cli.cli import output
from upr_cli.cli import rollback_point as rollback_cli
from upr_cli.cli import salvage as salvage_cli
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverEntry, RollbackDecision
from upr_cli.jobs.backup import BackupSummary, PartitionRollback
from upr_cli.jobs.diff import DiffReport, PartitionDiff
from upr_cli.jobs.examine import Version
from upr_cli.jobs.inspect import Problem, VerifyReport
from upr_cli.jobs.load import LoadSummary
from upr_cli.jobs.restore import RestoreSummary
from upr_cli.jobs.rollback_point import PartitionDecision
from upr_cli.jobs.salvage import LostItem, SalvageReport
from upr_cli.jobs.salvage import Version as SalvageVersion
from upr_cli.source import backup_named

BACKUP = "20261121T061500.123456Z"
WIDTH = 80


def at_80(renderable: Any) -> list[str]:
    """The lines a terminal 80 columns wide shows."""
    buf = io.StringIO()
    Console(file=buf, width=WIDTH, color_system=None, legacy_windows=False).print(renderable)
    lines = buf.getvalue().splitlines()
    assert all(cell_len(line) <= WIDTH for line in lines), "\n".join(lines)
    return lines


def whole(lines: list[str], *cells: str) -> None:
    """Every cell is shown whole (not cut to "iden…", not folded over two lines)."""
    text = "\n".join(lines)
    assert "…" not in text, text
    for cell in cells:
        assert cell in text, f"{cell!r} is cut or missing:\n{text}"


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands' stdout console is 80 columns wide, as a new user's terminal."""
    monkeypatch.setattr(output.stdout, "width", WIDTH)


# -- tables fit 80 columns -------------------------------------------------------------------


def version(seq: int, state: str) -> Version:
    value = b'{"name": "' + b"x" * 200 + b'"}'
    return Version(BACKUP, 12, seq, "mutation", 1732604039123456000 + seq, 7, 0, 0, value, 1,
                   state == "lost", state == "latest")  # fmt: skip


def test_examine_keeps_seq_rev_and_state_at_80_columns() -> None:
    versions = [version(10, "superseded"), version(1234567, "lost"), version(20, "latest")]
    lines = at_80(examine_cli.versions_table("user::1042", versions, width=WIDTH))
    whole(lines, BACKUP, "seq", "rev", "state", "1234567", "lost write", "latest", "superseded")


def test_examine_shows_cas_and_value_at_120_columns() -> None:
    versions = [version(10, "latest")]
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None).print(
        examine_cli.versions_table("k", versions, width=120)
    )
    text = buf.getvalue()
    assert "1732604039123456010" in text and '{"name"' in text and "latest" in text


def diff_report(n_behind: int, n_identical: int = 0) -> DiffReport:
    rows = [PartitionDiff(p, "behind", a_seq=1000 + p, b_seq=900, seed_rule=900, dcp_rule=900)
            for p in range(n_behind)]  # fmt: skip
    rows += [PartitionDiff(n_behind + p, "identical", a_seq=5, b_seq=5, seed_rule=5)
             for p in range(n_identical)]  # fmt: skip
    rows.append(PartitionDiff(9999, "no-common-history", a_seq=7, b_seq=8,
                              only_in_a=(FailoverEntry(0xDEADBEEF, 0),)))  # fmt: skip
    return DiffReport("upr://127.0.0.1:11210/default", "repo:/backups/cb", rows)


def test_diff_statuses_are_whole_at_80_columns() -> None:
    report = diff_report(2, 2)
    lines = at_80(diff_cli.diff_table(report, report.partitions, wide=False))
    whole(lines, "identical", "behind", "no-common-history", "9999", "1001", "restart at")


def test_info_kind_is_whole_at_80_columns() -> None:
    backups = [{"backup_id": BACKUP, "full": kind == "full", "type": kind, "items": 12_345_678,
                "bytes_read": 9 * 10**9, "bytes_written": 2 * 10**9, "ratio": 4.5,
                "rollback_count": 1024, "bytes_on_disk": 3 * 10**9, "parent": BACKUP,
                "finished": "2026-11-21T06:15:09.123456Z"}
               for kind in ("full", "incremental", "merged")]  # fmt: skip
    lines = at_80(inspect_cli.backups_table("/backups/cb: bucket default", backups, wide=False))
    whole(lines, BACKUP, "incremental", "full", "merged", "12,345,678", "3.0 GB", "1024")


def backup_summary(rollbacks: int) -> BackupSummary:
    rbs = [PartitionRollback(p, 10**9 + p, 999, 999, 999, p % 2 == 0, p)
           for p in range(rollbacks)]  # fmt: skip
    return BackupSummary(BACKUP, "default", False, 123_456, 10**9, 10**8, 1024, rbs,
                         seconds=12.5)  # fmt: skip


def test_backup_tables_fit_80_columns() -> None:
    summary = backup_summary(3)
    whole(at_80(backup_cli.summary_table(summary)), "incremental", "123,456", "rollbacks")
    whole(at_80(backup_cli.rollback_table(summary.rollbacks)), "1000000002", "during the run")


def decision(rollback: bool) -> RollbackDecision:
    return RollbackDecision("seed", 5, rollback, "3", FailoverEntry(0xCAFEBABE, 0))


def test_rollback_point_table_fits_80_columns() -> None:
    results = [
        PartitionDecision(1023, decision(True)),
        PartitionDecision(7, None, "impossible history"),
    ]
    whole(at_80(rollback_cli.sources_table("seed rule: server upr://h/b / client repo:/r",
                                           results)), "1023", "yes", "cafebabe@0")  # fmt: skip


def lost_item(p: int) -> LostItem:
    lost = SalvageVersion(seq=1000 + p, deleted=False, value=b'{"a": ' + b"1" * 20 + b"}",
                          cas=1, rev_seq=2, flags=0, expiry=0, datatype=1)  # fmt: skip
    return LostItem(p, b"user::" + b"9" * 20, 999, lost, f"backup {BACKUP}", "would-write")


def test_salvage_table_fits_80_columns() -> None:
    report = SalvageReport("repo:/backups/cb", "upr://h/b", True, [lost_item(1)])
    whole(at_80(salvage_cli.lost_table(report, report.items)), "would-write", "999")


# -- summaries, not floods ------------------------------------------------------------------


def test_a_backup_after_a_crash_counts_its_rollbacks_and_names_salvage(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    backup_cli.render(backup_summary(340), False, "/backups/cb")
    out, err = capsys.readouterr()
    assert "340 partitions rolled back (170 during the run)" in out
    assert out.count("1000000") == output.FIRST_ROWS  # the first rows, not 340
    assert "… 330 more rolled-back partitions (--all" in out
    assert "upr salvage --repo /backups/cb" in err and "upr salvage" not in out
    assert all(cell_len(line) <= WIDTH for line in out.splitlines()), out
    backup_cli.render(backup_summary(340), True, "/backups/cb")
    out, _err = capsys.readouterr()
    assert out.count("1000000") == 340 and "more" not in out


def test_a_backup_without_rollbacks_says_nothing_of_them(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    backup_cli.render(backup_summary(0), False, "/backups/cb")
    out, err = capsys.readouterr()
    assert "rolled back" not in out and err == ""


def test_diff_shows_counts_and_the_first_rows(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    diff_cli.render(diff_report(864, 160), False)
    out, err = capsys.readouterr()
    assert "1,025 partitions: 160 identical, 864 behind, 1 no-common-history" in out
    assert "… 855 more partitions (--all" in out
    assert out.count(" behind ") == output.FIRST_ROWS
    assert "identical " not in out.split("1,025 partitions")[0]  # not listed by default
    assert "catches up" in err and "from 0" in err
    diff_cli.render(diff_report(864, 160), True)
    out, _err = capsys.readouterr()
    assert out.count(" behind ") == 864 and out.count(" identical ") == 160


def test_rollback_point_lists_nothing_when_nothing_rolls_back(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    results = [PartitionDecision(p, decision(False)) for p in range(1024)]
    rollback_cli.render_sources("upr://h/b", "repo:/r", results, False)
    out, err = capsys.readouterr()
    assert out.strip() == "1,024 partitions, none must roll back" and err == ""
    rollback_cli.render_sources("upr://h/b", "repo:/r", results, True)
    assert capsys.readouterr().out.count(" no ") == 1024


def test_rollback_point_lists_the_first_partitions_that_roll_back(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    results = [PartitionDecision(p, decision(p < 30)) for p in range(1024)]
    rollback_cli.render_sources("upr://h/b", "repo:/r", results, False)
    out, err = capsys.readouterr()
    assert "1,024 partitions, 30 must roll back" in out and "… 20 more" in out
    assert "upr salvage" in err


def test_verify_and_salvage_shorten_long_lists(
    capsys: pytest.CaptureFixture[str], narrow: None
) -> None:
    report = SalvageReport("repo:/backups/cb", "upr://h/b", True, [lost_item(p) for p in range(50)])
    shown, left_out = output.first_rows(report.items, False)
    assert len(shown) == output.FIRST_ROWS and left_out == 40
    assert output.first_rows(report.items, True) == (report.items, 0)
    output.more_line(40, "lost writes")
    assert capsys.readouterr().out.startswith("… 40 more lost writes (--all")


# -- progress --------------------------------------------------------------------------------


def test_eta_and_rates_read_at_a_glance() -> None:
    assert output.eta(0, 100, 10) == ""  # nothing done: no rate yet
    assert output.eta(50, 100, 10) == "ETA 10s"
    assert output.eta(1, 100, 10) == "ETA 16m30s"
    assert output.eta(100, 100, 10) == ""
    assert output.eta(5, None, 10) == ""
    assert output.compact(950) == "950" and output.compact(12_345) == "12.3k"
    assert output.compact(4_500_000) == "4.5M"


def test_progress_shows_items_rate_and_eta_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=buf, width=WIDTH, force_terminal=True))
    with output.Progress("backup", "items", show=True) as bar:
        task = bar.bar.tasks[0]
        assert task.fields["where"] == "starting…"  # never blank
        bar.update(5000, parts=(512, 1024), started=bar.started - 10)
        task = bar.bar.tasks[0]
        assert task.fields["where"] == "5,000 items, 512/1,024 partitions"
        assert task.fields["rate"] in ("499/s", "500/s") and task.fields["eta"] == "ETA 10s"
        bar.update(5000, total=20_000, started=bar.started - 10)
        assert bar.bar.tasks[0].fields["eta"] == "ETA 30s"  # from the items' total
        bar.update(5000, nbytes=45_000_000, started=bar.started - 10)
        assert bar.bar.tasks[0].fields["rate"].split(" ", 1)[1] in ("4.5 MB/s", "4.4 MB/s")


def test_progress_prints_nothing_when_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(output, "stderr", Console(file=buf, width=WIDTH))
    with output.Progress("restore", "items", show=False) as bar:
        bar.update(10, parts=(1, 2))
    assert buf.getvalue() == ""


# -- the JSON convention of the summaries -----------------------------------------------------


def test_the_checker_finds_what_breaks_the_convention() -> None:
    assert problems({"seq": 5, "bytes": "10", "rows": 3, "cas": "12", "items": 3}) == [
        "$.seq: a 64-bit value is a decimal string, not 5",
        "$.bytes: a count is an integer, not '10'",
        "$.rows: an item count is called items",
    ]


def test_examine_verify_load_and_restore_json_follow_the_convention() -> None:
    docs: list[Any] = [
        version(1234, "lost").to_json(),
        VerifyReport("default", 2, 10, 5000, 10**6, [Problem("gap", "w", "d")]).to_json(),
        LoadSummary(ops=10, sets=5, updates=3, deletes=2, overwritten=1, seconds=1).to_json(),
        RestoreSummary(BACKUP, "sqlite:/x", False, 4, 10, 2, 12, seconds=1).to_json(),
    ]
    for doc in docs:
        assert problems(json.loads(json.dumps(doc))) == []
    assert docs[0]["seq"] == "1234" and docs[0]["rev_seq"] == "7"
    assert docs[1]["items"] == 5000 and docs[1]["bytes"] == 10**6
    assert docs[2]["items"] == 10 and docs[2]["created"] == 5 and docs[2]["overwritten"] == 1
    assert docs[3]["items"] == 12


# -- restore --at by a prefix -----------------------------------------------------------------


def test_at_takes_a_unique_prefix_of_a_backup_id() -> None:
    ids = ["20261121T061500.123456Z", "20261121T071033.959105Z", "20261122T010203.000001Z"]
    assert backup_named(ids, "latest") == ids[-1] and backup_named(ids, "oldest") == ids[0]
    assert backup_named(ids, ids[1]) == ids[1]
    assert backup_named(ids, "20261122") == ids[2]
    assert backup_named(ids, "20261121T07") == ids[1]
    assert backup_named(ids, "2027") is None and backup_named(ids, "") is None
    with pytest.raises(UsageError, match=r"start of 2 backups: 20261121T061500\.123456Z, "
                                         r"20261121T071033\.959105Z; give more"):  # fmt: skip
        backup_named(ids, "20261121")


def test_the_output_document_is_in_the_repository() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "output.md").read_text()
    assert "## 4. The JSON convention" in doc and "decimal string" in doc


def test_tables_use_the_house_style() -> None:
    t = output.table("t")
    assert isinstance(t, Table) and t.box is not None and not t.pad_edge
