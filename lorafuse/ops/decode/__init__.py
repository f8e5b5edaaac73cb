"""Kernels of the captured decoding step: GEMV with adapters, fused norm/MLP epilogues, RoPE into the cache, argmax, token records."""
