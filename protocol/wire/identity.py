"""Ed25519 peer identities: a key file created on first use (mode 0600) and reused after.

Signing and verification go through ``cryptography``; nothing here touches the network.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
DEFAULT_KEY_PATH = Path("~/.heterorl/identity.key")


@dataclass(frozen=True)
class Identity:
    """A private Ed25519 key and its raw 32-byte public key."""

    private_key: Ed25519PrivateKey

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def fingerprint(self) -> str:
        """Short printable id: the first 16 hex digits of the public key."""
        return self.public_key.hex()[:16]

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``; never raises."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def save_identity(identity: Identity, path: str | Path) -> Path:
    """Write the private key (PKCS#8 PEM) to ``path`` with mode 0600, refusing to overwrite."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path


def load_identity(path: str | Path) -> Identity:
    """Read a key file; ValueError if it is not an Ed25519 private key or others can read it."""
    path = Path(path).expanduser()
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(f"key file {path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"key file {path} is not a readable PEM private key: {e}") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity(key)


def load_or_create_identity(path: str | Path = DEFAULT_KEY_PATH) -> tuple[Identity, bool]:
    """The identity at ``path``, created on first use; returns (identity, created)."""
    path = Path(path).expanduser()
    if path.exists():
        return load_identity(path), False
    identity = Identity.generate()
    save_identity(identity, path)
    return identity, True
