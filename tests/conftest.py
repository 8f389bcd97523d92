import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny offline model, built once per session (same builder as `heterorl model init`)."""
    from heterorl.peer.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", progress=False)
