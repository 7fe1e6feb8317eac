"""workloads: replay real traffic through mmcache, grouped by job.

- ``traces``: trace loaders (Mooncake JSONL, mini-swe-agent trajectories) and their request types;
- ``sizing``: the pool-size sweep: replay a text trace through a metadata-only prefix cache at several pool sizes;
- ``harness``: the serving harness for model workloads: schedules, the cache-off/on replay, metrics, the HTML report,
  Prometheus metrics and the Grafana dashboard;
- ``models``: the model workloads (``vlm-chat``, ``agent-model``, ``mooncake-model``, ``image-gen``, ``voice-clone``,
  ``mixed``), each holding only its data and its accounting;
- ``registry`` (workload names), ``options`` (what a model workload is built from), ``cli`` (``mmcache``).
"""
