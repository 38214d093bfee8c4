"""Examples for lightning-adaptiveload (importable as `examples.*` from the repository root)."""
