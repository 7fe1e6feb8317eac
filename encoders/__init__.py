"""encoders: cached wrappers for real encoders, on one base (``base.CachedEncoder``: one media reader, the lookup
through an ``EncoderStore``): vision towers (``vision``), T5/umT5 prompt encoders (``text``), Whisper (``audio``),
fbank x-vector speaker encoders (``speaker``), the Mimi codec (``codec``)."""
