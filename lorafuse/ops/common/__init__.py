"""What the role packages share: launch plans and launches, autograd helpers, logging that traces, activations, bf16 pieces, dependent launches."""
