"""The HTTP server on 127.0.0.1, driven as clients drive it: OpenAI-shaped answers, streams, batching of
concurrent requests, and 4xx/5xx answers that never take it down. The engine is a stand-in that answers each
prompt with its tokens reversed, so that every answer is known exactly; the real engine has its own tests."""
import copy
import http.client
import json
import socket
import threading
import time

import pytest
from transformers import AutoTokenizer

from lorafuse._paths import ASSETS
from lorafuse.inference.server import LorafuseServer


class ReversingEngine:
    """Generates a prompt's tokens in reverse order (at most max_new_tokens), one token per step and yield, as
    Engine.stream yields; a row with the adapter "first_only" stops after one token. Records each batch's size,
    adapters and the steps it ran."""

    eos_token_ids = frozenset({2})

    def __init__(self, fail_on: str | None = None, tokenizer=None, adapter_names=(), mixes_adapters=False,
                 seconds_per_step: float = 0.01):
        self.batch_sizes, self.fail_on, self.tokenizer = [], fail_on, tokenizer
        self.adapter_names, self.mixes_adapters, self.batch_adapters = adapter_names, mixes_adapters, []
        self.seconds_per_step, self.steps_run = seconds_per_step, []

    def stream(self, prompts, params, adapters=None):
        self.batch_sizes.append(len(prompts))
        self.batch_adapters.append(adapters)
        self.steps_run.append(0)
        if self.fail_on and any(self.fail_on in self.tokenizer.decode(p) for p in prompts):
            raise RuntimeError("the engine broke")
        adapters = adapters or [None] * len(prompts)
        outputs = [list(reversed(prompt))[:1 if adapter == "first_only" else params.max_new_tokens]
                   for prompt, adapter in zip(prompts, adapters)]
        for step in range(max(map(len, outputs))):
            time.sleep(self.seconds_per_step)  # slow enough for concurrent requests to queue up behind a batch
            self.steps_run[-1] += 1
            yield {row: [output[step]] for row, output in enumerate(outputs) if step < len(output)}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


def started(engine, tokenizer):
    server = LorafuseServer(engine, tokenizer, port=0, model_name="tiny", max_length=256, max_new_tokens=64,
                            max_batch=4)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
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
    # a chunk per token that adds text (special tokens add none), after chat's chunk naming the role
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len([piece for piece in pieces if piece]) > 1
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
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


@pytest.mark.parametrize("raw,says", [
    (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON"),
    (b'{"prompt": "\xff"}', "not valid JSON"),  # not UTF-8
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "digits"),  # past int()'s limit of digits
    (b'{"prompt": "a\\ud800"}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "\\udc00 b"}]}', "lone surrogate"),
])
def test_a_body_that_is_no_json_object_of_text_gets_a_400(server, raw, says):
    path = "/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"
    status, data = post(server, path, None, raw=raw)
    assert status == 400 and says in json.loads(data)["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})[0] == 200


def test_a_chat_template_sees_only_role_and_content(tokenizer):
    # a template that reads a message's tool_calls, as many do: the 5 a client sent there would break it
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                               "{% for call in m.tool_calls or [] %}{{ call }}{% endfor %} | {% endfor %}")
    server = started(ReversingEngine(tokenizer=templated), templated)
    try:
        message = {"role": "user", "content": "hello there"}
        status, data = post(server, "/v1/chat/completions", {"messages": [{**message, "tool_calls": 5}],
                                                             "max_tokens": 3})
        prompt_ids = templated.apply_chat_template([message], tokenize=True, return_dict=False)
        assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == expected_text(
            templated, prompt_ids, 3)
    finally:
        server.shutdown()
        server.server_close()


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


def stream_pieces(data: str, chat: bool) -> tuple[str, str]:
    """(The text of a server-sent stream, its finish_reason)."""
    events = [line.removeprefix("data: ") for line in data.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in chunks)
    return text, chunks[-1]["finish_reason"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_text_ends_before_the_first_stop_string(server, tokenizer, path):
    chat = path.endswith("chat/completions")
    body = {"messages": [{"role": "user", "content": "one two three four"}]} if chat else \
        {"prompt": "one two three four"}
    _, data = post(server, path, {**body, "max_tokens": 64, "temperature": 0})
    choice = json.loads(data)["choices"][0]
    full = choice["message"]["content"] if chat else choice["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]  # three characters from the middle of the answer
    for request in ({**body, "stop": [stop]}, {**body, "stop": stop, "stream": True}):
        status, data = post(server, path, {**request, "max_tokens": 64, "temperature": 0})
        if request.get("stream"):
            text, reason = stream_pieces(data, chat)
        else:
            choice = json.loads(data)["choices"][0]
            text, reason = choice["message"]["content"] if chat else choice["text"], choice["finish_reason"]
        assert status == 200 and text == full[:full.index(stop)] and reason == "stop", (stop, text)


def test_a_stop_string_completed_by_the_last_token_of_the_budget_is_a_stop(server, tokenizer):
    prompt_ids = tokenizer.encode("one two three four")
    text = expected_text(tokenizer, prompt_ids, 4)
    answer = json.loads(post(server, "/v1/completions", {"prompt": "one two three four", "max_tokens": 4,
                                                         "stop": [text[-2:]]})[1])["choices"][0]
    assert answer == {"index": 0, "finish_reason": "stop", "text": text[:-2], "logprobs": None}


def test_requests_with_a_seed_run_alone(server):
    results = []

    def ask(i):
        results.append(post(server, "/v1/completions", {"prompt": f"seeded {i}", "max_tokens": 4, "seed": 7,
                                                        "temperature": 0.8})[0])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [200] * 5 and server.batcher.engine.batch_sizes == [1] * 5


def test_a_batch_whose_client_went_away_stops(tokenizer):
    engine = ReversingEngine(tokenizer=tokenizer, seconds_per_step=0.05)
    server = started(engine, tokenizer)
    try:
        body = json.dumps({"prompt": "word " * 60, "max_tokens": 60, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                           % (len(body), body))
            received = b""
            while b"data: " not in received:  # the stream has begun: the batch is running
                received += client.recv(4096)
        assert post(server, "/v1/completions", {"prompt": "next", "max_tokens": 2})[0] == 200
        assert engine.steps_run[0] < 30, engine.steps_run  # 60 steps had it run to the end
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body,param", [
    ({"top_k": 10**30}, "top_k"), ({"top_k": -2}, "top_k"), ({"seed": 2**70}, "seed"), ({"seed": -1}, "seed"),
    ({"echo": True}, "echo"), ({"logprobs": 5}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"max_completion_tokens": 0}, None),
])
def test_settings_out_of_range_or_not_supported_get_a_400(server, path, body, param):
    chat = path.endswith("chat/completions")
    request = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    got, data = post(server, path, {**request, **body})
    if param is None:  # max_completion_tokens: chat's name for max_tokens, ignored by completions
        assert got == (400 if chat else 200), data
        return
    assert got == 400 and json.loads(data)["error"]["param"] == param, data


@pytest.mark.parametrize("body", [{"top_k": -1}, {"presence_penalty": 0, "logprobs": None, "echo": False}])
def test_settings_that_ask_for_nothing_are_taken(server, tokenizer, body):
    got, data = post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 3, **body})
    assert got == 200 and json.loads(data)["choices"][0]["text"] == expected_text(
        tokenizer, tokenizer.encode("hello there"), 3)


def test_a_chat_answer_may_fill_the_context_by_default_and_takes_max_completion_tokens(server, tokenizer):
    messages = [{"role": "user", "content": "a question of some twenty tokens or so, to be answered in full"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(prompt_ids) > 16
    usage = json.loads(post(server, "/v1/chat/completions", {"messages": messages})[1])["usage"]
    assert usage["completion_tokens"] == len(prompt_ids)  # the whole reversed prompt, not OpenAI's 16 of completions
    answer = json.loads(post(server, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 3})[1])
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("headers,raw,status", [
    ({"Content-Length": "abc"}, b"{}", 400),
    ({"Content-Length": "-1"}, b"{}", 400),
    ({"Content-Length": "9" * 5000}, b"{}", 400),  # past int()'s limit of digits
    ({"Content-Length": "\u00b2"}, b"{}", 400),  # "²": a digit to str.isdigit, not to int()
    ({"Content-Length": None, "Transfer-Encoding": "chunked"}, b"2\r\n{}\r\n0\r\n\r\n", 411),
    ({}, b"[" * 100000, 400),
])
def test_a_bad_length_or_a_body_too_deep_gets_a_4xx(server, headers, raw, status):
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {"Content-Length": str(len(raw)), **headers}.items():
        if value is not None:  # None: the header left out
            connection.putheader(name, value)
    connection.endheaders(raw)
    response = connection.getresponse()
    assert response.status == status and json.loads(response.read())["error"]["message"]
    connection.close()
    assert post(server, "/v1/completions", {"prompt": "still here", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("path,length", [("/v1/complete", None), ("/v1/completions", 2 << 20)])
def test_a_refused_body_closes_the_connection_and_the_next_request_gets_its_own_answer(server, tokenizer, path,
                                                                                      length):
    # length: a Content-Length past the server's limit, the body not sent (the server answers from the header; a
    # client still sending a body that large may see the connection closed under it)
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    body = json.dumps({"prompt": "x"}).encode()
    connection.putrequest("POST", path)
    connection.putheader("Content-Length", str(length or len(body)))
    connection.endheaders(None if length else body)
    response = connection.getresponse()
    assert response.status in (404, 413) and response.getheader("Connection") == "close"
    response.read()
    # http.client opens a new connection after "Connection: close"; on the old one the unread body was the next
    # request
    connection.request("POST", "/v1/completions", json.dumps({"prompt": "hello there", "max_tokens": 3}))
    answer = connection.getresponse()
    assert answer.status == 200 and json.loads(answer.read())["choices"][0]["text"] == expected_text(
        tokenizer, tokenizer.encode("hello there"), 3)
    connection.close()
