"""The server's gRPC face: the service (service), admission of calls (auth, admission),
bounded transfers and staging buffers (transfers) and the health service (health)."""
