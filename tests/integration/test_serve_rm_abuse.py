"""serve_rm under abuse (issue 14), as a real subprocess with the tiny reward model: memory after 30 MB requests,
a small request behind a 10k-query one, a disconnected client's work cancelled, half-sent requests closed,
malformed input answered 4xx, and SIGTERM with a half-sent request open.

Timings are bounds with wide margins (the CPU is shared); throughput is measured in bench/serve_rm.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import load_value_model, save_value_model
from helpers import free_port, get_json, post_json  # noqa: E402

# --dist loadgroup: one worker builds its reward model and server, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("serve_rm_abuse")

MAX_LEN, READ_TIMEOUT_S = 64, 2.0







def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Server:
    def __init__(self, rm_dir: str, log_path, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/get_reward"
        self.log = open(log_path, "w+")
        cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", rm_dir, "--port", str(self.port),
               "--max_len", str(MAX_LEN), "--param_dtype", "fp32", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.time() + 120
        while True:
            try:
                self.health()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    output = self.output()
                    self.stop()
                    pytest.fail(f"serve_rm did not start:\n{output}")
                time.sleep(0.3)

    def health(self) -> dict:
        return get_json(self.base + "/health", timeout=30)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def _open_request(port: int, body: bytes, declared: int | None = None, send: int | None = None) -> socket.socket:
    """A raw POST /get_reward: `declared` Content-Length (default: the body's), the first `send` bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /get_reward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if declared is None else declared}\r\n\r\n").encode()
    sock.sendall(head + body[:send])
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("serve_rm_abuse"))
    save_value_model(load_value_model(tiny_model_dir, init_value_head=True), path, load_tokenizer(tiny_model_dir),
                     mean=0.0, std=1.0)
    return path


@pytest.fixture(scope="module")
def server(rm_dir, tmp_path_factory):
    """Default settings except a short --read_timeout_s (the tests wait for it)."""
    srv = Server(rm_dir, tmp_path_factory.mktemp("log") / "serve_rm.log", "--read_timeout_s", str(READ_TIMEOUT_S))
    yield srv
    srv.stop()


def test_memory_returns_near_baseline_after_30mb_requests(server):
    for _ in range(3):  # warm up: the baseline includes forwards of full batches
        assert post_json(server.url, json.dumps({"query": ["warm up " * 7] * 64}).encode(), timeout=60)[0] == 200
    baseline = _rss_mb(server.proc.pid)
    huge = {  # each about 30 MB; each rejected at a different stage
        "--max_query_chars": json.dumps({"query": ["x" * 3000] * 10_000}),  # 10k long queries: while parsing
        "--max_len": json.dumps({"query": ["y" * 700] * 43_000}),  # under the character limit: at tokenization
        "--max_queries": json.dumps({"query": ["ab"] * 5_000_000}),  # too many queries: while parsing
    }
    after_round = []
    for _ in range(2):
        for flag, body in huge.items():
            status, data = post_json(server.url, body.encode(), timeout=120)
            assert status == 422 and flag in data["error"], (flag, status, data)
        after_round.append(_rss_mb(server.proc.pid))
    assert after_round[-1] <= 1.5 * baseline, (baseline, after_round)
    assert after_round[1] - after_round[0] < 20, after_round  # nothing is kept per request
    assert post_json(server.url, b'{"query": ["still fine"]}', timeout=60)[0] == 200


def _big_request(server: Server, n: int) -> tuple[socket.socket, dict]:
    """Send an n-query request on a raw socket; return once the server is scoring it."""
    before = server.health()
    sock = _open_request(server.port, json.dumps({"query": [f"query {i} " + "z" * 40 for i in range(n)]}).encode())
    def scoring() -> bool:
        now = server.health()
        return now["pending_requests"] >= 1 and now["sequences"] > before["sequences"]

    _wait_for(scoring, 60, "the big request to be scored")
    return sock, before


def test_small_request_is_not_stuck_behind_a_10k_query_request(server):
    sock, before = _big_request(server, 10_000)
    try:
        t0 = time.perf_counter()
        status, data = post_json(server.url, b'{"query": ["1+1=2"]}', timeout=60)
        latency = time.perf_counter() - t0
        scored = server.health()["sequences"] - before["sequences"]
    finally:
        sock.close()
    assert status == 200 and len(data["rewards"]) == 1
    assert latency < 5.0, f"a 1-query request behind a 10k-query request took {latency:.1f} s"
    assert scored < 10_000, "the big request finished first: nothing was behind it"


def test_disconnected_clients_work_is_cancelled(server):
    sock, before = _big_request(server, 10_000)
    sock.close()
    _wait_for(lambda: server.health()["cancelled"] > before["cancelled"], 10, "the request to be cancelled")
    time.sleep(0.5)  # a forward running at the cancellation finishes
    first = server.health()
    time.sleep(1.5)
    second = server.health()
    assert second["sequences"] == first["sequences"], "the disconnected client's queries are still being scored"
    assert first["sequences"] - before["sequences"] < 10_000
    assert first["dropped"] - before["dropped"] >= 10_000 - (first["sequences"] - before["sequences"])


def test_half_sent_requests_are_closed(server):
    body = json.dumps({"query": ["never finished"] * 50}).encode()
    half_bodies = [_open_request(server.port, body, send=len(body) // 2) for _ in range(20)]
    half_headers = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        half_headers.append(s)
    t0 = time.perf_counter()
    answers = [_read_until_closed(s, 30) for s in half_bodies]
    leftovers = [_read_until_closed(s, 30) for s in half_headers]  # b"": closed without an answer
    elapsed = time.perf_counter() - t0
    for s in half_bodies + half_headers:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408") and b"--read_timeout_s" in a for a in answers), answers[0][:300]
    assert leftovers == [b""] * 20
    assert elapsed < READ_TIMEOUT_S + 8
    assert post_json(server.url, b'{"query": ["ok"]}', timeout=60)[0] == 200


def test_malformed_inputs_get_4xx(server):
    cases = [
        (b'{"query": ["\\ud800"]}', 400, "lone surrogate"),
        (b'{"query": ["a\\udc00b"], "labels": [1]}', 400, "lone surrogate"),
        (b'{"query": ["\xed\xa0\x80"]}', 400, "not valid UTF-8"),  # a surrogate in raw UTF-8
        (b'{"query": ["\xff"]}', 400, "not valid UTF-8"),
        (b'{"query": ["a"], "labels": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", 422, "--max_json_depth"),
        (b"[" * 1_000_000, 400, "JSON object"),
        (b'{"query": ["a"], "labels": [' + b"9" * 5000 + b"]}", 400, "malformed JSON"),
        (b'{"query": null}', 400, "list of strings"),
        (b'{"query": [["nested"]]}', 400, "query[0] is not a string"),
        (b'{"query": ["a"], "prompts": 3}', 400, "'prompts' must be a list"),
        (b'{"query": ["a"], "query": ["b"]}', 400, "duplicate field"),
        (b'{"query": ["' + b"x" * 1000 + b'"]}', 422, "--max_query_chars (768)"),  # 64 tokens x 12 characters
        (json.dumps({"query": ["a"] * 65_537}).encode(), 422, "--max_queries (65536)"),
        (b'{"query": ["a"]', 400, "malformed JSON"),
        (b"", 400, "empty body"),
    ]
    for body, status, message in cases:
        got, data = post_json(server.url, body, timeout=60)
        assert got == status and message in data["error"], (body[:60], got, data)
    sock = _open_request(server.port, b"", declared=40 * 2 ** 20)  # refused before any byte of the body
    answer = _read_until_closed(sock, 30)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413") and b"--max_body_mb" in answer
    assert post_json(server.url, json.dumps({"query": ["fine", "also fine"]}).encode(), timeout=60)[0] == 200


def test_sigterm_with_a_half_sent_request_open_exits_within_10s(rm_dir, tmp_path):
    srv = Server(rm_dir, tmp_path / "serve_rm.log")  # default --read_timeout_s (10) and --shutdown_timeout_s
    try:
        body = json.dumps({"query": ["half"] * 10}).encode()
        half = _open_request(srv.port, body, send=10)
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        idle.sendall(b"POST /get_reward HTTP/1.1\r\n")
        time.sleep(0.5)  # the server is reading the half-sent body
        t0 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve_rm still running 10 s after SIGTERM:\n{srv.output()[-2000:]}")
        elapsed = time.perf_counter() - t0
        half.close()
        idle.close()
    finally:
        srv.stop()
    assert elapsed < 10 and srv.proc.returncode in (0, -signal.SIGTERM)
