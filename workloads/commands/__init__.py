"""The ``mmcache`` commands, one module each, on the one parser ``workloads.cli.build_parser`` makes.

- ``replay``: the ``replay`` subcommand, its shared options, and which replay TARGET asks for;
- ``trace_replay``: a trace through a metadata-only prefix cache at several pool sizes;
- ``replica_replay``: ``--replicas``, a trace or a model workload's data over R replicas, no model run;
- ``model_replay``: a model workload through real models, cache off then on;
- ``data``: ``data list`` and ``data fetch``, the public data sets the replays read;
- ``common``: what they share: exit statuses, one-line errors, option types, outputs, the metrics endpoint.

Each imports only argparse and torch-free modules at import, so ``mmcache --help`` stays fast.
"""
