"""The serving harness: schedules, the cache-off/on replay of a model workload, metrics, the HTML report,
Prometheus metrics and the Grafana dashboard."""
