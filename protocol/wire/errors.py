"""The one exception every decoder raises for input it refuses."""


class ProtocolError(ValueError):
    """Input from a peer was refused; ``str(err)`` says why (logged, never crashes the peer)."""
