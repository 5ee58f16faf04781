"""Parallelism: the process-group/mesh runtime, plans, context and tensor parallelism, CFG, text-encoder and VAE."""
