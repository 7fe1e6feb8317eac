"""workloads: real trace loaders, the replay engine, reports and the ``mmcache`` command line.

Text replay (prefix reuse on real traces): ``text_trace`` (request/session types), ``mooncake`` and ``swe_agent``
(loaders), ``ordering`` (timestamp / round-robin), ``text_replay`` (one replay through a PrefixCache), ``sweep``
(pool-size sweep, table, JSON), ``sweep_plot`` (PNG), ``catalog`` (workload names and paths), ``cli``.
"""
