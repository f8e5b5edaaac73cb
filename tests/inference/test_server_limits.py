"""The server's limits, against a live server on 127.0.0.1 with a one-second request_timeout: silent clients are
dropped (a body that stops coming gets a 408), connections beyond max_connections get a 503, and clients that go
away are one line each in the log, without a traceback."""
import http.client
import json
import logging
import socket
import threading
import time

import pytest
from transformers import AutoTokenizer

from lorafuse._paths import ASSETS
from lorafuse.inference.server import LorafuseServer

from .test_server import ReversingEngine

TIMEOUT = 1.0  # the server's request_timeout: each test waits a few of these at most
MAX_CONNECTIONS = 3


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")


@pytest.fixture
def server(tokenizer):
    server = LorafuseServer(ReversingEngine(tokenizer=tokenizer, seconds_per_step=0.05), tokenizer, port=0,
                            model_name="tiny", max_length=256, max_new_tokens=64, max_batch=4,
                            request_timeout=TIMEOUT, max_connections=MAX_CONNECTIONS)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5 * TIMEOUT)


def answer(client: socket.socket) -> tuple[int | None, bytes]:
    """The status and body of what the server sends before it closes the connection (None: it sent nothing)."""
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return (int(head.split()[1]) if head else None), body


def health(server) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5 * TIMEOUT)
    connection.request("GET", "/health")
    status = connection.getresponse().status
    connection.close()
    return status


def wait_for(condition, seconds: float = 5 * TIMEOUT) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_silent_clients_are_dropped_and_give_their_threads_back(server):
    threads = threading.active_count()
    headers_only = [connect(server) for _ in range(2)]
    for client in headers_only:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n")
    silent = connect(server)  # sends nothing at all
    started = time.monotonic()
    for client in headers_only:
        status, body = answer(client)
        assert status == 408 and "1 s" in json.loads(body)["error"]["message"]
    assert answer(silent) == (None, b"")  # closed without an answer
    assert time.monotonic() - started < 3 * TIMEOUT
    assert wait_for(lambda: threading.active_count() <= threads), threading.enumerate()


def test_connections_beyond_the_limit_get_a_503_until_a_silent_one_times_out(server):
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    with connect(server) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = answer(client)
    assert status == 503 and "busy" in json.loads(body)["error"]["message"]
    assert wait_for(lambda: health(server) == 200)  # the idle ones time out: their slots come back
    for client in idle:
        client.close()


def test_clients_that_go_away_are_one_line_each_in_the_log(server, caplog, capsys):
    caplog.set_level(logging.INFO, logger="lorafuse.serve")
    body = json.dumps({"prompt": "word " * 40, "max_tokens": 40, "stream": True}).encode()
    requests = [b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n",  # headers, no body
                b'POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"prompt"',  # part of the body
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]  # a stream
    for request in requests:
        with connect(server) as client:
            client.sendall(request)
            received = b""
            while b"stream" in request and b"data: " not in received:  # gone after the stream began
                received += client.recv(65536)

    def gone() -> list[logging.LogRecord]:
        return [record for record in caplog.records if "the client went away" in record.getMessage()]

    assert wait_for(lambda: len(gone()) >= len(requests)), caplog.text
    time.sleep(0.2)  # time for any second line about the same client
    assert len(gone()) == len(requests), caplog.text
    assert not any(record.exc_info or record.levelno >= logging.ERROR for record in caplog.records), caplog.text
    assert "Traceback" not in capsys.readouterr().err
    assert health(server) == 200
