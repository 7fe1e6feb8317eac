"""The replica routers a replay knows, by name (apart from ``routers``, so the CLI's ``--help`` imports no torch)."""

ROUTERS = ("random", "round-robin", "affinity", "cache-aware")
DEFAULT_REPLICA_POOL = "1M"  # total tokens over the replicas when --pool-tokens is not given
