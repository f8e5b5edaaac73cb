"""recipes/finetune.py end to end on a CPU: what it trains, writes, resumes and refuses."""
import json
import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import lorafuse
from lorafuse._paths import ASSETS
from lorafuse.train.checkpoint import latest_checkpoint

from .finetune_run import QUICK, metrics, run_recipe, train_rows

TINY = ASSETS / "tiny-llama"


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_default_run_learns_and_leaves_a_peft_adapter(tmp_path):
    """The README's main job: the defaults, plus the merged model. The eval loss falls; the adapter loads in plain
    PEFT (and in lorafuse) to the same logits as the merged model."""
    run_dir, home = tmp_path / "run", tmp_path / "home"
    home.mkdir()
    # 600 steps: about 2.5 min alone on 2 CPU cores, longer beside the other test worker on a slow CI machine
    run_recipe(f"run_dir={run_dir}", "train.save_merged=true", home=home, timeout=1800)
    evals = [row["eval_loss"] for row in metrics(run_dir) if "eval_loss" in row]
    assert len(evals) == 7 and evals[-1] < evals[0] - 1.0, evals
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/tokenizer.json",
                 "loss_curve.png", "summary.json", "finetune.log", "merged/config.json"):
        assert (run_dir / name).is_file(), name
    assert len(list(run_dir.glob(".hydra/*/config.yaml"))) == 1  # a folder per launch
    assert list(home.iterdir()) == []  # nothing written outside the run directory (matplotlib's cache included)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000400", "step-000600"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(evals[-1])

    ids = torch.randint(0, 500, (2, 24))
    plain_peft = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), run_dir / "adapter"), ids)
    fused = logits(lorafuse.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), str(run_dir / "adapter")), ids)
    merged = logits(AutoModelForCausalLM.from_pretrained(run_dir / "merged"), ids)
    base = logits(AutoModelForCausalLM.from_pretrained(TINY), ids)
    torch.testing.assert_close(fused, plain_peft, rtol=1e-4, atol=1e-4)  # attention: kernel vs sdpa order
    torch.testing.assert_close(merged, plain_peft, rtol=1e-4, atol=1e-3)  # W + s*BA rounded once in fp32
    assert (plain_peft - base).abs().max() > 0.1  # the adapter is not a no-op


def test_resume_after_a_kill_mid_save_equals_an_uninterrupted_run(tmp_path):
    # log_every=3 with saves every 4: the resumed run's first log line averages steps from both runs
    steps = ["train.max_steps=12", "train.save_every_n_steps=4", "train.keep_checkpoints=3", "train.log_every=3"]
    whole = tmp_path / "whole"
    run_recipe(*QUICK, *steps, f"run_dir={whole}")

    interrupted = tmp_path / "interrupted"
    killed = run_recipe(*QUICK, *steps, f"run_dir={interrupted}", kill_at="step-000008", check=False)
    assert killed.returncode == -9, killed.stderr
    assert (interrupted / "checkpoints" / ".tmp-step-000008" / "trainer_state.json").exists()
    assert latest_checkpoint(interrupted).name == "step-000004"  # the half-published one is ignored

    run_recipe(*QUICK, *steps, f"run_dir={interrupted}", "train.resume=true")
    expected, resumed = train_rows(whole), train_rows(interrupted)
    assert sorted(resumed) == [3, 6, 9, 12]
    for step in resumed:  # bit for bit: same data position, RNG (dropout), optimizer, schedule and log window
        for key in ("loss", "lr", "grad_norm", "tokens"):
            assert resumed[step][key] == expected[step][key], (step, key)
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step-000004", "step-000008",
                                                                             "step-000012"]


def test_resume_from_an_explicit_checkpoint_directory(tmp_path):
    first = tmp_path / "first"
    run_recipe(*QUICK, "train.save_every_n_steps=3", f"run_dir={first}")
    second = tmp_path / "second"
    run = run_recipe(*QUICK, f"run_dir={second}", f"train.resume={first}/checkpoints/step-000003")
    assert "resumed from" in run.stdout + run.stderr
    assert sorted(train_rows(second)) == [4, 5, 6]
    assert train_rows(second)[6]["loss"] == train_rows(first)[6]["loss"]


@pytest.mark.parametrize("overrides,expected", [
    (["train.max_step=5"], "Key 'max_step' not in 'TrainConfig'"),
    (["train.max_steps=abc"], "train.max_steps"),
    (["optim.scheduler=cosin"], "expected one of [cosine, linear, constant]"),
    (["train.batch_size=0"], "train.batch_size=0: must be > 0"),
    (["data.path=missing/demo.jsonl"], "data.path: no such file or directory: missing/demo.jsonl"),
    (["model.name_or_path=./no/such/model"], "model.name_or_path: './no/such/model' does not exist"),
    (["train.resume=true"], "holds no checkpoint yet"),
    (["train.eval_batches=0"], "train.eval_batches=0: must be > 0"),
    (["data.packing=true", "model.attn_implementation=sdpa"],
     "data.packing=true needs model.attn_implementation=lorafuse"),
    (["data.max_samples=10", "train.batch_size=16"], "10 training rows are fewer than one global batch of 16"),
    (["optim.betas=[1.5,0.9]"], "optim.betas=[1.5, 0.9]: two numbers in [0, 1)"),
    (["optim.eps=-1"], "optim.eps=-1.0: must be >= 0"),
    (["lora.target_modules=[nope]"], "Target modules {'nope'} not found in the base model"),
    (["data=alpaca"], "data.path has no value and needs one: set data.path=<value>"),
    (["data.input_column=inptu"], "needs column(s) ['inptu'], found columns ['instruction', 'input', 'output']"),
    (["data.path=no_such_dataset_name"], "data.path=no_such_dataset_name: no local file or directory of that name"),
])
def test_bad_config_stops_at_start_up_with_a_clear_message(tmp_path, overrides, expected):
    cwd, home, run_dir = tmp_path / "cwd", tmp_path / "home", tmp_path / "run"
    cwd.mkdir(), home.mkdir()
    run = run_recipe(*overrides, f"run_dir={run_dir}", cwd=cwd, home=home, check=False, timeout=120)
    assert run.returncode != 0
    assert expected in run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []  # nothing written outside the run directory
    assert not (run_dir / "checkpoints").exists()


def test_a_run_directory_is_continued_only_as_the_same_run(tmp_path):
    run_dir, other = tmp_path / "run", tmp_path / "other"
    run_recipe(*QUICK, f"run_dir={run_dir}")
    run_recipe(*QUICK, "train.max_steps=2", f"run_dir={other}")
    first_config = next(run_dir.glob(".hydra/*/config.yaml")).read_text()
    refusals = [
        ([], "already holds checkpoints: continue that run with train.resume=true"),
        (["train.resume=true"], "is at step 6, and train.max_steps=6: raise train.max_steps"),
        (["train.resume=true", "train.max_steps=8", "optim.lr=1e-4"], "optim.lr: 0.005 in the checkpoint, 0.0001 now"),
        (["train.resume=true", "train.max_steps=8", "train.grad_accum=1"], "global batch"),
        (["train.resume=true", "train.max_steps=8", "model.random_init=true"], "model.random_init: False in the "
                                                                               "checkpoint, True now"),
        ([f"train.resume={run_dir}", "train.max_steps=8"], "not a checkpoint"),
        ([f"train.resume={other}/checkpoints/step-000002", "train.max_steps=8"], "holds checkpoints of its own run"),
    ]
    for overrides, expected in refusals:
        run = run_recipe(*QUICK, f"run_dir={run_dir}", *overrides, check=False, timeout=120)
        output = run.stdout + run.stderr
        assert run.returncode == 2 and expected in output and "Traceback" not in output, (overrides, output[-2000:])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000006"]
    # every launch kept its config beside the others: the first one's is as it was
    configs = sorted(run_dir.glob(".hydra/*/config.yaml"))
    assert len(configs) > 1 and configs[0].read_text() == first_config


def test_activation_checkpointing_recomputes_the_same_step(tmp_path):
    """Same losses and gradient norms with and without it, offloaded or not: the recomputed forward draws the same
    dropout masks (tests/hf/test_activation_checkpointing.py checks that the forward does run again)."""
    rows = []
    for flag in ("false", "true", "offload"):
        run = run_recipe(*QUICK, "train.max_steps=3", f"train.activation_checkpointing={flag}",
                         f"run_dir={tmp_path / flag}")
        assert ("activation checkpointing on" in run.stdout + run.stderr) == (flag != "false")
        assert ("its input kept in pinned host memory" in run.stdout + run.stderr) == (flag == "offload")
        rows.append([(row["loss"], row["grad_norm"]) for row in train_rows(tmp_path / flag).values()])
    assert rows[0] == rows[1] == rows[2]


@pytest.mark.parametrize("data_format,content,expected", [
    ("demo", "", "holds no rows (bad.jsonl: an empty file)"),
    ("demo", '{"instruction": "x", "output": \n', "could not be read as json"),
    ("demo_chat", '{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
     'each message needs a "role" and a "content" string'),
])
def test_unreadable_data_names_the_file_or_the_column(tmp_path, data_format, content, expected):
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    run = run_recipe(f"data={data_format}", f"data.path={data}", "data.eval_fraction=0", "train.batch_size=1",
                     f"run_dir={tmp_path / 'run'}", check=False, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 2 and expected in output and "Traceback" not in output, output[-2000:]


def test_a_missing_column_names_the_file_the_columns_and_the_key(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(20)))
    home = tmp_path / "home"
    home.mkdir()
    run = run_recipe(f"data.path={data}", f"run_dir={tmp_path / 'run'}", home=home, check=False, timeout=120)
    message = run.stdout + run.stderr
    assert run.returncode == 2
    for part in (str(data), "instruction", "output", "prompt", "answer", "data.output_column"):
        assert part in message, part
    assert list(home.iterdir()) == []  # datasets' cache went to the run directory


def test_a_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Adam moves every weight by about lr per step: 1e30 makes the second step's loss non-finite.
    run = run_recipe(*QUICK, "optim.lr=1e30", "optim.warmup_steps=0", "train.save_every_n_steps=1",
                     f"run_dir={run_dir}", check=False)
    assert run.returncode == 2
    assert "step 2: loss" in run.stderr + run.stdout
    assert "stopped (train.on_nonfinite=stop)" in run.stderr + run.stdout
    assert "Start again in a new run_dir with a lower optim.lr" in run.stderr + run.stdout
    assert latest_checkpoint(run_dir).name == "step-000001"
    assert json.loads((latest_checkpoint(run_dir) / "trainer_state.json").read_text())["step"] == 1


def test_non_finite_steps_can_be_skipped_until_too_many_in_a_row(tmp_path):
    run = run_recipe(*QUICK, "optim.lr=1e30", "optim.warmup_steps=0", "train.on_nonfinite=skip",
                     "train.max_skipped_steps=3", f"run_dir={tmp_path / 'run'}", check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 2
    assert output.count("step skipped (train.on_nonfinite=skip)") == 2
    assert "step 4: loss" in output and "3 non-finite steps in a row" in output


def test_multirun_gives_each_job_its_own_directory(tmp_path):
    sweep = tmp_path / "sweep"
    run_recipe("-m", *QUICK, "train.max_steps=2", "lora.r=2,4", f"hydra.sweep.dir={sweep}")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [p.name[:2] for p in jobs] == ["0_", "1_"]  # then the job's overrides, e.g. ...,lora.r=2,...
    assert "lora.r=2," in jobs[0].name and "lora.r=4," in jobs[1].name
    ranks = [json.loads((job / "adapter" / "adapter_config.json").read_text())["r"] for job in jobs]
    assert ranks == [2, 4]


@pytest.mark.parametrize("overrides", [
    ["data=demo_chat", "data.packing=true"],
    ["data=demo_text", "data.packing=true"],
    ["lora.fused=false", "model.attn_implementation=sdpa", "optim.scheduler=linear"],
])
def test_other_data_formats_and_options_train(tmp_path, overrides):
    run_dir = tmp_path / "run"
    run_recipe(*QUICK, "train.max_steps=4", *overrides, f"run_dir={run_dir}")
    losses = [row["loss"] for row in train_rows(run_dir).values()]
    assert len(losses) == 4 and all(0 < loss < 20 for loss in losses)


def test_profile_writes_a_chrome_trace_and_prints_the_top_kernels(tmp_path):
    run_dir = tmp_path / "run"
    run = run_recipe(*QUICK, "train.profile_steps=2", f"run_dir={run_dir}")
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "top 15 by self_cpu_time_total" in run.stdout + run.stderr


@pytest.mark.parametrize("checkpointing", ["false", "offload"])
def test_two_processes_match_one_process_at_the_same_global_batch(tmp_path, checkpointing):
    """torchrun with 2 CPU processes (gloo; DDP as on GPUs) against one process with grad_accum=2: the same samples
    per step and the same token-weighted loss, so the same losses up to the all-reduce's rounding; also with the 2
    processes' decoder layers checkpointed (their parameters' gradients come from the layers' own backward)."""
    # dropout 0: each process draws its own masks, so with dropout the runs would differ by design
    settings = [*QUICK, "train.max_steps=4", "train.eval_every=2", "train.save_every_n_steps=2", "lora.dropout=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(*settings, "train.grad_accum=2", f"run_dir={one}")
    run = run_recipe(*settings, "train.grad_accum=1", f"train.activation_checkpointing={checkpointing}",
                     f"run_dir={two}", launcher=["-m", "torch.distributed.run", "--nproc_per_node", "2"])
    assert run.stdout.count("step 4/4") + run.stderr.count("step 4/4") == 1  # only the main process logs
    assert (two / "finetune.log").read_text().count("step 4/4") == 1
    for name in ("loss", "grad_norm", "eval_loss"):
        expected = [row[name] for row in metrics(one) if name in row]
        assert [row[name] for row in metrics(two) if name in row] == pytest.approx(expected, rel=1e-5), name
    assert sorted(p.name for p in (two / "checkpoints" / "step-000004").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]


def test_two_processes_resume_a_run_whose_last_files_were_lost(tmp_path):
    """A 2-process run that ended at its final checkpoint but lost its last files (as a crash while merging leaves
    it) is finished by train.resume=true on 2 processes: the main process writes the adapter, the merged model and
    the summary; neither process trains, evaluates or waits on the other for ever."""
    settings = [*QUICK, "train.max_steps=2", "train.grad_accum=1", "train.save_merged=true"]
    two = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    run_dir = tmp_path / "run"
    run_recipe(*settings, f"run_dir={run_dir}", launcher=two)
    summary, logged = json.loads((run_dir / "summary.json").read_text()), metrics(run_dir)
    for lost in ("adapter", "merged"):
        shutil.rmtree(run_dir / lost)
    (run_dir / "summary.json").unlink()

    run = run_recipe(*settings, f"run_dir={run_dir}", "train.resume=true", launcher=two, timeout=300)
    assert (run.stdout + run.stderr).count("before the run's last files were written: writing them") == 1
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert metrics(run_dir) == logged  # nothing trained or evaluated again
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
