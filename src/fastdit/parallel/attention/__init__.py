"""Context-parallel attention.

* :mod:`~fastdit.parallel.attention.dispatch` — the one entry point under context parallelism: routes the
  processors' ``dispatch_attention_fn`` calls to Ulysses, ring or USP, with a selectable local backend.
* :mod:`~fastdit.parallel.attention.ulysses` — all-to-all attention (uneven shards and heads, masks reordered).
* :mod:`~fastdit.parallel.attention.comm` — the all-to-all exchanges (fused q/k/v, async, FP8).
* :mod:`~fastdit.parallel.attention.ring`, :mod:`~fastdit.parallel.attention.usp`,
  :mod:`~fastdit.parallel.attention.local` — ring attention, Ulysses × ring, and attention with log-sum-exp.
"""
