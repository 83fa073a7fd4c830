"""Per-corpus preparation recipes (one module per corpus)."""
