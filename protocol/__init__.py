"""What crosses the wire: message schemas, codec, identities, DHT records (see DESIGN.md)."""

__all__: list[str] = []
