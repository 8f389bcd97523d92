"""Ed25519 identities: key file lifecycle, signatures and their mallory cases, the keys CLI."""

import os
import stat
import subprocess
import sys

import pytest

from heterorl.protocol import Identity, load_identity, load_or_create_identity, verify

pytestmark = pytest.mark.fast  # in `make test-fast`


def test_key_file_created_once_with_0600_and_reused(tmp_path):
    path = tmp_path / "sub" / "id.key"
    first, created = load_or_create_identity(path)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created_again = load_or_create_identity(path)
    assert not created_again and again.public_key == first.public_key


def test_signatures_and_mallory():
    alice, bob = Identity.generate(), Identity.generate()
    msg = b"trajectory batch"
    sig = alice.sign(msg)
    assert verify(alice.public_key, sig, msg)
    assert not verify(bob.public_key, sig, msg)  # signed by someone else
    assert not verify(alice.public_key, sig, msg + b"!")  # tampered data
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert not verify(alice.public_key, flipped, msg)  # corrupted signature
    assert not verify(alice.public_key, b"", msg)  # unsigned
    assert not verify(b"short", sig, msg)


def test_world_readable_or_foreign_key_files_are_refused(tmp_path):
    path = tmp_path / "id.key"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_identity(path)
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ValueError, match="not a readable PEM"):
        load_identity(junk)


def test_keys_cli(tmp_path):
    key = tmp_path / "k.key"
    run = [sys.executable, "-m", "heterorl", "keys"]
    new = subprocess.run([*run, "new", "--key", str(key)], capture_output=True, text=True)
    assert new.returncode == 0
    show = subprocess.run([*run, "show", "--key", str(key)], capture_output=True, text=True)
    assert show.returncode == 0 and load_identity(key).public_key.hex() in show.stdout
    again = subprocess.run([*run, "new", "--key", str(key)], capture_output=True, text=True)
    assert again.returncode == 1 and "exists already" in again.stderr


def test_non_ed25519_key_file_is_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "ec.key"
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="not an Ed25519 key"):
        load_identity(path)
