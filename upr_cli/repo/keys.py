"""The keys of an encrypted repository: where the secret comes from, how it is stretched,
and the key slots of repo.json that wrap the one data key (formats/repository.md §10).

Theory of operation: a random 32-byte data key seals every file of the repository
(`upr_cli.repo.sealed`). The user's secret never touches data: it comes from (first
found) `--key-file`, `--key-command`, `UPR_KEY_FILE`, `UPR_PASSPHRASE`, as bytes with
one trailing newline removed (`echo pw > f` and `printf pw > f` are the same key), and
is stretched with Argon2id (its parameters and a random salt stored per slot) into a
key-encryption key. Each key slot holds the data key wrapped (AES-256-GCM) under one
stretched secret, its associated data binding the repository id and the slot id, so a
slot copied into another repository or renamed does not open. Unlocking tries each slot;
the key check (a constant sealed under a key derived from the data key) confirms a data
key handed over directly (`Access.data_keys`, a Spark executor's).

Adding, removing and rotating keys rewrite repo.json alone, in one atomic write: the
data key does not change, so a backup running meanwhile goes on sealing with it and
its files stay readable with every key repo.json lists afterwards. A leaked data key
needs a re-encrypting copy (`upr repo copy --encrypt`); a lost secret with no other
slot loses the repository.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from argon2.low_level import Type, hash_secret_raw
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from upr_cli.errors import ExitCode, os_error
from upr_cli.repo.access import Access
from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.names import format_time, parse_time
from upr_cli.repo.sealed import CHUNK_SIZE, EncryptedStorage
from upr_cli.storage import display_location

if TYPE_CHECKING:
    from upr_cli.repo.layout import RepoInfo, Repository

__all__ = [
    "CIPHER",
    "KDF",
    "BadKeySource",
    "Encryption",
    "EncryptionKeyError",
    "KdfParams",
    "KeySlot",
    "MissingKey",
    "WrongKey",
    "add_slot",
    "create_encrypted",
    "ensure_encrypted",
    "new_secret",
    "open_encrypted",
    "read_secret",
    "refuse_plain",
    "rewrite_slots",
    "unlock",
    "with_slots",
]

CIPHER = "AES-256-GCM"
"""The cipher of every sealed chunk and wrapped key."""
KDF = "argon2id"
"""The key-stretching function of every slot."""
KEY_COMMAND_TIMEOUT = 60.0
"""Seconds a `--key-command` may run."""
_WRAP_AAD = b"upr key slot v1\x00"
_CHECK = b"upr key check v1"


class EncryptionKeyError(RepositoryError):
    """No key, a wrong key or a key source that fails: bad input, exit 2, before the
    repository is read or written."""

    exit_code = ExitCode.USAGE


class MissingKey(EncryptionKeyError):
    """The repository is encrypted and no key source gave a secret."""


class WrongKey(EncryptionKeyError):
    """The secret opens none of the repository's key slots."""


class BadKeySource(EncryptionKeyError):
    """A key file that cannot be read, a key command that fails, an empty secret."""


@dataclass(frozen=True, slots=True)
class KdfParams:
    """Argon2id's parameters and salt of one slot."""

    time_cost: int = 3
    memory_kib: int = 64 * 1024
    parallelism: int = 4
    salt: bytes = b""

    def stretch(self, secret: bytes) -> bytes:
        """The 32-byte key-encryption key of `secret` (cached per process: a command that
        opens the repository twice stretches once)."""
        cache_key = (hashlib.sha256(secret).digest(), self)
        found = _STRETCHED.get(cache_key)
        if found is None:
            found = hash_secret_raw(secret, self.salt, time_cost=self.time_cost,
                                    memory_cost=self.memory_kib, parallelism=self.parallelism,
                                    hash_len=32, type=Type.ID)  # fmt: skip
            _STRETCHED[cache_key] = found
        return found

    def to_json(self) -> dict[str, object]:
        return {"name": KDF, "time_cost": self.time_cost, "memory_kib": self.memory_kib,
                "parallelism": self.parallelism, "salt": self.salt.hex()}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str) -> KdfParams:
        d = _object(data, where, {"name", "time_cost", "memory_kib", "parallelism", "salt"})
        if d["name"] != KDF:
            raise RepositoryError(f"{where}: kdf {d['name']!r} is not {KDF!r}")
        t, m, p = (_int(d[k], f"{where}.{k}") for k in ("time_cost", "memory_kib", "parallelism"))
        if m < 8 * p:
            raise RepositoryError(f"{where}.memory_kib: {m} is less than 8 KiB a lane")
        return cls(t, m, p, _hex(d["salt"], f"{where}.salt", 16))


_STRETCHED: dict[tuple[bytes, KdfParams], bytes] = {}


@dataclass(frozen=True, slots=True)
class KeySlot:
    """One secret's way in: the data key wrapped under the stretched secret."""

    id: str
    created: datetime
    kdf: KdfParams
    nonce: bytes
    wrapped: bytes

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "created": format_time(self.created), "kdf": self.kdf.to_json(),
                "nonce": self.nonce.hex(), "wrapped_key": self.wrapped.hex()}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str) -> KeySlot:
        d = _object(data, where, {"id", "created", "kdf", "nonce", "wrapped_key"})
        slot_id = d["id"]
        if not isinstance(slot_id, str) or not slot_id:
            raise RepositoryError(f"{where}.id: {slot_id!r} is not a slot id")
        try:
            created = parse_time(str(d["created"]))
        except RepositoryError as exc:
            raise RepositoryError(f"{where}.created: {exc}") from None
        return cls(slot_id, created, KdfParams.from_json(d["kdf"], f"{where}.kdf"),
                   _hex(d["nonce"], f"{where}.nonce", 12),
                   _hex(d["wrapped_key"], f"{where}.wrapped_key", 48))  # fmt: skip

    def unwrap(self, secret: bytes, repo_id: bytes) -> bytes | None:
        """The data key, when `secret` is this slot's."""
        aes = AESGCM(self.kdf.stretch(secret))
        try:
            return aes.decrypt(self.nonce, self.wrapped, _slot_aad(repo_id, self.id))
        except InvalidTag:
            return None


@dataclass(frozen=True, slots=True)
class Encryption:
    """repo.json's `encryption` object."""

    chunk_size: int
    key_check: bytes
    keys: tuple[KeySlot, ...]
    cipher: str = CIPHER

    def to_json(self) -> dict[str, object]:
        return {"cipher": self.cipher, "chunk_size": self.chunk_size,
                "key_check": self.key_check.hex(),
                "keys": [k.to_json() for k in self.keys]}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str) -> Encryption:
        d = _object(data, where, {"cipher", "chunk_size", "key_check", "keys"})
        if d["cipher"] != CIPHER:
            raise RepositoryError(f"{where}.cipher: {d['cipher']!r} is not {CIPHER!r}")
        chunk = _int(d["chunk_size"], f"{where}.chunk_size")
        if not 1024 <= chunk <= 1 << 24:
            raise RepositoryError(f"{where}.chunk_size: {chunk} is not in [1024, 16 MiB]")
        slots = d["keys"]
        if not isinstance(slots, list) or not slots:
            raise RepositoryError(f"{where}.keys: expected a list of key slots")
        keys = tuple(KeySlot.from_json(s, f"{where}.keys[{i}]") for i, s in enumerate(slots))
        if len({k.id for k in keys}) != len(keys):
            raise RepositoryError(f"{where}.keys: two slots have one id")
        return cls(chunk, _hex(d["key_check"], f"{where}.key_check", 12 + len(_CHECK) + 16),
                   keys)  # fmt: skip


def _object(data: object, where: str, keys: set[str]) -> dict[str, object]:
    if not isinstance(data, dict) or set(data) != keys:
        raise RepositoryError(f"{where}: expected keys {', '.join(sorted(keys))}")
    return data


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RepositoryError(f"{where}: {value!r} is not a positive integer")
    return value


def _hex(value: object, where: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != size:
        raise RepositoryError(f"{where}: expected {size} bytes in hex")
    return raw


def _slot_aad(repo_id: bytes, slot_id: str) -> bytes:
    return _WRAP_AAD + repo_id + slot_id.encode()


def _check_key(data_key: bytes) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_CHECK)
    return AESGCM(hkdf.derive(data_key))


def key_check(data_key: bytes, repo_id: bytes) -> bytes:
    """The key check of repo.json: a constant sealed under a key derived from the data key."""
    nonce = secrets.token_bytes(12)
    return nonce + _check_key(data_key).encrypt(nonce, _CHECK, repo_id)


def checks(data_key: bytes, repo_id: bytes, check: bytes) -> bool:
    """True when `data_key` is the one the key check was made with."""
    try:
        return _check_key(data_key).decrypt(check[:12], check[12:], repo_id) == _CHECK
    except InvalidTag:
        return False


def new_slot(secret: bytes, data_key: bytes, repo_id: bytes,
             taken: Sequence[str] = ()) -> KeySlot:  # fmt: skip
    """A key slot wrapping `data_key` under `secret` (a new salt, a new id)."""
    slot_id = secrets.token_hex(4)
    while slot_id in taken:
        slot_id = secrets.token_hex(4)
    kdf = KdfParams(salt=secrets.token_bytes(16))
    nonce = secrets.token_bytes(12)
    wrapped = AESGCM(kdf.stretch(secret)).encrypt(nonce, data_key, _slot_aad(repo_id, slot_id))
    return KeySlot(slot_id, datetime.now(UTC), kdf, nonce, wrapped)


# -- secrets -------------------------------------------------------------------------


def _strip(raw: bytes, what: str) -> bytes:
    secret = raw[:-1] if raw.endswith(b"\n") else raw
    if not secret:
        raise BadKeySource(f"{what} is empty: a key needs at least one byte")
    return secret


def _from_file(path: Path, what: str) -> bytes:
    try:
        return _strip(path.read_bytes(), f"{what} {path}")
    except OSError as exc:
        raise BadKeySource(f"{what} {path}: cannot read: {exc.strerror or exc}") from None


def _from_command(command: str, what: str) -> bytes:
    try:
        done = subprocess.run(command, shell=True, capture_output=True, check=False,
                              timeout=KEY_COMMAND_TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise BadKeySource(f"{what} did not finish in {KEY_COMMAND_TIMEOUT:.0f} s") from None
    except OSError as exc:
        raise BadKeySource(f"{what}: cannot run: {exc.strerror or exc}") from None
    if done.returncode:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        why = f": {lines[-1]}" if lines else ""
        raise BadKeySource(f"{what} exited with status {done.returncode}{why}")
    return _strip(done.stdout, f"the output of {what}")


def read_secret(access: Access) -> bytes | None:
    """The secret of (first found) `--key-file`, `--key-command`, `UPR_KEY_FILE`,
    `UPR_PASSPHRASE`, one trailing newline removed; None when none is given."""
    if access.key_file is not None:
        return _from_file(access.key_file, "--key-file")
    if access.key_command is not None:
        return _from_command(access.key_command, "--key-command")
    env = os.environ.get("UPR_KEY_FILE")
    if env:
        return _from_file(Path(env), "UPR_KEY_FILE")
    phrase = os.environb.get(b"UPR_PASSPHRASE")
    if phrase is not None:
        return _strip(phrase, "UPR_PASSPHRASE")
    return None


def new_secret(key_file: Path | None, key_command: str | None) -> bytes:
    """The secret of a new key slot: `--new-key-file`, `--new-key-command` or
    `UPR_NEW_PASSPHRASE`, by the same rule as `read_secret`."""
    if key_file is not None:
        return _from_file(key_file, "--new-key-file")
    if key_command is not None:
        return _from_command(key_command, "--new-key-command")
    phrase = os.environb.get(b"UPR_NEW_PASSPHRASE")
    if phrase is not None:
        return _strip(phrase, "UPR_NEW_PASSPHRASE")
    raise BadKeySource(
        "no new key: give --new-key-file FILE, --new-key-command CMD or UPR_NEW_PASSPHRASE"
    )


def _need(where: str) -> str:
    return (f"{where}: the repository is encrypted: give its key with --key-file, "
            "--key-command, UPR_KEY_FILE or UPR_PASSPHRASE")  # fmt: skip


# -- opening and creating --------------------------------------------------------------


def unlock(info: RepoInfo, access: Access, where: str) -> tuple[bytes, KeySlot | None]:
    """The data key of the repository `info` describes, and the slot that gave it (None
    for a data key handed over in `access.data_keys`); `MissingKey` or `WrongKey`."""
    enc, repo_id = info.encryption, bytes.fromhex(info.id or "")
    assert enc is not None
    given = access.data_keys.get(info.id or "")
    if given is not None:
        if not checks(given, repo_id, enc.key_check):
            raise WrongKey(f"{where}: the data key given for repository {info.id} does not open it")
        return given, None
    secret = read_secret(access)
    if secret is None:
        raise MissingKey(_need(where))
    for slot in enc.keys:
        data_key = slot.unwrap(secret, repo_id)
        if data_key is not None and checks(data_key, repo_id, enc.key_check):
            return data_key, slot
    n = len(enc.keys)
    raise WrongKey(f"{where}: the key opens none of its {n} key slot{'s' * (n != 1)}")


def open_encrypted(repo: Repository, info: RepoInfo) -> EncryptedStorage:
    """The sealing storage of the encrypted repository `repo` (`info`: its repo.json),
    with the data key of `repo.access`."""
    assert info.encryption is not None and info.id is not None
    data_key, _slot = unlock(info, repo.access, display_location(repo.path))
    return EncryptedStorage(repo.backend, bytes.fromhex(info.id), data_key,
                            info.encryption.chunk_size)  # fmt: skip


def refuse_plain(repo: Repository) -> None:
    """`--encrypt` given for a repository: a plaintext one is refused, saying how to start
    an encrypted one; a missing one needs a key (nothing is created here)."""
    where = display_location(repo.path)
    info = repo.peek()
    if info is not None and info.encryption is None:
        raise EncryptionKeyError(
            f"{where}: --encrypt: the repository exists and is not encrypted; start an "
            f"encrypted one from it: upr repo copy --from {where} --to NEW --encrypt"
        )
    if info is None and read_secret(repo.access) is None:
        raise MissingKey(
            f"{where}: --encrypt needs a key: give --key-file, --key-command, UPR_KEY_FILE "
            "or UPR_PASSPHRASE (e.g. a key file: head -c 32 /dev/urandom > KEY)"
        )


def ensure_encrypted(repo: Repository) -> None:
    """`--encrypt`: an encrypted repository is used as it is (unlocked); a missing or
    empty one is created encrypted (`create_encrypted`); a plaintext one is refused."""
    refuse_plain(repo)
    if repo.peek() is None:
        create_encrypted(repo)
    repo.storage.stat(repo.path)  # unlocks: a wrong key fails here


def create_encrypted(repo: Repository) -> None:
    """Make the new (missing or empty) repository `repo` an encrypted one: a random data
    key and repository id, one key slot for the key of `repo.access`. Another process
    that created it meanwhile wins (its repo.json is then validated and unlocked)."""
    from upr_cli.repo.layout import REPO_ENCRYPTED, RepoInfo

    where = display_location(repo.path)
    secret = read_secret(repo.access)
    if secret is None:
        raise MissingKey(_need(where).replace("the repository is encrypted", "to encrypt it"))
    if repo.peek() is not None:
        raise RepositoryError(f"{where}: already a repository: an encrypted one is made new")
    repo.check_init()
    backend = repo.backend
    created_dir = backend.stat(repo.path, follow_links=True) is None
    try:
        backend.make_dirs(repo.path)
    except OSError as exc:
        raise os_error(exc, repo.path, "cannot create the repository") from None
    if created_dir:
        backend.sync_dir(repo.path.parent)
    data_key, repo_id = secrets.token_bytes(32), secrets.token_bytes(16)
    enc = Encryption(CHUNK_SIZE, key_check(data_key, repo_id),
                     (new_slot(secret, data_key, repo_id),))  # fmt: skip
    info = RepoInfo(REPO_ENCRYPTED, datetime.now(UTC), repo_id.hex(), enc)
    with contextlib.suppress(FileExistsError):
        backend.write_if_absent(repo.repo_file, info.dumps())
    repo.forget_storage()
    repo.info()


def rewrite_slots(repo: Repository, before: RepoInfo, keys: tuple[KeySlot, ...]) -> RepoInfo:
    """repo.json as `before` with `keys` as its key slots, in one atomic write (the data
    key and everything it sealed unchanged). A repo.json that changed since `before` was
    read (another key command) is left alone: the command is run again."""
    assert before.encryption is not None
    if repo.peek() != before:
        raise EncryptionKeyError(
            f"{display_location(repo.path)}: repo.json changed meanwhile (another key "
            "command?): nothing written; run it again"
        )
    new = replace(before, encryption=replace(before.encryption, keys=keys))
    repo.backend.write(repo.repo_file, new.dumps())
    return new


def add_slot(repo: Repository, secret: bytes) -> tuple[RepoInfo, KeySlot, KeySlot | None]:
    """A new slot for `secret`, added to the slots of repo.json (the repository's own key
    must open it): (the new repo.json, the new slot, the slot the key opened)."""
    info, data_key, opened = _unlocked(repo)
    assert info.encryption is not None and info.id is not None
    repo_id = bytes.fromhex(info.id)
    for slot in info.encryption.keys:
        if slot.unwrap(secret, repo_id) is not None:
            where = display_location(repo.path)
            raise BadKeySource(f"{where}: key slot {slot.id} has that key already")
    slot = new_slot(secret, data_key, repo_id, [k.id for k in info.encryption.keys])
    return info, slot, opened


def _unlocked(repo: Repository) -> tuple[RepoInfo, bytes, KeySlot | None]:
    info = repo.info()
    if info.encryption is None:
        raise EncryptionKeyError(f"{display_location(repo.path)}: the repository is not encrypted")
    data_key, slot = unlock(info, repo.access, display_location(repo.path))
    return info, data_key, slot


def with_slots(repo: Repository) -> tuple[RepoInfo, KeySlot | None]:
    """repo.json of the encrypted repository `repo` once its key opened it, and the slot
    that key opened."""
    info, _key, slot = _unlocked(repo)
    return info, slot
