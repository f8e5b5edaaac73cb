"""Generate text with the static-cache engine: prompts from the command line or a file, an optional adapter.

    python recipes/generate.py                                          # the bundled tiny model, two demo prompts
    python recipes/generate.py model.adapter=runs/<run>/adapter prompts='["What is 12 plus 30?"]'
    python recipes/generate.py model.name_or_path=meta-llama/Llama-3.2-1B prompts_file=prompts.txt \\
        chat=false sampling.temperature=0.7 sampling.top_p=0.9 sampling.seed=0 output=completions.jsonl
    python recipes/generate.py model.adapter=runs/a/adapter +model.adapters.b=runs/b/adapter prompts_file=p.jsonl
        # p.jsonl: {"prompt": "...", "adapter": "b"} per line ("__base__": no adapter); one batch, rows on both

One prompt streams its text as it comes; several print their completions when all are done. Config: conf/generate.yaml.
"""
import json
import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from lorafuse.hf.loading import ModelLoadError
from lorafuse.inference.build import build_engine, sampling_params
from lorafuse.inference.config import register_configs
from lorafuse.inference.detokenize import TextStream, completion_text
from lorafuse.inference.prompts import PromptError, encode_prompt, read_prompts

register_configs()
logger = logging.getLogger("lorafuse.generate")


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    try:
        prompts, adapters = read_prompts(cfg.prompts, cfg.prompts_file)
        engine, tokenizer = build_engine(cfg.model, cfg.engine)
        ids = [encode_prompt(tokenizer, prompt, cfg.chat) for prompt in prompts]
        params = sampling_params(cfg.sampling)
    except (PromptError, ModelLoadError, ValueError) as err:
        logger.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None
    streamed = TextStream(tokenizer, params.stop)

    def stream(row: int, new: list[int]) -> None:  # one prompt: its text as it comes
        sys.stdout.write(streamed.add(new))
        sys.stdout.flush()

    try:
        outputs = engine.generate(ids, params, on_tokens=stream if len(prompts) == 1 else None,
                                  adapters=adapters if any(adapters) else None)
    except ValueError as err:  # an adapter name the model does not hold
        logger.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None
    # the text ends before the first stop string, as the server's (and OpenAI's) does
    completions = [completion_text(tokenizer, out, params.stop)[0] for out in outputs]
    if len(prompts) == 1:
        print(streamed.finish())
    else:
        for number, (prompt, completion) in enumerate(zip(prompts, completions)):
            print(f"[{number}] {prompt}\n    -> {completion}")
    if cfg.output is not None:
        with open(cfg.output, "w") as handle:
            for prompt, adapter, completion in zip(prompts, adapters, completions):
                row = {"prompt": prompt, **({"adapter": adapter} if adapter else {}), "completion": completion}
                handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
