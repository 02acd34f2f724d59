"""`upr repo init`, `keys`, `add-key`, `remove-key`, `rotate-key`: create a repository
(encrypted with `--encrypt`) and manage the key slots of an encrypted one
(formats/repository.md §10, `upr_cli.repo.keys`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from upr_cli.cli.options import JsonOutput, Repo
from upr_cli.cli.output import hint, keep_whole, print_json, stdout, table
from upr_cli.errors import UsageError
from upr_cli.repo import keys
from upr_cli.repo.layout import RepoInfo, Repository
from upr_cli.storage import display_location

_KEYS = """Every key command takes the repository's key from (first found) --key-file,
--key-command, UPR_KEY_FILE or UPR_PASSPHRASE: the bytes, one trailing newline
removed. Exit status: 0 done; 2 bad input (no key, a wrong key, not a repository)."""

INIT_HELP = f"""Create a repository: a new or empty directory (or s3:// prefix).

--encrypt makes it encrypted at rest: a random data key seals every file but repo.json
and the lock files (AES-256-GCM), and the given key, stretched with Argon2id, opens its
first key slot. Keep a second key (add-key): a lost key loses every backup in it.

{_KEYS}

Example (a random 32-byte key file, then an encrypted repository):

  head -c 32 /dev/urandom > ~/.upr/cb.key
  upr repo init --repo /backups/cb --encrypt --key-file ~/.upr/cb.key

Example (a passphrase from the environment, summary as JSON):

  UPR_PASSPHRASE='long passphrase' upr repo init --repo /backups/cb --encrypt --json
"""

KEYS_HELP = """List the key slots of an encrypted repository: id and creation time.

Reading the list needs no key (repo.json is not sealed).

Example:

  upr repo keys --repo /backups/cb
"""

ADD_HELP = f"""Add a key slot: a second key that opens the repository.

The new key comes from --new-key-file, --new-key-command or UPR_NEW_PASSPHRASE (one
trailing newline removed); the repository's own key must open it first. Only
repo.json changes, in one atomic write: a backup running meanwhile is not disturbed.

{_KEYS}

Example (a spare key, kept somewhere else):

  head -c 32 /dev/urandom > spare.key
  upr repo add-key --repo /backups/cb --key-file cb.key --new-key-file spare.key
"""

REMOVE_HELP = f"""Remove a key slot (its id from upr repo keys); the last one is kept.

{_KEYS}

Example:

  upr repo remove-key 3f2a9c1e --repo /backups/cb --key-file cb.key
"""

ROTATE_HELP = f"""Replace the key given by a new one (its slot by a new slot).

A slot for the new key is added and the slot the given key opened is removed, in one
atomic write of repo.json. The data is not rewritten: the data key stays. A leaked
data key needs a re-encrypting copy instead (upr repo copy --from OLD --to NEW
--encrypt).

{_KEYS}

Example:

  upr repo rotate-key --repo /backups/cb --key-file old.key --new-key-file new.key
"""

NewKeyFile = Annotated[
    Path | None,
    typer.Option("--new-key-file", metavar="FILE", show_default=False,
                 help="The new key: this file's bytes (one trailing newline removed)."),
]  # fmt: skip
NewKeyCommand = Annotated[
    str | None,
    typer.Option("--new-key-command", metavar="CMD", show_default=False,
                 help="The new key: the output of this shell command."),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add the key commands to the `repo` group."""
    app.command("init", help=INIT_HELP, no_args_is_help=True)(init_cmd)
    app.command("keys", help=KEYS_HELP, no_args_is_help=True)(keys_cmd)
    app.command("add-key", help=ADD_HELP, no_args_is_help=True)(add_key_cmd)
    app.command("remove-key", help=REMOVE_HELP, no_args_is_help=True)(remove_key_cmd)
    app.command("rotate-key", help=ROTATE_HELP, no_args_is_help=True)(rotate_key_cmd)


def _slots(info: RepoInfo) -> list[dict[str, object]]:
    enc = info.encryption
    return [] if enc is None else [{"slot_id": k.id, "created_at": _time(k)} for k in enc.keys]


def _time(slot: keys.KeySlot) -> str:
    from upr_cli.repo.names import format_time

    return format_time(slot.created)


def _summary(repo: Repository, info: RepoInfo, **more: object) -> dict[str, object]:
    out: dict[str, object] = {
        "repo": display_location(repo.path),
        "version": info.version,
        "encrypted": info.encryption is not None,
    }
    if info.encryption is not None:
        out["repo_id"] = info.id
        out["key_slots"] = _slots(info)
    out.update(more)
    return out


def _encrypted(repo: Repository) -> RepoInfo:
    """repo.json of an encrypted repository, read without its key."""
    info = repo.peek()
    if info is None:
        repo.info()  # says why: no repository, a damaged repo.json
        raise UsageError(f"{display_location(repo.path)}: not a upr repository")
    if info.encryption is None:
        raise UsageError(f"{display_location(repo.path)}: the repository is not encrypted")
    return info


def init_cmd(
    repo: Repo,
    encrypt: Annotated[
        bool, typer.Option("--encrypt", help="Encrypt it at rest with the given key.")
    ] = False,
    json_out: JsonOutput = False,
) -> None:
    """Create a repository."""
    r = Repository(repo)
    where = display_location(r.path)
    if r.peek() is not None:
        raise UsageError(f"{where}: already a upr repository")
    if encrypt:
        keys.create_encrypted(r)
        info = r.info()
    else:
        info = r.init()
    if json_out:
        print_json(_summary(r, info))
        return
    if info.encryption is None:
        stdout.print(f"created repository {where}", markup=False)
        return
    slot = info.encryption.keys[0]
    stdout.print(f"created encrypted repository {where} (key slot {slot.id})", markup=False)
    hint(f"keep a second key: upr repo add-key --repo {where} --new-key-file FILE")


def keys_cmd(repo: Repo, json_out: JsonOutput = False) -> None:
    """List the key slots."""
    r = Repository(repo)
    info = _encrypted(r)
    if json_out:
        print_json(_summary(r, info))
        return
    t = table()
    t.add_column("slot")
    t.add_column("created")
    for s in _slots(info):
        t.add_row(str(s["slot_id"]), str(s["created_at"]))
    stdout.print(keep_whole(t))


def _new_slot(
    repo: Path, new_key_file: Path | None, new_key_command: str | None
) -> tuple[Repository, RepoInfo, keys.KeySlot, keys.KeySlot | None]:
    """The encrypted repository, its repo.json, a slot for the new key (not yet written)
    and the slot the given key opened (what add-key and rotate-key start from)."""
    r = Repository(repo)
    _encrypted(r)
    secret = keys.new_secret(new_key_file, new_key_command)
    info, slot, opened = keys.add_slot(r, secret)
    return r, info, slot, opened


def add_key_cmd(
    repo: Repo,
    new_key_file: NewKeyFile = None,
    new_key_command: NewKeyCommand = None,
    json_out: JsonOutput = False,
) -> None:
    """Add a key slot."""
    r, info, slot, _opened = _new_slot(repo, new_key_file, new_key_command)
    assert info.encryption is not None
    info = keys.rewrite_slots(r, info, (*info.encryption.keys, slot))
    _done(r, info, json_out, f"added key slot {slot.id}", slot_id=slot.id)


def remove_key_cmd(
    slot_id: Annotated[str, typer.Argument(metavar="ID", help="The slot to remove.")],
    repo: Repo,
    json_out: JsonOutput = False,
) -> None:
    """Remove a key slot."""
    r = Repository(repo)
    _encrypted(r)
    info, _opened = keys.with_slots(r)
    assert info.encryption is not None
    slots = info.encryption.keys
    where = display_location(r.path)
    if slot_id not in {k.id for k in slots}:
        have = ", ".join(k.id for k in slots)
        raise UsageError(f"{where}: no key slot {slot_id!r} (it has {have})")
    if len(slots) == 1:
        raise UsageError(
            f"{where}: slot {slot_id} is the last key slot: add another key first "
            "(upr repo add-key), or the repository cannot be opened again"
        )
    info = keys.rewrite_slots(r, info, tuple(k for k in slots if k.id != slot_id))
    _done(r, info, json_out, f"removed key slot {slot_id}", slot_id=slot_id)


def rotate_key_cmd(
    repo: Repo,
    new_key_file: NewKeyFile = None,
    new_key_command: NewKeyCommand = None,
    json_out: JsonOutput = False,
) -> None:
    """Replace the key."""
    r, info, slot, opened = _new_slot(repo, new_key_file, new_key_command)
    if opened is None:  # a data key handed over (an executor's), not a slot's key
        raise UsageError(f"{display_location(r.path)}: rotate-key needs the key of a slot")
    assert info.encryption is not None
    kept = tuple(k for k in info.encryption.keys if k.id != opened.id)
    info = keys.rewrite_slots(r, info, (*kept, slot))
    _done(r, info, json_out, f"key slot {opened.id} replaced by {slot.id}",
          slot_id=slot.id, replaced_slot_id=opened.id)  # fmt: skip


def _done(r: Repository, info: RepoInfo, json_out: bool, line: str, **more: object) -> None:
    if json_out:
        print_json(_summary(r, info, **more))
        return
    n = len(info.encryption.keys) if info.encryption is not None else 0
    stdout.print(f"{line} ({n} key slot{'s' * (n != 1)})", markup=False)
