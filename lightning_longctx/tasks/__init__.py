"""Ready-made training tasks used by the examples and ``longctx-train``."""
