"""The sizes of the wire's messages, which the run config's defaults and checks and the tensors'
framing share. Standard library only: reading a config imports neither torch nor gRPC."""

DEFAULT_CHUNK_BYTES = 256 << 10
"""Largest gRPC message of a task stream (tensor bytes and their framing). Larger task messages
raise the server's peak memory at thousands of processes and save no CPU
(``benchmarks/server_scale.py --set server.chunk_bytes=...``; docs/benchmarks.md, "Server at
scale"). Results come in messages of ``server.result_chunk_bytes`` or less."""

GRPC_LARGEST_MESSAGE = 4 << 20
"""gRPC's default limit on the size of a received message, which fedpart's server and clients
keep: no task or result message may be larger."""
