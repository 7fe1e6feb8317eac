"""Real peer engines driven on the same traces as mmcache, for side-by-side runs: transformers' continuous
batching with its own prefix sharing (``transformers_cb``)."""
