"""LoRA fine-tuning with lorafuse's fused layers: Hydra config in, adapter out.

    python recipes/finetune.py                                  # bundled tiny Llama on the demo data (CPU: minutes)
    python recipes/finetune.py model=llama3_2_1b data=alpaca data.path=my.jsonl train.max_steps=1000
    python recipes/finetune.py run_dir=runs/demo train.resume=true           # continue from the last checkpoint
    accelerate launch --config_file conf/accelerate/ddp.yaml recipes/finetune.py ...   # several GPUs
    python recipes/finetune.py -m lora.r=8,16 optim.lr=1e-3,3e-3            # a sweep, one directory per job

Config groups are in conf/ (model, data, lora, optim, train); the run directory gets the Hydra config, the log,
metrics.jsonl, TensorBoard events, checkpoints/, adapter/ (PEFT's format), loss_curve.png and summary.json.
"""
import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from lorafuse.train import ConfigError, Finetune, NonFiniteLoss, register_configs
from lorafuse.train.config import check_override_keys
from lorafuse.train.data import DataError

register_configs()
logger = logging.getLogger("lorafuse.train")

# `accelerate launch` starts one process per GPU, and each composes the config: only the main one (rank 0) keeps
# Hydra's .hydra/ and log file, so that the run directory holds one log, not one per process.
if int(os.environ.get("RANK", "0")) != 0:
    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]


@hydra.main(config_path="../conf", config_name="finetune", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Trains; returns the final eval loss (what a Hydra sweeper minimises)."""
    try:
        summary = Finetune(OmegaConf.to_object(cfg), HydraConfig.get().runtime.output_dir).train()
    except MissingMandatoryValue as err:  # e.g. data=alpaca without data.path
        logger.error("ConfigError: %s has no value and needs one: set %s=<value>", err.full_key, err.full_key)
        raise SystemExit(2) from None
    except (ConfigError, DataError, NonFiniteLoss) as err:
        logger.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None
    return summary.get("eval_loss")


def refuse_unknown_keys() -> None:
    """A command-line key the schema lacks, with or without `+`, stops here with exit code 2, before Hydra composes:
    Hydra would take `+train.foo=1` in silently, and refuse `train.foo=1` without naming the keys allowed."""
    try:
        # key=value, +key=value, ~key: Hydra's own options (-m, --config-name NAME, ...) start with "-" or hold no "="
        check_override_keys([arg for arg in sys.argv[1:] if not arg.startswith("-") and ("=" in arg or arg[:1] == "~")])
    except ConfigError as err:
        print(f"ConfigError: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    refuse_unknown_keys()
    main()
