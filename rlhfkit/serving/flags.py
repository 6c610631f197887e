"""The reward server's own flags (rlhfkit.cli.serve_rm), declared as fields (rlhfkit.config.declare): the
server's batching, address, request limits and shutdown, and its CPU threads. `ServeConfig` and
`RequestLimits` take their defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.declare import flag


@dataclass
class ServerFlags:
    batch_size: int = flag(16, help="most sequences per forward")
    batch_wait_ms: float = flag(5.0, help="longest wait for requests being read/parsed before a forward that is not full")
    port: int = flag(5000, help="TCP port to listen on")
    host: str = flag("127.0.0.1", help="bind address (0.0.0.0 to accept remote clients)")
    max_body_mb: float = flag(32.0, help="largest request body (larger: 413)")
    max_queries: int = flag(65536, help="most queries in a request, and most items of any list in it (more: 422)")
    max_query_chars: int = flag(
        0, help="most characters in one query (more: 422, before tokenization); 0: --max_len x the longest "
                "vocabulary entry, which no query within --max_len tokens exceeds")
    max_json_depth: int = flag(32, help="deepest JSON nesting of a request (deeper: 422)")
    read_timeout_s: float = flag(
        10.0, help="longest time to receive a request's headers, and then its body (slower: 408 / closed)")
    shutdown_timeout_s: float = flag(
        5.0, help="on SIGTERM, longest wait for requests in progress before they are cancelled")
    num_threads: int = flag(
        0, help="torch CPU threads for the model; 0: on CPU one per core but one (a core for the HTTP side), on GPU "
                "torch's default")
