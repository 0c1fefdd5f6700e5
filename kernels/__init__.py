"""Attention and other hot ops; one module per backend, each tested against the torch reference."""
