"""Throughput and latency of the reward server (rlhfkit.cli.serve_rm) on CPU with a tiny reward model.

For 1, 8 and 64 concurrent clients (each a closed loop: send, wait for the answer, send again) we
measure requests/s, sequences/s and p50/p99 latency against servers started as subprocesses:

    default        serve_rm's default settings (--batch_size 16, --batch_wait_ms 5, --num_threads 0:
                   on CPU one torch thread per core but one)
    torch_threads  the same with --num_threads = torch's default thread count (serve_rm's former default)
    unbatched      the same with --batch_size 1 --batch_wait_ms 0 (one forward per sequence)

and report the ratios default / torch_threads and default / unbatched. It also times a 1-query request
sent while the default server scores a 10k-query request (`small_behind_large_s`; the 10k-query client
then disconnects, and its remaining work is dropped). Clients use `RemoteRewardClient` and run in this
process, on the same machine as the server (they compete for the same cores). One request carries
--queries_per_request texts (OpenRLHF's single-turn agent sends 1).

    python bench/serve_rm.py [--duration_s 3] [--out bench/results/serve_rm_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
from rlhfkit.models.value import load_value_model, save_value_model
from rlhfkit.rewards.http_client import RemoteRewardClient

CONCURRENCY = (1, 8, 64)


def make_reward_model(root: str, hidden: int, layers: int) -> str:
    lm = make_tiny_model(os.path.join(root, "lm"), TinyModelSpec(hidden_size=hidden, num_hidden_layers=layers,
                                                                 num_attention_heads=4, max_position_embeddings=1024))
    torch.manual_seed(0)
    rm = os.path.join(root, "rm")
    save_value_model(load_value_model(lm, init_value_head=True), rm, load_tokenizer(lm), mean=0.0, std=1.0)
    return rm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.loads(r.read())


def start_server(rm: str, max_len: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", rm, "--port", str(port),
           "--max_len", str(max_len), "--param_dtype", "fp32", "--device", "cpu", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            health(base)
            return proc, base
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"serve_rm did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.3)


def small_behind_large(base: str, text: str, n_large: int = 10_000) -> float:
    """Seconds for a 1-query request sent once the server is scoring an n_large-query request."""
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"query": [text] * n_large}).encode()
    before = health(base)["sequences"]
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        sock.sendall(f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        while health(base)["sequences"] == before:
            time.sleep(0.02)
        req = urllib.request.Request(base + "/get_reward", data=json.dumps({"query": [text]}).encode())
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
        return round(time.perf_counter() - t0, 3)
    finally:
        sock.close()  # the server drops the rest of the large request


async def load(url: str, clients: int, queries: list[str], duration_s: float, warmup_s: float) -> dict:
    """Closed-loop clients for warmup + duration; counts the answers completed inside the window."""
    latencies: list[float] = []
    done = {"requests": 0, "sequences": 0}
    async with RemoteRewardClient([url], timeout_s=120, max_retries=0) as client:
        t_start = time.perf_counter()
        t_measure, t_end = t_start + warmup_s, t_start + warmup_s + duration_s

        async def one_client() -> None:
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                out = await client.get_rewards(queries)
                t1 = time.perf_counter()
                if t_measure <= t1 <= t_end:  # answers completed inside the window
                    latencies.append(t1 - t0)
                    done["requests"] += 1
                    done["sequences"] += len(out)

        await asyncio.gather(*[one_client() for _ in range(clients)])
    latencies.sort()
    pick = (lambda q: round(1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2)) \
        if latencies else (lambda q: None)
    return {"requests_per_s": round(done["requests"] / duration_s, 1),
            "sequences_per_s": round(done["sequences"] / duration_s, 1),
            "latency_p50_ms": pick(0.5), "latency_p99_ms": pick(0.99)}


def measure(base: str, queries: list[str], args: argparse.Namespace) -> dict:
    results = {}
    for c in CONCURRENCY:
        h0 = health(base)
        r = asyncio.run(load(base + "/get_reward", c, queries, args.duration_s, args.warmup_s))
        h1 = health(base)
        fwd = h1["forwards"] - h0["forwards"]
        r["mean_forward_batch"] = round((h1["sequences"] - h0["sequences"]) / fwd, 2) if fwd else None
        results[str(c)] = r
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration_s", type=float, default=3.0)
    p.add_argument("--warmup_s", type=float, default=0.5)
    p.add_argument("--query_chars", type=int, default=64, help="characters (= tokens) per query")
    p.add_argument("--queries_per_request", type=int, default=1)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--out", type=str, default=None, help="also write the JSON here")
    args = p.parse_args()

    load0 = os.getloadavg()[0]
    torch_threads = torch.get_num_threads()  # torch's default in a fresh process (nothing here sets it)
    text = ("The answer is 42 because 6 x 7 = 42. " * 100)[: args.query_chars]
    queries = [text] * args.queries_per_request
    servers = {"default": [], "torch_threads": ["--num_threads", str(torch_threads)],
               "unbatched": ["--batch_size", "1", "--batch_wait_ms", "0"]}
    runs, threads, behind = {}, {}, None
    with tempfile.TemporaryDirectory() as root:
        rm = make_reward_model(root, args.hidden_size, args.num_layers)
        for name, extra in servers.items():
            proc, base = start_server(rm, args.query_chars + 16, extra)
            try:
                threads[name] = health(base)["num_threads"]
                runs[name] = measure(base, queries, args)
                if name == "default":
                    behind = small_behind_large(base, text)
            finally:
                proc.terminate()
                proc.wait(timeout=30)

    def ratio(key: str, other: str) -> dict:
        return {c: round(runs["default"][c][key] / max(runs[other][c][key], 1e-9), 2) for c in runs["default"]}

    result = {
        "bench": "serve_rm", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "model": {"arch": "llama", "hidden_size": args.hidden_size, "num_layers": args.num_layers},
        "query_tokens": args.query_chars, "queries_per_request": args.queries_per_request,
        "duration_s": args.duration_s, "server_flags": servers, "server_torch_threads": threads,
        "default": runs["default"], "torch_threads_baseline": runs["torch_threads"],
        "unbatched_baseline": runs["unbatched"],
        "requests_per_s_default_vs_torch_threads": ratio("requests_per_s", "torch_threads"),
        "sequences_per_s_default_vs_unbatched": ratio("sequences_per_s", "unbatched"),
        "small_behind_large_s": behind,
        "load_average_1min": {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)},
        "note": "clients run in the bench process on the same cores as the server",
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
