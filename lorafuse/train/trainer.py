"""The LoRA fine-tuning loop on accelerate: set-up, train, evaluate, checkpoint, and the files a run leaves.

`Finetune(cfg, run_dir)` builds everything (failing at start-up on bad config, model or data, before any
training), `train()` runs to `train.max_steps` optimizer steps, saving as configured, and returns the
summary. One process or several (`accelerate launch`: DDP, or FSDP from accelerate's config): each process
trains on its own shard of every global batch, only the main process writes logs and files.

The loss of an optimizer step is the mean over every label token of its global batch (all micro-steps, all
processes), so one process with grad_accum=2 computes the same step as two processes with grad_accum=1.

With train.cuda_graphs on (one CUDA process, batches of one shape), each step is one CUDA graph replay
(captured_step.CapturedStep) and the host reads the steps' losses, gradient norms and non-finite flags only at log
and save steps: train.on_nonfinite then acts on the steps since the last read, as the eager loop acts on each.
"""
import gc
import inspect
import json
import logging
import math
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..hf import loading
from ..hf.activation_checkpointing import checkpointing_mode, enable_activation_checkpointing
from .batches import ShardedBatches, eval_batches
from .captured_step import ITEMS, CapturedStep
from .checkpoint import keep_trainable_weights_only, latest_checkpoint, load_checkpoint, publishing, save_checkpoint
from .config import ConfigError, CudaGraphs, FinetuneConfig, OnNonFinite, Precision, cuda_graphs_setting, validate
from .data import IGNORE, Collator, build_datasets, count_loss_tokens, count_sample_tokens
from .metrics import (METRICS_FILE, SUMMARY_FILE, MetricsLog, memory_stats, plot_loss_curve, read_metrics,
                      trackers)
from .optim import Schedule, build_optimizer, build_scheduler, resume_schedule
from .profiling import StepProfiler
from .resume import checkpoint_to_resume, fixed_settings

logger = logging.getLogger("lorafuse.train")


class NonFiniteLoss(RuntimeError):
    """The loss or the gradients became NaN or Inf and the config says to stop."""


class Finetune:
    def __init__(self, cfg: FinetuneConfig, run_dir: str | Path):
        validate(cfg)
        self.cfg = cfg
        self._check_paths()
        precision = _resolve_precision(cfg.train.precision)
        # cpu=True without CUDA: several processes (torchrun, accelerate launch) then form a gloo group.
        # log_with: the trackers MetricsLog reports to, logging under run_dir (the main process's, which logs)
        self.accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available(),
                                       log_with=trackers(cfg.train.report_to, run_dir), project_dir=str(run_dir))
        self.run_dir = self._shared_run_dir(Path(run_dir))
        self.cuda_graphs = use_cuda_graphs(cfg, torch.cuda.is_available(), self.accelerator.num_processes, precision,
                                           self.accelerator.is_main_process)
        settings = fixed_settings(cfg, self.accelerator.num_processes, precision,
                                  _storage_dtype(cfg.model.dtype, precision))
        # A used run_dir or a checkpoint this run cannot continue stops it here; the data is read, tokenized and
        # checked before the model's weights load: neither error costs a model load.
        checkpoint = checkpoint_to_resume(cfg, self.run_dir, settings)
        self.tokenizer = self._load_tokenizer()
        self.train_set, self.eval_set = self._build_data()
        self._check_batch_fits()
        set_seed(cfg.train.seed)
        model = self._build_model(precision)
        # Prepared together: under FSDP2 accelerate points the optimizer at the sharded parameters.
        self.model, self.optimizer = self.accelerator.prepare(model, build_optimizer(model, cfg.optim))
        self.takes_num_items = accepts_loss_kwargs(model)  # how its loss is normalised (_micro_batch_loss)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        self.accelerator.register_for_checkpointing(self.scheduler)
        keep_trainable_weights_only(self.accelerator)
        # log_window: the loss sum and finite steps since the last log line, saved with checkpoints so that a resumed
        # run logs the same averages as an uninterrupted one.
        self.state = {"step": 0, "tokens": 0, "skipped_steps": 0, "log_window": [0.0, 0], "config": settings}
        self._unsummed_tokens = 0  # this process's tokens not yet added to state["tokens"] (see _sum_tokens)
        self.resumed_from = self._resume(checkpoint)

    # ---- set-up -------------------------------------------------------------------------------------------------

    def _check_paths(self) -> None:
        """Missing files fail here, before any process group or model exists."""
        model = self.cfg.model
        for key, path in (("model.name_or_path", model.name_or_path), ("model.tokenizer", model.tokenizer)):
            if path is not None:
                try:
                    loading.check_exists(path)
                except loading.ModelLoadError as err:
                    raise ConfigError(f"{key}: {err}") from err

    def _shared_run_dir(self, run_dir: Path) -> Path:
        # Each process composed its own config; a run directory named after the start time can differ between
        # them by a second. The main process's one is the run's.
        shared = [str(run_dir)]
        broadcast_object_list(shared)
        if run_dir != Path(shared[0]) and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()  # made by this process's Hydra, empty (the recipe keeps Hydra's files to the main one)
        return Path(shared[0])

    def _load_tokenizer(self):
        cfg = self.cfg.model
        try:
            return loading.load_tokenizer(cfg.tokenizer or cfg.name_or_path, cfg.trust_remote_code)
        except loading.ModelLoadError as err:
            raise ConfigError(f"{'model.tokenizer' if cfg.tokenizer else 'model.name_or_path'}: {err}") from err

    def _build_model(self, precision: str):
        cfg = self.cfg.model
        dtype = _storage_dtype(cfg.dtype, precision)
        try:
            model = loading.load_causal_lm(
                cfg.name_or_path, dtype=dtype, attn_implementation=cfg.attn_implementation.value,
                random_init=cfg.random_init, config_overrides=dict(cfg.config_overrides),
                trust_remote_code=cfg.trust_remote_code, seed=self.cfg.train.seed)
        except loading.ModelLoadError as err:
            raise ConfigError(f"model.name_or_path: {err}") from err
        lora = self.cfg.lora
        try:
            model = loading.add_lora(
                model, fused=lora.fused, attention=cfg.attn_implementation.value == "lorafuse",
                model_kernels=lora.model_kernels, loss_kernels=lora.loss_kernels, r=lora.r,
                lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                exclude_modules=lora.exclude_modules, use_rslora=lora.use_rslora, bias=lora.bias)
        except ValueError as err:  # PEFT's refusals: no module matches, a module type it cannot adapt, ...
            raise ConfigError(f"lora (target_modules={lora.target_modules!r}, exclude_modules="
                              f"{lora.exclude_modules!r}): {err}") from err
        checkpointing = checkpointing_mode(self.cfg.train.activation_checkpointing)
        if checkpointing:
            enable_activation_checkpointing(model, checkpointing)
            logger.info("activation checkpointing on: each decoder layer's forward runs again in the backward%s",
                        ", its input kept in pinned host memory meanwhile" if checkpointing == "offload" else "")
        if self.accelerator.is_main_process:
            trainable, total = loading.parameter_counts(model)
            logger.info("model %s: %s trainable of %s parameters (%.3f%%), weights in %s, attention %s",
                        cfg.name_or_path, f"{trainable:,}", f"{total:,}", 100 * trainable / total, dtype,
                        model.config._attn_implementation)
        return model

    def _build_data(self):
        if self.cfg.data.cache_dir is None:  # nothing written outside the run directory unless asked
            self.cfg.data.cache_dir = str(self.run_dir / "cache")
        # The main process tokenizes first and fills datasets' cache; the others then read it.
        with self.accelerator.main_process_first():
            train_set, eval_set = build_datasets(self.cfg.data, self.tokenizer, self.cfg.train.seed)
        # a captured step takes batches of one shape: packed rows too are padded to max_length then
        fixed_length = self.cfg.data.pad_to_max_length or self.cuda_graphs
        self.collate = Collator(pad_token_id=self.tokenizer.pad_token_id,
                                pad_to_length=self.cfg.data.max_length if fixed_length else None)
        if self.accelerator.is_main_process:
            logger.info("data %s: %d training rows, %s eval rows", self.cfg.data.path, len(train_set),
                        len(eval_set) if eval_set is not None else "no")
        return train_set, eval_set

    def _check_batch_fits(self) -> None:
        train = self.cfg.train
        global_batch = train.batch_size * self.accelerator.num_processes * train.grad_accum
        if len(self.train_set) < global_batch:
            raise ConfigError(f"{len(self.train_set)} training rows are fewer than one global batch of {global_batch} "
                              f"(train.batch_size={train.batch_size} x {self.accelerator.num_processes} processes x "
                              f"train.grad_accum={train.grad_accum}): lower them, or give more data")

    def _resume(self, checkpoint: Path | None) -> Path | None:
        """Loads checkpoint_to_resume's `checkpoint` (None: a fresh start) and sets the run's learning-rate schedule."""
        if checkpoint is None:
            self.state["schedule"] = asdict(Schedule(self.cfg.train.max_steps))
            return None
        self.state = load_checkpoint(self.accelerator, checkpoint, self.run_dir, self.cfg.train.resume_lenient)
        self._continue_schedule()
        if self.accelerator.is_main_process:
            logger.info("resumed from %s at step %d", checkpoint, self.state["step"])
        return checkpoint

    def _continue_schedule(self) -> None:
        """Sets the scheduler to the checkpoint's schedule at its step, continued over train.max_steps where that
        changed: the decay then starts again from the rate of the checkpoint's last step (Schedule.continued)."""
        step, total, optim = self.state["step"], self.cfg.train.max_steps, self.cfg.optim
        # a checkpoint of an earlier lorafuse records no schedule: its decay is recomputed over train.max_steps
        saved = Schedule(**self.state.get("schedule", {"total_steps": total}))
        schedule = saved.continued(step, total, optim)
        # the scheduler as built, with the state the checkpoint restored, unless the schedule changed or that state was
        # not restored (train.resume_lenient past an unreadable scheduler file)
        if schedule != Schedule(total) or self.scheduler.last_epoch != step:
            resume_schedule(self.scheduler, schedule, optim, step)
        self.state["schedule"] = asdict(schedule)
        if schedule != saved and self.accelerator.is_main_process:
            logger.info("train.max_steps=%d, where the checkpoint's schedule ran to %d: the learning rate goes on "
                        "from step %d's, %.3g, over the steps left", total, saved.total_steps, step,
                        optim.lr * schedule.factor(step - 1, optim))

    # ---- training -----------------------------------------------------------------------------------------------

    def train(self) -> dict:
        start = self.state["step"]
        acc = self.accelerator
        log = MetricsLog(self.run_dir, acc, resumed_from=start) if acc.is_main_process else None
        profiler = self._profiler(self.cfg.train.max_steps - start)
        with _collector_frozen():
            self._run_steps(start, log, profiler)
        if profiler:
            profiler.stop()
        summary = self._finish(log)
        return summary

    def _run_steps(self, start: int, log: MetricsLog | None, profiler: StepProfiler | None) -> None:
        """Optimizer steps start + 1 ... train.max_steps, with their logging, evals and checkpoints."""
        cfg, acc = self.cfg.train, self.accelerator
        batches = self._train_batches(start)
        window = {"tokens_before": self.state["tokens"], "time": time.perf_counter()}
        consecutive_skips = 0
        # built after _resume loaded the optimizer state, which make_capturable's learning-rate tensor must outlive
        captured = CapturedStep(self.model, self.optimizer, self._captured_micro_batch_loss,
                                self.cfg.optim.max_grad_norm) if self.cuda_graphs else None
        unread = _UnreadSteps(cfg.log_every, acc.device) if captured else None
        if start == 0 and cfg.eval_every:
            self._log_eval(0, log)  # the loss before training: what the rest is compared with
            window["time"] = time.perf_counter()  # eval time stays out of tokens/s
        self.model.train()
        # disable=None: a bar on a terminal only (the log lines carry the same numbers elsewhere).
        with logging_redirect_tqdm(), tqdm(total=cfg.max_steps, initial=start, disable=None if acc.is_main_process
                                           else True, desc="train", unit="step", dynamic_ncols=True) as bar:
            for step in range(start + 1, cfg.max_steps + 1):
                micro_batches = [next(batches) for _ in range(cfg.grad_accum)]
                if captured is None:
                    loss, grad_norm, tokens, finite = self._train_step(micro_batches)
                    consecutive_skips = self._count_step(step, loss, grad_norm, finite, consecutive_skips)
                else:
                    tokens = sum(count_sample_tokens(batch) for batch in micro_batches)
                    items = sum(count_loss_tokens(batch["labels"]) for batch in micro_batches)  # one process: all
                    unread.add(step, *captured(micro_batches, items))
                lr = self.scheduler.get_last_lr()[0]  # the rate this step used; the scheduler now moves to the next
                self.scheduler.step()
                self._unsummed_tokens += tokens
                if profiler:
                    profiler.step()
                bar.update(1)
                log_step = step % cfg.log_every == 0 or step == cfg.max_steps
                save_step = cfg.save_every_n_steps and step % cfg.save_every_n_steps == 0 and step != cfg.max_steps
                if unread is not None and (log_step or save_step):  # a checkpoint holds the log window too
                    for step_read, loss, grad_norm, finite in unread.read():
                        consecutive_skips = self._count_step(step_read, loss, grad_norm, finite, consecutive_skips)
                if log_step:
                    self._log_train(step, window, lr, grad_norm, bar, log)
                paused = time.perf_counter()  # eval and save time stays out of tokens/s
                if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.max_steps:
                    self._log_eval(step, log)
                if save_step:
                    self._save(step)
                window["time"] += time.perf_counter() - paused

    def _profiler(self, steps_left: int) -> StepProfiler | None:
        steps = self.cfg.train.profile_steps
        if not steps or not self.accelerator.is_main_process:
            return None
        if steps + 1 > steps_left:  # one warm-up step first
            logger.warning("train.profile_steps=%d: only %d steps are left to run, so the profile records %d",
                           steps, steps_left, max(steps_left - 1, 0))
        return StepProfiler(self.run_dir, steps)

    def _train_batches(self, start_step: int):
        acc, train = self.accelerator, self.cfg.train
        sampler = ShardedBatches(len(self.train_set), train.batch_size, train.seed, acc.process_index,
                                 acc.num_processes, train.grad_accum, start_step)
        # A generator of its own: iter() would otherwise draw worker seeds from the global RNG, which a resumed
        # run restored for the dropout masks of its next step.
        loader = DataLoader(self.train_set, batch_sampler=sampler, collate_fn=self.collate,
                            num_workers=self.cfg.train.num_workers, pin_memory=acc.device.type == "cuda",
                            generator=torch.Generator().manual_seed(self.cfg.train.seed))
        return iter(loader)

    def _train_step(self, micro_batches: list[dict]) -> tuple[float, float, int, bool]:
        """One optimizer step over `micro_batches`; returns the global loss, the gradient norm, the tokens this
        process trained on, and whether the step was finite. One host sync per step: the loss and norm decide
        whether the optimizer steps."""
        acc = self.accelerator
        local_items = sum(count_loss_tokens(batch["labels"]) for batch in micro_batches)
        global_items = acc.reduce(torch.tensor(local_items, device=acc.device, dtype=torch.float64), reduction="sum")
        # Gradients are averaged over processes: each divides its token-loss sum by the global count / processes.
        items_per_process = global_items / acc.num_processes
        loss_sum = torch.zeros((), device=acc.device, dtype=torch.float64)
        tokens = sum(count_sample_tokens(b) for b in micro_batches)  # on the host, before the copy: no sync
        for index, batch in enumerate(micro_batches):
            batch = {name: tensor.to(acc.device, non_blocking=True) for name, tensor in batch.items()}
            last = index == len(micro_batches) - 1
            with nullcontext() if last else acc.no_sync(self.model):
                loss = self._micro_batch_loss(batch, items_per_process)
                acc.backward(loss)
            loss_sum += loss.detach().double() * items_per_process
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        loss_sum = acc.reduce(loss_sum, reduction="sum")
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
            grad_norm = grad_norm.full_tensor()
        loss, grad_norm = torch.stack([loss_sum / global_items, torch.as_tensor(grad_norm).double()]).tolist()
        # fp16's grad scaler: an overflowing step is the scaler's to skip (optimizer.step() does, and lowers the
        # scale), not a non-finite step; it must still be called, or the scaler breaks on the next unscale.
        scaled = acc.scaler is not None
        finite = math.isfinite(loss) and (scaled or math.isfinite(grad_norm))
        if finite or scaled:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, tokens, finite

    def _count_step(self, step: int, loss: float, grad_norm: float, finite: bool, consecutive_skips: int) -> int:
        """Adds a step's loss to the log window, or applies train.on_nonfinite to it; returns the non-finite steps in
        a row up to it."""
        consecutive_skips = 0 if finite else consecutive_skips + 1
        if not finite:
            self._non_finite(step, loss, grad_norm, consecutive_skips)
        self.state["log_window"][0] += loss if finite else 0.0
        self.state["log_window"][1] += finite
        return consecutive_skips

    def _captured_micro_batch_loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """CapturedStep's loss_fn: _micro_batch_loss, with the step's token count from the batch (model is
        self.model)."""
        return self._micro_batch_loss(batch, batch.pop(ITEMS))

    def _micro_batch_loss(self, batch: dict, items: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token-loss sum divided by `items`, so that the micro-steps' gradients add up to those of
        the mean over the whole accumulated batch. A model that takes num_items_in_batch divides by it itself; one
        that does not (remote code without **kwargs) would average over its micro-batch alone, so its loss is taken
        here from its logits, as transformers' causal-LM loss takes it."""
        if self.takes_num_items:
            return self.model(**batch, num_items_in_batch=items).loss
        inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
        return _causal_lm_loss_sum(self.model(**inputs).logits, batch["labels"]) / items

    def _non_finite(self, step: int, loss: float, grad_norm: float, consecutive: int) -> None:
        cfg = self.cfg.train
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        checkpoint = latest_checkpoint(self.run_dir)
        kept = f"the last good checkpoint, {checkpoint}, is intact" if checkpoint else "no checkpoint was written yet"
        if cfg.on_nonfinite is OnNonFinite.stop:
            raise NonFiniteLoss(f"{what}: stopped (train.on_nonfinite=stop); {kept}. Start again in a new run_dir "
                                "with a lower optim.lr or a smaller optim.max_grad_norm (a resumed run keeps the "
                                "checkpoint's optimizer settings), or skip such steps with "
                                "train.on_nonfinite=skip")
        self.state["skipped_steps"] += 1
        if consecutive >= cfg.max_skipped_steps:
            raise NonFiniteLoss(f"{what}: {consecutive} non-finite steps in a row (train.max_skipped_steps="
                                f"{cfg.max_skipped_steps}): stopped; {kept}")
        if self.accelerator.is_main_process:
            logger.warning("%s: step skipped (train.on_nonfinite=skip)", what)

    # ---- evaluation, logging, saving ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss per label token over the eval split (or train.eval_batches batches of it), and perplexity."""
        acc = self.accelerator
        if self.eval_set is None:
            return {}
        batches = eval_batches(len(self.eval_set), self.cfg.train.batch_size, acc.process_index, acc.num_processes,
                               limit=self.cfg.train.eval_batches)
        totals = torch.zeros(2, device=acc.device, dtype=torch.float64)  # token-loss sum, token count
        self.model.eval()
        for indices, counted in batches:
            batch = {name: t.to(acc.device) for name, t in self.collate([self.eval_set[i] for i in indices]).items()}
            items = count_loss_tokens(batch["labels"])
            loss = self.model(**batch).loss.double()
            if counted and items:
                totals += torch.stack([loss * items, torch.tensor(float(items), device=acc.device)])
        self.model.train()
        loss_sum, count = acc.reduce(totals, reduction="sum").tolist()
        if count == 0:
            if acc.is_main_process:
                logger.warning("eval: no eval token carries loss (an empty eval split?): no eval loss")
            return {}
        eval_loss = loss_sum / count
        return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 80.0))}

    def _sum_tokens(self) -> None:
        """Adds every process's tokens since the last call to state["tokens"]: a collective, so it runs at log and
        save steps only, not every step."""
        acc = self.accelerator
        self.state["tokens"] += int(acc.reduce(torch.tensor(self._unsummed_tokens, device=acc.device), "sum"))
        self._unsummed_tokens = 0

    def _log_train(self, step: int, window: dict, lr: float, grad_norm: float, bar: tqdm,
                   log: MetricsLog | None) -> None:
        self._sum_tokens()
        elapsed = time.perf_counter() - window["time"]
        loss_sum, steps = self.state["log_window"]
        loss = loss_sum / steps if steps else float("nan")
        row = {"loss": loss, "lr": float(lr), "grad_norm": grad_norm,
               "tokens_per_s": (self.state["tokens"] - window["tokens_before"]) / elapsed,
               "tokens": self.state["tokens"]}
        row.update(memory_stats(self.accelerator.device))  # on every process: each closes its own peak window
        self.state["log_window"] = [0.0, 0]
        window.update(tokens_before=self.state["tokens"], time=time.perf_counter())
        if log is None:
            return
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **_memory_postfix(row))
        logger.info("step %d/%d  loss %.4f  lr %.3g  grad_norm %.3g  %.0f tokens/s", step, self.cfg.train.max_steps,
                    loss, row["lr"], grad_norm, row["tokens_per_s"])
        log.log(step, **row)

    def _log_eval(self, step: int, log: MetricsLog | None) -> dict:
        metrics = self.evaluate()
        if metrics and log is not None:
            logger.info("step %d  eval_loss %.4f  eval_ppl %.2f", step, metrics["eval_loss"], metrics["eval_ppl"])
            log.log(step, **metrics)
        return metrics

    def _save(self, step: int) -> Path:
        self._sum_tokens()
        # final: the checkpoint that ends the run, after which only the run's last files are left to write
        state = {**self.state, "final": step == self.cfg.train.max_steps}
        return save_checkpoint(self.accelerator, self.model, self.run_dir, step, state,
                               keep=self.cfg.train.keep_checkpoints)

    def _finish(self, log: MetricsLog | None) -> dict:
        """The last eval and the final checkpoint, then the adapter (and merged model), the loss curve and the summary.

        Each of the last is written beside its name and published by one rename, the summary last: a crash on the
        way (out of memory while merging, say) leaves no half-written file, and train.resume=true, which then
        resumes the final checkpoint, writes what is missing."""
        acc, steps = self.accelerator, self.cfg.train.max_steps
        if self.state["step"] < steps:
            eval_metrics = self._log_eval(steps, log)
            checkpoint = self._save(steps)
        else:  # resumed at the last step: the final eval was logged before the final checkpoint was saved
            # read by the main process alone, which writes the summary and has just rewritten that file (MetricsLog)
            eval_metrics = _logged_eval(self.run_dir, steps) if acc.is_main_process else {}
            checkpoint = self.resumed_from
            if acc.is_main_process:
                logger.info("training ended at step %d before the run's last files were written: writing them", steps)
        adapter, merged = self.run_dir / "adapter", self.run_dir / "merged"
        summary = {"step": steps, "tokens": self.state["tokens"], "skipped_steps": self.state["skipped_steps"],
                   **eval_metrics, "checkpoint": str(checkpoint), "adapter": str(adapter)}
        if self.cfg.train.save_merged:
            summary["merged"] = str(merged)
        if acc.is_main_process:
            with publishing(adapter) as tmp:
                shutil.copytree(checkpoint / "adapter", tmp)
                self.tokenizer.save_pretrained(tmp)
            with publishing(self.run_dir / "loss_curve.png") as tmp:
                plot_loss_curve(self.run_dir / METRICS_FILE, tmp)
        acc.wait_for_everyone()
        acc.end_training()  # the process group ends here: the merge below keeps no other process waiting
        if acc.is_main_process:
            if self.cfg.train.save_merged:
                with publishing(merged) as tmp:
                    self._save_merged(adapter, tmp)
            with publishing(self.run_dir / SUMMARY_FILE) as tmp:
                tmp.write_text(json.dumps(summary, indent=2))
            logger.info("done: %s", json.dumps(summary))
        return summary

    def _save_merged(self, adapter: Path, out_dir: Path) -> None:
        """The base model reloaded on the CPU (every distributed layout holds it whole there), the adapter merged."""
        cfg = self.cfg.model
        base = loading.load_causal_lm(
            cfg.name_or_path, dtype=_storage_dtype(cfg.dtype, self.accelerator.mixed_precision),
            attn_implementation="sdpa", random_init=cfg.random_init, config_overrides=dict(cfg.config_overrides),
            trust_remote_code=cfg.trust_remote_code, seed=self.cfg.train.seed)
        loading.save_merged(base, adapter, out_dir, self.tokenizer)


class _UnreadSteps:
    """The captured steps' losses, gradient norms and non-finite flags, kept on the device until the host reads them
    (at log and save steps, at most `capacity` steps apart): reading them every step would make the host wait for
    the GPU every step."""

    def __init__(self, capacity: int, device: torch.device):
        self.rows = torch.zeros(capacity, 3, dtype=torch.float64, device=device)  # loss, grad norm, non-finite
        self.steps: list[int] = []

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, nonfinite: torch.Tensor) -> None:
        row = self.rows[len(self.steps)]
        row[0], row[1], row[2] = loss, grad_norm, nonfinite  # copies on the device
        self.steps.append(step)

    def read(self) -> list[tuple[int, float, float, bool]]:
        """(step, loss, grad norm, finite) of each step since the last read, in order; one host sync."""
        rows = self.rows[:len(self.steps)].tolist()
        read = [(step, loss, grad_norm, not nonfinite) for step, (loss, grad_norm, nonfinite) in zip(self.steps, rows)]
        self.steps = []
        return read


def use_cuda_graphs(cfg: FinetuneConfig, cuda: bool, processes: int, precision: str,
                    main_process: bool = True) -> bool:
    """Whether train.cuda_graphs captures the training step. auto captures where it can and says once in the log why
    not where it cannot; true fails at start-up where capture cannot work (ConfigError). Several processes (DDP, FSDP)
    train eagerly with either, said in the log."""
    setting = cuda_graphs_setting(cfg.train.cuda_graphs)
    if setting is CudaGraphs.false:
        return False
    if processes > 1:
        if main_process:
            logger.info("train.cuda_graphs=%s: eager steps: %d processes (DDP/FSDP) are not captured", setting.value,
                        processes)
        return False
    blocker = _capture_blocker(cfg, cuda, precision)
    if blocker is None:
        return True
    why, fix = blocker
    if setting is CudaGraphs.true:
        raise ConfigError(f"train.cuda_graphs=true: {why}; {fix}, or use train.cuda_graphs=auto, which runs eager "
                          "steps where capture cannot work")
    if main_process:
        logger.info("train.cuda_graphs=auto: eager steps: %s (%s to capture them)", why, fix)
    return False


def _capture_blocker(cfg: FinetuneConfig, cuda: bool, precision: str) -> tuple[str, str] | None:
    """Why a captured step cannot work with `cfg` here, and what would make it work; None where it can."""
    if not cuda:
        return "no CUDA device", "run on a CUDA GPU"
    if not (cfg.data.packing or cfg.data.pad_to_max_length):
        return ("each batch is padded to its own longest row, so batch shapes vary",
                "set data.pad_to_max_length=true or data.packing=true")
    if precision == "fp16":
        return "fp16's grad scaler reads its overflow check on the host every step", "use train.precision=bf16"
    if checkpointing_mode(cfg.train.activation_checkpointing):
        return ("activation checkpointing saves and restores the RNG state on the host to recompute each layer",
                "set train.activation_checkpointing=false")
    return None


def _memory_postfix(row: dict) -> dict:
    """The progress bar's GPU memory, allocated/reserved/peak in GiB: none off CUDA."""
    if "mem_allocated_GiB" not in row:
        return {}
    return {"mem_GiB": f"{row['mem_allocated_GiB']:.1f}/{row['mem_reserved_GiB']:.1f}/{row['mem_peak_GiB']:.1f}"}


def _logged_eval(run_dir: Path, step: int) -> dict:
    """The eval metrics logged at `step` in the run's metrics file ({} where no eval ran)."""
    logged = [row for row in read_metrics(run_dir / METRICS_FILE) if row["step"] == step and "eval_loss" in row]
    return {key: logged[-1][key] for key in ("eval_loss", "eval_ppl")} if logged else {}


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward takes num_items_in_batch, decided as transformers' Trainer decides it: the model's
    `accepts_loss_kwargs` where it says, else its forward's signature (a PEFT model passes its keyword arguments on
    to its base model, whose forward is the one that counts)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy over the labelled tokens, in fp32, computed as transformers' ForCausalLMLoss
    computes it (label t predicted at position t-1), so that dividing it by the token count gives the same loss."""
    # logits: [B, T, V], labels: [B, T]
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten().to(logits.device),
                                             ignore_index=IGNORE, reduction="sum")


@contextmanager
def _collector_frozen():
    """The training loop with the objects that exist now frozen out of the garbage collector's full passes.

    Set-up made most of the process's objects (modules, parameters, datasets) and none of them become garbage while
    training: frozen, they are left out of the full passes, whose pauses would otherwise stall every process of a
    distributed step at the next collective. Unfrozen when the loop ends, however it ends: a Hydra multirun trains
    its jobs one after another in one process, and a frozen object is never collected, so every finished job's
    model would stay in memory wherever a reference cycle holds it (accelerate's mixed-precision forward makes one).
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _resolve_precision(precision: Precision) -> str:
    if precision is Precision.auto:
        return "bf16" if torch.cuda.is_available() else "no"
    if precision in (Precision.bf16, Precision.fp16) and not torch.cuda.is_available():
        raise ConfigError(f"train.precision={precision.value}: mixed precision needs a CUDA GPU; "
                          "use train.precision=auto or no on this machine")
    return precision.value


def _storage_dtype(dtype: str, precision: str) -> torch.dtype:
    """The frozen weights' dtype: model.dtype, or with "auto" the mixed-precision dtype (fp32 without one)."""
    if dtype != "auto":
        return loading.DTYPES[dtype]
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
