"""Fuzz the protocol decoders: no crash, no hang, nothing accepted that should not be.

``heterorl bench fuzz --inputs 100000`` (or ``python -m heterorl.bench.fuzz``) feeds malformed inputs to every
function that parses bytes from a peer, and checks three things per input:

- **crash**: the decoder raised anything but its documented refusal (:class:`ProtocolError`; for frames also
  ``EOFError``; the DHT validator must never raise and must return a bool);
- **hang**: one input took more than :data:`config.HANG_S` seconds (inputs still running after
  :data:`config.ABORT_S` are interrupted with SIGALRM when the harness runs in the main thread);
- **oracle violation**: an *independent* oracle, written from the wire format and sharing no code with
  ``protocol/wire/schema.py`` or the decoders, decides for every input whether it must be accepted, and with
  what result. Any disagreement, either way, is a failure: ``accepted_but_should_not`` (the dangerous one),
  ``rejected_but_should_not``, ``wrong_result``, and for frames ``over_read`` (asking the stream for more
  than the cap).

Targets (see :data:`ALL_TARGETS`):

``decode``
    :func:`protocol.wire.messages.decode` on random bytes and on mutated valid messages: bit flips, byte
    overwrites, truncation, extension, splicing two messages, and msgpack-level structure mutation (a node of
    the decoded tree replaced, deleted, duplicated, nested a thousand deep, made an ext type...).
``decode_signed``
    the same decoder on structure-aware bodies: wrong types, out-of-range numbers, NaN/inf, positive
    log-probs, token ids outside the vocabulary, mismatched lengths, oversized arrays and strings, extra and
    missing fields, wrong run id, wrong protocol version, wrong message type... each *signed correctly* so
    that the signature check passes and the schema layer is what must refuse.
``frame``
    :func:`protocol.net.framing.read_frame` on an ``asyncio.StreamReader`` fed adversarial length
    prefixes, truncated and trailing data, in pieces, with and without EOF.
``dht_record``
    :meth:`protocol.net.dht.SignedRecordValidator.validate` on honest, re-signed, forged, tampered and
    wrongly typed ``DHTRecord`` objects: it must never raise and never accept a record not signed by its
    subkey's owner (nor one whose message, key or expiration is wrong).
``chunk_request``
    ``protocol.net.chunks._parse_request`` on random and mutated chunk requests.
``rewards`` (only when named: ``--targets rewards``; the others are :data:`DEFAULT_TARGETS`)
    hostile answers (code, bombs, huge and invalid text, a connection to a listener) at every built-in
    reward and task scorer through the reward sandbox: nothing may get out, every call returns a reward in
    [0, 1] within the sandbox's limit, honest answers score as in process (:mod:`.reward_target`).

Inputs come from a seeded :class:`random.Random` generator and, for a share of each target's inputs
(``hypothesis_share``, default 0.2), from hypothesis strategies (``@seed``-ed, no database, generate phase
only), so a run is deterministic for a seed: each target's report carries a digest of every input it saw.
Signing keys are derived from the seed as well (Ed25519 signatures are deterministic).

A hang is re-timed once after a full GC before it counts (a pause or a busy machine is not a hang); a
read_frame loop still running after :data:`config.FRAME_GUARD_S` is a hang too.

atheris: ``pip install atheris`` works here (3.0 ships a manylinux wheel with libFuzzer built in, no clang
needed), so there is an optional coverage-guided mode: ``heterorl bench fuzz --atheris TARGET [--inputs N]
[--libfuzzer '-max_len=4096 -jobs=2']``. It instruments only ``heterorl.protocol`` (``instrument_all()``
would walk torch: minutes), starts from the target's own seed corpus (random bytes never reach a signed
envelope), applies the same oracles, and stops at the first failure, leaving libFuzzer's ``crash-*`` file
in the working directory. Nothing else imports atheris and it is not a declared dependency. Byte-level
libFuzzer mutation is weak against a signed, msgpack-structured format: 200 000 atheris runs on ``decode``
found nothing that the structure-aware generators here find within a few hundred inputs.

How the parts fit (each module's docstring says more):

- :mod:`.config`: target names and input shares, the hang limits (patch them there), the DHT clock;
- :mod:`.wire`: the wire format restated for the oracle (:data:`SPEC`, limits), never imported from protocol/;
- :mod:`.oracle`: what every input must decode to, or why it must be refused (:class:`Oracle`);
- :mod:`.generators`: valid bodies, edge values, mutations, msgpack packing, hypothesis value strategies;
- :mod:`.base`: the target interface and one input's outcome; the targets: :mod:`.decode_targets`,
  :mod:`.frame_target`, :mod:`.dht_target`, :mod:`.chunk_target`, :mod:`.reward_target`, registered by name
  in :mod:`.targets`;
- :mod:`.harness`: keys and signing, running one input and sorting its outcome into the counts;
- :mod:`.runner`: :func:`run_fuzz`, a whole run over the chosen targets;
- :mod:`.report`: :class:`TargetStats` / :class:`FuzzReport`, the table and the JSON;
- :mod:`.libfuzzer`: the atheris mode; :mod:`.cli`: the flags and :func:`main` (also ``__main__``).
"""

from . import config
from .chunk_target import ChunkRequestTarget
from .cli import add_arguments, main, run_from_args
from .config import ALL_TARGETS, DEFAULT_TARGETS, NOW, TARGET_WEIGHTS
from .decode_targets import DecodeSignedTarget, DecodeTarget
from .dht_target import DHTRecordTarget
from .frame_target import FrameTarget
from .generators import valid_body
from .libfuzzer import FuzzFailure, atheris_main
from .oracle import Oracle
from .report import FuzzReport, TargetStats
from .reward_target import RewardTarget
from .runner import run_fuzz
from .wire import DHT_KINDS, KINDS, SPEC

__all__ = [
    "ALL_TARGETS",
    "DEFAULT_TARGETS",
    "DHT_KINDS",
    "KINDS",
    "NOW",
    "SPEC",
    "TARGET_WEIGHTS",
    "ChunkRequestTarget",
    "DHTRecordTarget",
    "DecodeSignedTarget",
    "DecodeTarget",
    "FrameTarget",
    "FuzzFailure",
    "FuzzReport",
    "Oracle",
    "RewardTarget",
    "TargetStats",
    "add_arguments",
    "atheris_main",
    "config",
    "main",
    "run_from_args",
    "run_fuzz",
    "valid_body",
]
