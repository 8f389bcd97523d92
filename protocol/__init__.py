"""What crosses the wire, and nothing else: identities, messages, DHT records, checkpoint and trajectory
streams.

Layers, bottom up (each module's docstring says more):

- :mod:`.identity` Ed25519 keys; :mod:`.messages` signed versioned msgpack and the one strict :func:`decode`;
  :mod:`.schema` the checks it applies;
- :mod:`.framing` length-capped frames on libp2p streams; :mod:`.dht` signed, schema-checked DHT records
  (a hivemind ``RecordValidator``); :mod:`.node` one go-libp2p daemon + hivemind DHT node per peer;
- :mod:`.checkpoint` + :mod:`.store` content-addressed chunks and manifests on disk; :mod:`.chunks` swarm
  fetch/serve of checkpoint versions;
- :mod:`.outbox` (sampler) + :mod:`.ledger` (learner) durable queues; :mod:`.trajectories` batch delivery
  with Ack/Reject and flow control.

Heavy modules (hivemind, sqlite stores) are imported from their own submodules, not from here.
"""

from .wire.errors import ProtocolError
from .wire.identity import Identity, load_identity, load_or_create_identity, save_identity, verify
from .wire.messages import PROTOCOL_VERSION, decode, encode

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
