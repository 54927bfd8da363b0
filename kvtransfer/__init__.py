"""Moving KV blocks between processes: a Transport protocol, NIXL and TCP backends, the handshake."""
