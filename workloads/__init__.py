"""workloads: real trace loaders, the replay engine, reports and the ``mmcache`` command line.

Text replay (prefix reuse on real traces): ``text_trace`` (request/session types), ``mooncake`` and ``swe_agent``
(loaders), ``ordering`` (timestamp / round-robin), ``text_replay`` (one replay through a PrefixCache), ``sweep``
(pool-size sweep, table, JSON), ``sweep_plot`` (PNG), ``catalog`` (workload names and paths), ``cli``.

Model replay (real models, cache off vs on): ``serving`` (workload protocol, schedules, replay, compare),
``metrics`` (TTFT/TTFA/ITL, goodput, hit rates), ``report`` (HTML and JSON), ``prometheus`` (live metrics),
``model_options`` (what every model workload is built from), and the workloads: ``vlm_chat`` (``vlm-chat``),
``agent_model`` (``agent-model``, ``mooncake-model``, and the text-LM serving core ``vlm_chat`` shares),
``image_gen`` (``image-gen``), ``voice_clone`` (``voice-clone``), ``mixed`` (their blend).
"""
