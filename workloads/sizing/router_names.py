"""The replica routers a replay knows, by name (apart from ``routers``, so the CLI's ``--help`` imports no torch)."""

ROUTERS = ("random", "round-robin", "affinity", "media-affinity", "cache-aware", "kv-aware")
TEXT_ROUTERS = tuple(r for r in ROUTERS if r != "media-affinity")  # a text trace has no media: it would be affinity
DEFAULT_REPLICA_POOL = "1M"  # total tokens over the replicas when --pool-tokens is not given
