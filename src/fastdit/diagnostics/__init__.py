"""Diagnostics: ``inspect`` reads a transformer and says how fastdit fits it (block patterns, heads, CP/TP plan);
``verify`` runs the integration ladder (cache, CP, TP, text encoder, VAE, hybrids) against the baseline.

Above the techniques and the model vocabulary: nothing below the CLI imports this package.
"""
