"""Tensor-parallel rollout: throughput of the builtin engine at TP 1 / 2 / 4, and TP parity on GPUs.

    python bench/rollout_tp.py --shape qwen2.5-7b --tp 1,2,4 --batch 256 --prompt 512 --new 512 --out tp.json
    python bench/rollout_tp.py --shape qwen2.5-32b --tp 4 --batch 256 --prompt 512 --new 512 --out tp32.json
    python bench/rollout_tp.py --parity --tp 2          # TP 2 == TP 1 on a small fp32 model (GPU or CPU)

Each TP size runs in its own `tp` processes (one GPU each, NCCL; gloo on CPU), started with
torch.multiprocessing; every shard builds its engine from the shape's HF config with random
weights drawn on its GPU (`BuiltinEngine(config)`, no checkpoint on disk: a 32B model is not
written and read back), warms up (compile + CUDA graphs), then generates `batch` sequences of
`new` tokens from random `prompt`-token prompts at temperature 1, eos ignored. tokens/s counts new
tokens over the wall time of shard 0's generate() (prefill included), median of `--repeat`.

Roofline of one decode step, over all `tp` GPUs' bandwidth: the bytes that must cross HBM, the
model's weights once (every matrix, embedding rows excluded: only the sampled rows are read) plus
the KV cache of every sequence at the mean context (prompt + new / 2):

    roofline tokens/s = batch / ((weight_bytes + batch * kv_bytes_per_token * ctx) / (tp * bandwidth))

`--sleep_check` times one more generate() after `sleep()` + `wake_up()` (the engine keeps its
compiled step; only CUDA graphs are recaptured) next to the one before.
`--parity`: greedy tokens and log-probs of TP `tp` against TP 1 on the same (consistent) weights of a
small random fp32 model (written to a temporary directory first), the fast paths on.
Prints one JSON line per TP size and writes them all to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM_TBPS = {"H200": 4.8, "H100": 3.35}
SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False),
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=1001, tie_word_embeddings=False),
}


def config_of(shape: str, max_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=max(max_len, 4096), rope_theta=1e6,
                       rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def weight_bytes(cfg, elem: int) -> int:
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    d = h // cfg.num_attention_heads
    per_layer = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2) + 3 * h * i
    return (layers * per_layer + cfg.vocab_size * h) * elem  # + lm_head


def kv_bytes_per_token(cfg, elem: int) -> int:
    d = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * elem


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model, tp_size: int, rank: int, device: str, dtype, cfg):
    from rlhfkit.rollout.builtin import BuiltinEngine
    from rlhfkit.rollout.builtin.model.tensor_parallel import make_group

    tp = make_group() if tp_size > 1 else None
    return BuiltinEngine(model, None, device=device, dtype=dtype, config=cfg, eos_token_ids=[], tp=tp)


def _requests(batch: int, plen: int, new: int, vocab: int, greedy: bool = False):
    from rlhfkit.types import GenerationRequest, SamplingParams

    g = torch.Generator().manual_seed(plen * 7919 + batch)
    ids = torch.randint(10, vocab, (batch, plen), generator=g)
    sp = SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=new, logprobs=True)
    return [GenerationRequest(r.tolist(), sp, i) for i, r in enumerate(ids)]


def _worker(rank: int, tp_size: int, port: int, job: dict, out_path: str) -> None:
    import torch.distributed as dist

    from rlhfkit.rollout.builtin import BuiltinEngineConfig

    if job.get("hang_dump_s"):
        import faulthandler

        faulthandler.dump_traceback_later(job["hang_dump_s"], exit=True)
    cuda = torch.cuda.is_available() and job["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    if tp_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp_size,
                                device_id=torch.device(device) if cuda else None)
        from rlhfkit.parallel.rendezvous import destroy_at_exit

        destroy_at_exit()
    dtype = getattr(torch, job["dtype"])
    b, plen, new = job["batch"], job["prompt"], job["new"]
    ecfg = BuiltinEngineConfig(max_num_seqs=b, max_model_len=plen + new + 8,
                               compile=bool(job.get("compile", True)) and cuda,
                               cuda_graphs=None if job.get("graphs", True) else False)
    model = job["model_dir"] or config_of(job["shape"], plen + new + 8)
    t0 = time.perf_counter()
    engine = _engine(model, tp_size, rank, device, dtype, ecfg)
    load_s = time.perf_counter() - t0
    if tp_size > 1 and rank > 0:
        engine.serve()
        os._exit(0)  # no destroy_process_group: with compiled collectives it hung (H100, NCCL 2.28)
    res = {"tp": tp_size, "load_s": load_s, "attention": engine.model.attn, "gemm": engine.model.gemm,
           "compiled": engine.runner.compiled, "graphs": engine.runner.cuda_graphs}
    reqs = _requests(b, plen, new, engine.spec.vocab_size, greedy=job["greedy"])
    t0 = time.perf_counter()
    engine.generate([type(r)(r.prompt_token_ids, type(r.params)(temperature=r.params.temperature,
                                                                  max_new_tokens=16), r.request_id) for r in reqs])
    res["warmup_s"] = time.perf_counter() - t0

    def timed():
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.generate(reqs)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, outs

    times, outs = [], None
    for _ in range(job["repeat"]):
        dt, outs = timed()
        times.append(dt)
    res["runs_s"] = times
    res["s"] = statistics.median(times)
    res["tok_s"] = b * new / res["s"]
    res["tok_s_per_gpu"] = res["tok_s"] / tp_size
    if job["sleep_check"]:
        t = time.perf_counter()
        engine.sleep(1)
        engine.wake_up()
        res["sleep_wake_s"] = time.perf_counter() - t
        res["after_wake_s"], _ = timed()
        res["after_wake_again_s"], _ = timed()
    if cuda:
        res["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        res["compile_error"] = engine.runner.compile_error
    if job["keep_outputs"]:
        res["outputs"] = [[c.token_ids, c.logprobs] for o in outs for c in o]
    engine.close()
    with open(out_path, "w") as f:
        json.dump(res, f)
    if tp_size > 1:
        os._exit(0)


def run_tp(tp_size: int, job: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.json")
        if tp_size == 1:
            _worker(0, 1, 0, job, out)
        else:
            mp.spawn(_worker, args=(tp_size, _free_port(), job, out), nprocs=tp_size, join=True)
        with open(out) as f:
            return json.load(f)


def roofline(job: dict, tp_size: int) -> dict:
    cfg = config_of(job["shape"], job["prompt"] + job["new"])
    elem = torch.empty((), dtype=getattr(torch, job["dtype"])).element_size()
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    bw = next((v for k, v in HBM_TBPS.items() if k in name), None)
    if bw is None:
        return {}
    ctx = job["prompt"] + job["new"] / 2
    step_bytes = weight_bytes(cfg, elem) + job["batch"] * kv_bytes_per_token(cfg, elem) * ctx
    tok_s = job["batch"] / (step_bytes / (tp_size * bw * 1e12))
    return {"roofline_tok_s": tok_s, "step_bytes_gb": step_bytes / 1e9, "hbm_tbps_per_gpu": bw}


PARITY_OPTS: dict = {}


def parity(tp_size: int, device: str) -> dict:
    """TP `tp_size` vs TP 1, greedy, fp32 (fast paths on), same weights from one directory."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        cfg = config_of("small", 256)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        job = dict(device=device, dtype="float32", batch=16, prompt=24, new=48, shape="small", model_dir=d,
                   repeat=1, sleep_check=False, keep_outputs=True, greedy=True, **PARITY_OPTS)
        one, many = run_tp(1, job), run_tp(tp_size, job)
    same = sum(a[0] == b[0] for a, b in zip(one["outputs"], many["outputs"]))
    gaps = [abs(x - y) for a, b in zip(one["outputs"], many["outputs"]) if a[0] == b[0] for x, y in zip(a[1], b[1])]
    return {"parity_tp": tp_size, "same_sequences": same, "sequences": len(one["outputs"]),
            "max_logprob_gap": max(gaps) if gaps else None,
            "tp_paths": {k: many.get(k) for k in ("attention", "gemm", "compiled", "graphs", "compile_error")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--model_dir", default=None, help="an HF directory instead of random weights of --shape")
    ap.add_argument("--tp", default="1", help="comma-separated TP sizes")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sleep_check", action="store_true")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--no_compile", action="store_true")
    ap.add_argument("--no_graphs", action="store_true")
    ap.add_argument("--hang_dump_s", type=float, default=0, help="dump every thread's stack and exit after this long")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    PARITY_OPTS.update(compile=not a.no_compile, graphs=not a.no_graphs, hang_dump_s=a.hang_dump_s)
    sizes = [int(x) for x in a.tp.split(",")]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows = []
    if a.parity:
        for n in sizes:
            rows.append({"device": gpu, **parity(n, a.device)})
            print(json.dumps(rows[-1]), flush=True)
    else:
        job = dict(device=a.device, dtype=a.dtype, batch=a.batch, prompt=a.prompt, new=a.new, shape=a.shape,
                   model_dir=a.model_dir, repeat=a.repeat, sleep_check=a.sleep_check, keep_outputs=False, greedy=False,
                   **PARITY_OPTS)
        for n in sizes:
            try:
                res = run_tp(n, job)
            except Exception as exc:  # noqa: BLE001 - one TP size failing leaves the others' numbers
                res = {"tp": n, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            res.update(device=gpu, gpus=n, shape=a.shape, batch=a.batch, prompt=a.prompt, new=a.new, dtype=a.dtype)
            rf = roofline(job, n)
            res.update(rf)
            if rf and "tok_s" in res:
                res["roofline_fraction"] = res["tok_s"] / rf["roofline_tok_s"]
            rows.append(res)
            print(json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
