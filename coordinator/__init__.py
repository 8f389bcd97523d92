"""Run hosting: RunSpec signing, DHT bootstrap, swarm view, dashboard (see DESIGN.md)."""

__all__: list[str] = []
