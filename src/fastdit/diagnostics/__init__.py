"""Diagnostics: ``inspect`` reads a transformer and says how fastdit fits it (block patterns, heads, CP/TP plan).

Above the techniques and the model vocabulary: nothing below the CLI imports this package.
"""
