"""Model workloads: each builds its requests and accounts for its hits; the serving itself is
``mmcache.hf.runner``."""
