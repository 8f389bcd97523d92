"""Run hosting: RunSpec signing, DHT bootstrap, swarm view, dashboard (see docs/architecture.md)."""

__all__: list[str] = []
