"""The typed config of the generate and serve recipes (conf/generate.yaml, conf/serve.yaml), stored in Hydra's
ConfigStore so that unknown keys and wrong types stop at start-up, naming the key."""
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .._paths import register_asset_resolver
from .engine import DEFAULT_BUCKETS


@dataclass
class InferenceModelConfig:
    name_or_path: str = MISSING        # a Hub id or a local directory
    tokenizer: Optional[str] = None    # defaults to name_or_path
    adapter: Optional[str] = None      # a LoRA adapter directory in PEFT's format (what recipes/finetune.py saves)
    adapters: dict[str, str] = field(default_factory=dict)  # more adapters by name (serve: a request's "model")
    merge: bool = False                # fold the adapter into the weights; unmerged it can be swapped in place
    dtype: str = "auto"                # auto: bfloat16 on CUDA, float32 on a CPU; or float32, bfloat16, float16
    attn_implementation: str = "lorafuse"  # lorafuse, sdpa or eager
    random_init: bool = False          # weights drawn from `seed` (speed runs without the weights)
    config_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    trust_remote_code: bool = False


@dataclass
class EngineConfig:
    max_length: int = 1024             # tokens per row, prompt and new tokens
    buckets: list[int] = field(default_factory=lambda: list(DEFAULT_BUCKETS))  # batch sizes with a decode graph
    check_every: int = 8               # decode steps between the host's looks at EOS and stop strings
    cuda_graphs: Optional[bool] = None  # None: on CUDA


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0           # 0: greedy
    top_k: int = 0                     # 0: off
    top_p: float = 1.0                 # 1: off
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)


@dataclass
class GenerateConfig:
    model: InferenceModelConfig = field(default_factory=InferenceModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: list[str] = field(default_factory=list)  # or prompts_file
    prompts_file: Optional[str] = None  # one prompt per line (.txt), or a "prompt" field per line (.jsonl)
    chat: bool = False                 # wrap each prompt as a user message in the tokenizer's chat template
    output: Optional[str] = None       # also write {"prompt", "completion"} lines to this JSONL file


@dataclass
class ServeConfig:
    model: InferenceModelConfig = field(default_factory=InferenceModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: Optional[str] = None   # the "model" field of answers; defaults to the model directory's name
    max_new_tokens: int = 512          # the largest max_tokens a request may ask for
    request_timeout: float = 30.0      # seconds a client may stay silent while it sends a request, or between requests
    max_connections: int = 64          # open at once; beyond, a client gets a 503


def check_serve_config(cfg: ServeConfig) -> None:
    """What the schema's types cannot check: the port's range and the limits' signs."""
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"port={cfg.port}: must be from 0 to 65535 (0: any free port)")
    for key, value in (("max_new_tokens", cfg.max_new_tokens), ("request_timeout", cfg.request_timeout),
                       ("max_connections", cfg.max_connections)):
        if not value > 0:
            raise ValueError(f"{key}={value}: must be > 0")


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="generate_schema", node=GenerateConfig)
    store.store(name="serve_schema", node=ServeConfig)
    register_asset_resolver()
