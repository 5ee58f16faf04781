"""Technique-neutral plumbing: the nesting table (:mod:`.layers`), argument access (:mod:`.args`) and the block
runner (:mod:`.blocks`). Techniques build on these; nothing here knows about caches or parallelism."""
