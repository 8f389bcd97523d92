"""Address defaults, importable without starting (or importing) the network stack."""

# loopback, any free port: safe by default; use /ip4/0.0.0.0/tcp/PORT to be reachable from other machines
DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
