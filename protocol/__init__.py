"""What crosses the wire: identities, signed msgpack messages and their strict decoder.

DHT records, checkpoint chunks and trajectory streams are to come (issue 3).
"""

from .errors import ProtocolError
from .identity import Identity, load_identity, load_or_create_identity, save_identity, verify
from .messages import PROTOCOL_VERSION, decode, encode

__all__ = [
    "PROTOCOL_VERSION",
    "Identity",
    "ProtocolError",
    "decode",
    "encode",
    "load_identity",
    "load_or_create_identity",
    "save_identity",
    "verify",
]
