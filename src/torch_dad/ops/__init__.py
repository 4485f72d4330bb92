"""Fused operations, each with a PyTorch twin and (on CUDA) a Triton kernel path."""
