"""encoders: cached wrappers for real encoders and pool-backed KV for transformers models.

``vision`` (CLIP/SigLIP/LLaVA towers), ``text`` (T5/umT5 prompts of diffusers pipelines), ``audio`` (Whisper),
``speaker`` (fbank x-vector), ``paged_kv`` (a transformers Cache over a PagePool), ``prefill`` (one request through
a model with it), ``vlm`` (LLaVA prefill with image digests in the page chain).
"""
