"""Secret keys of a trust domain: where they come from, which one writes, which ones are accepted.

Keys never sit in a config's text. A remote tier's ``auth`` section names a file (``keys_file``) or an
environment variable (``keys_env``) that holds entries ``<key id>:<hex secret>`` — one per line in a file
(``#`` starts a comment), separated by commas or whitespace in a variable::

    # /etc/tierstore/keys  (mode 0600 or 0400: a file others may read is refused)
    k2:6f1c...64 hex digits...
    k1:93ab...

The first entry (or ``write_key``) seals new objects; every entry is accepted on reads, so keys rotate
without a flag day: add the new key below the old one everywhere, move it to the top (or name it in
``write_key``), and drop the old one once its objects are gone (``tierstore gc --older-than``).

With ``encrypt: true`` the payload of every object written is also encrypted (AES-256-GCM, see
:mod:`tierstore.sealing`), for tenants whose prompts must not be readable on shared storage.

Per-tenant keys come from one master secret by HKDF-SHA256 (RFC 5869): with ``tenant: acme`` each secret
is first replaced by ``HKDF(secret, info="tenant\\0acme")``. ``tierstore keygen --tenant acme`` prints the
same derived entries, so a deployment can be given its tenant's keys without the master.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

#: a key id: short, printable, safe in a JSON header and a log line
KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: the shortest secret accepted (128 bits); ``keygen`` makes 256-bit ones
MIN_SECRET = 16
SECRET_BYTES = 32
_SALT = b"tierstore keyring v1"
LEGACY_POLICIES = ("refuse", "read")


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32, salt: bytes = _SALT) -> bytes:
    """HKDF-SHA256 (RFC 5869): ``length`` bytes derived from ``secret`` for the purpose ``info``."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def tenant_secret(secret: bytes, tenant: str) -> bytes:
    """The secret of ``tenant`` under a master ``secret``."""
    return hkdf_sha256(secret, b"tenant\0" + tenant.encode())


def parse_entries(text: str, where: str) -> dict[str, bytes]:
    """``{key id: secret}`` from ``kid:hex`` entries (lines, commas or spaces; ``#`` comments), in order."""
    keys: dict[str, bytes] = {}
    for line in text.splitlines():
        for entry in line.split("#", 1)[0].replace(",", " ").split():
            kid, sep, hexed = entry.partition(":")
            if not sep or not KEY_ID.fullmatch(kid):
                raise ConfigError(f"{where}: expected entries '<key id>:<hex secret>' with ids of "
                                  f"[A-Za-z0-9._-], got {entry[:24]!r}...")
            try:
                secret = bytes.fromhex(hexed)
            except ValueError:
                raise ConfigError(f"{where}: the secret of key {kid!r} is not hex") from None
            if len(secret) < MIN_SECRET:
                raise ConfigError(f"{where}: the secret of key {kid!r} has {len(secret)} bytes; at least "
                                  f"{MIN_SECRET} are needed (`tierstore keygen` makes {SECRET_BYTES})")
            if kid in keys:
                raise ConfigError(f"{where}: key id {kid!r} is listed twice")
            keys[kid] = secret
    if not keys:
        raise ConfigError(f"{where}: holds no keys")
    return keys


def read_keys_file(path: str, where: str) -> dict[str, bytes]:
    """The entries of a key file, refused if other users may read or write it."""
    try:
        # O_NONBLOCK: a FIFO (or a device) opens at once and is refused below, instead of blocking the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot open {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: {path!r} is not a regular file")
        if st.st_mode & 0o007:
            raise ConfigError(f"{where}: {path!r} has mode {stat.filemode(st.st_mode)}, which lets every user "
                              f"read the keys; chmod 600 it (or 0400; for a Kubernetes secret defaultMode: 0400)")
        with os.fdopen(fd, encoding="ascii", errors="replace") as f:
            fd = -1
            return parse_entries(f.read(1 << 20), f"{where} ({path})")
    finally:
        if fd >= 0:
            os.close(fd)


def format_entries(keys: Mapping[str, bytes]) -> str:
    """Key entries in the file format :func:`parse_entries` reads."""
    return "".join(f"{kid}:{secret.hex()}\n" for kid, secret in keys.items())


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


@dataclass(frozen=True)
class Keyring:
    """The keys one trust domain seals and opens objects with.

    ``keys`` maps key ids to the secrets used (tenant-derived already, when a tenant is configured);
    ``write_id`` names the one that seals; ``legacy`` says whether unsealed objects (written before
    sealing was turned on) are read (``"read"``) or refused as forged (``"refuse"``, the default);
    ``encrypt`` whether objects written are also encrypted (objects read are decrypted either way).
    """

    keys: Mapping[str, bytes]
    write_id: str
    legacy: str = "refuse"
    encrypt: bool = False

    def __post_init__(self) -> None:
        # the MAC and encryption keys of each id, one derivation away from its secret (a tenant's secret
        # seals like a master)
        mac_keys = {kid: hkdf_sha256(secret, b"object mac\0blake3") for kid, secret in self.keys.items()}
        enc_keys = {kid: hkdf_sha256(secret, b"object encryption\0aes-256-gcm") for kid, secret in self.keys.items()}
        object.__setattr__(self, "_mac_keys", mac_keys)
        object.__setattr__(self, "_enc_keys", enc_keys)
        if not isinstance(self.encrypt, bool):
            raise ConfigError(f"auth.encrypt: expected true or false, got {self.encrypt!r}")
        if self.write_id not in self.keys:
            raise ConfigError(f"auth.write_key: {self.write_id!r} is not among the keys ({', '.join(self.keys)})")
        if self.legacy not in LEGACY_POLICIES:
            raise ConfigError(f"auth.legacy: expected one of {LEGACY_POLICIES}, got {self.legacy!r}")

    def mac_key(self, kid: str) -> bytes | None:
        """The 32-byte MAC key of ``kid``; ``None`` for an id this keyring does not accept."""
        key: bytes | None = self._mac_keys.get(kid)  # type: ignore[attr-defined]
        return key

    def encryption_key(self, kid: str) -> bytes | None:
        """The 32-byte key objects sealed with ``kid`` are encrypted under; ``None`` for an unknown id."""
        key: bytes | None = self._enc_keys.get(kid)  # type: ignore[attr-defined]
        return key

    def __repr__(self) -> str:  # never print secrets
        return (f"Keyring(ids={list(self.keys)}, write_id={self.write_id!r}, legacy={self.legacy!r}, "
                f"encrypt={self.encrypt})")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str = "auth") -> Keyring:
        """A keyring from a tier's ``auth`` options (see the module docstring); :class:`ConfigError` names
        what is wrong."""
        known = {"keys_file", "keys_env", "write_key", "tenant", "legacy", "encrypt"}
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(options).__name__}")
        unknown = set(options) - known
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(known))})")
        if ("keys_file" in options) == ("keys_env" in options):
            raise ConfigError(f"{where}: give exactly one of keys_file (a path) or keys_env (a variable name); "
                              f"keys never go in the config itself")
        if "keys_file" in options:
            path = options["keys_file"]
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ConfigError(f"{where}.keys_file: expected a path, got {path!r}")
            keys = read_keys_file(os.path.expanduser(os.fspath(path)), f"{where}.keys_file")
        else:
            name = options["keys_env"]
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}.keys_env: expected a variable name, got {name!r}")
            if name not in os.environ:
                raise ConfigError(f"{where}.keys_env: the environment variable {name} is not set")
            keys = parse_entries(os.environ[name], f"{where}.keys_env ({name})")
        tenant = options.get("tenant")
        if tenant is not None:
            if not isinstance(tenant, str) or not tenant or "\0" in tenant:
                raise ConfigError(f"{where}.tenant: expected a non-empty string, got {tenant!r}")
            keys = {kid: tenant_secret(secret, tenant) for kid, secret in keys.items()}
        write_id = options.get("write_key", next(iter(keys)))
        if not isinstance(write_id, str):
            raise ConfigError(f"{where}.write_key: expected a key id, got {write_id!r}")
        encrypt = options.get("encrypt", False)
        if encrypt is True:
            try:
                import cryptography  # noqa: F401
            except ImportError:
                raise ConfigError(f"{where}.encrypt needs the cryptography package (tierstore's 'encryption' "
                                  f"extra: pip install cryptography)") from None
        return cls(keys, write_id, options.get("legacy", "refuse"), encrypt)


def add_keygen_arguments(p: Any) -> None:
    p.add_argument("--id", default="k1", help="the new key's id (default k1)")
    p.add_argument("--tenant", help="instead of a new key: TENANT's keys derived from the --keys file")
    p.add_argument("--keys", help="the master key file to derive from (with --tenant)")
    p.add_argument("--out", help="write to this file, created with mode 0600 (default: print)")


def run_keygen(args: Any) -> int:
    """``tierstore keygen``: a new 256-bit key entry, or a tenant's derived entries."""
    if args.tenant is not None:
        if not args.keys:
            raise SystemExit("keygen --tenant needs --keys FILE (the master keys to derive from)")
        keys = {kid: tenant_secret(s, args.tenant) for kid, s in read_keys_file(args.keys, "--keys").items()}
    else:
        if not KEY_ID.fullmatch(args.id):
            raise SystemExit(f"--id {args.id!r}: use 1-64 of [A-Za-z0-9._-]")
        keys = {args.id: new_secret()}
    text = format_entries(keys)
    if args.out is None:
        print(text, end="")
        return 0
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return 0
