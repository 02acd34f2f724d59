"""The command group behind `upr`: commands imported when used, help that reads at 80 columns.

`LazyGroup` knows each command's module and one-line summary (`COMMANDS`), so `upr
--help` lists them without importing a module (and through it asyncio, sqlite-utils,
zstandard, Rich tables or Spark). A command's module is imported when the command runs
or shows its own help.

Every command it hands out, and its subcommands, goes through `polish` once:

- help paragraphs are hard-wrapped in the source and Rich wraps them again at the
  terminal's width, which leaves ragged lines; prose lines of a paragraph are joined so
  Rich wraps each paragraph once. Indented lines (examples) keep their line breaks, and
  one longer than an 80-column terminal shows is broken before an option, with ` \\`, so
  it still pastes into a shell;
- square brackets in help are text, not Rich markup ("[uuid, seq]" was swallowed);
- metavars are plain names (URI, N, PATH, text|json), never Typer's type labels
  (`<int range> [x>=1]`, `<bool>`, `{uri}`);
- a command run without arguments shows its help, unless the environment answers
  every required parameter (`UPR_REPO=/backups/cb upr info` runs `info`).

Every command, the group itself included, takes `--log-format` and `--log-level`
(`add_log_options`): eager options that set upr_cli/logs.py's state before any other
option's callback or the command's body can write a line on stderr.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
import typer.core

#: name -> (module under upr_cli.cli, the summary `upr --help` lists), in the order a new
#: user meets them; the summary is the first line of the command's help (a test checks)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "Run a UPR node: KV front end, DCP producer, SQLite storage in --data DIR."),
    "load": ("load", "Write a reproducible workload of JSON documents through the KV front end."),
    "tail": ("tail", "Print a bucket's changes as they stream over DCP."),
    "backup": ("backup", "Back up a bucket into a repository, incrementally, through failovers."),
    "restore": (
        "restore",
        "Restore the state at a backup into a node, a cluster or a SQLite store.",
    ),
    "info": ("inspect", "Show a repository's backups: items, bytes, ratio, rollbacks, the chain."),
    "verify": ("inspect", "Read everything in a repository and check it."),
    "prune": ("prune", "Remove the backups no keep rule keeps; what the kept ones restore stays."),
    "remove": ("prune", "Remove the named backups; what the other backups restore stays."),
    "examine": ("examine", "Show every version of a key stored in a repository."),
    "ls": ("ls", "List the keys a restore of a backup's state would write."),
    "cat": ("cat", "Print one document of a backup's state, as a restore would write it."),
    "merge": ("merge", "Merge a repository's chain into one full backup, on one machine."),
    "replay": ("replay", "Replay a source into a SQLite store that follows it like a UPR replica."),
    "diff": ("diff", "Compare the failover histories of A and B, partition by partition."),
    "salvage": (
        "salvage",
        "Find the lost writes of a failover and write back those still safe to.",
    ),
    "rollback-point": (
        "rollback_point",
        "Compute where a client must roll back to and restart streaming a partition.",
    ),
    "repo": ("repo", "Manage a repository itself: its keys, its lock, copies of it."),
    "spark": ("spark", "Run upr's data pipeline on Spark, locally or on a Spark cluster."),
    "cluster": ("cluster", "Run a cluster of upr serve nodes on loopback, under one cluster map."),
    "collections": (
        "collections",
        "Create, drop and list a bucket's scopes and collections, on every node.",
    ),
}

#: the widest line of help text an 80-column terminal shows (Rich pads one column a side)
HELP_WIDTH = 78


def load_command(name: str) -> typer.core.TyperGroup | typer.core.TyperCommand:
    """Import the module of command `name` and build its click command, polished."""
    module = importlib.import_module(f"upr_cli.cli.{COMMANDS[name][0]}")
    holder = typer.Typer(add_completion=False)
    module.register(holder)
    command = typer.main.get_group(holder).commands[name]
    if name in ACCESS_COMMANDS:
        add_access_options(command)
    add_log_options(command)
    polish(command)
    return command  # type: ignore[return-value]


# -- repository access options ----------------------------------------------------------

#: the commands (every subcommand of a group) that open repositories, and so take the key
#: and object-store options (`upr_cli.repo.access`)
ACCESS_COMMANDS = frozenset({
    "backup", "restore", "info", "verify", "prune", "remove", "examine", "ls", "cat",
    "merge", "replay", "diff", "salvage", "rollback-point", "spark", "repo",
})  # fmt: skip
ACCESS_PANEL = "Repository access"


def _record(field: str) -> Any:
    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value is not None:
            from upr_cli.repo import access

            access.configure(**{field: value})
        return value

    return callback


def _opt(decl: str, metavar: str, field: str, text: str, **kw: Any) -> Any:
    return typer.Option(
        decl, metavar=metavar, expose_value=False, callback=_record(field), help=text,
        rich_help_panel=ACCESS_PANEL, **kw,
    )  # fmt: skip


def _access(
    key_file: Annotated[Path | None, _opt(
        "--key-file", "FILE", "key_file", "The key or passphrase of an encrypted "
        "repository: the file's bytes, one trailing newline removed (else "
        "UPR_KEY_FILE, UPR_PASSPHRASE).", dir_okay=False)] = None,
    key_command: Annotated[str | None, _opt(
        "--key-command", "CMD", "key_command",
        "A shell command whose output is the key or passphrase (a secret manager).")] = None,
    s3_endpoint: Annotated[str | None, _opt(
        "--s3-endpoint", "URL", "s3_endpoint",
        "The S3-compatible service of s3:// repositories (else AWS_ENDPOINT_URL).")] = None,
    transfers: Annotated[int | None, _opt(
        "--transfers", "N", "transfers", "Parallel object-store requests (default 8).",
        min=1, max=256)] = None,
) -> None:  # fmt: skip
    """The access options' holder (never called: its options are not exposed)."""


def access_options() -> list[Any]:
    """`--key-file`, `--key-command`, `--s3-endpoint`, `--transfers`: recorded in
    `upr_cli.repo.access` as they are parsed, never passed to the command's function."""
    holder = typer.Typer(add_completion=False)
    holder.command("access")(_access)
    return list(typer.main.get_command(holder).params)


def add_access_options(command: Any) -> None:
    """Give `command` (and each subcommand of a group) the access options."""
    subcommands = getattr(command, "commands", None)
    if subcommands:
        for sub in subcommands.values():
            add_access_options(sub)
        return
    names = {n for p in command.params for n in getattr(p, "opts", ())}
    command.params.extend(o for o in access_options() if o.opts[0] not in names)


# -- log options ----------------------------------------------------------------------------

LOG_PANEL = "Logs"


def _log_callback(setter: str) -> Any:
    """A callback that sets the format or level (`setter`, a function of upr_cli.logs):
    the group's sets it from the option, else the environment, else the default; a
    command's, given the option, overrides it."""

    def callback(ctx: Any, param: Any, value: Any) -> Any:
        from upr_cli import logs

        root = ctx.parent is None
        if root or value is not None:
            try:
                getattr(logs, setter)(value)
            except ValueError as exc:
                if value is None:  # from the environment
                    from upr_cli.errors import UsageError

                    raise UsageError(str(exc)) from exc
                raise typer.BadParameter(str(exc).split(": ", 1)[1]) from exc
        logs.set_command(" ".join(ctx.command_path.split()[1:]))
        if "upr_cli.cli.output" in sys.modules:  # messages wrap only on a terminal
            from upr_cli.cli import output

            output.stderr.soft_wrap = not sys.stderr.isatty()
        return value

    return callback


def _logs(
    log_format: Annotated[str | None, typer.Option(
        "--log-format", metavar="text|json", expose_value=False, is_eager=True,
        callback=_log_callback("set_format"), rich_help_panel=LOG_PANEL,
        help="How stderr's lines read: text as always, or one JSON object a line "
        "(else UPR_LOG_FORMAT).")] = None,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", metavar="LEVEL", expose_value=False, is_eager=True,
        callback=_log_callback("set_level"), rich_help_panel=LOG_PANEL,
        help="debug, info, notice (the default), warning or error: the least severe "
        "line shown (else UPR_LOG).")] = None,
) -> None:  # fmt: skip
    """The log options' holder (never called: its options are not exposed)."""


def log_options() -> list[Any]:
    """`--log-format` and `--log-level`, applied as they are parsed (upr_cli/logs.py)."""
    holder = typer.Typer(add_completion=False)
    holder.command("logs")(_logs)
    return list(typer.main.get_command(holder).params)


def add_log_options(command: Any) -> None:
    """Give `command` (and each subcommand of a group) the log options."""
    subcommands = getattr(command, "commands", None)
    if subcommands and not isinstance(subcommands, _Commands):
        for sub in subcommands.values():
            add_log_options(sub)
        return
    names = {n for p in command.params for n in getattr(p, "opts", ())}
    command.params.extend(o for o in log_options() if o.opts[0] not in names)


class _Commands(MutableMapping[str, Any]):
    """The group's commands by name, each built on first use (a mapping, as click's
    `Group.commands` is, so code that reads that sees every command)."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = load_command(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        del self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*COMMANDS, *(n for n in self._built if n not in COMMANDS)])

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._built))

    def summary(self, name: str) -> Any:
        """A stand-in for the listing: the command if built, else its name and summary."""
        if name in self._built or name not in COMMANDS:
            return self[name]
        return typer.core.TyperCommand(name=name, short_help=COMMANDS[name][1])


class LazyGroup(typer.core.TyperGroup):
    """`upr`'s group: its commands are imported when run, listed without importing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands()
        self._listing = False
        add_log_options(self)
        polish(self)

    def list_commands(self, ctx: Any) -> list[str]:
        """Every command's name, in `COMMANDS` order."""
        return list(self.commands)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """The command (imported now), or only its summary while the help lists them."""
        commands = self.commands
        assert isinstance(commands, _Commands)
        if self._listing:
            return commands.summary(cmd_name)
        return commands.get(cmd_name)

    def get_params(self, ctx: Any) -> list[Any]:
        """The group's options, those Typer adds after the group is built
        (--install-completion, --show-completion) with plain metavars too."""
        params: list[Any] = super().get_params(ctx)
        for param in params:
            if not getattr(param, "_upr_plain", False):
                param._upr_plain = True
                _plain_param(param)
        return params

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """The group's help, listing the commands by their summaries."""
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


# -- polish -------------------------------------------------------------------------------


def polish(command: Any) -> None:
    """Make `command`'s help (and its subcommands') read well: see the module's doc."""
    if getattr(command, "_upr_polished", False):
        return
    command._upr_polished = True
    if command.help:
        command.help = reflow(command.help)
    if command.short_help:
        command.short_help = _escape(command.short_help)
    for param in command.params:
        _plain_param(param)
    built = command.get_help_option  # click builds --help on first use

    def help_option(ctx: Any) -> Any:
        option = built(ctx)
        if option is not None:
            _plain_param(option)
        return option

    command.get_help_option = help_option
    if getattr(command, "no_args_is_help", False) and any(p.envvar for p in command.params):
        _environment_answers(command)
    subcommands = getattr(command, "commands", {})
    if not isinstance(subcommands, _Commands):  # those are polished as they are built
        for sub in subcommands.values():
            polish(sub)


def _environment_answers(command: Any) -> None:
    """`command` run without arguments shows its help, unless the environment gives
    every required parameter a value (`UPR_REPO=… upr info` reads the repository): then
    it runs, as it would with those options on the command line."""
    parse = command.parse_args

    def parse_args(ctx: Any, args: list[str]) -> Any:
        if args or not _given_by_environment(command):
            return parse(ctx, args)
        command.no_args_is_help = False
        try:
            return parse(ctx, args)
        finally:
            command.no_args_is_help = True

    command.parse_args = parse_args


def _given_by_environment(command: Any) -> bool:
    """Whether an environment variable is set for one of `command`'s parameters and for
    each of its required ones."""

    def env_set(param: Any) -> bool:
        names = [param.envvar] if isinstance(param.envvar, str) else (param.envvar or [])
        return any(os.environ.get(n) for n in names)

    required = [p for p in command.params if p.required]
    return any(env_set(p) for p in command.params) and all(env_set(p) for p in required)


def reflow(text: str) -> str:
    """Help text whose prose paragraphs are one line each (Rich wraps them to the
    terminal), examples as written (long ones broken), square brackets escaped."""
    paragraphs = [_reflow_paragraph(p) for p in re.split(r"\n[ \t]*\n", inspect.cleandoc(text))]
    rest = "\n".join(paragraphs[2:]).split("\n")
    if len(paragraphs) > 2 and all(line[:1].isspace() for line in rest if line):
        # Typer dedents the text after the summary as a docstring, from its second line
        # on: when only examples follow one prose line, they would lose their indent. A
        # separator line holding a zero-width space (shown blank) keeps it.
        return "\n\n".join(paragraphs[:2]) + "\n\u200b\n" + "\n\n".join(paragraphs[2:])
    return "\n\n".join(paragraphs)


def _reflow_paragraph(paragraph: str) -> str:
    if paragraph.startswith("\b"):  # click's "do not rewrap" mark
        return paragraph
    out: list[str] = []
    prose = False
    for line in paragraph.split("\n"):
        if line[:1].isspace():  # an example or a continuation of one: as written
            out.extend(_fit(line.rstrip()))
            prose = False
        elif prose:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
            prose = True
    return "\n".join(_escape(line) for line in out)


def _fit(line: str, width: int = HELP_WIDTH) -> list[str]:
    """An example line broken before options (` \\` at each break, the rest indented 4
    more) so no piece is wider than `width`; a line that fits, or that has no place to
    break, is kept as it is."""
    indent = len(line) - len(line.lstrip())
    out: list[str] = []
    while len(line) > width:
        cut = _break_at(line, width - 2, indent)
        if cut is None:
            break
        out.append(line[:cut] + " \\")
        line = " " * (indent + 4) + line[cut + 1 :]
    out.append(line)
    return out


def _break_at(line: str, limit: int, indent: int) -> int | None:
    """The last space before `limit` outside quotes that comes before an option (else
    any such space), past the first word."""
    spaces: list[int] = []
    quote = ""
    for i, ch in enumerate(line[:limit]):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == " " and i > indent and line[i - 1] != " ":
            spaces.append(i)
    options = [i for i in spaces if line[i + 1 : i + 2] == "-"]
    found = options or spaces
    return found[-1] if found else None


_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def _escape(text: str) -> str:
    """`text` with what Rich would read as a markup tag escaped ("[uuid, seq]"), as
    `rich.markup.escape` does, but a backslash ending a line (a shell continuation) kept
    single."""
    return _TAG.sub(r"\1\1\\\2", text)


_SECONDS = re.compile(r"timeout|interval|age|wait|seconds|after-s")


def _plain_param(param: Any) -> None:
    """A plain metavar for `param` and no Typer type labels or range notes."""
    param._upr_plain = True
    if param.help:
        param.help = _escape(" ".join(param.help.split()))
    if hasattr(param, "_get_number_range_help_str"):
        # "[x>=1]" reads as code: the help says the range where it matters
        param._get_number_range_help_str = lambda: None
    if isinstance(param, typer.core.TyperArgument):
        name = param.metavar or (param.name or "ARG").upper()
        param.metavar = name
        shown = name if param.required else f"[{name}]"
        shown += "..." if param.nargs != 1 else ""
        # the usage line shows URI, not Typer's {uri}; the name column is the metavar already
        setattr(param, "get_usage_pieces", lambda ctx: [shown])  # noqa: B010
        setattr(param, "display_type_rich", lambda ctx: None)  # noqa: B010
        return
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        param.metavar = ""  # a flag takes no value: no "<bool>"
    elif param.metavar is None:
        param.metavar = _metavar(param)


def _metavar(param: Any) -> str:
    """The plain metavar of an option declared without one, from its type and name."""
    desc = param.type_descriptor
    if desc.is_choice:
        return "|".join(str(getattr(c, "value", c)) for c in desc.choices or ())
    if desc.is_path:
        return "PATH"
    annotation = desc.annotation
    if desc.is_list:
        annotation = (get_args(annotation) or (str,))[0]
    if annotation is int:
        return "N"
    if annotation is float:
        return "SECONDS" if _SECONDS.search(param.name.replace("_", "-")) else "N"
    return "TEXT"
