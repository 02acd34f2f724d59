"""What every command says on stderr, as text or as JSON lines (docs/output.md "Logs").

Theory of operation
-------------------
One state per process: the format (`text` or `json`), the level (`debug`, `info`,
`notice`, `warning`, `error`) and the command's name. `--log-format` and `--log-level`
set it on every command (the options are added to each command in one place,
upr_cli/cli/help.py); else `UPR_LOG_FORMAT` and `UPR_LOG`; else text at `notice`,
which shows what upr always showed: notices, warnings, errors, and the records of
Python's logging from `warning` up.

What reaches stderr comes by three roads, and each takes the same rule:

- upr's own lines, through upr_cli/cli/output.py: the error line (`upr: error: …`,
  level error), notices (`upr: …`, notice), hints (notice, unless their text is a
  warning). They call `emit` in json format and print themselves, as always, in text;
- lines any module writes to `sys.stderr` itself (`upr: warning: …`, `warning: …`):
  while the format is json, or the level hides notices or warnings, `sys.stderr` is a
  `_LineStream` that reads each whole line, tells its level and event by its prefix
  (`classify`), drops it below the level, and writes it as JSON or as it was. It says it
  is no terminal in json format, so the commands show no progress bar: stderr then
  carries JSON lines only;
- records of Python's logging (`logging.getLogger` in node/, dcp/, repo/, jobs/): one
  handler on the root logger, at the level, writes `TIME upr-COMMAND LEVEL NAME: MESSAGE`
  or a JSON object with event `log` and the logger's name (and, in json format,
  Python's warnings). Other libraries' debug records are left out: botocore's show the
  headers of signed requests.

A JSON line is one object: `time` (RFC 3339, UTC), `level`, `command`, `event`,
`message`, then the event's fields. Secrets never reach it: a password in a URI becomes
`***` (as `SourceUri.redacted` shows it; a `SourceUri` field is written redacted), and a
field named password, passphrase, secret, key or token (or ending so) is `***`.

`reset` puts everything back (the stream, the handler, the root logger's level), so a
command run inside a test process leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import re
import sys
import threading
import traceback
from typing import Any, TextIO

#: the levels, as Python's logging numbers them (notice sits between info and warning)
LEVELS = {"debug": 10, "info": 20, "notice": 25, "warning": 30, "error": 40}
FORMATS = ("text", "json")
DEFAULT_LEVEL = "notice"
FORMAT_ENV = "UPR_LOG_FORMAT"
LEVEL_ENV = "UPR_LOG"

#: a field with such a name is a secret, whatever its value
_SECRET_NAME = re.compile(r"(^|_)(password|passphrase|secret|key|token)$", re.I)
#: the password of a URI's userinfo: `scheme://user:PASSWORD@`
_URI_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^\s/@:'\"]*):[^\s@/'\"]*@", re.I)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
#: (prefix, level, event) of the lines upr writes on stderr, the longest first
_PREFIXES = (
    ("upr: error: ", "error", "error"),
    ("upr: warning: ", "warning", "warning"),
    ("warning: ", "warning", "warning"),
    ("upr: ", "notice", "notice"),
)


class _State:
    def __init__(self) -> None:
        self.stream: _LineStream | None = None
        self.root_level: int | None = None
        self.clear()

    def clear(self) -> None:
        self.format = "text"
        self.level = LEVELS[DEFAULT_LEVEL]
        self.level_given = False
        self.command = ""
        self.stream = None
        self.root_level = None


_state = _State()
_lock = threading.RLock()


def parse_format(text: str, where: str = "--log-format") -> str:
    """`text` or `json` (any case), else a ValueError naming `where`."""
    value = text.strip().lower()
    if value not in FORMATS:
        raise ValueError(f"{where}: {text!r} is not a log format: text or json")
    return value


def parse_level(text: str, where: str = "--log-level") -> str:
    """A level name (any case; `warn` and `critical` as Python spells them), else a
    ValueError naming `where`."""
    value = {"warn": "warning", "critical": "error"}.get(text.strip().lower(), text.strip().lower())
    if value not in LEVELS:
        raise ValueError(f"{where}: {text!r} is not a level: {', '.join(LEVELS)}")
    return value


def set_format(value: str | None) -> None:
    """The format given (`None`: `UPR_LOG_FORMAT`, else text)."""
    env = os.environ.get(FORMAT_ENV, "")
    if value is not None:
        _state.format = parse_format(value)
    else:
        _state.format = parse_format(env, FORMAT_ENV) if env.strip() else "text"
    _apply()


def set_level(value: str | None) -> None:
    """The level given (`None`: `UPR_LOG`, else notice)."""
    env = os.environ.get(LEVEL_ENV, "")
    if value is not None:
        name, given = parse_level(value), True
    elif env.strip():
        name, given = parse_level(env, LEVEL_ENV), True
    else:
        name, given = DEFAULT_LEVEL, False
    _state.level, _state.level_given = LEVELS[name], given
    _apply()


def set_command(name: str) -> None:
    """The command the lines are about (`backup`, `repo keys add`)."""
    _state.command = name


def is_json() -> bool:
    """Whether stderr carries JSON lines."""
    return _state.format == "json"


def enabled(level: str) -> bool:
    """Whether a line at `level` is shown."""
    return LEVELS[level] >= _state.level


def reset() -> None:
    """Text at notice, stderr and the root logger as they were before."""
    with _lock:
        stream = _state.stream
        if stream is not None:
            stream.close_line()
            if sys.stderr is stream:
                sys.stderr = stream.raw
        root = logging.getLogger()
        if _HANDLER in root.handlers:
            root.removeHandler(_HANDLER)
        if _state.root_level is not None:
            root.setLevel(_state.root_level)
        if _state.format == "json":
            logging.captureWarnings(False)
        _state.clear()


def _apply() -> None:
    """Put the stream and the logging handler in line with the state."""
    with _lock:
        wrap = _state.format == "json" or _state.level > LEVELS["notice"]
        if wrap and _state.stream is None:
            _state.stream = _LineStream(sys.stderr)
            sys.stderr = _state.stream
        elif not wrap and _state.stream is not None:
            _state.stream.close_line()
            if sys.stderr is _state.stream:
                sys.stderr = _state.stream.raw
            _state.stream = None
        logging.captureWarnings(_state.format == "json")  # Python's warnings: records too
        root = logging.getLogger()
        _HANDLER.setLevel(_state.level)
        if _HANDLER not in root.handlers:
            root.addHandler(_HANDLER)
        if _state.level_given:  # a level asked for: records below WARNING are made too
            if _state.root_level is None:
                _state.root_level = root.level
            root.setLevel(_state.level)
        elif _state.root_level is not None:
            root.setLevel(_state.root_level)
            _state.root_level = None


def _raw() -> TextIO:
    """The stream under stderr's line reader (stderr itself when there is none)."""
    stream = _state.stream
    return stream.raw if stream is not None and sys.stderr is stream else sys.stderr


# -- JSON lines -----------------------------------------------------------------------------


def redact(text: str) -> str:
    """`text` with the password of every URI in it shown as `***`."""
    return _URI_PASSWORD.sub(r"\1:***@", text)


def _field(name: str, value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return "***" if _SECRET_NAME.search(name) and value is not None else value
    if _SECRET_NAME.search(name):
        return "***"
    if hasattr(value, "redacted") and callable(value.redacted):  # a SourceUri
        return str(value.redacted())
    if isinstance(value, dict):
        return {str(k): _field(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_field(name, v) for v in value]
    return redact(str(value))


def record(level: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """The JSON object of one line, secrets redacted."""
    now = datetime.datetime.now(datetime.UTC)
    obj: dict[str, Any] = {
        "time": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": level,
        "command": _state.command,
        "event": event,
        "message": redact(" ".join(str(message).split())),
    }
    for name, value in fields.items():
        if name not in obj:
            obj[name] = _field(name, value)
    return obj


def emit(level: str, event: str, message: str, **fields: Any) -> None:
    """One JSON line on stderr, when `level` is shown."""
    if not enabled(level):
        return
    line = json.dumps(record(level, event, message, **fields), ensure_ascii=False)
    with _lock:
        out = _raw()
        out.write(line + "\n")
        out.flush()


def classify(text: str) -> tuple[str, str, str]:
    """(level, event, message) of a line written on stderr, by its prefix: anything
    else is a notice of event `message`."""
    for prefix, level, event in _PREFIXES:
        if text.startswith(prefix):
            return level, event, text[len(prefix) :]
    return "notice", "message", text


class _LineStream(io.TextIOBase):
    """`sys.stderr` while lines are filtered or turned into JSON: see the module's doc."""

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw = raw
        self._buf = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.raw, "errors", None)

    def isatty(self) -> bool:
        """A terminal only in text format (JSON lines take no progress bar)."""
        return not is_json() and self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with _lock:
            self._buf += s
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                self._line(line)
        return len(s)

    def flush(self) -> None:
        with _lock:
            if self._buf and not is_json():  # a progress bar redraws without a newline
                self.raw.write(self._buf)
                self._buf = ""
            self.raw.flush()

    def close_line(self) -> None:
        """Write out a last line that has no newline."""
        with _lock, contextlib.suppress(ValueError, OSError):  # the stream under it closed
            if self._buf:
                line, self._buf = self._buf, ""
                self._line(line)
            self.raw.flush()

    def close(self) -> None:
        """The last line out; the stream under it stays open (it is not this one's)."""
        self.close_line()

    def _line(self, line: str) -> None:
        plain = _ANSI.sub("", line).strip()
        level, event, message = classify(plain)
        if is_json():
            if plain:
                emit(level, event, message)
        elif not plain or enabled(level):
            self.raw.write(line + "\n")


# -- Python's logging -----------------------------------------------------------------------


class _Handler(logging.Handler):
    """The root logger's one handler: records as text lines or JSON objects."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.INFO and not record.name.startswith(_OWN_LOGGERS):
            return  # other libraries' debug records (botocore's show request headers)
        try:
            level = _level_name(record.levelno)
            message = record.getMessage()
            if is_json():
                fields = {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}
                if record.exc_info:
                    fields["exception"] = "".join(traceback.format_exception(*record.exc_info))
                emit(level, "log", message, logger=record.name, **fields)
                return
            when = _FORMATTER.formatTime(record)
            who = "upr-" + (_state.command or "cli").replace(" ", "-")
            text = f"{when} {who} {record.levelname} {record.name}: {message}"
            if record.exc_info:
                text += "\n" + _FORMATTER.formatException(record.exc_info)
            with _lock:
                out = _raw()
                out.write(text + "\n")
                out.flush()
        except Exception:  # noqa: BLE001 - a log line must not end the command
            self.handleError(record)


def _level_name(levelno: int) -> str:
    for name, number in sorted(LEVELS.items(), key=lambda kv: -kv[1]):
        if levelno >= number:
            return name
    return "debug"


_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName",
}  # fmt: skip
_FORMATTER = logging.Formatter()
#: the loggers whose debug records `debug` shows (other libraries': from info up)
_OWN_LOGGERS = ("upr", "asyncio")
_HANDLER = _Handler()
logging.addLevelName(LEVELS["notice"], "NOTICE")
