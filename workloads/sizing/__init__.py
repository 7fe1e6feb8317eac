"""The pool-size sweep: a text trace replayed through a metadata-only prefix cache at several pool sizes."""
