"""The fine-tuning recipe's typed config: one dataclass per Hydra config group, stored in Hydra's ConfigStore.

`conf/finetune.yaml` picks one file per group (conf/model/, conf/data/, ...); each file fills the
dataclass of its group, so that Hydra rejects unknown keys and wrong types at start-up, naming the key,
and enums name their allowed values. Keys given on the command line are checked by check_override_keys, which the
recipe runs before Hydra: Hydra takes `+train.foo=1` in, and the schema then ignores it.
"""
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import MISSING

from .._paths import register_asset_resolver
from ..hf.activation_checkpointing import checkpointing_mode


class DataFormat(Enum):
    instruction = "instruction"  # alpaca-style columns: instruction, optional input, output
    chat = "chat"                # a list of {"role", "content"} messages, rendered with the tokenizer's chat template
    text = "text"                # plain text, loss on every token


class Precision(Enum):
    auto = "auto"  # bf16 mixed precision on CUDA, fp32 elsewhere
    no = "no"      # fp32
    bf16 = "bf16"
    fp16 = "fp16"


class Scheduler(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OnNonFinite(Enum):
    stop = "stop"  # stop the run; the last checkpoint stays as it was
    skip = "skip"  # drop the step's gradients and go on (a run of `max_skipped_steps` in a row still stops)


class CudaGraphs(Enum):
    auto = "auto"    # capture where it can: one CUDA process, every batch of one shape (data.packing or
                     # data.pad_to_max_length); otherwise eager, the reason said once in the log
    true = "true"    # capture; a config that cannot (no CUDA, batches of varying shape) fails at start-up
    false = "false"  # eager steps


class Attention(Enum):
    lorafuse = "lorafuse"
    sdpa = "sdpa"
    eager = "eager"


@dataclass
class ModelConfig:
    name_or_path: str = MISSING        # a Hub id or a local directory (config, weights, tokenizer)
    tokenizer: Optional[str] = None    # defaults to name_or_path
    random_init: bool = False          # weights drawn from train.seed instead of loaded: benchmarks, offline machines
    config_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {num_hidden_layers: 8}
    dtype: str = "auto"                # storage dtype of the frozen weights: auto, float32, bfloat16, float16
    attn_implementation: Attention = Attention.lorafuse
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    path: str = MISSING                # a json/jsonl/csv/parquet file, a directory of them, or a Hub dataset name
    format: DataFormat = DataFormat.instruction
    split: str = "train"
    eval_path: Optional[str] = None    # a separate eval file; without it, eval_fraction of `path` is held out
    eval_fraction: float = 0.05
    instruction_column: str = "instruction"
    input_column: str = "input"
    output_column: str = "output"
    messages_column: str = "messages"
    text_column: str = "text"
    max_length: int = 512              # tokens per sample (per row when packing); longer samples are truncated
    packing: bool = False              # several samples per row, attention kept inside each sample
    pad_to_max_length: bool = False    # every batch padded to max_length, not to its longest row: one shape for
                                       # all batches, which train.cuda_graphs=auto needs to capture the step
    train_on_prompt: bool = False      # False: loss on responses only (instruction, chat)
    max_samples: Optional[int] = None  # use only the first N training samples
    cache_dir: Optional[str] = None    # datasets' cache; None: <run_dir>/cache, so a run writes nowhere else


@dataclass
class LoraSection:
    r: int = 16
    alpha: float = 32
    dropout: float = 0.05
    target_modules: Any = "all-linear"  # names, a regex, or "all-linear" (PEFT's forms)
    exclude_modules: Optional[Any] = None
    use_rslora: bool = False
    bias: str = "none"
    fused: bool = True                  # False: PEFT's own LoRA layers (for comparison)
    model_kernels: bool = True          # with fused: Llama-style RMSNorm, SwiGLU and RoPE on lorafuse's kernels too
    loss_kernels: bool = True           # with fused: the loss without full logits (Llama-style causal LMs)


@dataclass
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: Scheduler = Scheduler.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0           # the schedule decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0          # 0 turns clipping off


@dataclass
class TrainConfig:
    seed: int = 0
    max_steps: int = 100                # optimizer steps
    batch_size: int = 8                 # samples per device per micro-step
    grad_accum: int = 1                 # micro-steps per optimizer step
    precision: Precision = Precision.auto
    activation_checkpointing: Any = False  # false, true (each decoder layer recomputed in the backward) or offload
                                        # (its input also waits in pinned host memory); Any as cuda_graphs is
    eval_every: int = 50                # optimizer steps between eval passes; 0: only at the end
    eval_batches: Optional[int] = None  # cap on eval batches per pass; None: the whole eval split
    log_every: int = 10
    save_every_n_steps: int = 0         # 0: a checkpoint at the end only
    keep_checkpoints: int = 2           # newest checkpoints kept, older ones deleted; 0 keeps all
    resume: Any = False                 # true: the latest checkpoint of run_dir; or a checkpoint directory. Data,
                                        # lora, optim settings, the resolved model.dtype and precision, and the
                                        # global batch must match the checkpoint's
    resume_lenient: bool = False        # with resume: an optimizer, scheduler or RNG file that cannot be read is
                                        # replaced by this run's starting state, with a warning, instead of stopping
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    max_skipped_steps: int = 10         # with on_nonfinite=skip: this many non-finite steps in a row stop the run
    profile_steps: int = 0              # >0: record this many steps with torch.profiler (Chrome trace, top kernels)
    save_merged: bool = False           # also save the base model with the adapter merged in
    num_workers: int = 0                # DataLoader workers
    cuda_graphs: Any = "auto"           # auto, true or false (CudaGraphs): the training step captured as one CUDA
                                        # graph. Typed Any because Hydra reads true and false as booleans
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])  # accelerate's trackers the metrics also go
                                        # to: tensorboard (run_dir/tensorboard), wandb, mlflow; or [none]


@dataclass
class FinetuneConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run_dir: str = MISSING              # where logs, checkpoints, the adapter and plots go (hydra.run.dir)


def register_configs() -> None:
    """Stores the schema as `finetune_schema`, which conf/finetune.yaml's defaults list starts from, and the
    `${asset:NAME}` resolver."""
    ConfigStore.instance().store(name="finetune_schema", node=FinetuneConfig)
    register_asset_resolver()


class ConfigError(ValueError):
    """A config value that cannot work: the message names the key, the value and what is allowed."""


def validate(cfg: FinetuneConfig) -> None:
    """Checks what the schema's types cannot: ranges, and values of keys typed loosely on purpose."""
    positive = {"train.max_steps": cfg.train.max_steps, "train.batch_size": cfg.train.batch_size,
                "train.grad_accum": cfg.train.grad_accum, "train.log_every": cfg.train.log_every,
                "data.max_length": cfg.data.max_length, "lora.r": cfg.lora.r, "lora.alpha": cfg.lora.alpha,
                "optim.lr": cfg.optim.lr}
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value}: must be > 0")
    at_least_zero = {"train.eval_every": cfg.train.eval_every, "train.save_every_n_steps": cfg.train.save_every_n_steps,
                     "train.keep_checkpoints": cfg.train.keep_checkpoints,
                     "train.profile_steps": cfg.train.profile_steps,
                     "optim.warmup_steps": cfg.optim.warmup_steps, "optim.max_grad_norm": cfg.optim.max_grad_norm,
                     "optim.weight_decay": cfg.optim.weight_decay, "train.num_workers": cfg.train.num_workers}
    for key, value in at_least_zero.items():
        if value < 0:
            raise ConfigError(f"{key}={value}: must be >= 0")
    if cfg.data.packing and cfg.model.attn_implementation is not Attention.lorafuse:
        # transformers' sdpa and eager attention, given no mask, let a packed row's samples attend to each other
        # (checked in tests/train/test_packing.py); lorafuse's reads the restarting position ids.
        raise ConfigError(f"data.packing=true needs model.attn_implementation=lorafuse, which keeps packed samples "
                          f"apart; {cfg.model.attn_implementation.value} would let them attend to each other. "
                          "Use lorafuse attention, or data.packing=false")
    if cfg.data.max_samples is not None and cfg.data.max_samples <= 0:
        raise ConfigError(f"data.max_samples={cfg.data.max_samples}: must be > 0, or null for every training sample")
    for key, value, also in (("lora.target_modules", cfg.lora.target_modules,
                              '"all-linear", or null for PEFT\'s defaults of the model type'),
                             ("lora.exclude_modules", cfg.lora.exclude_modules, "or null")):
        if value is not None:
            _check_module_names(key, value, also)
    if cfg.train.eval_batches is not None and cfg.train.eval_batches <= 0:
        raise ConfigError(f"train.eval_batches={cfg.train.eval_batches}: must be > 0, or null for the whole eval split")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction}: must be in [0, 1)")
    if not 0 <= cfg.lora.dropout < 1:
        raise ConfigError(f"lora.dropout={cfg.lora.dropout}: must be in [0, 1)")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio}: must be in [0, 1]")
    if len(cfg.optim.betas) != 2 or not all(0 <= beta < 1 for beta in cfg.optim.betas):
        raise ConfigError(f"optim.betas={cfg.optim.betas}: two numbers in [0, 1), e.g. [0.9, 0.999]")
    if not cfg.optim.eps >= 0:
        raise ConfigError(f"optim.eps={cfg.optim.eps}: must be >= 0")
    allowed_dtypes = ("auto", "float32", "bfloat16", "float16")
    if cfg.model.dtype not in allowed_dtypes:
        raise ConfigError(f"model.dtype={cfg.model.dtype!r}: allowed values are {', '.join(allowed_dtypes)}")
    if cfg.lora.bias not in ("none", "all", "lora_only"):
        raise ConfigError(f"lora.bias={cfg.lora.bias!r}: allowed values are none, all, lora_only")
    cuda_graphs_setting(cfg.train.cuda_graphs)
    try:
        checkpointing_mode(cfg.train.activation_checkpointing, "train.activation_checkpointing")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    check_report_to(cfg.train.report_to)
    if not isinstance(cfg.train.resume, (bool, str)):
        raise ConfigError(f"train.resume={cfg.train.resume!r}: true, false, or the path of a checkpoint directory")


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # each tracker's package


def check_report_to(trackers: list[str]) -> None:
    """train.report_to names known trackers (or none, alone), each of whose package is installed: a missing one
    stops the run here, before anything loads, rather than when accelerate starts the trackers."""
    allowed = [*TRACKER_PACKAGES, "none"]
    if not trackers or any(name not in allowed for name in trackers):
        raise ConfigError(f"train.report_to={list(trackers)}: a list of {', '.join(allowed)}, e.g. [tensorboard,wandb]")
    if "none" in trackers and len(trackers) > 1:
        raise ConfigError(f"train.report_to={list(trackers)}: none reports to no tracker, so it stands alone: [none]")
    for name in trackers:
        package = TRACKER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"train.report_to: {name} needs the {package} package, which is not installed: "
                              f"pip install {package}, or leave {name} out of train.report_to")


def cuda_graphs_setting(value: Any) -> CudaGraphs:
    """train.cuda_graphs as its enum, from the boolean or the string Hydra gives."""
    if isinstance(value, CudaGraphs):
        return value
    text = str(value).lower() if isinstance(value, (bool, str)) else None
    if text not in [setting.value for setting in CudaGraphs]:
        raise ConfigError(f"train.cuda_graphs={value!r}: allowed values are auto, true, false")
    return CudaGraphs(text)


def _check_module_names(key: str, value: Any, also_allowed: str) -> None:
    """PEFT's forms of a module selection (typed Any in the schema, so that Hydra takes a list or a string)."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(name, str) for name in value)):
        return
    raise ConfigError(f"{key}={value!r}: a list of module names (e.g. [q_proj,v_proj]), a regex string matching "
                      f"module names, {also_allowed}")


def check_override_keys(overrides: list[str]) -> None:
    """Each command-line override (`key=value`, `+key=value`, `~key`, ...) names a key of the schema; hydra.* keys
    and config group paths are Hydra's to check."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return  # Hydra says what is malformed
    for override in parsed:
        key = override.key_or_group
        if key.split(".")[0] != "hydra" and "/" not in key:  # "/": a config group's path, which Hydra checks
            _check_key(key)


def _check_key(key: str) -> None:
    """Each name of a dotted key is a field of its section, down to a field that is no section (model.config_overrides,
    a dict: any key below it goes). The message starts as Hydra's does, and lists the keys allowed."""
    section, names = FinetuneConfig, key.split(".")
    for depth, name in enumerate(names):
        fields = {f.name: f.type for f in dataclasses.fields(section)}
        if name not in fields:
            group = ".".join(names[:depth]) or "the config"
            raise ConfigError(f"{key}: Key {name!r} not in {section.__name__!r}; the keys of {group} are "
                              f"{', '.join(fields)}")
        section = fields[name]
        if not dataclasses.is_dataclass(section):
            return
