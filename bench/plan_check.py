"""What train_ppo_ray's memory plan says about a model shape on this host, without loading anything.

    python bench/plan_check.py --shape qwen2.5-14b --gpus 4 [--device_gib 79.2] --out plan.json

For each layout of `LAYOUTS` (colocated on every GPU, with and without sleep, with --adam_offload), GRPO
32 x 8 x 512 (prompt 128), ZeRO-3, gradient checkpointing: the plan's table and its verdict as
train_ppo_ray prints them before any actor starts (a refusal with the flags that would fit, or the
note naming a larger token budget). The GPU's memory is this host's GPU 0 unless --device_gib is given.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.models import STREAMED  # noqa: E402

LAYOUTS = {
    "colocated": ["--colocate_all_models"],
    "colocated_sleep": ["--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep"],
    "colocated_sleep_adam_offload": ["--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep",
                                     "--adam_offload"],
}


def write_inputs(work: str) -> None:
    """The prompt file and reward function the flags name (train_ppo_ray checks both exist)."""
    with open(os.path.join(work, "p.jsonl"), "w") as f:
        f.write(json.dumps({"input": "1 + 1 ="}) + "\n")
    with open(os.path.join(work, "r.py"), "w") as f:
        f.write("def reward_func(queries, prompts, labels):\n    return [0.0 for _ in queries]\n")


def verdict(shape: str, gpus: int, tp: int, flags: list[str], device_bytes: int, work: str) -> dict:
    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.cli import train_ppo_ray as R
    from rlhfkit.cli.common import UsageError
    from rlhfkit.rl_run.memory_check import check_memory

    argv = ["--pretrain", work, "--prompt_data", os.path.join(work, "p.jsonl"), "--remote_rm_url",
            os.path.join(work, "r.py"), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "32", "--train_batch_size", "256", "--micro_train_batch_size", "4",
            "--micro_rollout_batch_size", "16", "--prompt_max_len", "128", "--generate_max_len", "512",
            "--zero_stage", "3", "--gradient_checkpointing", "--actor_num_gpus_per_node", str(gpus),
            "--vllm_num_engines", str(gpus // tp), "--vllm_tensor_parallel_size", str(tp),
            "--save_path", os.path.join(work, "out"), "--device", "cuda", *flags]
    args = resolve(R.build_parser().parse(argv), gpus)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            check_memory(args, {"policy": gpus}, device_bytes)
            refused = None
        except UsageError as e:
            refused = str(e)
    return {"shape": shape, "gpus": gpus, "engine_tp": tp, "flags": flags, "printed": out.getvalue(),
            "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-14b", choices=sorted(STREAMED))
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--device_gib", type=float, default=None, help="one GPU's memory (default: this host's GPU 0)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.device_gib:
        device_bytes, device = int(a.device_gib * 2**30), f"{a.device_gib} GiB (given)"
    else:
        import torch

        props = torch.cuda.get_device_properties(0)
        device_bytes, device = props.total_memory, props.name
    rows = []
    with tempfile.TemporaryDirectory() as work:
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump({**STREAMED[a.shape], "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, f)
        write_inputs(work)
        for tp in a.tp:
            for name, flags in LAYOUTS.items():
                row = verdict(a.shape, a.gpus, tp, flags, device_bytes, work)
                rows.append({"layout": name, **row})
                print(f"{a.shape} x {a.gpus} GPUs, engines TP {tp}, {name}: "
                      f"{'refused: ' + row['refused'] if row['refused'] else 'fits'}", flush=True)
    result = {"bench": "plan_check", "device": device, "device_gib": device_bytes / 2**30, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
