"""`log_once` for code that torch.compile traces: the ops' fallbacks and the attention glue say their reason there too.

Dynamo cannot trace a logging call: it would break the graph at each fallback. Marked a constant result, the call
runs while Dynamo traces instead (the reason is fixed at trace time, as the route is), and the graph holds nothing
of it. A message Dynamo cannot make a constant (one that prints a dynamic shape) still breaks the graph there, and is
said as in eager mode.
"""
import logging

import torch

from ..._logging import log_once


@torch.compiler.assume_constant_result
def log_once_traceable(message: str, level: int = logging.WARNING) -> None:
    log_once(message, level)
