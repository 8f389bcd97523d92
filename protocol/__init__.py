"""What crosses the wire: identities and signatures now; message schemas, codec and DHT records next."""

from .identity import Identity, load_identity, load_or_create_identity, save_identity, verify

__all__ = ["Identity", "load_identity", "load_or_create_identity", "save_identity", "verify"]
