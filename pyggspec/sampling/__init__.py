"""Sampler chains that run partly in the ggml graph and finish on the host (placeholder)."""
