"""Fine-tuning on accelerate and datasets: the loop, data, checkpoints and metrics behind recipes/finetune.py."""
from .config import ConfigError, FinetuneConfig, register_configs
from .trainer import Finetune, NonFiniteLoss

__all__ = ["ConfigError", "Finetune", "FinetuneConfig", "NonFiniteLoss", "register_configs"]
