"""An OpenAI-compatible HTTP server over the decoding engine, on the standard library's http.server.

POST /v1/completions and /v1/chat/completions (with "stream": true, server-sent events, as OpenAI's API sends
them), GET /v1/models and /health. Each request runs on its own handler thread, which parses and validates it
(a bad request gets a 4xx with a message naming the field, and never reaches the engine) and waits on its
queue of events. One batcher thread owns the engine: it takes the waiting requests that share sampling
settings, up to the engine's largest batch, runs them as one batch, and feeds each request's queue its
tokens as they come. An engine error fails the requests of that batch with a 500; the server goes on.
A request with a seed runs alone: the rows of a batch draw from one generator, so only alone does a seed give
the same text whatever else is being served. A batch whose clients have all gone away stops at the next check.
The text ends before the first stop string (as OpenAI's API and vLLM return it); the usage counts every token
made, the one that completed the stop string included.

A request's "model" picks the LoRA adapter, as vLLM serves its LoRA modules: the server's model_name (or no "model")
runs the engine's active adapter, an adapter's name that adapter, and GET /v1/models lists them all. Adapters are
offered only where the engine runs rows with different adapters in one batch (Engine.mixes_adapters).

Connections are bounded: each has its thread, up to max_connections at once (beyond, a 503 and the connection
closed); a client silent for request_timeout seconds while it sends a request, or between requests, is dropped (a
body that stops coming gets a 408). A client that goes away is one line in the log.
"""
import contextlib
import json
import logging
import queue
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .detokenize import TextStream
from .prompts import PromptError, encode_messages
from .sampling import SamplingParams

logger = logging.getLogger("lorafuse.serve")
MAX_BODY_BYTES = 1 << 20
MAX_LENGTH_DIGITS = 18  # a longer Content-Length cannot be a body this server reads, and int() may refuse it
MAX_TOP_K = (1 << 31) - 1
# Fields of OpenAI's API that this server does not implement, with the values that ask for nothing (sent by many
# clients as defaults): any other value is refused rather than silently ignored.
UNSUPPORTED = {"echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,), "best_of": (1,),
               "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "suffix": ("",),
               "tools": ([],), "response_format": ({"type": "text"},)}
# JSON's \u escapes can leave a lone surrogate in a string: no text (UTF-8 cannot encode it); tokenizers refuse it
LONE_SURROGATE = re.compile("[\\ud800-\\udfff]")


class RequestError(ValueError):
    """A request the server refuses: its message says which field and why."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Job:
    """One request on its way through the batcher: its prompt, settings, and the events for its handler."""
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # None: the engine's active adapter
    events: queue.Queue = field(default_factory=queue.Queue)  # ("tokens", [ids]), ("done", reason), ("error", msg)
    gone: bool = False  # its client went away: nobody reads its events


# ---- parsing ------------------------------------------------------------------------------------------------

def _field(body: dict, name: str, kind, default, check=None, allowed: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or (check and not check(value)):
        raise RequestError(f"'{name}' must be {allowed or kind.__name__}, got {value!r}", param=name)
    return value


def sampling_params(body: dict, max_new_tokens: int, default_max_tokens: int, chat: bool) -> SamplingParams:
    """The sampling settings of an OpenAI request body; `max_new_tokens` caps max_tokens. Chat requests may name it
    max_completion_tokens, as OpenAI's current clients do."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise RequestError(f"'{name}' is not supported by this server (got {body[name]!r})", param=name)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError("'stop' must be a string or a list of non-empty strings", param="stop")
    _field(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
    length = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    top_k = _field(body, "top_k", int, 0, lambda v: -1 <= v <= MAX_TOP_K, f"an integer from -1 to {MAX_TOP_K} "
                   "(0 or -1: off)")
    return SamplingParams(
        max_new_tokens=_field(body, length, int, min(default_max_tokens, max_new_tokens),
                              lambda v: 1 <= v <= max_new_tokens, f"an integer from 1 to {max_new_tokens}"),
        temperature=_field(body, "temperature", float, 1.0, lambda v: 0 <= v <= 2, "a number from 0 to 2"),
        top_p=_field(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=max(top_k, 0),
        seed=_field(body, "seed", int, None, lambda v: 0 <= v < 1 << 64, "an integer from 0 to 2**64 - 1"),
        stop=tuple(stop or ()))


def requested_adapter(body: dict, model_name: str, adapters: tuple[str, ...]) -> str | None:
    """The adapter that a request's "model" names: None for the served model itself (its active adapter). Without
    adapters to pick from the field is not checked, as OpenAI clients may send a placeholder."""
    model = body.get("model", model_name)
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {model!r}", param="model")
    if model == model_name or model is None or not adapters:
        return None
    if model not in adapters:
        raise RequestError(f"the model {model!r} does not exist: this server runs {model_name!r} and its adapters "
                           f"{', '.join(map(repr, adapters))}", param="model", status=HTTPStatus.NOT_FOUND)
    return model


def _check_text(text: str, name: str, param: str) -> None:
    if LONE_SURROGATE.search(text):
        raise RequestError(f"{name} holds a lone surrogate (a \\ud800-\\udfff escape without its pair), which is "
                           "not text", param=param)


def completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", param="prompt")
    _check_text(prompt, "'prompt'", "prompt")
    return tokenizer.encode(prompt)


def chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                and isinstance(message.get("content"), str)):
            raise RequestError(f"messages[{i}] must be {{'role': 'system'|'user'|'assistant', 'content': str}}",
                               param="messages")
        _check_text(message["content"], f"messages[{i}].content", "messages")
    try:
        # role and content only: the chat template is not fed other keys, whose types nothing here checks
        return encode_messages(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    except PromptError as err:
        raise RequestError(f"{err}", param="messages") from err


# ---- the batcher ----------------------------------------------------------------------------------------------

class Batcher(threading.Thread):
    """Runs the engine on batches of waiting jobs that share sampling settings (the engine takes one set per
    batch; adapters may differ: the server offers them only where the engine mixes them); jobs with other settings
    wait for a later batch, in arrival order. A job with a seed runs alone (see the module's docstring)."""

    def __init__(self, engine, max_batch: int):
        super().__init__(daemon=True, name="lorafuse-batcher")
        self.engine, self.max_batch = engine, max_batch
        self.jobs: queue.Queue[Job] = queue.Queue()

    def run(self) -> None:
        waiting: list[Job] = []
        while True:
            if not waiting:
                waiting.append(self.jobs.get())
            while not self.jobs.empty():  # everything that arrived while the last batch ran
                waiting.append(self.jobs.get_nowait())
            first = waiting[0]
            batch = [first] if first.params.seed is not None else \
                [job for job in waiting if job.params == first.params][:self.max_batch]
            waiting = [job for job in waiting if job not in batch]
            self._run(batch)

    def _run(self, batch: list[Job]) -> None:
        adapters = [job.adapter for job in batch]
        made = [[] for _ in batch]
        try:
            for new in self.engine.stream([job.prompt_ids for job in batch], batch[0].params,
                                          adapters=None if not any(adapters) else adapters):
                for row, ids in new.items():
                    made[row] += ids
                    batch[row].events.put(("tokens", list(ids)))
                if all(job.gone for job in batch):
                    logger.info("a batch of %d stopped: its clients went away", len(batch))
                    return
        except Exception as err:  # noqa: BLE001 - whatever broke, the requests get an answer and the server lives
            logger.exception("engine failed on a batch of %d", len(batch))
            for job in batch:
                job.events.put(("error", f"generation failed: {type(err).__name__}: {err}"))
            return
        for job, ids in zip(batch, made):
            # "stop" after EOS or a stop string (the handler finds those in the text), "length" at the budget
            ended_by_eos = bool(ids) and ids[-1] in self.engine.eos_token_ids
            job.events.put(("done", "length" if len(ids) >= job.params.max_new_tokens and not ended_by_eos
                            else "stop"))


# ---- HTTP -----------------------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    server: "LorafuseServer"
    protocol_version = "HTTP/1.1"

    def setup(self):
        self.timeout = self.server.request_timeout  # StreamRequestHandler.setup puts it on the socket
        super().setup()

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        logger.info("%s %s", self.address_string(), format % args)

    def do_GET(self):
        if self.path == "/health":
            return self._json(HTTPStatus.OK, {"status": "ok"})
        if self.path == "/v1/models":
            served = [{"id": self.server.model_name, "object": "model", "owned_by": "lorafuse"}]
            served += [{"id": name, "object": "model", "owned_by": "lorafuse", "parent": self.server.model_name}
                       for name in self.server.adapters]
            return self._json(HTTPStatus.OK, {"object": "list", "data": served})
        self._error(RequestError(f"no such endpoint: GET {self.path}", status=HTTPStatus.NOT_FOUND))

    def do_POST(self):
        try:
            chat = {"/v1/completions": False, "/v1/chat/completions": True}.get(self.path)
            if chat is None:
                raise RequestError(f"no such endpoint: POST {self.path}", status=HTTPStatus.NOT_FOUND)
            body = self._body()
            adapter = requested_adapter(body, self.server.model_name, self.server.adapters)
            prompt = (chat_prompt if chat else completion_prompt)(body, self.server.tokenizer)
            # OpenAI's defaults: 16 tokens for a completion, what the context leaves for a chat answer
            default_max_tokens = max(1, self.server.max_length - len(prompt)) if chat else 16
            params = sampling_params(body, self.server.max_new_tokens, default_max_tokens, chat)
            if len(prompt) + params.max_new_tokens > self.server.max_length:
                raise RequestError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_new_tokens}) "
                                   f"exceed the server's {self.server.max_length} tokens", param="max_tokens")
            stream = _field(body, "stream", bool, False)
        except RequestError as err:
            return self._error(err)
        job = Job(prompt, params, adapter)
        self.server.batcher.jobs.put(job)
        answer = _Answer(chat, adapter or self.server.model_name, TextStream(self.server.tokenizer, params.stop))
        try:
            (self._stream if stream else self._whole)(job, answer)
        except OSError:  # the client went away or stopped reading: logged in one line (handle_error, http.server)
            job.gone = True
            raise

    def _body(self) -> dict:
        if "Transfer-Encoding" in self.headers:
            raise RequestError("a chunked body is not read: send the body with a Content-Length",
                               status=HTTPStatus.LENGTH_REQUIRED)
        length = self._content_length()
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(f"the body did not come: the client sent nothing for {self.timeout:g} s",
                               status=HTTPStatus.REQUEST_TIMEOUT) from None
        if len(data) < length:
            raise ConnectionAbortedError(f"the client closed the connection after {len(data)} of the {length} "
                                         "bytes of its body")
        try:
            body = json.loads(data or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise RequestError(f"the body is not valid JSON: {type(err).__name__}: {err}") from err
        except ValueError as err:  # an integer longer than int() converts
            raise RequestError(f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits, "
                               "which this server does not read") from err
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _content_length(self) -> int:
        text = self.headers.get("Content-Length") or "0"
        if not (text.isascii() and text.isdigit()) or len(text) > MAX_LENGTH_DIGITS:
            shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"
            raise RequestError(f"Content-Length must be a number of bytes, got {shown}")
        if int(text) > MAX_BODY_BYTES:
            raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return int(text)

    def _whole(self, job: Job, answer: "_Answer") -> None:
        ids, reason, error = _collect(job)
        if error:
            return self._json(HTTPStatus.INTERNAL_SERVER_ERROR, _error_body(error, "server_error"))
        self._json(HTTPStatus.OK, answer.whole(ids, reason, len(job.prompt_ids)))

    def _stream(self, job: Job, answer: "_Answer") -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if answer.chat:
            self._event(answer.chunk("", None, role=True))  # OpenAI's first chunk names the role
        while True:
            kind, value = job.events.get()
            if kind == "tokens":
                text = answer.text.add(value)
                if text:
                    self._event(answer.chunk(text, None))
                continue
            if kind == "done":
                rest = answer.text.finish()
                if rest:
                    self._event(answer.chunk(rest, None))
                self._event(answer.chunk("", answer.reason(value)))
            else:
                self._event(_error_body(value, "server_error"))
            break
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: HTTPStatus, payload: dict, close: bool = False) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: RequestError) -> None:
        # The body may be unread (an unknown endpoint, too large, a bad length): the connection cannot carry another
        # request after it.
        self.close_connection = True
        self._json(err.status, _error_body(str(err), "invalid_request_error", err.param), close=True)


def _error_body(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _collect(job: Job) -> tuple[list[int], str | None, str | None]:
    ids = []
    while True:
        kind, value = job.events.get()
        if kind == "tokens":
            ids += value
        else:
            return ids, value if kind == "done" else None, value if kind == "error" else None


class _Answer:
    """OpenAI's response objects for one request: a whole completion, or the chunks of a stream; `text` turns its
    tokens into the text it may send."""

    def __init__(self, chat: bool, model: str, text: TextStream):
        self.chat, self.model, self.text = chat, model, text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def reason(self, engine_reason: str) -> str:
        """The finish_reason: "stop" where the text met a stop string (the engine may have ended the row on the same
        token for its budget), else the engine's."""
        return "stop" if self.text.stopped else engine_reason

    def whole(self, ids: list[int], reason: str, prompt_tokens: int) -> dict:
        text = self.text.add(ids) + self.text.finish()
        choice = {"index": 0, "finish_reason": self.reason(reason)}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else
                      {"text": text, "logprobs": None})
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                 "total_tokens": prompt_tokens + len(ids)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage}

    def chunk(self, text: str, reason: str | None, role: bool = False) -> dict:
        choice = {"index": 0, "finish_reason": reason}
        delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
        choice.update({"delta": delta} if self.chat else {"text": text, "logprobs": None})
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}


def check_can_listen(host: str, port: int) -> None:
    """Raises OSError where host:port cannot be listened on (taken, or no address of this machine): the recipe asks
    before the model loads, so that a bad address costs no load. Binds as the server does (address reuse on)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


class LorafuseServer(ThreadingHTTPServer):
    """The HTTP server: `serve_forever()` in the caller's thread, `shutdown()` from another. At most
    `max_connections` connections are open at once; `request_timeout` is each socket's timeout in seconds."""
    daemon_threads = True

    def __init__(self, engine, tokenizer, *, host: str = "127.0.0.1", port: int = 8000, model_name: str = "lorafuse",
                 max_length: int, max_new_tokens: int, max_batch: int, request_timeout: float = 30.0,
                 max_connections: int = 64):
        super().__init__((host, port), _Handler)
        self.tokenizer, self.model_name = tokenizer, model_name
        self.request_timeout, self.max_connections = request_timeout, max_connections
        self.connection_slots = threading.BoundedSemaphore(max_connections)
        # the adapters a request may name besides the served model (its active adapter is that model itself): only
        # where the engine runs them side by side in a batch
        self.adapters = engine.adapter_names if len(engine.adapter_names) > 1 and engine.mixes_adapters else ()
        if len(engine.adapter_names) > 1 and not engine.mixes_adapters:
            logger.warning("the engine cannot run rows with other adapters than its active one (see "
                           "Engine.mixes_adapters): every request runs the active adapter")
        self.max_length, self.max_new_tokens = max_length, max_new_tokens
        self.batcher = Batcher(engine, max_batch)
        self.batcher.start()

    def process_request(self, request, client_address) -> None:
        """Starts the connection's thread, or, with max_connections open, answers 503 and closes."""
        if self.connection_slots.acquire(blocking=False):
            return super().process_request(request, client_address)
        logger.warning("%s: refused, %d connections are open (the limit, max_connections)", client_address[0],
                       self.max_connections)
        self._refuse(request)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()

    def _refuse(self, request) -> None:
        """The 503, sent from the accepting thread: a new socket's send buffer takes it at once."""
        message = f"the server is busy: {self.max_connections} connections are open, its limit; retry later"
        data = json.dumps(_error_body(message, "server_error")).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        request.setblocking(False)
        with contextlib.suppress(OSError):  # nothing came yet
            request.recv(1 << 16)  # the request, read: closed unread, the socket could reset before the client reads
        with contextlib.suppress(OSError):  # the client is gone already
            request.sendall(head.encode() + data)
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that went away is one line in the log (http.server logs a timeout so itself); anything else is
        a bug, logged with its traceback."""
        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            logger.info("%s: the client went away (%s: %s)", client_address[0], type(err).__name__, err)
        else:
            logger.exception("the handler of %s failed", client_address[0])
