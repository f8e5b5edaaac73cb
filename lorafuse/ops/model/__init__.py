"""The decoder's other layers as kernels: RMSNorm, SwiGLU, RoPE and the fused linear + cross-entropy loss."""
