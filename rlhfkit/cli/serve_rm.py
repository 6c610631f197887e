"""HTTP reward-model server (OpenRLHF's `serve_rm` protocol), FastAPI + uvicorn (the `serve` extra).

    python -m rlhfkit.cli.serve_rm --reward_pretrain PATH --port 5000 --max_len 2048 --batch_size 16 \\
        [--normalize_reward] [--value_head_prefix score] [--host 127.0.0.1] [--max_body_mb 32]

    POST /get_reward  {"query": [str], "prompts"?: [str], "labels"?: [any]}
                  ->  {"rewards": [float], "scores": [float], "extra_logs": {"raw_reward": [float]}}
    GET  /health      {"status": "ok", "forwards": ..., "sequences": ..., "cancelled": ..., ...}

Data flow. A request's body is read under --read_timeout_s and --max_body_mb and parsed under the
item, character and depth limits (`serving/request.py`) before anything is tokenised; its queries then
join the round-robin scheduler (`serving/batcher.py`), which hands one worker thread micro-batches of
at most --batch_size queries taken in turn from every pending request; the thread tokenises and scores
each micro-batch. A small request is therefore answered after a forward or two even behind a huge one,
and a request whose client disconnects loses its queries not yet scored:

    request A (10k) --read, parse-->+
    request B (1)   --read, parse-->+--> round robin --> [A0 B0 A1 .. A14] --thread--> tokenise, model
                                                          B answered; A's next micro-batches follow

`rewards` are the reward model's scores, normalised as (r - mean) / std with --normalize_reward
(mean/std from the model's config.json); `scores` equal `rewards`; `extra_logs.raw_reward` holds
the scores before normalisation. `prompts` and `labels` are validated but not used.

Errors answer JSON `{"error": ...}` and the server keeps serving: 400 malformed input (not UTF-8, not
JSON, lone surrogates, missing `query`, wrong types or lengths); 408 a body not received within
--read_timeout_s; 413 a body larger than --max_body_mb; 422 a limit (--max_queries, --max_query_chars,
--max_json_depth) or a query that is empty or longer than --max_len tokens (we reject rather than
truncate, unlike OpenRLHF, which silently cuts the end of the text: a reward for a cut text is not the
reward of the text); 500 a model error. A 408 or 413 also closes the connection. A connection whose
request headers do not arrive within --read_timeout_s is closed; an oversized body is read through
before its 413 so the client gets the answer, not a reset; input that is not HTTP gets a JSON 400 too.
The port is bound before the model loads: a busy one ends the server in one line before anything says
it listens. SIGTERM stops accepting connections,
lets requests in progress finish for up to --shutdown_timeout_s, then cancels them and exits.

Threads (--num_threads 0, the default): on CPU the model gets one torch thread per core but one, and
the tokenizer runs single-threaded (TOKENIZERS_PARALLELISM=false unless set), leaving a core to the
event loop that reads, parses and answers requests: with torch's default (a thread per core) its
spinning OpenMP workers starve the event loop under many clients (64 clients on 2 cores: 10.7
requests/s against 77.6 with one thread, issue 14). On GPU torch's default is kept.

Memory: requests are parsed from their text without building more than the text itself, queries are
tokenised one micro-batch at a time, all threads share one glibc malloc arena, and after a body of
1 MB or more the C heap is trimmed (`malloc_trim`), so a rejected 30 MB request leaves the process near
its baseline size.

Differences from OpenRLHF: binds 127.0.0.1 unless --host says otherwise (OpenRLHF: 0.0.0.0);
--batch_size defaults to 16 (OpenRLHF: the whole request in one batch); the limits above (OpenRLHF has
none).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Sequence

import torch

from rlhfkit.serving.app import import_fastapi, bind_port, choose_num_threads, create_app, one_malloc_arena
from rlhfkit.serving.request import header_timeout_protocol
from rlhfkit.serving.flags import ServerFlags
from rlhfkit.serving.scorer import RewardScorer, ServeConfig
from rlhfkit.config.configs import ModelFlags, from_args
from rlhfkit.config.declare import add_fields, flag_fields
from rlhfkit.config.flags import (FlagParser, add_device_flag, add_max_len_flag, add_normalize_reward_flag,
                                  add_packing_flag, add_reward_model_flag, add_value_head_flag)

def build_parser() -> FlagParser:
    p = FlagParser("serve_rm", "Serve a reward model over HTTP (OpenRLHF protocol).", own_logging=True)
    p.set_defaults(log_level="warning")
    with p.group("reward model"):
        add_reward_model_flag(p, "reward model directory or hub id (saved by train_rm, or any sequence-classification "
                                 "model)")
        add_normalize_reward_flag(p, "answer (r - mean) / std with mean/std from the model's config.json")
        add_value_head_flag(p, "name of the model's value head module")
        add_max_len_flag(p, "longest query in tokens (longer: 422)")
    with p.group("server"):
        add_fields(p, ServerFlags, [f.name for f in flag_fields(ServerFlags) if f.name != "num_threads"], here=True)
    with p.group("model loading and device"):
        add_fields(p, ModelFlags, ["param_dtype", "attn_implementation", "load_in_4bit", "disable_fast_tokenizer"],
                   help={"param_dtype": "compute dtype on GPU; CPU computes in fp32",
                         "load_in_4bit": "load the weights in 4-bit NF4 (needs bitsandbytes; on CPU 0.48 or newer)"})
        add_packing_flag(p, "OpenRLHF: pack queries into one row", inert="serve_rm pads its batches")
        add_fields(p, ModelFlags, ["experts_implementation", "use_ms"],
                   help={"use_ms": "download --reward_pretrain from ModelScope (needs modelscope)"})
        add_device_flag(p)
        add_fields(p, ServerFlags, ["num_threads"], here=True)
    return p


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if not args.reward_pretrain:
        raise SystemExit("serve_rm: error: --reward_pretrain is required (a reward model directory or hub id)")
    return from_args(ServeConfig, args)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from rlhfkit.cli.common import check_packages, cli_main, resolve_model_paths

    def prepare() -> None:  # one error line, before the model loads: a missing package, a model not to be had
        import_fastapi()
        check_packages(args)
        resolve_model_paths(args)

    cli_main("serve_rm", prepare)
    cfg = config_from_args(args)
    if args.shutdown_timeout_s < 0:
        raise SystemExit(f"serve_rm: error: --shutdown_timeout_s must be >= 0, got {args.shutdown_timeout_s}")
    import uvicorn

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    one_malloc_arena()
    cfg.device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(choose_num_threads(args.num_threads, cfg.device))
    sock = bind_port(args.host, args.port)  # a busy port fails here, before the model loads
    t0 = time.time()
    scorer = RewardScorer(cfg)
    app = create_app(scorer, cfg)
    sock.listen(2048)
    print(f"serve_rm: {cfg.reward_pretrain} loaded in {time.time() - t0:.1f} s on {scorer.device} "
          f"({torch.get_num_threads()} torch threads); listening on http://{args.host}:{args.port}/get_reward",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            http=header_timeout_protocol(cfg.read_timeout_s),
                            timeout_graceful_shutdown=args.shutdown_timeout_s)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
