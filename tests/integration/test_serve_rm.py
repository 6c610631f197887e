"""serve_rm as a real subprocess + the async reward client (retries, round robin, errors).

The server runs a tiny reward model; its answers are compared with scores computed in this process.
Client retry tests use small aiohttp servers in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import load_value_model, reward_at_last_token, save_value_model
from rlhfkit.rewards.http_client import RemoteRewardClient, RewardServerError, get_rewards_sync
from rlhfkit.rewards.output import RewardOutput
from helpers import free_port, get_json, listening_pid, post_json  # noqa: E402

# --dist loadgroup: one worker builds its reward model and server, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("serve_rm")

MEAN, STD, MAX_LEN = 0.5, 2.0, 64
QUERIES = ["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>", "ab", "hello world",
           "12+34=46", "x" * MAX_LEN, "the quick brown fox"]







@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("serve_rm"))
    save_value_model(load_value_model(tiny_model_dir, init_value_head=True), path,
                     load_tokenizer(tiny_model_dir), mean=MEAN, std=STD)
    return path


@pytest.fixture(scope="module")
def server(rm_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "serve_rm.log", "w+")
    cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward.model_name_or_path", rm_dir,
           "--port", str(port), "--data.max_len", str(MAX_LEN), "--batch_size", "4", "--batch_wait_ms", "20",
           "--param_dtype", "fp32", "--normalize_reward", "--max_body_mb", "0.01"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            get_json(base + "/health")
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                proc.kill()
                pytest.fail(f"serve_rm did not start:\n{log.read()}")
            time.sleep(0.3)
    yield base
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


@pytest.fixture(scope="module")
def expected(rm_dir) -> list[float]:
    """Raw scores computed in this process, one query at a time (no padding at all)."""
    tok, model = load_tokenizer(rm_dir), load_value_model(rm_dir).eval()
    out = []
    with torch.no_grad():
        for q in QUERIES:
            ids = torch.tensor([tok(q, add_special_tokens=False)["input_ids"]])
            out.append(reward_at_last_token(model(ids), torch.ones_like(ids)).item())
    return out


def test_scores_match_in_process_model(server, expected):
    status, data = post_json(server + "/get_reward", json.dumps({"query": QUERIES, "prompts": [""] * 6,
                                                             "labels": list(range(6))}).encode())
    assert status == 200
    raw = data["extra_logs"]["raw_reward"]
    assert raw == pytest.approx(expected, abs=1e-5)  # 6 queries > --batch_size 4: two forwards
    assert data["rewards"] == pytest.approx([(r - MEAN) / STD for r in expected], abs=1e-5)
    assert data["scores"] == data["rewards"]


def test_bad_requests_get_4xx_and_server_keeps_serving(server, expected):
    url = server + "/get_reward"
    cases = [
        (b'{"query": ["ab"', 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompts": ["a"]}', 400, "missing field 'query'"),
        (b'{"query": "ab"}', 400, "list of strings"),
        (b'{"query": [1]}', 400, "list of strings"),
        (b'{"query": ["a", "b"], "labels": [1]}', 400, "'labels' has 1 entries for 2 queries"),
        (json.dumps({"query": ["ab", "y" * (MAX_LEN + 1)]}).encode(), 422, "query[1] has 65 tokens"),
        (b'{"query": [""]}', 422, "query[0] is empty"),
        (json.dumps({"query": ["z" * 20000]}).encode(), 413, "--max_body_mb"),
    ]
    for body, status, message in cases:
        got, data = post_json(url, body)
        assert got == status and message in data["error"], (body[:40], got, data)
    status, data = post_json(url, json.dumps({"query": QUERIES[1:3]}).encode())
    assert status == 200 and data["extra_logs"]["raw_reward"] == pytest.approx(expected[1:3], abs=1e-5)
    assert post_json(url, b'{"query": []}') == (200, {"rewards": [], "scores": [], "extra_logs": {"raw_reward": []}})


def test_concurrent_requests_are_batched(server, expected):
    """18 one-query requests that arrive together share forwards. The server is stopped (SIGSTOP) while
    they are sent, so they are all waiting when it reads them, however slowly this process sends."""
    before = get_json(server + "/health")
    pid = listening_pid(int(server.rsplit(":", 1)[1]))

    async def run() -> list[RewardOutput]:
        async with RemoteRewardClient([server + "/get_reward"], timeout_s=30, max_retries=0) as client:
            calls = [asyncio.ensure_future(client.get_rewards([q])) for q in QUERIES * 3]
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(1.0)  # every request connected and written
                finally:
                    os.kill(pid, signal.SIGCONT)
            return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert [o.extra_logs["raw_reward"][0] for o in outs] == pytest.approx(expected * 3, abs=1e-5)
    after = get_json(server + "/health")
    assert after["sequences"] - before["sequences"] == 18
    assert after["forwards"] - before["forwards"] < 18  # requests were merged into shared forwards


# ----------------------------------------------------------------------------- in-process units


def test_reward_output_validation():
    out = RewardOutput.from_mapping({"rewards": torch.tensor([1.0, 0.0]), "extra_logs": {"acc": [1, 0], "t": 2}},
                                    2, "f.py")
    assert out.scores == [1.0, 0.0] and out.sample_logs(1) == {"acc": 0.0, "t": 2.0}
    out = RewardOutput.from_mapping({"rewards": [[0.5]], "scores": [1], "extra_logs": {"ok": [True]}}, 1, "f.py")
    assert (out.rewards, out.scores, out.extra_logs) == ([0.5], [1.0], {"ok": [1.0]})
    for bad, msg in [({"scores": [1]}, "no 'rewards'"), ({"rewards": [1]}, "1 values for 2 samples"),
                     ({"rewards": [1, float("nan")]}, "not finite"), ({"rewards": [1, "a"]}, "must be a number"),
                     ({"rewards": [True, False]}, "must be a number"), ({"rewards": 1.0}, r"one number \(1.0\) for 2 samples"),
                     ({"rewards": [1, 2], "extra_logs": {"x": "a"}}, "'extra_logs.x' must be a number")]:
        with pytest.raises(ValueError, match=msg):
            RewardOutput.from_mapping(bad, 2, "f.py")


# ----------------------------------------------------------------------------- client vs fake servers


async def _rewards(urls, queries, **kw) -> RewardOutput:
    """One call with a client that is closed afterwards."""
    async with RemoteRewardClient(urls, **kw) as client:
        return await client.get_rewards(queries)


class FakeServer:
    """aiohttp server answering from a script: a list of (status, body) per call, the last repeated."""

    def __init__(self, script: list[tuple[int, object]], delay_s: float = 0.0) -> None:
        self.script, self.delay_s, self.calls = script, delay_s, 0
        self.runner = None
        self.url = ""

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        status, answer = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if answer == "echo":
            answer = {"rewards": [float(len(q)) for q in body["query"]], "extra_logs": {"n": 1}}
        return web.json_response(answer, status=status)

    async def __aenter__(self) -> "FakeServer":
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/get_reward", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/get_reward"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def test_client_retries_then_succeeds():
    async def run(max_retries: int):
        async with FakeServer([(500, {"error": "x"}), (503, {"error": "y"}), (200, "echo")]) as srv:
            t0 = time.perf_counter()
            async with RemoteRewardClient([srv.url], timeout_s=5, max_retries=max_retries, backoff_s=0.05) as client:
                out = await client.get_rewards(["abc", "de"], ["p", "q"], [1, 2])
            return out, srv.calls, time.perf_counter() - t0

    out, calls, elapsed = asyncio.run(run(2))
    assert out.rewards == [3.0, 2.0] and out.scores == [3.0, 2.0] and calls == 3
    assert elapsed >= 0.05 + 0.10  # exponential backoff: 0.05 s then 0.1 s
    with pytest.raises(RewardServerError, match="failed 2 times .* HTTP 503"):
        asyncio.run(run(1))


def test_client_gives_up_naming_the_url():
    async def run():
        async with FakeServer([(503, {"error": "busy"})]) as srv:
            with pytest.raises(RewardServerError) as e:
                await _rewards(srv.url, ["a"], max_retries=3, backoff_s=0.0)
            return str(e.value), srv.calls, srv.url

    msg, calls, url = asyncio.run(run())
    assert calls == 4 and url in msg and "failed 4 times" in msg
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    with pytest.raises(RewardServerError, match=dead.replace(".", r"\.")):
        get_rewards_sync([dead], ["a"], max_retries=1, backoff_s=0.0)


def test_client_round_robin_failover_and_non_retryable_errors():
    async def run():
        async with FakeServer([(200, "echo")]) as a, FakeServer([(200, "echo")]) as b, \
                FakeServer([(400, {"error": "bad"})]) as c, FakeServer([(200, {"rewards": [1.0, 2.0]})]) as d, \
                FakeServer([(200, "echo")], delay_s=1.0) as slow:
            async with RemoteRewardClient([a.url, b.url], backoff_s=0.0) as client:
                for _ in range(4):
                    await client.get_rewards(["a"])
            assert (a.calls, b.calls) == (2, 2)
            dead = f"http://127.0.0.1:{free_port()}/get_reward"
            async with RemoteRewardClient([dead, a.url], backoff_s=0.0, max_retries=1) as client:
                assert (await client.get_rewards(["xyz"])).rewards == [3.0]  # failed over to a
            with pytest.raises(RewardServerError, match="rejected the request: HTTP 400"):
                await _rewards(c.url, ["a"], max_retries=5, backoff_s=0.0)
            assert c.calls == 1  # a 4xx answer is not retried
            with pytest.raises(ValueError, match=f"reward server {d.url}: 'rewards' has 2 values for 1 samples"):
                await _rewards(d.url, ["a"])
            with pytest.raises(RewardServerError, match=r"no answer within 0\.\d+ s"):  # the rest of 2 x 0.2 s
                await _rewards(slow.url, ["a"], timeout_s=0.2, max_retries=1, backoff_s=0.0)

    asyncio.run(run())
