"""A GRPO run of a large model under train_ppo_ray, checkpointed, resumed and exported (issue 13).

    python bench/scale_ckpt.py --model_dir /tmp/qwen2.5-7b --work /tmp/ckpt7b --out scale_ckpt.json \
        --flags "--actor_num_gpus_per_node 4 --vllm_num_engines 4 --colocate_all_models"

Run A: `train_ppo_ray` for 3 steps with `--save_steps 2` (a sharded DCP checkpoint after step 2,
each policy rank writing its own shard) and the final policy exported to Hugging Face format
(streamed into <= 5 GB safetensors files). Run B: the same command with `--load_checkpoint`
resumes after step 2 and runs step 3. The resumed step 3 must equal run A's (same sampled
tokens, same loss). With `--noise_run`, run C resumes from the same checkpoint again: on a GPU, whose
kernels are not bit-reproducible, the resume's difference from run A is judged against run C's from
run B (`noise_max_rel_diff`). Then the export is loaded with `AutoModelForCausalLM.from_pretrained` on one
GPU and scores one prompt (finite logits, parameter count).

Reported: run A's per-step wall time and phase split (the loop's `time/*`), weight-sync MB and
seconds, the peak memory of each GPU (NVML, all processes), the checkpoint's size and the seconds
to save / load it, the export's files and seconds, and run B's step 3 next to run A's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: rlhfkit, bench.harness

COMPARE = ("train/policy_loss", "train/reward", "train/response_length", "train/grad_norm", "train/entropy", "train/kl")


def _dir_gb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 1e9


class _Timer:
    """Wraps `obj.name` to add its wall time to `seconds[key]`."""

    def __init__(self, obj, name: str, key: str, seconds: dict) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed)


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference over the COMPARE metrics both steps logged."""
    return max((abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in COMPARE
                if isinstance(a.get(k), float) and isinstance(b.get(k), float)), default=0.0)


def run(argv: list[str]) -> None:
    from rlhfkit.cli import train_ppo_ray

    train_ppo_ray.main(argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--flags", default="--actor_num_gpus_per_node 4 --vllm_num_engines 4 --colocate_all_models")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=512)
    ap.add_argument("--micro_train_batch_size", type=int, default=4)
    ap.add_argument("--noise_run", action="store_true",
                    help="run C: run B again (a second resume from the same checkpoint); its step 3 against run B's "
                         "is the run-to-run noise the resume's difference is judged against (GPU kernels are not "
                         "bit-reproducible)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()


    import torch

    from bench.harness.models import random_prompt
    from bench.harness.ray_step import GpuMemoryPeak, start_ray
    from bench.harness.rl_run import write_inputs

    os.makedirs(a.work, exist_ok=True)
    rng = __import__("numpy").random.default_rng(0)
    prompts = [random_prompt(rng, a.prompt_len) for _ in range(a.prompts * 3)]
    reward, data = write_inputs(a.work, prompts)
    ckpt = os.path.join(a.work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    base = ["--pretrain", a.model_dir, "--remote_rm_url", reward, "--prompt_data", data, "--input_key", "input",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(a.n),
            "--rollout_batch_size", str(a.prompts), "--train_batch_size", str(a.prompts * a.n),
            "--micro_train_batch_size", str(a.micro_train_batch_size), "--micro_rollout_batch_size", "16",
            "--init_kl_coef", "0", "--generate_max_len", str(a.new_tokens), "--prompt_max_len", str(a.prompt_len + 8),
            "--max_steps", "3", "--actor_learning_rate", "1e-6", "--param_dtype", "bf16", "--gradient_checkpointing",
            "--disable_progress", "--save_steps", "2", "--ckpt_path", ckpt, "--max_ckpt_num", "1",
            "--ray_address", "local", "--ray_num_cpus_per_worker", "1", "--seed", "0",
            *a.flags.split()]
    from rlhfkit.rl_run import builders as S
    from rlhfkit.rl_run import root as R

    seconds: dict[str, float] = {}
    _Timer(S.RLCheckpointer, "save", "ckpt_save_s", seconds)
    _Timer(S.RLCheckpointer, "load", "ckpt_load_s", seconds)
    _Timer(R, "save_final", "hf_export_s", seconds)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out: dict = {"device": gpu, "gpus": torch.cuda.device_count(), "flags": a.flags, "prompts": a.prompts, "n": a.n,
                 "new_tokens": a.new_tokens, "model_dir": a.model_dir}

    class _A:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        ray_object_store_gb = 8.0
    started = start_ray(_A)
    try:
        run_a = os.path.join(a.work, "run_a")
        t0 = time.perf_counter()
        with GpuMemoryPeak() as mem:
            run(base + ["--save_path", os.path.join(a.work, "hf_a"), "--run_dir", run_a])
        out["run_a_s"] = time.perf_counter() - t0
        out["gpu_peak_mem_gb"] = mem.peaks_gb
        out["ckpt_save_s"] = seconds.pop("ckpt_save_s", None)
        out["hf_export_s"] = seconds.pop("hf_export_s", None)
        out["ckpt_gb"] = _dir_gb(ckpt)
        hf = os.path.join(a.work, "hf_a")
        out["hf_files"] = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
        out["hf_gb"] = _dir_gb(hf)
        run_b = os.path.join(a.work, "run_b")
        t0 = time.perf_counter()
        run(base + ["--load_checkpoint", "--save_path", os.path.join(a.work, "hf_b"), "--run_dir", run_b])
        out["run_b_s"] = time.perf_counter() - t0
        out["ckpt_load_s"] = seconds.pop("ckpt_load_s", None)
        if a.noise_run:
            run_c = os.path.join(a.work, "run_c")
            run(base + ["--load_checkpoint", "--save_path", os.path.join(a.work, "hf_c"), "--run_dir", run_c])
            shutil.rmtree(os.path.join(a.work, "hf_c"), ignore_errors=True)
    finally:
        if started:
            import ray

            ray.shutdown()
    ra = [json.loads(x) for x in open(os.path.join(run_a, "metrics.jsonl"))]
    rb = [json.loads(x) for x in open(os.path.join(run_b, "metrics.jsonl"))]
    out["steps_a"] = [{k: v for k, v in r.items() if k.startswith("time/") or k in ("step", "train/weight_sync_mb")}
                      for r in ra]
    a3 = next(r for r in ra if r["step"] == 3)
    b3 = next(r for r in rb if r["step"] == 3)
    out["step3_uninterrupted"] = {k: a3.get(k) for k in COMPARE}
    out["step3_resumed"] = {k: b3.get(k) for k in COMPARE}
    out["resume_equal"] = all(a3.get(k) == b3.get(k)
                              for k in ("train/policy_loss", "train/reward", "train/response_length"))
    out["resume_max_rel_diff"] = max_rel_diff(a3, b3)
    if a.noise_run:
        c3 = next(r for r in (json.loads(x) for x in open(os.path.join(run_c, "metrics.jsonl"))) if r["step"] == 3)
        out["step3_resumed_again"] = {k: c3.get(k) for k in COMPARE}
        out["noise_max_rel_diff"] = max_rel_diff(b3, c3)  # the same resume twice: what the GPU alone changes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(a.work, "hf_a"), dtype=torch.bfloat16).to(
        "cuda:0" if torch.cuda.is_available() else "cpu")
    out["hf_load_s"] = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(os.path.join(a.work, "hf_a"))
    ids = tok(prompts[0], return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        logits = model(ids).logits.float()
    out["hf_params"] = sum(p.numel() for p in model.parameters())
    out["hf_logits_finite"] = bool(torch.isfinite(logits).all())
    print(json.dumps(out), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
