import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny offline model, built once per session (same builder as `heterorl model init`)."""
    from heterorl.peer.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", progress=False)


@pytest.fixture(scope="module")
def bootstrap_node():
    """A real hivemind DHT node on 127.0.0.1 in the test process: the swarm's first peer."""
    from heterorl.protocol import Identity
    from heterorl.protocol.net.node import NetConfig, Node

    node = Node.start(Identity.generate(), NetConfig())
    yield node
    node.close()


@pytest.fixture
def peers(tmp_path):
    """Start netpeers role processes (``peers("seed", "--store", ...)``); all are killed at test end."""
    from heterorl.testing.procs import PeerProcess

    started: list[PeerProcess] = []

    def start(role: str, *args: str) -> PeerProcess:
        p = PeerProcess(role, *args, log_path=tmp_path / f"{role}-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.__exit__(None, None, None)
