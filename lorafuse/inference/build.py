"""An Engine and its tokenizer from the recipes' config: the model loaded (or built from its config), the adapter
applied with fused LoRA layers, moved to the GPU when there is one."""
import json
import os
from pathlib import Path

import torch

from .._paths import looks_local
from ..hf import loading
from .config import EngineConfig, InferenceModelConfig, SamplingConfig
from .engine import Engine
from .sampling import SamplingParams


def build_engine(model_cfg: InferenceModelConfig, engine_cfg: EngineConfig):
    """(engine, tokenizer)."""
    check_adapter_configs(model_cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = loading.DTYPES.get(model_cfg.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = loading.load_tokenizer(model_cfg.tokenizer or model_cfg.name_or_path, model_cfg.trust_remote_code)
    model = loading.load_causal_lm(model_cfg.name_or_path, dtype=dtype,
                                   attn_implementation=model_cfg.attn_implementation,
                                   random_init=model_cfg.random_init, config_overrides=dict(model_cfg.config_overrides),
                                   trust_remote_code=model_cfg.trust_remote_code, seed=model_cfg.seed)
    if model_cfg.adapters and (model_cfg.adapter is None or model_cfg.merge):
        raise ValueError(f"model.adapters={dict(model_cfg.adapters)}: more adapters need model.adapter (the served "
                         "model's own) and model.merge=false (several adapters run unmerged, side by side)")
    if model_cfg.adapter is not None:
        model = loading.load_adapter(model, model_cfg.adapter, model_cfg.attn_implementation == "lorafuse",
                                     others=dict(model_cfg.adapters))
    engine = Engine(model.to(device), tokenizer, max_length=engine_cfg.max_length, buckets=engine_cfg.buckets,
                    check_every=engine_cfg.check_every, merge=model_cfg.merge and model_cfg.adapter is not None,
                    cuda_graphs=engine_cfg.cuda_graphs)
    if model_cfg.adapters and not engine.mixes_adapters:
        raise ValueError(f"model.adapters={dict(model_cfg.adapters)}: this engine cannot run other adapters than the "
                         f"active one (it needs the fused decode step, which declined: {engine.fused_step_reason})")
    return engine, tokenizer


def check_adapter_configs(model_cfg: InferenceModelConfig) -> None:
    """Each local adapter's adapter_config.json reads as a JSON object, checked before the model loads: PEFT's own
    error for a corrupt one names no file."""
    named = [("model.adapter", model_cfg.adapter)] if model_cfg.adapter is not None else []
    named += [(f"model.adapters.{name}", directory) for name, directory in model_cfg.adapters.items()]
    for key, directory in named:
        path = Path(directory).expanduser() / "adapter_config.json"
        if not path.is_file():  # a Hub id, or missing: PEFT's error names the directory
            continue
        try:
            config = json.loads(path.read_bytes())
        except (OSError, ValueError) as err:
            raise loading.ModelLoadError(f"{key}: {path} cannot be read as JSON ({err})") from err
        if not isinstance(config, dict):
            raise loading.ModelLoadError(f"{key}: {path} must hold a JSON object of LoRA settings, not a "
                                         f"{type(config).__name__}")


def served_model_name(name_or_path: str) -> str:
    """The name the server answers to by default: a local model directory's own name (its path is not sent to
    clients), or the Hub id."""
    if not looks_local(name_or_path):
        return name_or_path
    return os.path.basename(os.path.abspath(os.path.expanduser(name_or_path)))


def sampling_params(cfg: SamplingConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                          top_p=cfg.top_p, seed=cfg.seed, stop=tuple(cfg.stop))
