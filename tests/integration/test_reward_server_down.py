"""A reward server that fails the whole batch (down, 5xx, too slow) is retried as a batch with backoff
within 2 x the timeout and fails every sample of it once; a sample the server refuses (4xx) is retried
alone. Issue 42.6: a server that refuses connections stops the run at start (a probe, before any model
is loaded); one that dies during a --reward_failure drop run ends it within 3 x --reward_timeout of its
death (the later calls fail at once), and the lines say "reward server", not "user code"."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port, rl_flags, write_rl_data
from test_serve_rm import FakeServer

from rlhfkit.rewards.batching import BatchingRewardSource
from rlhfkit.rewards.http_client import RemoteRewardClient, RewardServerDown, RewardServerError
from rlhfkit.rewards.sources import HTTPRewardSource


def test_a_failing_server_is_retried_as_a_batch_and_fails_it_once():
    async def run():
        async with FakeServer([(503, {"error": "overloaded"})]) as srv:
            t0 = time.perf_counter()
            src = BatchingRewardSource(HTTPRewardSource([srv.url], timeout_s=5.0, max_retries=2, backoff_s=0.05))
            out = await asyncio.gather(*(src([f"q{i}"], [""], [None]) for i in range(6)), return_exceptions=True)
            return out, srv.calls, time.perf_counter() - t0

    out, calls, elapsed = asyncio.run(run())
    assert calls == 3  # 1 + 2 retries of the batch of 6, not 6 x 3
    assert elapsed >= 0.05 + 0.1  # with backoff
    assert all(isinstance(e, RewardServerDown) and "for a batch of 6" in str(e) and "HTTP 503" in str(e) for e in out)


def test_a_sample_the_server_refuses_is_retried_alone():
    class Picky(FakeServer):
        async def handle(self, request):
            from aiohttp import web

            body = await request.json()
            self.calls += 1
            if any("bad" in q for q in body["query"]):
                return web.json_response({"error": "bad query"}, status=422)
            return web.json_response({"rewards": [1.0] * len(body["query"])})

    async def run():
        async with Picky([]) as srv:
            src = BatchingRewardSource(HTTPRewardSource([srv.url], timeout_s=5.0, max_retries=3, backoff_s=0.0))
            out = await asyncio.gather(*(src([q], [""], [None]) for q in ["a", "bad", "c"]), return_exceptions=True)
            return out, srv.calls

    out, calls = asyncio.run(run())
    assert calls == 4  # the batch, then each sample alone; a 4xx is never retried as such
    assert out[0].rewards == [1.0] and out[2].rewards == [1.0]
    assert isinstance(out[1], RewardServerError) and not isinstance(out[1], RewardServerDown)


def test_retries_stop_at_twice_the_timeout():
    async def run():
        async with FakeServer([(200, "echo")], delay_s=1.2) as slow:
            t0 = time.perf_counter()
            async with RemoteRewardClient([slow.url], timeout_s=0.3, max_retries=10, backoff_s=0.05) as client:
                with pytest.raises(RewardServerDown, match=r"within 0\.6 s"):
                    await client.get_rewards(["a"])
            return time.perf_counter() - t0

    assert asyncio.run(run()) < 0.6 + 0.3


def test_a_server_that_refuses_connections_stops_the_run_at_start(tiny_model_dir, tmp_path, capsys):
    from rlhfkit.cli import train_ppo

    d = write_rl_data(str(tmp_path))
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    argv = rl_flags(tiny_model_dir, d, str(tmp_path / "out"), "--reward_failure", "drop", "--reward_timeout", "1",
                    steps=10)
    argv[argv.index("--remote_rm_url") + 1] = dead
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv)
    assert e.value.code == 1 and time.perf_counter() - t0 < 3 * 1.0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"train_ppo: error: --remote_rm_url: the reward server {dead} does not accept "
                           "connections (Connection refused"), last


class _DyingHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"rewards": [len(q) % 3 / 2.0 for q in body["query"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        self.server.answered.set()


def test_a_server_that_dies_ends_a_drop_run_within_three_timeouts(tiny_model_dir, tmp_path, capsys):
    """It answers step 1's first request, then stops listening: a dead server from then on."""
    from rlhfkit.cli import train_ppo

    server = ThreadingHTTPServer(("127.0.0.1", 0), _DyingHandler)
    server.answered, died = threading.Event(), []

    def die() -> None:
        server.answered.wait()
        server.shutdown()
        server.server_close()
        died.append(time.monotonic())

    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Thread(target=die, daemon=True).start()
    d = write_rl_data(str(tmp_path))
    argv = rl_flags(tiny_model_dir, d, str(tmp_path / "out"), "--reward_failure", "drop", "--reward_timeout", "2",
                    steps=10)
    argv[argv.index("--remote_rm_url") + 1] = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    with pytest.raises(SystemExit) as e:
        train_ppo.main(argv)
    ended = time.monotonic()
    assert e.value.code == 1 and died and ended - died[0] < 3 * 2.0, ended - died[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert "3 steps in a row (--max_failed_steps 3)" in err[-1] and "failed in the reward server" in err[-1], err[-1]
    assert not any("user code" in line for line in err), err
