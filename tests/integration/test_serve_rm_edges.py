"""serve_rm at its edges: a busy port fails in one line before anything says it listens; a 40 MB body
sent without waiting gets its 413 (not a reset); input that is not HTTP gets a JSON 400."""

from __future__ import annotations

import json
import socket

import pytest
from helpers import post_json
from test_serve_rm_abuse import Server, _read_until_closed, rm_dir  # noqa: F401 - rm_dir: a fixture

# --dist loadgroup: one worker builds its server, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("serve_rm_edges")


@pytest.fixture(scope="module")
def server(rm_dir, tmp_path_factory):  # noqa: F811
    srv = Server(rm_dir, tmp_path_factory.mktemp("log") / "serve_rm.log", "--max_body_mb", "32")
    yield srv
    srv.stop()


def test_a_busy_port_is_one_line_before_listening(rm_dir, capsys):  # noqa: F811
    from rlhfkit.cli import serve_rm

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(SystemExit) as e:
            serve_rm.main(["--reward_pretrain", rm_dir, "--port", str(port), "--param_dtype", "fp32"])
    finally:
        busy.close()
    assert str(e.value) == (f"serve_rm: error: cannot listen on 127.0.0.1:{port} (--host / --port): "
                            "Address already in use")
    assert "listening" not in capsys.readouterr().err


def test_an_oversized_body_sent_at_once_gets_its_413(server):
    body = b'{"query": ["' + b"x" * (40 * 2 ** 20) + b'"]}'
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    head = (f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)  # without waiting for an answer, as most clients do
    answer = _read_until_closed(sock, 60)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error == f"request body of {len(body)} bytes exceeds --max_body_mb ({32 * 2 ** 20} bytes)"
    assert post_json(server.url, json.dumps({"query": ["fine"]}).encode(), timeout=60)[0] == 200


@pytest.mark.parametrize("junk", [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\nHost x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01"])
def test_input_that_is_not_http_gets_a_json_400(server, junk):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(junk)
    answer = _read_until_closed(sock, 30)
    sock.close()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
    assert json.loads(body)["error"].startswith("malformed HTTP request: ")
