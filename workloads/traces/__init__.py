"""Trace loaders: Mooncake JSONL and mini-swe-agent trajectories, read into one request/session type."""
