"""transformers integration: a ``transformers.Cache`` over the page pool (``paged_kv``), the one request runner
(``runner``), and the LLaVA and CSM specifics. The core never imports this package."""
