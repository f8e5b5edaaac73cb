"""The LoRA linear op: its Function and custom ops, its route table, and the kernels of each route."""
