"""Golden bytes: the exact wire form of every message kind, of a DHT record, a frame, a chunk request and a
checkpoint delta, from fixed keys and bodies (Ed25519 signatures are deterministic).

A failure here means the bytes peers exchange changed: a field renamed, reordered, retyped or resized, a
new envelope. Peers running the previous code would then refuse (or misread) the new bytes. If the change is
intended, bump PROTOCOL_VERSION (or the format's version string) and regenerate the literals below with
``python tests/test_wire_golden.py``, which prints them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import sys

import msgpack
import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord

from heterorl.protocol import Identity
from heterorl.protocol.net import chunks
from heterorl.protocol.net.dht import SignedRecordValidator, make_record, peers_key
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.wire import messages
from heterorl.protocol.wire.checkpoint import chunk_hash
from heterorl.protocol.wire.delta import apply_delta, encode_delta, read_header

pytestmark = pytest.mark.fast  # in `make test-fast`

SIGNER = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
OTHER = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))))
RUN = "golden-run"
BATCH_ID = bytes(range(16))
T = 1_700_000_000.25  # a timestamp: floats travel as msgpack float64


def _row(group: int, n: int) -> dict:
    return {
        "group": group,
        "prompt_ids": [1, 300, 70000],
        "completion_ids": list(range(5, 5 + n)),
        "logprobs": [-0.5 * (i + 1) for i in range(n)],
        "reward": 0.75 if group else -1.0,
    }


def _batch(**extra) -> dict:
    body = {"run_id": RUN, "batch_id": BATCH_ID, "policy_version": 42, "timestamp": T}
    return {**body, "rows": [_row(0, 2), _row(1, 3)], **extra}


def _manifest(**extra) -> dict:
    body = {
        "run_id": RUN,
        "version": 7,
        "parent_version": 6,
        "chunk_hashes": [hashlib.sha256(b"chunk0").digest(), hashlib.sha256(b"chunk1").digest()],
        "total_size": 5000,
        "dtype": "bfloat16",
        "chunk_bytes": 4096,
    }
    return {**body, **extra}


def _heartbeat(**extra) -> dict:
    body = {
        "run_id": RUN,
        "role": "sampler",
        "state": "generating",
        "policy_version": 41,
        "tokens_per_s": 123.5,
        "timestamp": T,
        "peer_id": "12D3KooWGolden",
        "maddrs": ["/ip4/10.0.0.2/tcp/31337", "/ip6/::1/tcp/31337"],
        "hardware": "cpu x2",
        "stats": messages.pack_stats({"outbox": 3, "reward": 0.5}),
    }
    return {**body, **extra}


DELTAS = [
    {
        "base_version": 5,
        "codec": "sparse-zstd",
        "chunk_hashes": [hashlib.sha256(b"delta0").digest()],
        "total_size": 321,
    }
]

# (message kind, body): every kind in messages.SCHEMAS, and each optional field once
MESSAGES = {
    "TrajectoryBatch": ("TrajectoryBatch", _batch()),
    "TrajectoryBatch+engine": ("TrajectoryBatch", _batch(engine="vllm", engine_dtype="bfloat16")),
    "TrajectoryBatch+manifest": (
        "TrajectoryBatch",
        _batch(manifest_sha256=hashlib.sha256(b"manifest").digest()),
    ),
    "CheckpointManifest": ("CheckpointManifest", _manifest()),
    "CheckpointManifest+deltas": ("CheckpointManifest", _manifest(deltas=DELTAS)),
    "CheckpointManifest+term": ("CheckpointManifest", _manifest(term=3)),
    "RunSpec": (
        "RunSpec",
        {
            "run_id": RUN,
            "model": "tiny",
            "initial_checkpoint": hashlib.sha256(b"initial").digest(),
            "task": "arithmetic",
            "reward": "arithmetic_exact",
            "objective": "gepo",
            "hyperparameters": json.dumps({"lr": 1e-5, "group_size": 8}, sort_keys=True),
            "sampling": {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 64},
            "learner_keys": [SIGNER.public_key, OTHER.public_key],
            "vocab_size": 49152,
            "max_batch_rows": 256,
        },
    ),
    "Heartbeat": ("Heartbeat", _heartbeat()),
    "Heartbeat+backend": ("Heartbeat", _heartbeat(backend="vllm 0.32.0, bfloat16, cuda")),
    "Heartbeat+lineage": (
        "Heartbeat",
        _heartbeat(role="learner", lineage={"term": 3, "writes": True, "applied": 41, "reserved": 57}),
    ),
    "Provider": (
        "Provider",
        {
            "run_id": RUN,
            "version": 7,
            "peer_id": "12D3KooWGolden",
            "maddrs": ["/ip4/10.0.0.2/tcp/31337"],
            "complete": True,
            "timestamp": T,
        },
    ),
    "Provider+dataset": (
        "Provider",
        {
            "run_id": RUN,
            "version": 0,
            "peer_id": "12D3KooWGolden",
            "maddrs": ["/ip4/10.0.0.2/tcp/31337"],
            "complete": True,
            "timestamp": T,
            "dataset": hashlib.sha256(b"dataset manifest").digest(),
        },
    ),
    "Ack": ("Ack", {"run_id": RUN, "batch_id": BATCH_ID}),
    "Reject": (
        "Reject",
        {"run_id": RUN, "batch_id": BATCH_ID, "reason": "buffer full", "retry_after_s": 2.0},
    ),
    "LineageHello": (
        "LineageHello",
        {
            "run_id": RUN,
            "peer_id": "12D3KooWGolden",
            "to_peer_id": "12D3KooWWriter",
            "schema": hashlib.sha256(b"schema").digest(),
            "version": 7,
            "state": hashlib.sha256(b"state 7").digest(),
            "term": 3,
        },
    ),
    "StateOffer": (
        "StateOffer",
        {
            "run_id": RUN,
            "term": 3,
            "version": 9,
            "state": hashlib.sha256(b"state 9").digest(),
            "weights_sha256": hashlib.sha256(b"weights").digest(),
            "optimizer_sha256": hashlib.sha256(b"optimizer").digest(),
            "trained_sha256": hashlib.sha256(BATCH_ID + bytes(32)).digest(),
            "trained_from": 4,
        },
    ),
    "Contribution": (
        "Contribution",
        {
            "run_id": RUN,
            "term": 3,
            "version": 7,
            "batches": [{"batch_id": BATCH_ID, "sha256": hashlib.sha256(b"batch").digest(), "tokens": 96}],
            "lr_scale": 1.0,
            "grad_sha256": hashlib.sha256(b"gradient").digest(),
        },
    ),
    "Commit": (
        "Commit",
        {
            "run_id": RUN,
            "term": 3,
            "version": 8,
            "parent_version": 7,
            "parent_state": hashlib.sha256(b"state 7").digest(),
            "state": hashlib.sha256(b"state 8").digest(),
            "applied": [
                {
                    "learner": OTHER.public_key,
                    "batches": [{"batch_id": BATCH_ID, "sha256": hashlib.sha256(b"batch").digest()}],
                }
            ],
            "tokens": 96,
            "lr_scale": 1.0,
            "update_sha256": hashlib.sha256(b"update").digest(),
            "grad_sha256": hashlib.sha256(b"reduced").digest(),
            "publish": True,
            "manifests": [b"a signed manifest"],
        },
    ),
    "LineageWait": (
        "LineageWait",
        {"run_id": RUN, "term": 3, "version": 7, "pending": True, "manifests": []},
    ),
    "LineageWait+refused": (
        "LineageWait",
        {
            "run_id": RUN,
            "term": 3,
            "version": 7,
            "pending": False,
            "manifests": [],
            "refused": {"batch_ids": [BATCH_ID], "reason": "it names batches the lineage trained"},
        },
    ),
    "LineageRefuse": ("LineageRefuse", {"run_id": RUN, "reason": "not one of the run's learner keys"}),
}


def _safetensors(tensors: list[tuple[str, str, list[int], bytes]]) -> bytes:
    """A safetensors file by hand (no torch): 8-byte header length, JSON header padded to 8, the data."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors)


PARENT = _safetensors(
    [
        ("a", "F32", [4], struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)),
        ("b", "BF16", [3], bytes.fromhex("803f0040403f")),
    ]
)
CHILD = _safetensors(
    [
        ("a", "F32", [4], struct.pack("<4f", 1.0, 2.5, 3.0, -4.0)),
        ("b", "BF16", [3], bytes.fromhex("803f0140403f")),
    ]
)
RECORD_EXPIRATION = T + 60.0


def record_bytes() -> tuple[bytes, bytes, bytes]:
    """(key id, subkey, signed value) of the DHT record a peer stores for the golden Heartbeat."""
    message = messages.encode("Heartbeat", MESSAGES["Heartbeat"][1], SIGNER)
    rec = make_record(peers_key(RUN), SIGNER.public_key, message, RECORD_EXPIRATION, SIGNER)
    return rec.key, rec.subkey, rec.value


class _Sink:
    def __init__(self):
        self.buf = bytearray()

    def write(self, b):
        self.buf += b

    async def drain(self):
        pass


def frame_bytes(payload: bytes) -> bytes:
    sink = _Sink()
    asyncio.run(write_frame(sink, payload))
    return bytes(sink.buf)


CHUNK_REQUEST = {"hashes": [chunk_hash(b"chunk0"), chunk_hash(b"chunk1")]}


# ---- the golden values (generated once from the code; see the module docstring) ----

GOLDEN_MESSAGES = {
    "TrajectoryBatch": (
        "85a17601a474797065af5472616a6563746f72794261746368a4626f647985a672756e5f6964aa676f6c64656e2d7275"
        "6ea862617463685f6964c410000102030405060708090a0b0c0d0e0fae706f6c6963795f76657273696f6e2aa974696d"
        "657374616d70cb41d954fc40100000a4726f77739285a567726f757000aa70726f6d70745f6964739301cd012cce0001"
        "1170ae636f6d706c6574696f6e5f696473920506a86c6f6770726f627392cbbfe0000000000000cbbff0000000000000"
        "a6726577617264cbbff000000000000085a567726f757001aa70726f6d70745f6964739301cd012cce00011170ae636f"
        "6d706c6574696f6e5f69647393050607a86c6f6770726f627393cbbfe0000000000000cbbff0000000000000cbbff800"
        "0000000000a6726577617264cb3fe8000000000000a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4"
        "d6309ba50d5f1ddc8664125531b8a3736967c4404e2c4ab038e2372b922375b552e6153704add1bb16bf701b3ac540a1"
        "28c53dee56cc753fa22ea523b5291f074401cead15592d1c4300eeaadebcc5ac8aaaf809"
    ),
    "TrajectoryBatch+engine": (
        "85a17601a474797065af5472616a6563746f72794261746368a4626f647987a672756e5f6964aa676f6c64656e2d7275"
        "6ea862617463685f6964c410000102030405060708090a0b0c0d0e0fae706f6c6963795f76657273696f6e2aa974696d"
        "657374616d70cb41d954fc40100000a4726f77739285a567726f757000aa70726f6d70745f6964739301cd012cce0001"
        "1170ae636f6d706c6574696f6e5f696473920506a86c6f6770726f627392cbbfe0000000000000cbbff0000000000000"
        "a6726577617264cbbff000000000000085a567726f757001aa70726f6d70745f6964739301cd012cce00011170ae636f"
        "6d706c6574696f6e5f69647393050607a86c6f6770726f627393cbbfe0000000000000cbbff0000000000000cbbff800"
        "0000000000a6726577617264cb3fe8000000000000a6656e67696e65a4766c6c6dac656e67696e655f6474797065a862"
        "666c6f61743136a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
        "a3736967c4406eb811a50a82d91cd4a50a032c0e0078ce076870fccb4ab2fa2a8d0d6a0a1171f7c19e9f40b2303ab991"
        "7adc55a3a57d1501fbe3ed59eb5904f2238f816bdd03"
    ),
    "TrajectoryBatch+manifest": (
        "85a17601a474797065af5472616a6563746f72794261746368a4626f647986a672756e5f6964aa676f6c64656e2d7275"
        "6ea862617463685f6964c410000102030405060708090a0b0c0d0e0fae706f6c6963795f76657273696f6e2aa974696d"
        "657374616d70cb41d954fc40100000a4726f77739285a567726f757000aa70726f6d70745f6964739301cd012cce0001"
        "1170ae636f6d706c6574696f6e5f696473920506a86c6f6770726f627392cbbfe0000000000000cbbff0000000000000"
        "a6726577617264cbbff000000000000085a567726f757001aa70726f6d70745f6964739301cd012cce00011170ae636f"
        "6d706c6574696f6e5f69647393050607a86c6f6770726f627393cbbfe0000000000000cbbff0000000000000cbbff800"
        "0000000000a6726577617264cb3fe8000000000000af6d616e69666573745f736861323536c42005b3abf2579a5eb664"
        "03cd78be557fd860633a1fe2103c7642030defe32c657fa6617574686f72c42003a107bff3ce10be1d70dd18e74bc099"
        "67e4d6309ba50d5f1ddc8664125531b8a3736967c44005ff107b82f0fd480e86028e69bef36abd938e6484adc8bc07a6"
        "4031104b397500a9d36222f5524aa85e4b1373827e2ecf94c8381b217d53e36975b67ddbbc04"
    ),
    "CheckpointManifest": (
        "85a17601a474797065b2436865636b706f696e744d616e6966657374a4626f647987a672756e5f6964aa676f6c64656e"
        "2d72756ea776657273696f6e07ae706172656e745f76657273696f6e06ac6368756e6b5f68617368657392c42023f0db"
        "1c88ac8544cbba8de6f02fe48523f37ea99d9ae63bf902ffcca4ebf2b3c420412cb322137d81a561102174568c4f9c84"
        "e5db95f51dcc3e298078e0ece8c774aa746f74616c5f73697a65cd1388a56474797065a862666c6f61743136ab636875"
        "6e6b5f6279746573cd1000a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664"
        "125531b8a3736967c440bb46b9507a74398065580343301d25e6cafaf18bf5cf44dc712255032381f2bfb3e5f7d5d585"
        "c2c45091e80ad438b0bddea4622677afa78d26f557d82c69bb06"
    ),
    "CheckpointManifest+deltas": (
        "85a17601a474797065b2436865636b706f696e744d616e6966657374a4626f647988a672756e5f6964aa676f6c64656e"
        "2d72756ea776657273696f6e07ae706172656e745f76657273696f6e06ac6368756e6b5f68617368657392c42023f0db"
        "1c88ac8544cbba8de6f02fe48523f37ea99d9ae63bf902ffcca4ebf2b3c420412cb322137d81a561102174568c4f9c84"
        "e5db95f51dcc3e298078e0ece8c774aa746f74616c5f73697a65cd1388a56474797065a862666c6f61743136ab636875"
        "6e6b5f6279746573cd1000a664656c7461739184ac626173655f76657273696f6e05a5636f646563ab7370617273652d"
        "7a737464ac6368756e6b5f68617368657391c4206b6285ddb81370e5d5632b935948cfc973467892a16ee26f2687c3f2"
        "d879d32eaa746f74616c5f73697a65cd0141a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309b"
        "a50d5f1ddc8664125531b8a3736967c44049bc3ec9157563e7a0c13098822e555198767389daafb1a162ba9ef08fdba0"
        "2e835bc999af40b9bec20b4ede35ae03bb95876f86795a7a7e4068552344f04d05"
    ),
    "CheckpointManifest+term": (
        "85a17601a474797065b2436865636b706f696e744d616e6966657374a4626f647988a672756e5f6964aa676f6c64656e"
        "2d72756ea776657273696f6e07ae706172656e745f76657273696f6e06ac6368756e6b5f68617368657392c42023f0db"
        "1c88ac8544cbba8de6f02fe48523f37ea99d9ae63bf902ffcca4ebf2b3c420412cb322137d81a561102174568c4f9c84"
        "e5db95f51dcc3e298078e0ece8c774aa746f74616c5f73697a65cd1388a56474797065a862666c6f61743136ab636875"
        "6e6b5f6279746573cd1000a47465726d03a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba5"
        "0d5f1ddc8664125531b8a3736967c440e8266415c19428724153aaa2f481546eaa624749effd2d9f4feab038b4ec978c"
        "0e210c60a790c6ee960fb02e04f2a2904db5ef67e4a5610e608f2ebaa1b30b05"
    ),
    "RunSpec": (
        "85a17601a474797065a752756e53706563a4626f64798ba672756e5f6964aa676f6c64656e2d72756ea56d6f64656ca4"
        "74696e79b2696e697469616c5f636865636b706f696e74c420ac1b5c0961a7269b6a053ee64276ed0e20a7f48aefb9f6"
        "7519539d23aaf10149a47461736baa61726974686d65746963a6726577617264b061726974686d657469635f65786163"
        "74a96f626a656374697665a46765706faf6879706572706172616d6574657273be7b2267726f75705f73697a65223a20"
        "382c20226c72223a2031652d30357da873616d706c696e6783ab74656d7065726174757265cb3ff0000000000000a574"
        "6f705f70cb3fee666666666666ae6d61785f6e65775f746f6b656e7340ac6c6561726e65725f6b65797392c42003a107"
        "bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8c42029acbae141bccaf0b22e1a94d34d0bc736"
        "1e526d0bfe12c89794bc9322966dd7aa766f6361625f73697a65cdc000ae6d61785f62617463685f726f7773cd0100a6"
        "617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c44044cd"
        "6a55462878c21e7ea56f076d25d24de5bb1f2a7c31060c4a2760e91fac9b4289b8c5636d88ff2d770fe0247a900ae3db"
        "50300cefd34c8b03554ca3531903"
    ),
    "Heartbeat": (
        "85a17601a474797065a9486561727462656174a4626f64798aa672756e5f6964aa676f6c64656e2d72756ea4726f6c65"
        "a773616d706c6572a57374617465aa67656e65726174696e67ae706f6c6963795f76657273696f6e29ac746f6b656e73"
        "5f7065725f73cb405ee00000000000a974696d657374616d70cb41d954fc40100000a7706565725f6964ae313244334b"
        "6f6f57476f6c64656ea66d616464727392b72f6970342f31302e302e302e322f7463702f3331333337b22f6970362f3a"
        "3a312f7463702f3331333337a86861726477617265a6637075207832a573746174739282a46e616d65a66f7574626f78"
        "a576616c7565cb400800000000000082a46e616d65a6726577617264a576616c7565cb3fe0000000000000a661757468"
        "6f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c44088bbfcfa2b43"
        "24f83fc68db8fee352b9ca93dbc4c3f2cc230f75428affa9412adf6746f4f4547d7ea6709a5d23106fd559e32da2db92"
        "abe2d79a612e5a6c6f0e"
    ),
    "Heartbeat+backend": (
        "85a17601a474797065a9486561727462656174a4626f64798ba672756e5f6964aa676f6c64656e2d72756ea4726f6c65"
        "a773616d706c6572a57374617465aa67656e65726174696e67ae706f6c6963795f76657273696f6e29ac746f6b656e73"
        "5f7065725f73cb405ee00000000000a974696d657374616d70cb41d954fc40100000a7706565725f6964ae313244334b"
        "6f6f57476f6c64656ea66d616464727392b72f6970342f31302e302e302e322f7463702f3331333337b22f6970362f3a"
        "3a312f7463702f3331333337a86861726477617265a6637075207832a573746174739282a46e616d65a66f7574626f78"
        "a576616c7565cb400800000000000082a46e616d65a6726577617264a576616c7565cb3fe0000000000000a76261636b"
        "656e64bb766c6c6d20302e33322e302c2062666c6f617431362c2063756461a6617574686f72c42003a107bff3ce10be"
        "1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c4408c7f923977dd01935cc834440054698e428c"
        "3a0442e19ce0b8f7c5b83097147314ecad8dc1fa1668a58f3349fee1483c2ca6fc219813144a38082b614355e004"
    ),
    "Heartbeat+lineage": (
        "85a17601a474797065a9486561727462656174a4626f64798ba672756e5f6964aa676f6c64656e2d72756ea4726f6c65"
        "a76c6561726e6572a57374617465aa67656e65726174696e67ae706f6c6963795f76657273696f6e29ac746f6b656e73"
        "5f7065725f73cb405ee00000000000a974696d657374616d70cb41d954fc40100000a7706565725f6964ae313244334b"
        "6f6f57476f6c64656ea66d616464727392b72f6970342f31302e302e302e322f7463702f3331333337b22f6970362f3a"
        "3a312f7463702f3331333337a86861726477617265a6637075207832a573746174739282a46e616d65a66f7574626f78"
        "a576616c7565cb400800000000000082a46e616d65a6726577617264a576616c7565cb3fe0000000000000a76c696e65"
        "61676584a47465726d03a6777269746573c3a76170706c69656429a8726573657276656439a6617574686f72c42003a1"
        "07bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c4406cfb37a6f41db8cfe6a7a866"
        "ad21ef171fe904177315a858bb2440172210f7bc0bb202fade058e452851ec61d2bc9c78263c932274c79d2f59eea705"
        "3cbff907"
    ),
    "Provider": (
        "85a17601a474797065a850726f7669646572a4626f647986a672756e5f6964aa676f6c64656e2d72756ea77665727369"
        "6f6e07a7706565725f6964ae313244334b6f6f57476f6c64656ea66d616464727391b72f6970342f31302e302e302e32"
        "2f7463702f3331333337a8636f6d706c657465c3a974696d657374616d70cb41d954fc40100000a6617574686f72c420"
        "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c44015fb2b32f7277cfb66ab"
        "9a6fef538ddc467b2e849e200cea0fa6c2f85b24b693e71ffa8aff3850e1d49f129674fa567e27c27c0340cf1c46f742"
        "ee8edc73790f"
    ),
    "Provider+dataset": (
        "85a17601a474797065a850726f7669646572a4626f647987a672756e5f6964aa676f6c64656e2d72756ea77665727369"
        "6f6e00a7706565725f6964ae313244334b6f6f57476f6c64656ea66d616464727391b72f6970342f31302e302e302e32"
        "2f7463702f3331333337a8636f6d706c657465c3a974696d657374616d70cb41d954fc40100000a764617461736574c4"
        "201aab24d41f6a59843f58548ec7b562d648c6ec324623185bdfa539ad8c5f6487a6617574686f72c42003a107bff3ce"
        "10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c4400f8e8ff944ff57314f541bde4e5c14ee"
        "504fab5727a777c03c910ccb0fe7b401f885fd70c4edee0dd0f816ef40869c0c96478e98f5c6d3a0f6b4f6e81879f309"
    ),
    "Ack": (
        "85a17601a474797065a341636ba4626f647982a672756e5f6964aa676f6c64656e2d72756ea862617463685f6964c410"
        "000102030405060708090a0b0c0d0e0fa6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d"
        "5f1ddc8664125531b8a3736967c440acee3e367215ec272bda92c9e42862a6315fe3361bf32ad38aa5ce735a3532cc18"
        "f7e59376d5efface59faaa306a6da454b8fcd2c34f02f6a568c76689bb8e09"
    ),
    "Reject": (
        "85a17601a474797065a652656a656374a4626f647984a672756e5f6964aa676f6c64656e2d72756ea862617463685f69"
        "64c410000102030405060708090a0b0c0d0e0fa6726561736f6eab6275666665722066756c6cad72657472795f616674"
        "65725f73cb4000000000000000a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc"
        "8664125531b8a3736967c4404c080f1e308119d6e1bbac613e6619a2f2dab5a3e74f3f6154f223bc0393a3b6d8ec9fc4"
        "13a963245295dd76c3a489923b6ab361368da4797766710336ce9b0b"
    ),
    "LineageHello": (
        "85a17601a474797065ac4c696e6561676548656c6c6fa4626f647987a672756e5f6964aa676f6c64656e2d72756ea770"
        "6565725f6964ae313244334b6f6f57476f6c64656eaa746f5f706565725f6964ae313244334b6f6f57577269746572a6"
        "736368656d61c420df0ad6e43880f09c90ebf95f19110178aba6890df0010ebda7485029e2b543b4a776657273696f6e"
        "07a57374617465c4208a9828bb1fa1d3b40f13f3af4091f57991e528c63c9992a1ca273775de3eedcea47465726d03a6"
        "617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c440c780"
        "68939d751da0ab31966b9f1af52de0be1b6ec474a14789bf36d6475359033357cdb84b6f024be5d27bf4614eb53b0207"
        "b1ea0fd5162fac030c2fc3e2fd08"
    ),
    "StateOffer": (
        "85a17601a474797065aa53746174654f66666572a4626f647988a672756e5f6964aa676f6c64656e2d72756ea4746572"
        "6d03a776657273696f6e09a57374617465c4209c3c31ddebc77bec08b30752c60f18abeaaa825f5122130e96f3845274"
        "33f7b4ae776569676874735f736861323536c4209a129038d9a00aed0cf6a7ea059ca50a813449061ab87848cf1a13ea"
        "fdf33b2cb06f7074696d697a65725f736861323536c42023732d00643137c9b14b11bdb90f47a8e97b4da42cdfc08879"
        "12f4ff732c689cae747261696e65645f736861323536c42042124616002bdd62bf7722780632a1fa9e6e30e3e507e1f8"
        "64695067d6c65cb1ac747261696e65645f66726f6d04a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967"
        "e4d6309ba50d5f1ddc8664125531b8a3736967c440761c103caca5316cddf50b8076ca5170f1b0f66014983969306a64"
        "5940994eb5be2d5ce59a03cf3e562f679fc7b55e63f5060044cea4f73421df2f4bc616410c"
    ),
    "Contribution": (
        "85a17601a474797065ac436f6e747269627574696f6ea4626f647986a672756e5f6964aa676f6c64656e2d72756ea474"
        "65726d03a776657273696f6e07a7626174636865739183a862617463685f6964c410000102030405060708090a0b0c0d"
        "0e0fa6736861323536c4204bb24efc9641afc5ded1ca77eabb6e2fcf062d2112ccd61bd8bd6acd89180baea6746f6b65"
        "6e7360a86c725f7363616c65cb3ff0000000000000ab677261645f736861323536c4201b6a3443f30a8adc08c12490d5"
        "b12cbe9a8590f6c76b73a15cdb3ac880eb7cc4a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d630"
        "9ba50d5f1ddc8664125531b8a3736967c440ee71c0210c4b41c9727ae4ef7bb7b5ecfbc461f960b1cb6bcfaba024e5b3"
        "769873f72f5efd3d3f3a92fa52c7bbea96ebb780cc1016ef07b892c87c1e7754280c"
    ),
    "Commit": (
        "85a17601a474797065a6436f6d6d6974a4626f64798da672756e5f6964aa676f6c64656e2d72756ea47465726d03a776"
        "657273696f6e08ae706172656e745f76657273696f6e07ac706172656e745f7374617465c4208a9828bb1fa1d3b40f13"
        "f3af4091f57991e528c63c9992a1ca273775de3eedcea57374617465c42010467b72deacfa1d0824e44b5a028cb45ce5"
        "a833778631e6b18e6eb0ba89994fa76170706c6965649182a76c6561726e6572c42029acbae141bccaf0b22e1a94d34d"
        "0bc7361e526d0bfe12c89794bc9322966dd7a7626174636865739182a862617463685f6964c410000102030405060708"
        "090a0b0c0d0e0fa6736861323536c4204bb24efc9641afc5ded1ca77eabb6e2fcf062d2112ccd61bd8bd6acd89180bae"
        "a6746f6b656e7360a86c725f7363616c65cb3ff0000000000000ad7570646174655f736861323536c4202937013f2181"
        "810606b2a799b05bda2849f3e369a20982a4138f0e0a55984ce4ab677261645f736861323536c420c454a455918b652d"
        "3cf538899c457100ffa79ef029aada6b20f54ae8d3166c82a77075626c697368c3a96d616e69666573747391c4116120"
        "7369676e6564206d616e6966657374a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f"
        "1ddc8664125531b8a3736967c440af18ef9a9db2444851b61b3ef80fb59e8f8de02948be0563a4da448f4d36186a880d"
        "69ac20d3e9c341c22e9d2e9a71fcd7f5af4bec69be05d43cbeb4123c2d0d"
    ),
    "LineageWait": (
        "85a17601a474797065ab4c696e6561676557616974a4626f647985a672756e5f6964aa676f6c64656e2d72756ea47465"
        "726d03a776657273696f6e07a770656e64696e67c3a96d616e69666573747390a6617574686f72c42003a107bff3ce10"
        "be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c440a1d5377383908611fefa8ba007fd094a7a"
        "42987f23d4ffd4a14be2dfae517ccb630c8594917e7fbf2b8fb6cf38df2e58a6aad5cfea09dbe13d45c77e89fdb90f"
    ),
    "LineageWait+refused": (
        "85a17601a474797065ab4c696e6561676557616974a4626f647986a672756e5f6964aa676f6c64656e2d72756ea47465"
        "726d03a776657273696f6e07a770656e64696e67c2a96d616e69666573747390a77265667573656482a962617463685f"
        "69647391c410000102030405060708090a0b0c0d0e0fa6726561736f6ed9246974206e616d6573206261746368657320"
        "746865206c696e6561676520747261696e6564a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d630"
        "9ba50d5f1ddc8664125531b8a3736967c440b6fe1628f3463e94cb9af6542209883cface20a6ed17b0bcd171b8de4b4a"
        "5d5b4602e5e36f1aa4b3930dc14c506be27f1f46bf0ad22769fe18ab222c1721170b"
    ),
    "LineageRefuse": (
        "85a17601a474797065ad4c696e65616765526566757365a4626f647982a672756e5f6964aa676f6c64656e2d72756ea6"
        "726561736f6ed9216e6f74206f6e65206f66207468652072756e2773206c6561726e6572206b657973a6617574686f72"
        "c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c44056811d2e047e4d5a"
        "8177d3b26c89d069b22c94098a0c0c1407b2953ea651c8e3bf7bf91e6e57b09a7cd644818750c3154a432f1943763569"
        "9c8ac78260fb1b0e"
    ),
}
GOLDEN_OTHER = {
    "record_key": ("b9cf82123ca68e66b0e2a1cf6441c67bf31e2f49"),
    "record_subkey": ("c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"),
    "record_value": (
        "92c5018dc5018a85a17601a474797065a9486561727462656174a4626f64798aa672756e5f6964aa676f6c64656e2d72"
        "756ea4726f6c65a773616d706c6572a57374617465aa67656e65726174696e67ae706f6c6963795f76657273696f6e29"
        "ac746f6b656e735f7065725f73cb405ee00000000000a974696d657374616d70cb41d954fc40100000a7706565725f69"
        "64ae313244334b6f6f57476f6c64656ea66d616464727392b72f6970342f31302e302e302e322f7463702f3331333337"
        "b22f6970362f3a3a312f7463702f3331333337a86861726477617265a6637075207832a573746174739282a46e616d65"
        "a66f7574626f78a576616c7565cb400800000000000082a46e616d65a6726577617264a576616c7565cb3fe000000000"
        "0000a6617574686f72c42003a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8a3736967c4"
        "4088bbfcfa2b4324f83fc68db8fee352b9ca93dbc4c3f2cc230f75428affa9412adf6746f4f4547d7ea6709a5d23106f"
        "d559e32da2db92abe2d79a612e5a6c6f0ec4409880a8295ab281eeaecc50ebd7a0605524d421d2bf52601a30923735b2"
        "d553089feb9d6bd16df8bce5977e29a089a318288227f01b0070b37bb1f2ad0397a40b"
    ),
    "chunk_request": (
        "81a668617368657392c42023f0db1c88ac8544cbba8de6f02fe48523f37ea99d9ae63bf902ffcca4ebf2b3c420412cb3"
        "22137d81a561102174568c4f9c84e5db95f51dcc3e298078e0ece8c774"
    ),
    "delta_parent": (
        "70000000000000007b2261223a7b226474797065223a22463332222c227368617065223a5b345d2c22646174615f6f66"
        "6673657473223a5b302c31365d7d2c2262223a7b226474797065223a2242463136222c227368617065223a5b335d2c22"
        "646174615f6f666673657473223a5b31362c32325d7d7d200000803f000000400000404000008040803f0040403f"
    ),
    "delta_child": (
        "70000000000000007b2261223a7b226474797065223a22463332222c227368617065223a5b345d2c22646174615f6f66"
        "6673657473223a5b302c31365d7d2c2262223a7b226474797065223a2242463136222c227368617065223a5b335d2c22"
        "646174615f6f666673657473223a5b31362c32325d7d7d200000803f0000204000004040000080c0803f0140403f"
    ),
    "delta": (
        "85a6666f726d6174b068657465726f726c2d64656c74612f31a462617365c4209d06dc3fe4fd2a1d5413d8e16dadfdec"
        "1b34f37eb4454e9876bd73b1dfc015c4a473697a6516a774656e736f72739293a16102a093a16201a0a464617461c41c"
        "28b52ffd20169d000068020200200000800200000001000100051802"
    ),
    "delta_payload": ("02020000000000000000000020000080020000000100"),
}


# ---- the checks ----


def test_every_message_kind_has_golden_bytes():
    assert {kind for kind, _ in MESSAGES.values()} == set(messages.SCHEMAS)
    assert set(GOLDEN_MESSAGES) == set(MESSAGES)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_message_bytes_are_pinned(name):
    kind, body = MESSAGES[name]
    assert messages.encode(kind, body, SIGNER).hex() == GOLDEN_MESSAGES[name]


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_pinned_bytes_decode_to_the_body(name):
    kind, body = MESSAGES[name]
    got_kind, got_body, author = messages.decode(bytes.fromhex(GOLDEN_MESSAGES[name]), kind, run_id=RUN)
    assert (got_kind, got_body, author) == (kind, body, SIGNER.public_key)
    assert messages.encode(got_kind, got_body, SIGNER).hex() == GOLDEN_MESSAGES[name]  # and back


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_the_envelope_keeps_its_field_order_and_the_body_its_schema_order(name):
    kind, body = MESSAGES[name]
    env = msgpack.unpackb(bytes.fromhex(GOLDEN_MESSAGES[name]), raw=False)
    assert list(env) == ["v", "type", "body", "author", "sig"]
    assert env["v"] == messages.PROTOCOL_VERSION == 1 and env["type"] == kind
    assert len(env["author"]) == 32 and len(env["sig"]) == 64
    assert list(env["body"]) == list(body)  # the bodies above are written in their schema's order


def test_a_changed_field_changes_the_bytes():
    """The pins notice what matters: a type (int vs float), a size, an order."""
    kind, body = MESSAGES["Ack"]
    assert messages.encode(kind, body, SIGNER).hex() == GOLDEN_MESSAGES["Ack"]
    reordered = {"batch_id": body["batch_id"], "run_id": body["run_id"]}
    raw = msgpack.unpackb(bytes.fromhex(GOLDEN_MESSAGES["Ack"]), raw=False)
    raw["body"] = reordered
    assert msgpack.packb(raw, use_bin_type=True).hex() != GOLDEN_MESSAGES["Ack"]
    kind, body = MESSAGES["Reject"]
    as_int = msgpack.unpackb(bytes.fromhex(GOLDEN_MESSAGES["Reject"]), raw=False)
    as_int["body"]["retry_after_s"] = 2  # the schema sends a float64; an int would be other bytes
    assert msgpack.packb(as_int, use_bin_type=True).hex() != GOLDEN_MESSAGES["Reject"]


def test_dht_record_bytes_are_pinned_and_verify():
    key, subkey, value = record_bytes()
    assert (key.hex(), subkey.hex(), value.hex()) == (
        GOLDEN_OTHER["record_key"],
        GOLDEN_OTHER["record_subkey"],
        GOLDEN_OTHER["record_value"],
    )
    rec = DHTRecord(key, subkey, value, RECORD_EXPIRATION)
    v = SignedRecordValidator(None, clock=lambda: T)
    kind, body, author = v.verify_record(rec)
    assert (kind, body, author) == ("Heartbeat", MESSAGES["Heartbeat"][1], SIGNER.public_key)
    inner = msgpack.unpackb(v.strip_value(rec))
    assert inner.hex() == messages.encode("Heartbeat", MESSAGES["Heartbeat"][1], SIGNER).hex()


def test_frame_and_chunk_request_bytes_are_pinned():
    assert frame_bytes(b"abc").hex() == "00000003616263"
    assert frame_bytes(b"").hex() == "00000000"
    request = msgpack.packb(CHUNK_REQUEST)  # as chunks.Download writes it
    assert request.hex() == GOLDEN_OTHER["chunk_request"]
    assert chunks._parse_request(bytes.fromhex(GOLDEN_OTHER["chunk_request"])) == CHUNK_REQUEST["hashes"]
    assert (chunks.HELD, chunks.NOT_HELD) == (b"\x00", b"\x01")
    assert chunk_hash(b"chunk0").hex() == hashlib.sha256(b"chunk0").hexdigest()  # chunks are named by SHA-256

    async def read() -> bytes:
        r = asyncio.StreamReader()
        r.feed_data(bytes.fromhex("00000003616263"))
        r.feed_eof()
        return await read_frame(r, 3, 1)

    assert asyncio.run(read()) == b"abc"


def test_delta_bytes_decode_and_its_envelope_is_pinned():
    """zstd's output may differ between library versions: the envelope and the uncompressed payload are
    pinned, and the golden delta (compressed once) must still apply."""
    assert PARENT.hex() == GOLDEN_OTHER["delta_parent"] and CHILD.hex() == GOLDEN_OTHER["delta_child"]
    golden = bytes.fromhex(GOLDEN_OTHER["delta"])
    assert apply_delta(PARENT, golden) == CHILD
    fresh = encode_delta(PARENT, CHILD)
    assert apply_delta(PARENT, fresh) == CHILD
    for d in (golden, fresh):
        env = msgpack.unpackb(d, raw=False)
        assert list(env) == ["format", "base", "size", "tensors", "data"]
        assert env["format"] == "heterorl-delta/1" and env["base"] == hashlib.sha256(PARENT).digest()
        assert env["tensors"] == [["a", 2, ""], ["b", 1, ""]]
        raw = zstandard.ZstdDecompressor().decompress(env["data"], max_output_size=env["size"])
        assert raw.hex() == GOLDEN_OTHER["delta_payload"]
        info, _, _ = read_header(d)
        assert (info.changed, info.tensors, info.raw_bytes) == (3, 2, len(raw))


def _generate() -> None:
    """Print the golden literals for this file from the current code."""
    out = {name: messages.encode(kind, body, SIGNER).hex() for name, (kind, body) in MESSAGES.items()}
    key, subkey, value = record_bytes()
    delta = encode_delta(PARENT, CHILD)
    env = msgpack.unpackb(delta, raw=False)
    other = {
        "record_key": key.hex(),
        "record_subkey": subkey.hex(),
        "record_value": value.hex(),
        "chunk_request": msgpack.packb(CHUNK_REQUEST).hex(),
        "delta_parent": PARENT.hex(),
        "delta_child": CHILD.hex(),
        "delta": delta.hex(),
        "delta_payload": zstandard.ZstdDecompressor()
        .decompress(env["data"], max_output_size=env["size"])
        .hex(),
    }
    for title, d in (("GOLDEN_MESSAGES", out), ("GOLDEN_OTHER", other)):
        print(f"{title} = {{")
        for name, h in d.items():
            lines = [h[i : i + 96] for i in range(0, len(h), 96)]
            print(f'    "{name}": (')
            for line in lines:
                print(f'        "{line}"')
            print("    ),")
        print("}")


if __name__ == "__main__":
    _generate()
    sys.exit(0)
