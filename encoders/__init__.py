"""encoders: cached wrappers for real encoders, on one base (``base``): vision towers (``vision``), T5/umT5 prompt
encoders (``text``), Whisper (``audio``), fbank x-vector speaker encoders (``speaker``)."""
