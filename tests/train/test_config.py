"""validate(): the values the schema's types let through but that cannot work, refused with the key and what is
allowed (tests/recipes/test_finetune.py runs some of them through the recipe)."""
from dataclasses import fields

import pytest

from lorafuse.train.config import (ConfigError, DataConfig, FinetuneConfig, LoraSection, ModelConfig, TrainConfig,
                                   check_override_keys, validate)


def config(**sections) -> FinetuneConfig:
    defaults = {"model": ModelConfig(name_or_path="unused"), "data": DataConfig(path="unused")}
    return FinetuneConfig(**{**defaults, **sections})


@pytest.mark.parametrize("sections, message", [
    ({"lora": LoraSection(target_modules=123)},
     'lora.target_modules=123: a list of module names (e.g. [q_proj,v_proj]), a regex string matching module names, '
     "\"all-linear\", or null for PEFT's defaults of the model type"),
    ({"lora": LoraSection(target_modules=["q_proj", 7])},
     "lora.target_modules=['q_proj', 7]: a list of module names"),
    ({"lora": LoraSection(exclude_modules={"q_proj": True})},
     "lora.exclude_modules={'q_proj': True}: a list of module names (e.g. [q_proj,v_proj]), a regex string matching "
     "module names, or null"),
    ({"data": DataConfig(path="unused", max_samples=-3)},
     "data.max_samples=-3: must be > 0, or null for every training sample"),
    ({"data": DataConfig(path="unused", max_samples=0)}, "data.max_samples=0: must be > 0"),
    ({"lora": LoraSection(alpha=0)}, "lora.alpha=0: must be > 0"),
    ({"lora": LoraSection(alpha=-16.0)}, "lora.alpha=-16.0: must be > 0"),
    ({"train": TrainConfig(activation_checkpointing="cpu")},
     "train.activation_checkpointing='cpu': allowed values are false, true, offload"),
])
def test_a_value_that_cannot_work_is_refused_naming_the_key_and_what_is_allowed(sections, message):
    with pytest.raises(ConfigError) as error:
        validate(config(**sections))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("lora", [LoraSection(target_modules="all-linear"), LoraSection(target_modules=r".*\.q_proj"),
                                  LoraSection(target_modules=["q_proj", "v_proj"], exclude_modules=["lm_head"]),
                                  LoraSection(exclude_modules=r".*mlp.*"), LoraSection(target_modules=None)])
def test_peft_forms_of_target_and_exclude_modules_pass(lora):
    validate(config(lora=lora, data=DataConfig(path="unused", max_samples=1)))


# --- command-line keys (recipes/finetune.py checks them before Hydra composes) ------------------------------------

@pytest.mark.parametrize("override", ["train.foo=1", "+train.foo=1", "++train.foo=1", "~train.foo"])
def test_a_key_not_in_the_schema_is_refused_with_or_without_plus_naming_the_keys_of_its_group(override):
    # Hydra takes +train.foo=1 in, and the schema then ignores it; without the plus it names no allowed key.
    with pytest.raises(ConfigError) as error:
        check_override_keys(["lora.r=8", override])
    message, allowed = str(error.value).split("; the keys of train are ")
    assert message == "train.foo: Key 'foo' not in 'TrainConfig'"
    assert allowed.split(", ") == [field.name for field in fields(TrainConfig)]


@pytest.mark.parametrize("override, message", [
    ("+foo=1", "foo: Key 'foo' not in 'FinetuneConfig'; the keys of the config are model, data, lora, optim, train, "
               "run_dir"),
    ("+model.config_override.num_hidden_layers=2", "model.config_override.num_hidden_layers: Key 'config_override' "
                                                   "not in 'ModelConfig'; the keys of model are name_or_path, "),
])
def test_an_unknown_key_is_named_at_its_own_level(override, message):
    with pytest.raises(ConfigError) as error:
        check_override_keys([override])
    assert str(error.value).startswith(message)


def test_keys_of_the_schema_and_of_hydra_pass():
    check_override_keys(["model=tiny", "data=alpaca", "data.path=my.jsonl", "run_dir=runs/x", "lora.r=8,16",
                         "+model.config_overrides.num_hidden_layers=2", "lora.target_modules=[q_proj,v_proj]",
                         "~train.eval_batches", "hydra/job_logging=disabled", "hydra.output_subdir=null"])
