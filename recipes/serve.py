"""An OpenAI-compatible HTTP server on the static-cache engine: /v1/completions and /v1/chat/completions
(streamed with "stream": true), /v1/models, /health. Concurrent requests are batched into the engine's buckets.

    python recipes/serve.py                                    # the bundled tiny model on http://127.0.0.1:8000
    python recipes/serve.py model.adapter=runs/<run>/adapter port=8080
    python recipes/serve.py model.adapter=runs/a/adapter +model.adapters.b=runs/b/adapter  # "model": "b" picks b
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "What is 2 plus 3?"}]}'

Config: conf/serve.yaml. It listens on 127.0.0.1 unless host= says otherwise.
"""
import logging

import hydra
from omegaconf import DictConfig, OmegaConf

from lorafuse.hf.loading import ModelLoadError
from lorafuse.inference.build import build_engine, served_model_name
from lorafuse.inference.config import check_serve_config, register_configs
from lorafuse.inference.server import LorafuseServer, check_can_listen

register_configs()
logger = logging.getLogger("lorafuse.serve")


@hydra.main(config_path="../conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    cfg = OmegaConf.to_object(cfg)
    try:
        check_serve_config(cfg)
    except ValueError as err:
        logger.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None
    try:
        check_can_listen(cfg.host, cfg.port)  # before the model loads; the server binds after it
    except OSError as err:
        cannot_listen(cfg, err)
    try:
        engine, tokenizer = build_engine(cfg.model, cfg.engine)
    except (ModelLoadError, ValueError) as err:
        logger.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None
    try:
        server = LorafuseServer(engine, tokenizer, host=cfg.host, port=cfg.port,
                                model_name=cfg.model_name or served_model_name(cfg.model.name_or_path),
                                max_length=cfg.engine.max_length, max_new_tokens=cfg.max_new_tokens,
                                max_batch=max(engine.buckets), request_timeout=cfg.request_timeout,
                                max_connections=cfg.max_connections)
    except OSError as err:  # taken since check_can_listen
        cannot_listen(cfg, err)
    host, port = server.server_address[:2]
    logger.info("serving %s on http://%s:%d (buckets %s, CUDA graphs %s)", cfg.model.name_or_path, host, port,
                engine.buckets, engine.cuda_graphs)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logger.info("stopped")
    finally:
        server.server_close()


def cannot_listen(cfg, err: OSError) -> None:
    """The port is taken, or the host is none of this machine's: one line, exit code 2."""
    logger.error("cannot listen on %s:%d: %s (set host= or port=)", cfg.host, cfg.port, err.strerror or err)
    raise SystemExit(2) from None


if __name__ == "__main__":
    main()
