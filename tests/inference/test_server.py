"""The HTTP server on 127.0.0.1, driven as clients drive it: OpenAI-shaped answers, streams, batching of
concurrent requests, and 4xx/5xx answers that never take it down. The engine is a stand-in that answers each
prompt with its tokens reversed, so that every answer is known exactly; the real engine has its own tests."""
import http.client
import json
import threading
import time

import pytest
from transformers import AutoTokenizer

from lorafuse._paths import ASSETS
from lorafuse.inference.server import LorafuseServer


class ReversingEngine:
    """Generates a prompt's tokens in reverse order (at most max_new_tokens), one token per step and call; a row
    with the adapter "first_only" stops after one token."""

    def __init__(self, fail_on: str | None = None, tokenizer=None, adapter_names=(), mixes_adapters=False):
        self.batch_sizes, self.fail_on, self.tokenizer = [], fail_on, tokenizer
        self.adapter_names, self.mixes_adapters, self.batch_adapters = adapter_names, mixes_adapters, []

    def generate(self, prompts, params, on_tokens=None, adapters=None):
        self.batch_sizes.append(len(prompts))
        self.batch_adapters.append(adapters)
        if self.fail_on and any(self.fail_on in self.tokenizer.decode(p) for p in prompts):
            raise RuntimeError("the engine broke")
        adapters = adapters or [None] * len(prompts)
        outputs = [list(reversed(prompt))[:1 if adapter == "first_only" else params.max_new_tokens]
                   for prompt, adapter in zip(prompts, adapters)]
        for step in range(max(map(len, outputs))):
            time.sleep(0.01)  # slow enough for concurrent requests to queue up behind a running batch
            for row, output in enumerate(outputs):
                if step < len(output) and on_tokens:
                    on_tokens(row, [output[step]])
        return outputs


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


def started(engine, tokenizer):
    server = LorafuseServer(engine, tokenizer, port=0, model_name="tiny", max_length=256, max_new_tokens=64,
                            max_batch=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server(tokenizer):
    server = started(ReversingEngine(fail_on="BREAK", tokenizer=tokenizer), tokenizer)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def adapter_server(tokenizer):
    # an engine holding two adapters (its active one, "default", and "first_only") that it mixes in a batch
    engine = ReversingEngine(tokenizer=tokenizer, adapter_names=("default", "first_only"), mixes_adapters=True)
    server = started(engine, tokenizer)
    yield server
    server.shutdown()
    server.server_close()


def post(server, path, body, raw: bytes | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    connection.request("POST", path, body=raw if raw is not None else json.dumps(body),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read().decode()
    connection.close()
    return response.status, data


def expected_text(tokenizer, prompt_ids, max_tokens):
    return tokenizer.decode(list(reversed(prompt_ids))[:max_tokens], skip_special_tokens=True)


def test_completion(server, tokenizer):
    status, data = post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 3})
    answer = json.loads(data)
    prompt_ids = tokenizer.encode("hello there")
    assert status == 200 and answer["object"] == "text_completion" and answer["model"] == "tiny"
    assert answer["choices"][0]["text"] == expected_text(tokenizer, prompt_ids, 3)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 3,
                               "total_tokens": len(prompt_ids) + 3}


def test_chat_completion_ends_with_stop_when_shorter_than_max_tokens(server, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    status, data = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 64})
    answer = json.loads(data)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert status == 200 and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant",
                                               "content": expected_text(tokenizer, prompt_ids, 64)}
    assert answer["choices"][0]["finish_reason"] == "stop"  # the prompt is shorter than 64 tokens


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "a stream of words"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]})])
def test_a_stream_sends_the_same_text_in_chunks(server, tokenizer, path, body):
    status, data = post(server, path, {**body, "stream": True, "max_tokens": 5})
    events = [line.removeprefix("data: ") for line in data.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    chat = path.endswith("chat/completions")
    pieces = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"] for c in chunks]
    _, whole = post(server, path, {**body, "max_tokens": 5})
    choice = json.loads(whole)["choices"][0]
    assert "".join(pieces) == (choice["message"]["content"] if chat else choice["text"])
    assert len(chunks) == 6 and [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert len({c["id"] for c in chunks}) == 1


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, tokenizer):
    prompts = [f"request number {i}" for i in range(8)]
    answers = {}

    def ask(prompt):
        answers[prompt] = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt in prompts:
        status, data = answers[prompt]
        assert status == 200
        assert json.loads(data)["choices"][0]["text"] == expected_text(tokenizer, tokenizer.encode(prompt), 4)
    sizes = server.batcher.engine.batch_sizes
    assert sum(sizes) == 8 and max(sizes) > 1 and max(sizes) <= 4


def test_requests_with_other_settings_wait_for_their_own_batch(server):
    results = []

    def ask(temperature):
        results.append(post(server, "/v1/completions", {"prompt": "x y z", "max_tokens": 2,
                                                        "temperature": temperature})[0])

    threads = [threading.Thread(target=ask, args=(t,)) for t in (0.0, 0.5, 0.0, 0.5, 0.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [200] * 5 and sum(server.batcher.engine.batch_sizes) == 5


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x " * 300, "max_tokens": 8}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/v1/embeddings", {"input": "x"}, 404, None),
])
def test_bad_requests_get_a_4xx_naming_the_field(server, path, body, status, param):
    got, data = post(server, path, body)
    error = json.loads(data)["error"]
    assert got == status and error["param"] == param and error["message"]
    assert post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_no_json_object_gets_a_400(server, raw):
    status, data = post(server, "/v1/completions", None, raw=raw)
    assert status == 400 and "JSON" in json.loads(data)["error"]["message"]


def test_an_engine_failure_is_a_500_and_the_server_goes_on(server):
    status, data = post(server, "/v1/completions", {"prompt": "BREAK now", "max_tokens": 2})
    assert status == 500 and "the engine broke" in json.loads(data)["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2})[0] == 200


def test_model_names_an_adapter(adapter_server, tokenizer):
    prompt_ids = tokenizer.encode("hello there")
    for model, tokens in (("first_only", 1), ("tiny", 3), (None, 3), ("default", 3)):
        body = {"prompt": "hello there", "max_tokens": 3, **({"model": model} if model else {})}
        status, data = post(adapter_server, "/v1/completions", body)
        answer = json.loads(data)
        assert status == 200 and answer["model"] == (model or "tiny")
        assert answer["choices"][0]["text"] == expected_text(tokenizer, prompt_ids, tokens)
    status, data = post(adapter_server, "/v1/completions", {"prompt": "x", "model": "other"})
    error = json.loads(data)["error"]
    assert status == 404 and error["param"] == "model" and "'first_only'" in error["message"]
    connection = http.client.HTTPConnection("127.0.0.1", adapter_server.server_address[1], timeout=10)
    connection.request("GET", "/v1/models")
    models = json.loads(connection.getresponse().read())["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("default", "tiny"),
                                                            ("first_only", "tiny")]


def test_a_non_string_model_is_a_400_and_any_model_is_taken_where_no_adapters_are_offered(adapter_server, tokenizer):
    status, data = post(adapter_server, "/v1/completions", {"prompt": "x", "model": 3})
    assert status == 400 and json.loads(data)["error"]["param"] == "model"
    # an engine with two adapters that it cannot mix offers none: requests run its active adapter, whatever "model"
    engine = ReversingEngine(tokenizer=tokenizer, adapter_names=("default", "first_only"), mixes_adapters=False)
    server = started(engine, tokenizer)
    try:
        status, data = post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 3,
                                                        "model": "first_only"})
        assert status == 200
        assert json.loads(data)["choices"][0]["text"] == expected_text(tokenizer, tokenizer.encode("hello there"), 3)
        assert engine.batch_adapters == [None]
    finally:
        server.shutdown()
        server.server_close()


def test_concurrent_requests_for_other_adapters_share_a_batch(adapter_server, tokenizer):
    answers = {}

    def ask(i, model):
        answers[i] = post(adapter_server, "/v1/completions", {"prompt": f"request {i}", "max_tokens": 4,
                                                              "model": model})

    threads = [threading.Thread(target=ask, args=(i, ["tiny", "first_only"][i % 2])) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(8):
        status, data = answers[i]
        tokens = 1 if i % 2 else 4
        assert status == 200
        assert json.loads(data)["choices"][0]["text"] == expected_text(tokenizer, tokenizer.encode(f"request {i}"),
                                                                       tokens)
    engine = adapter_server.batcher.engine
    mixed = [set(adapters) for adapters in engine.batch_adapters if adapters and len(set(adapters)) > 1]
    assert sum(engine.batch_sizes) == 8 and mixed  # 7 requests queue up behind the first batch, both adapters


def test_models_and_health(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    connection.request("GET", "/v1/models")
    models = json.loads(connection.getresponse().read())
    connection.request("GET", "/health")
    health = json.loads(connection.getresponse().read())
    assert [m["id"] for m in models["data"]] == ["tiny"] and health == {"status": "ok"}
