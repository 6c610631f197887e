"""Time to the first GRPO step: how long train_ppo's first `train_step()` takes after the models load,
cold (empty compilation caches) and warm (the caches a previous run left).

    python bench/first_step.py --out first_step_h100.json            # cold, then warm, each a fresh process
    python bench/first_step.py --model tiny --device cpu --steps 2    # CPU smoke test

Each run is its own process (`--child`), so nothing compiled stays in memory between them; the
compilation caches are the only thing a warm run inherits. Cold: TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR point at new empty folders. Warm: the same folders again. The run builds
train_ppo's trainer from its own flags on bench/harness/models.py's random model (bench/rl_step.py's
inputs and batch: `--prompts` x `--n` completions of `--new_tokens` tokens), then times
`build_trainer` (model loads, engine build) and each of `--steps` train steps with its phases
(time/generate, time/train, ...). `--variant` runs can change the engine's settings (e.g.
`compile=False`) through RLHFKIT_ENGINE_OPTS-style overrides of the builtin engine config.

One JSON: the GPU, the settings, and per run (cold / warm / each variant) the build time, the first
step's wall time and phases, and the later steps' times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness


def child(a: argparse.Namespace) -> dict:
    from bench.harness.models import device_name, make_bench_model, random_prompt
    from bench.harness.rl_run import engine_batch, force_full_length, rlhfkit_argv, write_inputs
    from bench.harness.timing import sync

    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.cli.common import set_seed
    from rlhfkit.cli.train_ppo import build_parser
    from rlhfkit.rl_run.local import local_trainer
    from rlhfkit.parallel.dist import init_distributed

    t_start = time.perf_counter()
    model_dir = make_bench_model(a.model_dir, a.model)
    work = tempfile.mkdtemp(prefix="first_step_")
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [random_prompt(rng, a.prompt_len) for _ in range(a.prompts * (a.steps + 1))]
    reward, data = write_inputs(work, prompts)
    parsed = build_parser().parse(rlhfkit_argv(a, model_dir, data, reward, work, a.prompts))
    dist = init_distributed(parsed.device)
    args = resolve(parsed, dist.world_size)
    set_seed(args.seed)
    opts = json.loads(a.engine_opts) if a.engine_opts else {}
    t0 = time.perf_counter()
    with engine_batch(a.prompts * a.n), _engine_options(opts):
        trainer, placement = local_trainer(args, dist)
    sync(a.device)
    build_s = time.perf_counter() - t0
    force_full_length(trainer)
    steps = []
    for _ in range(a.steps):
        sync(a.device)
        t0 = time.perf_counter()
        m = trainer.train_step()
        trainer.state.step += 1
        sync(a.device)
        steps.append({"wall_s": time.perf_counter() - t0,
                      **{k: m[k] for k in ("time/generate", "time/train", "time/logprobs", "time/weight_sync",
                                           "time/reward") if k in m}})
    engine = placement.engine
    out = {"device": device_name(a.device), "build_trainer_s": build_s, "first_step_s": steps[0]["wall_s"],
           "steps": steps, "process_s": time.perf_counter() - t_start, "engine_opts": opts}
    runner = getattr(engine, "runner", None)
    if runner is not None:
        out.update(engine_compiled=runner.compiled, engine_graphs=runner.captures,
                   engine_compile_error=runner.compile_error)
    close = getattr(engine, "close", None)
    if callable(close):
        close()
    trainer.logger.close()
    return out


class _engine_options:
    """Bench-only: builtin engine config overrides (e.g. {"compile": false}) while the trainer is built."""

    def __init__(self, opts: dict) -> None:
        self.opts = opts

    def __enter__(self) -> None:
        import rlhfkit.rollout as R

        self.R, self.orig = R, R.build_engine
        if self.opts:
            def build(name, *args, **kw):
                if name == "builtin":
                    kw.update(self.opts)
                return self.orig(name, *args, **kw)

            R.build_engine = build

    def __exit__(self, *exc) -> None:
        self.R.build_engine = self.orig


def run_child(a: argparse.Namespace, caches: str, engine_opts: dict | None = None) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--model_dir", a.model_dir,
            "--prompts", str(a.prompts), "--n", str(a.n), "--prompt_len", str(a.prompt_len),
            "--new_tokens", str(a.new_tokens), "--steps", str(a.steps), "--device", a.device,
            "--engine_opts", json.dumps(engine_opts or {})]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    return {**json.loads(line), "wall_incl_imports_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "first_step_model"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--engine_opts", default="")
    p.add_argument("--variants", default="", help="JSON list of builtin engine option dicts, each run cold then warm")
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.model = a.model or ("qwen2-0.5b" if a.device == "cuda" else "tiny")
    # bench/rl_step.py's flags for rlhfkit_argv
    for k, v in dict(micro_train_batch_size=64, micro_rollout_batch_size=64, gradient_checkpointing=False,
                     adam_offload=False, lr=1e-6, seed=0, rlhfkit_flags="", max_num_seqs=0,
                     total_steps=a.steps + 1, rollout_engine="builtin").items():
        setattr(a, k, v)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    variants = [{}] + (json.loads(a.variants) if a.variants else [])
    res = {"bench": "first_step", "model": a.model, "prompts": a.prompts, "n": a.n, "prompt_len": a.prompt_len,
           "new_tokens": a.new_tokens, "runs": []}
    for opts in variants:
        caches = tempfile.mkdtemp(prefix="first_step_caches_")
        for kind in ("cold", "warm"):
            run = {"kind": kind, "engine_opts": opts, **run_child(a, caches, opts)}
            res["runs"].append(run)
            print(json.dumps({k: run.get(k) for k in ("kind", "engine_opts", "device", "build_trainer_s",
                                                       "first_step_s", "error")}), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    base = [r for r in res["runs"] if not r["engine_opts"] and "error" not in r]
    for r in base:
        res[f"first_step_{r['kind']}_s"] = r["first_step_s"]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
