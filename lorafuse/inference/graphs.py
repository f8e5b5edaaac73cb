"""Capturing a decode step as a CUDA graph (CUDA only; on a CPU the step runs eagerly instead).

The step must read and write only tensors that outlive the graph (its static buffers, the KV cache, the model's
weights): a replay reruns the same kernels on the same addresses. Its temporaries live in the graph's memory
pool; the engine's graphs share one pool, which is safe because none of them leaves a result there and they
never run at the same time.
"""
from collections.abc import Callable

import torch


def capture(step: Callable[[], None], generator: torch.Generator, pool=None, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """`step` captured as one CUDA graph; replay it with `graph.replay()`. The step runs `warmup` times first on a
    side stream (Triton compiles and autotunes, cuBLAS and the allocator settle there, not in the graph), then
    once under capture: it must tolerate those runs (the engine resets its buffers afterwards). `generator` is
    registered with the graph so that each replay draws fresh numbers from it (its seed set between replays holds)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph
