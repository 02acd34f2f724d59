"""Structure checks over `upr_cli/` (issues 17 and 28, "Done when"), AST based and fast.

1. No function or method is over 100 lines, except spec-shaped ones that say so: a
   comment containing `spec-shaped` on the def line or in the first lines of the body.
2. No numeric index of a DCP record outside `upr_cli/protocol/`. A record is read by
   field name (`rec.key`, never `rec[9]`). The heuristic, per function (lambdas and
   comprehensions included): a name holds a record when it is one of `item`, `it`,
   `rec`, `record`, `row`, `r`, or when it is the target of a loop or comprehension
   over something named `batch`, `records`, `run` or `chunk` (through `sorted(...)`,
   `.values()` and the like). A name is cleared when that function binds it from
   something that is not a record: a parameter annotated with a container of ints,
   str or dict; a name splatted into another row type (`DocRow(*r)`: a storage row
   in that type's order); a value or loop source calling `execute`/`fetch*` (SQLite rows),
   `split`/`partition`, `loads` or `getsockname`; a source mentioning a cluster map
   (`...map...`); or a name tested with `isinstance(name, list | dict | str)` (parsed
   JSON). Flagged: a subscript of a record name by an int constant or an int-constant
   slice, and a `type: ignore` comment on a line subscripting a record name at all.
3. No literal opcode outside `upr_cli/protocol/`: a hex literal equal to a memcached
   or DCP opcode compared with a name such as `op`, `opcode` or `..._op`, used as a
   key or member of an opcode table (`OPS = {...}`), assigned to such a name
   (`OP_MUTATION = 0x57`, a second definition), or passed as `opcode=`; and any
   hex literal in 0x50-0x65 (the DCP range) written in a comparison.
4. No second definition of the wire vocabulary outside `upr_cli/protocol/` (issue 28):
   the DCP flags and stream-end statuses of `protocol/dcp.py`, the `Status` codes and
   the `Datatype` bits. A constant is `NAME = <int>` at module level or in a class body
   (enum members included; tuple assignments too), where `<int>` is an int literal or
   an expression of int literals (`0x04 | 0x100`); a value computed from a name
   (`Status.KEY_EEXISTS`, `OPEN_XATTRS | OPEN_DELETED_USER_XATTRS`) is a use, not a
   definition. Leading underscores are ignored. A constant re-declares an entry when
     a. it has the entry's name (`END_OK = 0`, `XATTR_EINVAL = 0x87`, `JSON = 0x01`),
        whatever its value; or
     b. it has the entry's value and the same stem, the words of the name after any
        leading family words (OPEN, S, FLAG, STREAM, END, MARKER, SNAPSHOT, STATUS,
        SUBDOC, DATATYPE, DCP), provided the stem has two words or more or the
        constant's name starts with a family word too: `FLAG_FROM_LATEST = 0x40` is
        `S_FROM_LATEST`, `PATH_ENOENT = 0xC0` is `SUBDOC_PATH_ENOENT` and
        `STREAM_CLOSED = 1` is `END_CLOSED`, but `CLOSED = 1` in a connection's state
        enum or `BATCH_ITEMS = 512` (0x200, a DCP_OPEN flag) is left alone; or
     c. it is a `status` attribute (`status = 0x87` in a `StatusError` subclass)
        holding a non-zero status code.
   A value alone (0, 1, 0x40…) is never enough: ordinary constants share them.
5. No datatype bit written as a literal outside `upr_cli/protocol/`: a non-zero int
   literal combined by `&`, `|` or `^` (or `&=`, `|=`), or compared, with an operand
   whose name ends in `datatype` (`rec.datatype & 0x01`, `datatype & 0x03 == 0x01`,
   `rec[R_DATATYPE] | 4`), passed as `datatype=` or assigned to such a name. 0 (raw) is
   allowed. Literals reaching a datatype through another name (a table of bits, a
   variable named `dt`) are not seen.

6. No class is over 500 lines (issue 28): a class that grows past it holds more than
   one job; split it by job (as the consumer's state machine, the node's handler
   families and the repository's manifests and sweep were).

Each check reports `path:line` of its offenders. The checkers themselves are tested
below on small snippets, so a check that passes does so for the right reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from upr_cli.protocol import dcp
from upr_cli.protocol.header import Datatype, Opcode
from upr_cli.protocol.status import Status

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "upr_cli"
PROTOCOL = PACKAGE / "protocol"
MAX_LINES = 100
MAX_CLASS_LINES = 500
MARK_LINES = 3  # the def line and this many lines after it may carry the mark

RECORD_NAMES = frozenset({"item", "it", "rec", "record", "row", "r"})
RECORD_SOURCES = frozenset({"batch", "records", "run", "chunk"})
NON_RECORD_CALLS = re.compile(r"^(execute\w*|fetch\w*|_fetch\w*|r?split|r?partition|loads|"
                              r"getsockname)$")  # fmt: skip
NON_RECORD_ANNOTATION = re.compile(r"^(list|Sequence|tuple)\[(int|str)|^(str|bytes|int|dict)")
OPCODE_NAME = re.compile(r"(^|_)(op|opcode|cmd)s?($|_)", re.IGNORECASE)
OPCODES = frozenset(int(o) for o in Opcode)
DCP_RANGE = range(0x50, 0x66)

FAMILY_WORDS = frozenset({"OPEN", "S", "FLAG", "STREAM", "END", "MARKER", "SNAPSHOT", "STATUS",
                          "SUBDOC", "DATATYPE", "DCP"})  # fmt: skip
DATATYPE_NAME = re.compile(r"datatype$", re.IGNORECASE)

Func = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _sources() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if PROTOCOL not in path.parents:
            yield path, path.read_text(encoding="utf-8")


def _rel(path: Path | str) -> str:
    return str(Path(path).relative_to(ROOT)) if isinstance(path, Path) else path


# -- 1. function length ------------------------------------------------------------


def long_classes(source: str, where: str = "<snippet>") -> list[str]:
    """`where:line name (N lines)` for every class over MAX_CLASS_LINES lines, nested
    classes included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_CLASS_LINES:
                out.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return out


def long_functions(source: str, where: str = "<snippet>") -> list[str]:
    """`where:line name (N lines)` for every unmarked function over MAX_LINES lines."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length <= MAX_LINES:
            continue
        head = lines[node.lineno - 1 : node.body[0].lineno + MARK_LINES - 1]
        if any("#" in ln and "spec-shaped" in ln.split("#", 1)[1] for ln in head):
            continue
        out.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return out


# -- 2. numeric record indexes ---------------------------------------------------------


def _root(expr: ast.expr) -> str | None:
    """The identifier a loop iterates: `batch`, `self.records`, `sorted(run, ...)`,
    `latest.values()` → batch, records, run, latest."""
    while True:
        if isinstance(expr, ast.Name):
            return expr.id
        if isinstance(expr, ast.Attribute):
            return expr.attr
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr in ("values", "copy"):
                expr = func.value
            elif isinstance(func, ast.Name) and func.id in ("sorted", "reversed", "list", "iter") \
                    and expr.args:  # fmt: skip
                expr = expr.args[0]
            else:
                return None
        elif isinstance(expr, ast.Subscript):
            expr = expr.value
        else:
            return None


def _not_a_record(expr: ast.AST, cleared: set[str]) -> bool:
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if NON_RECORD_CALLS.match(name):
                return True
        ident = sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)
        if isinstance(ident, str) and ("map" in ident.lower() or ident in cleared):
            return True
    return False


def _targets(target: ast.expr) -> Iterator[str]:
    for sub in ast.walk(target):
        if isinstance(sub, ast.Name):
            yield sub.id


def _scope_nodes(func: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function, not of the functions nested in it (they are scopes too)."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _record_names(func: Func) -> set[str]:
    nodes = list(_scope_nodes(func))
    names = set(RECORD_NAMES)
    cleared: set[str] = set()
    args = func.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        if a.annotation is not None and NON_RECORD_ANNOTATION.match(ast.unparse(a.annotation)):
            cleared.add(a.arg)
    for _ in range(2):  # a source cleared on the first pass clears its loop targets
        for node in nodes:
            if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                if _root(node.iter) in RECORD_SOURCES:
                    names.update(_targets(node.target))
                if _not_a_record(node.iter, cleared):
                    cleared.update(_targets(node.target))
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
                value = node.value
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if value is not None and _not_a_record(value, cleared):
                    for t in targets:
                        cleared.update(_targets(t))
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "").endswith("Row")
                  and node.args and isinstance(node.args[0], ast.Starred)
                  and isinstance(node.args[0].value, ast.Name)):  # fmt: skip
                cleared.add(node.args[0].value.id)  # `DocRow(*r)`: r is in that row's order
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"
                  and len(node.args) == 2 and isinstance(node.args[0], ast.Name)):  # fmt: skip
                kinds = {getattr(k, "id", "") for k in ast.walk(node.args[1])}
                if kinds & {"list", "dict", "str"}:
                    cleared.add(node.args[0].id)
    return names - cleared


def _int_index(index: ast.expr) -> bool:
    def const(e: ast.expr | None) -> bool:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            e = e.operand
        return isinstance(e, ast.Constant) and type(e.value) is int

    if isinstance(index, ast.Slice):
        bounds = [index.lower, index.upper]
        return any(b is not None for b in bounds) and all(b is None or const(b) for b in bounds)
    return const(index)


def _ignored_lines(source: str) -> set[int]:
    out = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and "type: ignore" in tok.string:
            out.add(tok.start[0])
    return out


def record_indexes(source: str, where: str = "<snippet>") -> list[str]:
    """`where:line` of numeric subscripts of record names (and `type: ignore` on lines
    subscripting them)."""
    ignored = _ignored_lines(source)
    found: set[int] = set()
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        names = _record_names(func)
        for node in _scope_nodes(func):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
                and (_int_index(node.slice) or node.lineno in ignored)
            ):
                found.add(node.lineno)
    return [f"{where}:{line}" for line in sorted(found)]


# -- 3. literal opcodes ---------------------------------------------------------------


def _hex_literals(node: ast.AST, source: str) -> Iterator[ast.Constant]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and type(sub.value) is int:
            text = ast.get_source_segment(source, sub) or ""
            if text.lower().startswith("0x"):
                yield sub


def _names_op(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        ident = sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)
        if isinstance(ident, str) and OPCODE_NAME.search(ident):
            return True
    return False


def literal_opcodes(source: str, where: str = "<snippet>") -> list[str]:
    """`where:line` of hex literals used as opcodes."""
    found: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for side in sides:
                others = [s for s in sides if s is not side]
                for lit in _hex_literals(side, source):
                    if lit.value in DCP_RANGE or (
                        lit.value in OPCODES and any(_names_op(o) for o in others)
                    ):
                        found.add(lit.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "opcode":
            found.update(c.lineno for c in _hex_literals(node.value, source)
                         if c.value in OPCODES)  # fmt: skip
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            table = node.value
            if any(_names_op(t) for t in targets) and isinstance(table, ast.Constant | ast.Tuple):
                # `OP_MUTATION = 0x57`: a second definition of what protocol/ names
                found.update(c.lineno for c in _hex_literals(table, source) if c.value in OPCODES)
            if any(_names_op(t) for t in targets) and isinstance(table, ast.Dict | ast.Set):
                members = table.keys if isinstance(table, ast.Dict) else table.elts
                for m in members:
                    if m is not None:
                        found.update(c.lineno for c in _hex_literals(m, source)
                                     if c.value in OPCODES)  # fmt: skip
    return [f"{where}:{line}" for line in sorted(found)]


# -- 4. the wire vocabulary defined twice ------------------------------------------------


def vocabulary() -> dict[str, int]:
    """Name → value of every DCP flag, stream-end status, status code and datatype bit
    that protocol/ defines."""
    out = {n: v for n, v in vars(dcp).items() if n.isupper() and type(v) is int}
    out.update((s.name, int(s)) for s in Status)
    out.update((name, int(bit)) for name, bit in Datatype.__members__.items())
    return out


def _words(name: str) -> list[str]:
    return [w for w in name.upper().split("_") if w]


def _stem(words: list[str]) -> tuple[str, ...]:
    i = 0
    while i < len(words) and words[i] in FAMILY_WORDS:
        i += 1
    return tuple(words[i:])


def _int_value(expr: ast.expr | None) -> int | None:
    """The value of an int literal or of an expression of int literals, else None."""
    if isinstance(expr, ast.Constant):
        return expr.value if type(expr.value) is int else None
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub | ast.Invert):
        inner = _int_value(expr.operand)
        return None if inner is None else (-inner if isinstance(expr.op, ast.USub) else ~inner)
    if isinstance(expr, ast.BinOp):
        left, right = _int_value(expr.left), _int_value(expr.right)
        if left is None or right is None:
            return None
        ops = {ast.BitOr: int.__or__, ast.BitAnd: int.__and__, ast.BitXor: int.__xor__,
               ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__,
               ast.LShift: int.__lshift__}  # fmt: skip
        op = ops.get(type(expr.op))
        return None if op is None else op(left, right)
    return None


def _int_constants(tree: ast.Module) -> Iterator[tuple[str, int, int]]:
    """(name, value, line) of each `NAME = <int>` at module level or in a class body."""
    bodies = [tree.body] + [c.body for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    for body in bodies:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                pairs = [(t, stmt.value) for t in stmt.targets]
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                pairs = [(stmt.target, stmt.value)]
            else:
                continue
            while pairs:
                target, value = pairs.pop()
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                        and len(target.elts) == len(value.elts):  # fmt: skip
                    pairs.extend(zip(target.elts, value.elts, strict=True))
                elif isinstance(target, ast.Name) and (v := _int_value(value)) is not None:
                    yield target.id, v, stmt.lineno


def vocabulary_redeclarations(source: str, where: str = "<snippet>",
                              vocab: dict[str, int] | None = None) -> list[str]:  # fmt: skip
    """`where:line NAME (re-declares ENTRY)` for each int constant that defines again a
    name or a named value of the wire vocabulary (rules 4a-c of the module docstring)."""
    vocab = vocabulary() if vocab is None else vocab
    stems: dict[tuple[str, ...], dict[int, str]] = {}
    for name, value in vocab.items():
        stems.setdefault(_stem(_words(name)), {}).setdefault(value, name)
    statuses = {int(s) for s in Status} - {0}
    out = []
    for name, value, line in _int_constants(ast.parse(source)):
        bare = name.lstrip("_")
        words = _words(bare)
        stem = _stem(words)
        if bare.upper() == bare and bare in vocab:
            entry: str | None = bare
        elif bare.upper() == bare and (len(stem) > 1 or (stem and len(stem) < len(words))):
            entry = stems.get(stem, {}).get(value)
        elif words and words[-1] == "STATUS" and value in statuses:
            entry = Status(value).name
        else:
            entry = None
        if entry is not None:
            out.append(f"{where}:{line} {name} (re-declares {entry})")
    return out


# -- 5. datatype bits as literals --------------------------------------------------------


def _is_datatype(expr: ast.AST) -> bool:
    """An operand that holds a datatype: a name or attribute ending in `datatype`, or a
    subscript by one (`rec[R_DATATYPE]`), or an operation on one."""
    for sub in ast.walk(expr):
        ident = sub.id if isinstance(sub, ast.Name) else getattr(sub, "attr", None)
        if isinstance(ident, str) and DATATYPE_NAME.search(ident):
            return True
    return False


def _bit_literal(expr: ast.expr) -> bool:
    value = _int_value(expr)
    return value is not None and value != 0


def datatype_literals(source: str, where: str = "<snippet>") -> list[str]:
    """`where:line` of non-zero int literals used as datatype bits (rule 5)."""
    found: set[int] = set()
    bit_ops = ast.BitAnd | ast.BitOr | ast.BitXor
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, bit_ops):
            for side, other in ((node.left, node.right), (node.right, node.left)):
                if _bit_literal(side) and _is_datatype(other):
                    found.add(side.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, bit_ops):
            if _bit_literal(node.value) and _is_datatype(node.target):
                found.add(node.value.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_datatype(s) for s in sides):
                found.update(s.lineno for s in sides if _bit_literal(s))
        elif isinstance(node, ast.keyword) and node.arg is not None:
            if DATATYPE_NAME.search(node.arg) and _bit_literal(node.value):
                found.add(node.value.lineno)
        elif (
            isinstance(node, ast.Assign)
            and _bit_literal(node.value)
            and any(isinstance(t, ast.Name) and DATATYPE_NAME.search(t.id) for t in node.targets)
        ):
            found.add(node.lineno)
    return [f"{where}:{line}" for line in sorted(found)]


# -- the checkers on snippets -----------------------------------------------------------

_LONG_BODY = "".join(f"    x{i} = {i}\n" for i in range(101))


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        (f"def f():\n{_LONG_BODY}", 1),
        (f"async def f():\n{_LONG_BODY}", 1),
        (f"class C:\n    def m(self):\n    {_LONG_BODY.replace(chr(10), chr(10) + '    ')}", 1),
        (f"def f():  # spec-shaped: the UPR rule in order\n{_LONG_BODY}", 0),
        (f'def f():\n    """Doc."""\n    # spec-shaped (the decoder\'s table)\n{_LONG_BODY}', 0),
        ("def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(99)), 0),
        ("def f():\n" + _LONG_BODY[:-1] + "  # spec-shaped, but too far down\n", 1),
    ],
)  # fmt: skip
def test_long_functions_checker(source: str, flagged: int) -> None:
    assert len(long_functions(source)) == flagged, long_functions(source)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("class C:\n" + "".join(f"    x{i} = {i}\n" for i in range(499)), 0),  # 500 lines
        ("class C:\n" + "".join(f"    x{i} = {i}\n" for i in range(500)), 1),  # 501
        ("def f():\n    class C:\n" + "".join(f"        x{i} = {i}\n" for i in range(520)), 1),
        ("".join(f"x{i} = {i}\n" for i in range(900)), 0),  # a long module is not a class
    ],
)  # fmt: skip
def test_long_classes_checker(source: str, flagged: int) -> None:
    assert len(long_classes(source)) == flagged, long_classes(source)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(batch):\n    for item in batch:\n        k = item[9]\n", 1),
        ("def f(batch):\n    for x in batch:\n        k = x[9]\n", 1),
        ("def f(rows):\n    return [r[1] for r in rows]\n", 1),
        ("def f(s):\n    return sorted(s.records, key=lambda r: r[1])\n", 1),
        ("def f(batch):\n    for it in batch:\n        op, vb, seq = it[:3]\n", 1),
        ("def f(batch):\n    for it in batch:\n        seq = it[2]  # type: ignore[index]\n", 1),
        ("def f(b):\n    for rec in b:\n        v = rec[n]  # type: ignore[index]\n", 1),
        ("def f(rec):\n    return rec[-1]\n", 1),
        # legitimate: named fields, non-record names, SQLite rows, split parts, JSON, maps
        ("def f(batch):\n    for item in batch:\n        k = item.key\n", 0),
        ("def f(text):\n    parts = text.split(':')\n    return parts[0]\n", 0),
        ("def f(db):\n    row = db.execute('q').fetchone()\n    return row[0]\n", 0),
        ("def f(db):\n    rows = db.execute('q').fetchall()\n    return [r[0] for r in rows]\n", 0),
        ("def f(line):\n    r = line.split()\n    return r[1]\n", 0),
        ("def f(obj):\n    for item in obj:\n        if isinstance(item, list):\n"
         "            return item[0]\n", 0),
        ("def f(cl, p):\n    row = cl.vbmap[p]\n    return row[0]\n", 0),
        ("def active_of(row: list[int]) -> int:\n    return row[0] if row else -1\n", 0),
        ("def f(pairs):\n    return [p[0] for p in pairs]\n", 0),
        ("def f(batch):\n    for item in batch:\n        k = item[key]\n", 0),
        ("def f(rows):\n    if any(r[8] for r in rows):\n"
         "        return [DocRow(*r) for r in rows]\n", 0),
    ],
)  # fmt: skip
def test_record_index_checker(source: str, flagged: int) -> None:
    assert len(record_indexes(source)) == flagged, record_indexes(source)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(r):\n    return r.opcode == 0x57\n", 1),
        ("def f(op):\n    return op in (0x57, 0x58)\n", 1),
        ("def f(rec):\n    return rec[0] != 0x57\n", 1),  # DCP range, any comparison
        ("def f(x):\n    return 0x5f == x.kind\n", 1),
        ("_DATA_OPS = {0x57, 0x58, 0x59}\n", 1),
        ("NAMES = {0x57: 'mutation'}\nOPCODE_NAMES = {0x57: 'mutation'}\n", 1),
        ("def f():\n    return Response(opcode=0x5E, opaque=1)\n", 1),
        ("OP_MUTATION, OP_DELETION = 0x57, 0x58\n", 1),
        # legitimate: named opcodes, flags and statuses, decimal numbers, plain constants
        ("def f(r):\n    return r.opcode == Opcode.DCP_MUTATION\n", 0),
        ("def f(flags):\n    return flags & 0x01 == 0x01\n", 0),
        ("def f(status):\n    return status == 0x20\n", 0),
        ("def f(n):\n    return n > 87\n", 0),
        ("MASK = 0x57\n", 0),
        ("def f(opaque):\n    return opaque == 0x1000_0000\n", 0),
    ],
)  # fmt: skip
def test_literal_opcode_checker(source: str, flagged: int) -> None:
    assert len(literal_opcodes(source)) == flagged, literal_opcodes(source)


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("END_OK, END_CLOSED, END_FILTER_EMPTY = 0, 1, 7\n", 3),
        ("OPEN_XATTRS = 0x04 | 0x100\nOPEN_PRODUCER: Final = 0x01\n", 2),
        ("FLAG_FROM_LATEST = 0x40\nFLAG_ACTIVE_ONLY = 0x10\n", 2),  # S_FROM_LATEST...
        ("STREAM_CLOSED = 1\n", 1),  # a family word and END_CLOSED's stem and value
        ("class Code(IntEnum):\n    SUCCESS = 0x00\n    PATH_ENOENT = 0xC0\n", 2),
        ("_JSON = 0x01\nclass Dt(IntFlag):\n    SNAPPY = 2\n", 2),
        ("ROLLBACK = 3\n", 1),  # the name alone: another meaning for a protocol name
        ("class XattrInvalid(StatusError):\n    status = 0x87\n", 1),
        # legitimate: uses of the vocabulary, ordinary constants that share a value
        ("OPEN_XATTRS = OPEN_INCLUDE_XATTRS | OPEN_DELETED_USER_XATTRS\n", 0),
        ("class Code(IntEnum):\n    PATH_ENOENT = Status.SUBDOC_PATH_ENOENT\n", 0),
        ("class E(StatusError):\n    status = int(Status.KEY_EEXISTS)\n", 0),
        ("class Link(IntEnum):\n    OPEN = 0\n    CLOSED = 1\n", 0),
        ("class Exit(IntEnum):\n    OK = 0\n    FAILED = 1\n    USAGE = 2\n", 0),
        ("BATCH_ITEMS = 512\nKEEP_BOUNDARIES = 256\nMAX_TTL = 0x7FFF_FFFF\n", 0),
        ("ACTIVE, REPLICA, PENDING, DEAD = 1, 2, 3, 4\nFORCE = 0x01\n", 0),
        ("def f():\n    END_OK = 0\n    return END_OK\n", 0),  # a local, not a definition
    ],
)  # fmt: skip
def test_vocabulary_redeclaration_checker(source: str, flagged: int) -> None:
    found = vocabulary_redeclarations(source)
    assert len(found) == flagged, found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(rec):\n    return rec.datatype & 0x01\n", 1),
        ("def f(datatype):\n    return datatype & 0x03 == 0x01\n", 1),
        ("def f(rec):\n    return rec[R_DATATYPE] | 4\n", 1),
        ("def f(d):\n    d.datatype |= 0x04\n", 1),
        ("def f():\n    return Response(opcode=op, value=b'{}', datatype=1)\n", 1),
        ("datatype = 0x02\n", 1),
        ("def f(a, b):\n    if a.datatype == 1:\n        return b.datatype ^ 2\n", 2),
        # legitimate: named bits, raw (0), literals on other fields
        ("def f(rec):\n    return rec.datatype & DATATYPE_JSON\n", 0),
        ("def f(datatype):\n    return datatype & ~SNAPPY, datatype | xattrs.XATTR\n", 0),
        ("def f():\n    return Response(opcode=op, datatype=0)\n", 0),
        ("def f(flags, rec):\n    return flags & 0x01, len(rec.value) & 1\n", 0),
    ],
)  # fmt: skip
def test_datatype_literal_checker(source: str, flagged: int) -> None:
    found = datatype_literals(source)
    assert len(found) == flagged, found


# -- the checks over upr_cli/ -------------------------------------------------------------


def test_no_function_over_100_lines_unless_marked_spec_shaped() -> None:
    found = [x for p, s in _sources() for x in long_functions(s, _rel(p))]
    assert not found, f"{len(found)} functions over {MAX_LINES} lines:\n" + "\n".join(found)


def test_no_class_over_500_lines() -> None:
    found = [x for p, s in _sources() for x in long_classes(s, _rel(p))]
    assert not found, f"{len(found)} classes over {MAX_CLASS_LINES} lines (split them by " \
        "job):\n" + "\n".join(found)  # fmt: skip


def test_no_numeric_index_of_a_record_outside_protocol() -> None:
    found = [x for p, s in _sources() for x in record_indexes(s, _rel(p))]
    assert not found, f"{len(found)} numeric record indexes (read fields by name):\n" + "\n".join(
        found
    )


def test_no_literal_opcode_outside_protocol() -> None:
    found = [x for p, s in _sources() for x in literal_opcodes(s, _rel(p))]
    assert not found, f"{len(found)} literal opcodes (use Opcode or OP_*):\n" + "\n".join(found)


def test_no_wire_vocabulary_defined_outside_protocol() -> None:
    vocab = vocabulary()
    found = [x for p, s in _sources() for x in vocabulary_redeclarations(s, _rel(p), vocab)]
    assert not found, f"{len(found)} DCP flags, statuses or datatype bits defined again " \
        "(import them from upr_cli/protocol/):\n" + "\n".join(found)  # fmt: skip


def test_no_datatype_bit_as_literal_outside_protocol() -> None:
    found = [x for p, s in _sources() for x in datatype_literals(s, _rel(p))]
    assert not found, f"{len(found)} datatype bits as literals (use Datatype, DATATYPE_JSON, " \
        "snappy.SNAPPY or xattrs.XATTR):\n" + "\n".join(found)  # fmt: skip
