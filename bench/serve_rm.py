"""Throughput of the reward server (rlhfkit.cli.serve_rm) on CPU with a tiny reward model.

For 1, 8 and 64 concurrent clients (each a closed loop: send, wait for the answer, send again) we
measure requests/s, sequences/s and latency against two servers started as subprocesses:

    batched    --batch_size 16 --batch_wait_ms 5   (the micro-batcher merges concurrent requests)
    unbatched  --batch_size 1  --batch_wait_ms 0   (baseline: one forward per sequence)

and report the ratio batched / unbatched. Clients use `RemoteRewardClient` and run in this process,
on the same machine as the server (so they compete for the same cores). One request carries
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

from rlhfkit.agents.remote_reward import RemoteRewardClient
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
from rlhfkit.models.value import load_value_model, save_value_model

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


def start_server(rm: str, batch_size: int, wait_ms: float, max_len: int,
                 threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", rm, "--port", str(port),
           "--batch_size", str(batch_size), "--batch_wait_ms", str(wait_ms), "--max_len", str(max_len),
           "--param_dtype", "fp32", "--device", "cpu", "--num_threads", str(threads)]
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
            "latency_p50_ms": pick(0.5), "latency_p95_ms": pick(0.95)}


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
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--batch_wait_ms", type=float, default=5.0)
    p.add_argument("--server_threads", type=int, default=1, help="torch threads in the server")
    p.add_argument("--out", type=str, default=None, help="also write the JSON here")
    args = p.parse_args()

    load0 = os.getloadavg()[0]
    text = ("The answer is 42 because 6 x 7 = 42. " * 100)[: args.query_chars]
    queries = [text] * args.queries_per_request
    runs = {}
    with tempfile.TemporaryDirectory() as root:
        rm = make_reward_model(root, args.hidden_size, args.num_layers)
        for name, bs, wait in (("batched", args.batch_size, args.batch_wait_ms), ("unbatched", 1, 0.0)):
            proc, base = start_server(rm, bs, wait, max_len=args.query_chars + 16, threads=args.server_threads)
            try:
                runs[name] = measure(base, queries, args)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    speedup = {c: round(runs["batched"][c]["sequences_per_s"] / max(runs["unbatched"][c]["sequences_per_s"], 1e-9), 2)
               for c in runs["batched"]}
    result = {
        "bench": "serve_rm", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "model": {"arch": "llama", "hidden_size": args.hidden_size, "num_layers": args.num_layers},
        "query_tokens": args.query_chars, "queries_per_request": args.queries_per_request,
        "duration_s": args.duration_s, "server": {"batch_size": args.batch_size, "batch_wait_ms": args.batch_wait_ms,
                                               "num_threads": args.server_threads},
        "batched": runs["batched"], "unbatched_baseline": runs["unbatched"],
        "speedup_sequences_per_s_vs_unbatched": speedup,
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
