"""validate(): the values the schema's types let through but that cannot work, refused with the key and what is
allowed (tests/recipes/test_finetune.py runs some of them through the recipe)."""
import pytest

from lorafuse.train.config import ConfigError, DataConfig, FinetuneConfig, LoraSection, ModelConfig, validate


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
