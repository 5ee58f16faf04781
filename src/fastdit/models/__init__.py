"""Model adapters: one file per family, plus the shared vocabulary (base) and the registry."""
