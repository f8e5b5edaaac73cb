"""recipes/generate.py and recipes/serve.py as users run them: greedy text equal to transformers' generate with
the same adapter, and a server on 127.0.0.1 (serving a second adapter beside the first) answering concurrent clients,
with the adapter each names, refusing malformed requests, and never sending the model's path; start-up errors of the
server in one line."""
import http.client
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorafuse._paths import ASSETS
from lorafuse.inference.build import served_model_name
from lorafuse.inference.config import ServeConfig, check_serve_config

from .finetune_run import ROOT, recipe_env

TINY = ASSETS / "tiny-llama"
PROMPTS = ["Reverse the letters of: zorbal", "What is 12 plus 30?", "Count the letters in quenbit."]


def saved_adapter(directory, seed: int, **config):
    """A LoRA adapter on the tiny Llama with clearly non-zero weights (PEFT starts lora_B at zero), saved."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY), LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return saved_adapter(tmp_path_factory.mktemp("adapter"), 0, r=4, lora_alpha=8,
                         target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def second_adapter(tmp_path_factory):
    return saved_adapter(tmp_path_factory.mktemp("second"), 1, r=8, lora_alpha=4,
                         target_modules=["k_proj", "o_proj", "up_proj"])


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


def hf_greedy_text(adapter, tokenizer, messages_list, max_new_tokens):
    """transformers' greedy generate with PEFT's own (unfused) adapter, each prompt alone."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY, attn_implementation="eager"),
                                      adapter).eval()
    texts = []
    for messages in messages_list:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):]
        texts.append(tokenizer.decode(out, skip_special_tokens=True))
    return texts


def test_generate_matches_transformers_greedy_with_the_adapter(tmp_path, adapter, tokenizer):
    output = tmp_path / "out.jsonl"
    prompts = json.dumps(PROMPTS)
    subprocess.run([sys.executable, str(ROOT / "recipes" / "generate.py"), f"prompts={prompts}",
                    f"model.adapter={adapter}", "sampling.max_new_tokens=12", f"output={output}"],
                   env=recipe_env(), cwd=tmp_path, check=True, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    expected = hf_greedy_text(adapter, tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS], 12)
    assert [row["prompt"] for row in rows] == PROMPTS
    assert [row["completion"] for row in rows] == expected
    assert list(tmp_path.iterdir()) == [output]  # no Hydra run directory, no log file


def test_generate_runs_each_prompt_with_the_adapter_its_line_names(tmp_path, adapter, second_adapter, tokenizer):
    lines = [{"prompt": PROMPTS[0], "adapter": "second"}, {"prompt": PROMPTS[1]}, {"prompt": PROMPTS[2],
                                                                                   "adapter": "default"}]
    prompts_file, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run([sys.executable, str(ROOT / "recipes" / "generate.py"), "prompts=[]",
                    f"prompts_file={prompts_file}", f"model.adapter={adapter}",
                    f"+model.adapters.second={second_adapter}", "sampling.max_new_tokens=12", f"output={output}"],
                   env=recipe_env(), cwd=tmp_path, check=True, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    expected = [hf_greedy_text(second_adapter, tokenizer, chats[:1], 12)[0],
                *hf_greedy_text(adapter, tokenizer, chats[1:], 12)]
    assert [row["completion"] for row in rows] == expected
    assert [row.get("adapter") for row in rows] == ["second", None, "default"]


def test_generate_refuses_a_missing_prompts_file(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "generate.py"), "prompts=[]",
                          "prompts_file=missing.txt"], env=recipe_env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "prompts_file: no such file: missing.txt" in run.stdout + run.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request(port, method, path, body=None, raw=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request(method, path, body=raw if raw is not None else json.dumps(body) if body else None)
    response = connection.getresponse()
    data = response.read().decode()
    connection.close()
    return response.status, data


@pytest.fixture(scope="module")
def server(adapter, second_adapter, tmp_path_factory):
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "serve.py"), f"port={port}",
                                f"model.adapter={adapter}", f"+model.adapters.second={second_adapter}"],
                               env=recipe_env(), cwd=tmp_path_factory.mktemp("serve"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # up once /health answers
        try:
            if request(port, "GET", "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail(f"the server did not come up:\n{process.stdout.read()}")
    yield port
    process.terminate()
    process.wait(timeout=30)


def test_the_server_answers_concurrent_clients_as_transformers_would(server, adapter, tokenizer):
    answers = {}

    def ask(prompt, stream):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 10, "temperature": 0,
                "stream": stream}
        answers[prompt, stream] = request(server, "POST", "/v1/chat/completions", body)

    threads = [threading.Thread(target=ask, args=(prompt, stream)) for prompt in PROMPTS for stream in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = hf_greedy_text(adapter, tokenizer, [[{"role": "user", "content": p}] for p in PROMPTS], 10)
    for prompt, text in zip(PROMPTS, expected):
        status, data = answers[prompt, False]
        assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == text
        status, data = answers[prompt, True]
        events = [json.loads(e.removeprefix("data: ")) for e in data.split("\n\n") if e and e != "data: [DONE]"]
        assert status == 200 and "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text


def test_a_request_names_the_second_adapter(server, second_adapter, tokenizer):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    status, data = request(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                                    "temperature": 0, "model": "second"})
    answer = json.loads(data)
    assert status == 200 and answer["model"] == "second"
    assert answer["choices"][0]["message"]["content"] == hf_greedy_text(second_adapter, tokenizer, [messages], 10)[0]
    status, data = request(server, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(data)["data"]] == ["tiny-llama", "default", "second"]


@pytest.mark.parametrize("path,body,raw,status", [
    ("/v1/chat/completions", None, b"{oops", 400),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, None, 400),
    ("/v1/nothing", {"prompt": "x"}, None, 404),
    ("/v1/completions", {"prompt": "x", "model": "third"}, None, 404),
])
def test_the_server_refuses_malformed_requests_and_stays_up(server, path, body, raw, status):
    got, data = request(server, "POST", path, body, raw)
    assert got == status and json.loads(data)["error"]["message"]
    assert request(server, "POST", "/v1/completions", {"prompt": "still up", "max_tokens": 2})[0] == 200


def test_the_server_names_its_model_by_the_directory_and_never_sends_its_path(server):
    answers = [request(server, "GET", "/v1/models"),
               request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
               request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
               request(server, "POST", "/v1/completions", {"prompt": "x", "model": "third"})]
    assert [status for status, _ in answers] == [200, 200, 200, 404]
    for _, data in answers:
        assert str(ASSETS) not in data and "tiny-llama" in data, data


def test_the_default_model_name_is_a_local_directory_s_name_or_the_hub_id():
    assert served_model_name(str(TINY)) == served_model_name(f"{TINY}/") == "tiny-llama"
    assert served_model_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"


@pytest.mark.parametrize("key,value", [("port", 70000), ("port", -1), ("request_timeout", 0.0),
                                       ("max_connections", 0), ("max_new_tokens", 0)])
def test_serve_config_values_out_of_range_are_refused(key, value):
    with pytest.raises(ValueError, match=f"^{key}={value}: must be"):
        check_serve_config(ServeConfig(**{key: value}))


def serve_start_up_error(*overrides: str, cwd) -> str:
    """The output of recipes/serve.py that stops at start-up, having checked its exit code is 2 and that it printed
    no traceback."""
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "serve.py"), *overrides], env=recipe_env(),
                         cwd=cwd, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in output, output
    return output


def test_serve_refuses_a_port_in_use_in_one_line(server, tmp_path):
    output = serve_start_up_error(f"port={server}", cwd=tmp_path)
    assert f"cannot listen on 127.0.0.1:{server}: Address already in use" in output, output


def test_serve_checks_its_port_before_it_loads_the_model(server, tmp_path):
    # a model that does not exist and a port in use: the port is what it names, so the model was never loaded
    output = serve_start_up_error(f"port={server}", f"model.name_or_path={tmp_path / 'absent'}", cwd=tmp_path)
    assert f"cannot listen on 127.0.0.1:{server}" in output and "ModelLoadError" not in output, output


def test_serve_refuses_a_corrupt_adapter_config_naming_the_file(adapter, tmp_path):
    corrupt = shutil.copytree(adapter, tmp_path / "corrupt")
    (corrupt / "adapter_config.json").write_text('{"r": 4, "lora_alpha":')
    output = serve_start_up_error(f"model.adapter={corrupt}", f"port={free_port()}", cwd=tmp_path)
    assert f"model.adapter: {corrupt / 'adapter_config.json'} cannot be read as JSON" in output, output
