"""Flash attention for training and prefill, its tile configs and attention windows, and the split-KV decode kernel."""
