"""One GRPO step of a vision-language model on Ray: step time, phases, generation speed, GPU memory.

    python bench/rl_step_vlm.py --shape qwen2.5-vl-7b --ray_gpus 4 --prompts 32 --n 8 --new_tokens 256 \
        --steps 2 --out rl_step_vlm_h200x4.json
    python bench/rl_step_vlm.py --shape tiny --device cpu --ray_gpus 2 --prompts 2 --n 2 --new_tokens 4 \
        --picture 56 --steps 1 --out /tmp/rl_step_vlm_cpu.json          # CPU workers, 2 slots
    python bench/rl_step_vlm.py --shape qwen2.5-vl-7b --write_model_only --model_dir /tmp/vlm7b

What runs: train_ppo_ray's trainer, built in this process as `train_ppo_ray`'s RayLayout builds it (its flag
parsing, checks, memory plan, placement and Ray groups: harness/ray_step.py's `launch_trainer`), with
`--colocate_all_models` over `--ray_gpus` slots: `--ray_gpus` FSDP2 policy ranks and
`--ray_gpus / --engine_tp` builtin engines of tensor-parallel size `--engine_tp` on the same GPUs,
nothing sleeping. GRPO (`--advantage_estimator group_norm`), `--prompts` prompts x `--n` samples a
step, one optimizer step a step, no reference model (KL coefficient 0), every completion exactly
`--new_tokens` tokens (eos banned until then, as bench/rl_step.py does), bf16 compute with fp32
master weights on GPU, `--gradient_checkpointing on|off` (on by default), `--freeze_visual_encoder`
optional. `--warmup_steps` untimed steps (CUDA graphs, compilation) and `--steps` timed ones.

Inputs, written here, offline:
- the model directory (`--model_dir`, reused when it holds a finished model): transformers' Qwen2.5-VL
  built from the `--shape` config of bench/rollout_vlm.py (qwen2.5-vl-7b: Qwen2.5-VL-7B-Instruct's
  language model and 32-block vision tower; tiny: 2 layers of width 64, a 512-entry vocabulary) with
  random weights (bf16 on GPU, fp32 on CPU), `save_pretrained`;
  a character-level tokenizer covering the whole vocabulary (printable characters, the ChatML and
  vision tokens, filler tokens: any sampled id decodes) with a chat template that renders image
  parts; and Qwen2-VL's image processor configuration with the vision config's patch, merge and
  temporal sizes and Qwen2.5-VL's pixel bounds (56 x 56 to 12845056 pixels), so a P x P picture
  is (P / 28)^2 picture tokens;
- prompts: rlhfkit.tasks.shapes pictures of `--picture` pixels ("What colour is the background?",
  chat template on, one picture a prompt, fresh pictures every step);
- the reward file: a score in [0, 1) fixed by the response text (its CRC-32), so the samples of a
  group differ and every step trains (a random model is never right).

Prints one JSON line and writes it to `--out` (rewritten after every step; `"complete": false` until
the end, `"error"` when the run failed or was stopped by SIGTERM): device name and count, shape,
step_s and each step's seconds, the loop's phases (generate, reward, logprobs, train, weight_sync)
per step and their means, `gen_tokens_per_s` (completion tokens over the generate phase, vision
tower and prefill included), picture and prompt tokens per prompt (read from the step's
trajectories), NVML peak used memory of every GPU over the timed steps (`gpu_peak_mem_gb`; every process) and each actor's torch peaks
(`memory_steps`), the memory plan train_ppo_ray printed against them (`memory_check`), and the
weight-sync figures. With one optimizer step a rollout and no reference model the loop takes the old
log-probs from the training pass: `logprobs` is near zero unless `--recompute_old_logprobs`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))  # the repository: rlhfkit, bench.harness

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
               ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(_k, _v)

from bench.harness.models import ENDOFTEXT, IM_END, IM_START, filler_vocab  # noqa: E402
from bench.harness.vlm_shapes import SHAPES as ROLLOUT_SHAPES  # noqa: E402

PHASES = ("generate", "reward", "logprobs", "train", "weight_sync")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VOCAB = {"qwen2.5-vl-7b": None, "tiny": 512}  # None: the shape's own; tiny: a small one for CPU
PIXELS = (56 * 56, 12845056)  # Qwen2.5-VL's image processor bounds
DONE = ".bench_complete"
REWARD_SRC = '''"""Bench reward: a score in [0, 1) fixed by the response text (its CRC-32), so the samples of a
group differ and every GRPO step trains."""
import zlib


def reward_func(queries, prompts, labels):
    out = []
    for q, p in zip(queries, prompts):
        response = q[len(p):] if q.startswith(p) else q
        out.append((zlib.crc32(response.encode("utf-8")) % 1000) / 1000)
    return {"rewards": out, "scores": out}
'''


# ----------------------------------------------------------------------------- model directory

def shape_config(shape: str) -> tuple[dict, dict]:
    """(text_config, vision_config) kwargs of the shape (bench/harness/vlm_shapes.py), vocabulary resized."""
    spec = copy.deepcopy(ROLLOUT_SHAPES[shape])
    text, vision = spec["text_config"], spec["vision_config"]
    if VOCAB[shape]:
        text["vocab_size"] = VOCAB[shape]
    return text, vision


def build_tokenizer(vocab_size: int) -> Any:
    """A fast character tokenizer with exactly `vocab_size` ids: harness/models.py's filler vocabulary (ChatML
    markers, printable characters, "<tN>" fillers) with the four vision tokens as its last ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from rlhfkit.models.tiny_vlm import VLM_CHAT_TEMPLATE

    vocab = filler_vocab(vocab_size - len(VISION_SPECIALS))
    for t in VISION_SPECIALS:
        vocab[t] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([ENDOFTEXT, IM_START, IM_END, *VISION_SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  additional_special_tokens=[IM_START, *VISION_SPECIALS], padding_side="right")
    tok.chat_template = VLM_CHAT_TEMPLATE
    if len(tok) != vocab_size:
        raise AssertionError(f"tokenizer has {len(tok)} ids, expected {vocab_size}")
    return tok


def image_processor_config(vision: dict) -> dict:
    """Qwen2-VL's image processor with the vision tower's patch / merge / temporal sizes and Qwen2.5-VL's
    pixel bounds (the tiny VLM's file, bounds widened)."""
    from rlhfkit.models.tiny_vlm import image_processor_config as tiny

    cfg = tiny("qwen2_5_vl")
    lo, hi = PIXELS
    cfg.update(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
               temporal_patch_size=vision["temporal_patch_size"], min_pixels=lo, max_pixels=hi,
               size={"shortest_edge": lo, "longest_edge": hi})
    return cfg


def write_vlm_model(path: str, shape: str, device: str, seed: int = 0) -> dict:
    """The shape's Qwen2.5-VL with random weights, its tokenizer and image processor at `path` (written to a
    sibling folder, then renamed; a finished directory is reused) -> {seconds, parameters, reused}."""
    if os.path.exists(os.path.join(path, DONE)):
        return {"seconds": 0.0, "reused": True}
    from transformers import AutoConfig, AutoModelForImageTextToText

    t0 = time.perf_counter()
    text, vision = shape_config(shape)
    tok = build_tokenizer(text["vocab_size"])
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("vision_start_token_id", VISION_SPECIALS[0]), ("vision_end_token_id", VISION_SPECIALS[1]),
            ("image_token_id", VISION_SPECIALS[2]), ("video_token_id", VISION_SPECIALS[3]))}
    text.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    cfg = AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    params = sum(p.numel() for p in model.parameters())
    tmp = f"{path.rstrip(os.sep)}.writing"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "preprocessor_config.json"), "w") as f:
        json.dump(image_processor_config(vision), f, indent=2)
    with open(os.path.join(tmp, DONE), "w") as f:
        f.write(shape + "\n")
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    return {"seconds": time.perf_counter() - t0, "parameters": params, "reused": False}


# ----------------------------------------------------------------------------- prompts and reward

def write_inputs(work: str, rows: int, picture: int, seed: int) -> tuple[str, str]:
    """`rows` shapes prompts with `picture`-pixel pictures and the reward file -> (data path, reward path)."""
    from rlhfkit.tasks.shapes import shapes_rows

    data = os.path.join(work, "shapes_prompts.jsonl")
    with open(data, "w") as f:
        for r in shapes_rows(rows, work, "bench", seed, size=picture):
            f.write(json.dumps({"prompt": r["prompt"], "images": r["images"], "label": r["label"]}) + "\n")
    reward = os.path.join(work, "bench_reward.py")
    with open(reward, "w") as f:
        f.write(REWARD_SRC)
    return data, reward


def picture_tokens(picture: int, vision: dict) -> int:
    """Picture tokens of a square picture the processor keeps at its size: (side / (patch x merge))^2."""
    side = vision["patch_size"] * vision["spatial_merge_size"]
    return (picture // side) ** 2


# ----------------------------------------------------------------------------- the run

def train_argv(a: argparse.Namespace, model_dir: str, data: str, reward: str, work: str) -> list[str]:
    """train_ppo_ray's flags of the run."""
    from bench.harness.rl_run import micro

    total = a.prompts * a.n
    per_rank = total // a.ray_gpus
    gpu = a.device.startswith("cuda")
    _, vision = shape_config(a.shape)
    argv = ["--pretrain", model_dir, "--remote_rm_url", reward, "--prompt_data", data,
            "--input_key", "prompt", "--label_key", "label", "--apply_chat_template",
            "--image_key", "images", "--max_images_per_prompt", "1",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(a.n),
            "--rollout_batch_size", str(a.prompts), "--train_batch_size", str(total),
            "--micro_train_batch_size", str(micro(per_rank, a.micro_train_batch_size)),
            "--micro_rollout_batch_size", str(micro(per_rank, a.micro_rollout_batch_size)),
            "--init_kl_coef", "0", "--generate_max_len", str(a.new_tokens),
            "--prompt_max_len", str(picture_tokens(a.picture, vision) + 128),
            "--max_steps", str(a.warmup_steps + a.steps), "--actor_learning_rate", str(a.lr), "--lr_warmup_ratio", "0",
            "--temperature", "1.0", "--seed", str(a.seed), "--param_dtype", "bf16" if gpu else "fp32",
            "--device", a.device, "--disable_progress",
            "--save_path", os.path.join(work, "ckpt"), "--run_dir", os.path.join(work, "run"),
            "--ray_address", "local", "--ray_num_cpus_per_worker", str(a.ray_num_cpus_per_worker),
            "--weight_sync", a.weight_sync, "--weight_sync_bucket_mb", str(a.weight_sync_bucket_mb),
            "--colocate_all_models", "--actor_num_gpus_per_node", str(a.ray_gpus),
            "--vllm_num_engines", str(a.ray_gpus // a.engine_tp),
            "--vllm_tensor_parallel_size", str(a.engine_tp)]
    if a.gradient_checkpointing == "on":
        argv.append("--gradient_checkpointing")
    if a.freeze_visual_encoder:
        argv.append("--freeze_visual_encoder")
    if a.recompute_old_logprobs:
        argv.append("--recompute_old_logprobs")
    return argv + shlex.split(a.extra)


def prompt_figures(trainer: Any, image_token_id: int) -> dict:
    """Prompt and picture tokens per prompt, from the last step's trajectories (what the model saw)."""
    trajs = getattr(trainer, "_samples", None) or []
    if not trajs:
        return {"prompt_tokens": None, "picture_tokens": None}
    from bench.harness.timing import mean

    return {"prompt_tokens": mean([float(t.prompt_len) for t in trajs]),
            "picture_tokens": mean([float(sum(1 for i in t.token_ids[:t.prompt_len] if i == image_token_id))
                                    for t in trajs])}


def device_info(device: str) -> tuple[str, int]:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    from bench.harness.models import device_name

    return device_name("cpu"), 0


def timed_steps(a: argparse.Namespace, trainer: Any, launched: Any, report: dict) -> tuple[list[float], list[dict]]:
    """`--warmup_steps` untimed + `--steps` timed `train_step()` calls -> (wall times, metrics with each step's
    actor memory peaks under "_memory"); a progress line per step, the report rewritten after each."""
    from bench.harness.ray_step import memory_step

    walls: list[float] = []
    metrics: list[dict] = []
    report["warmup_s_each"] = []
    for i in range(a.warmup_steps + a.steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        trainer.state.step += 1
        wall = time.perf_counter() - t0
        warm = i < a.warmup_steps
        split = " ".join(f"{k}={m.get(f'time/{k}', 0.0):.2f}" for k in PHASES)
        print(f"[rl_step_vlm] step {i}{' (warm-up)' if warm else ''} {wall:.2f} s ({split}; reward "
              f"{m.get('reward', 0.0):.3f}, {m.get('weight_sync_mb', 0.0):.0f} MB synced)", flush=True)
        memory = memory_step(launched)  # also resets the actors' peaks
        if warm:
            report["warmup_s_each"].append(wall)
        else:
            walls.append(wall)
            metrics.append(dict(m, _memory=memory))
            report.update(step_s_each=walls, phases_each=[{p: x.get(f"time/{p}") for p in PHASES} for x in metrics])
        write(a, report)
    return walls, metrics


def run(a: argparse.Namespace, work: str, report: dict) -> None:
    """Model, inputs, Ray, the trainer; warm-up + timed steps, `report` updated (and written) as it goes."""
    import ray
    from transformers import AutoConfig

    from bench.harness.ray_step import (GpuMemoryPeak, launch_trainer, measured_vs_plan, nvml_processes, ray_summary,
                                        start_ray)
    from bench.harness.rl_run import force_full_length, summarize_rlhfkit

    model_dir = a.model_dir or os.path.join(work, f"model_{a.shape}")
    report["model_write"] = write_vlm_model(model_dir, a.shape, a.device, a.seed)
    image_token_id = AutoConfig.from_pretrained(model_dir).image_token_id
    data, reward = write_inputs(work, a.prompts * (a.warmup_steps + a.steps + 1), a.picture, a.seed)
    argv = train_argv(a, model_dir, data, reward, work)
    report["argv"] = argv
    write(a, report)
    started = start_ray(a)
    launched = None
    try:
        print(f"[rl_step_vlm] launching on {ray.cluster_resources()}", flush=True)
        args, launched, trainer, launch_s, memory_plan = launch_trainer(a, argv)
        print(f"[rl_step_vlm] launched in {launch_s:.1f} s; weight sync {launched.weight_sync.describe()}", flush=True)
        report["launch_s"] = launch_s
        report["min_new_tokens"] = force_full_length(trainer)
        with GpuMemoryPeak() as mem:
            walls, metrics = timed_steps(a, trainer, launched, report)
        steps_mem = [m.pop("_memory") for m in metrics]
        trainer.logger.close()
        report.update(summarize_rlhfkit(walls, metrics, a.prompts * a.n))
        report.update(ray_summary(metrics, launched, launch_s))
        report.update(prompt_figures(trainer, image_token_id))
        report.update(micro_train_batch_size=args.micro_train_batch_size,
                      micro_rollout_batch_size=args.micro_rollout_batch_size,
                      old_logprobs_pass_each=[m.get("old_logprobs_pass") for m in metrics],
                      gpu_peak_mem_gb=mem.peaks_gb, memory_plan=memory_plan, memory_steps=steps_mem,
                      memory_processes_gib=nvml_processes())
        report["memory_check"] = measured_vs_plan(memory_plan, steps_mem, mem.peaks_gb, report["placement"])
    finally:
        if launched is not None:
            launched.shutdown()
        if started:
            ray.shutdown()


def write(a: argparse.Namespace, report: dict) -> None:
    if a.out:
        out = a.out if os.sep in a.out else os.path.join(BENCH, "results", a.out)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-vl-7b", choices=sorted(VOCAB))
    ap.add_argument("--model_dir", default=None, help="where the random model is written (reused when finished)")
    ap.add_argument("--write_model_only", action="store_true", help="write --model_dir and exit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ray_gpus", type=int, default=4, help="colocated slots: policy ranks = GPUs (CPU workers)")
    ap.add_argument("--engine_tp", type=int, default=1, help="tensor-parallel size of each engine")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per RL step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new_tokens", type=int, default=256, help="tokens per completion (all run to the limit)")
    ap.add_argument("--picture", type=int, default=448, help="picture side in pixels (a multiple of 28)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps")
    ap.add_argument("--warmup_steps", type=int, default=1, help="untimed steps first")
    ap.add_argument("--micro_train_batch_size", type=int, default=8, help="per policy rank (largest divisor <= it)")
    ap.add_argument("--micro_rollout_batch_size", type=int, default=16, help="per policy rank")
    ap.add_argument("--gradient_checkpointing", default="on", choices=["on", "off"])
    ap.add_argument("--freeze_visual_encoder", action="store_true", help="train_ppo_ray --freeze_visual_encoder")
    ap.add_argument("--recompute_old_logprobs", action="store_true", help="train_ppo_ray --recompute_old_logprobs")
    ap.add_argument("--weight_sync", default="auto", choices=["auto", "object_store", "broadcast", "ipc"])
    ap.add_argument("--weight_sync_bucket_mb", type=int, default=256)
    ap.add_argument("--ray_object_store_gb", type=float, default=4.0, help="object store of the local Ray")
    ap.add_argument("--ray_num_cpus_per_worker", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", default="", help="more train_ppo_ray flags, one string")
    ap.add_argument("--out", default=None, help="JSON file (bench/results/ when a bare name)")
    a = ap.parse_args(argv)
    for name in ("prompts", "new_tokens", "steps", "ray_gpus", "engine_tp"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.n < 2:
        ap.error("--n must be >= 2 (GRPO groups)")
    if a.warmup_steps < 0:
        ap.error("--warmup_steps must be >= 0")
    if a.picture % 28 or a.picture < 56:
        ap.error("--picture must be a multiple of 28, at least 56 (14-pixel patches merged 2 x 2)")
    if a.ray_gpus % a.engine_tp:
        ap.error(f"--ray_gpus {a.ray_gpus} must be a multiple of --engine_tp {a.engine_tp}")
    if (a.prompts * a.n) % a.ray_gpus:
        ap.error(f"--prompts x --n ({a.prompts * a.n}) must be a multiple of --ray_gpus {a.ray_gpus}")
    if a.write_model_only and not a.model_dir:
        ap.error("--write_model_only needs --model_dir")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.write_model_only:
        print(json.dumps({"model_dir": a.model_dir, **write_vlm_model(a.model_dir, a.shape, a.device, a.seed)}))
        return 0
    name, count = device_info(a.device)
    _, vision = shape_config(a.shape)
    report: dict[str, Any] = {
        "bench": "rl_step_vlm", "device": name, "device_count": count, "shape": a.shape, "ray_gpus": a.ray_gpus,
        "engines": a.ray_gpus // a.engine_tp, "engine_tp": a.engine_tp, "prompts": a.prompts, "n": a.n,
        "completions": a.prompts * a.n, "new_tokens": a.new_tokens, "picture_px": a.picture,
        "expected_picture_tokens": picture_tokens(a.picture, vision), "warmup_steps": a.warmup_steps,
        "timed_steps": a.steps, "gradient_checkpointing": a.gradient_checkpointing == "on",
        "freeze_visual_encoder": a.freeze_visual_encoder, "compute_dtype": "bf16" if a.device.startswith("cuda")
        else "fp32", "complete": False, "versions": {"torch": torch.__version__}}
    t0 = time.perf_counter()
    rc = 0

    def on_term(signum: int, frame: Any) -> None:  # `timeout` stops the run: shut the actors, keep the JSON
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    with tempfile.TemporaryDirectory(prefix="rl_step_vlm_") as work:
        try:
            run(a, work, report)
            report["complete"] = True
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the bench records the failure in its JSON
            traceback.print_exc()
            report["error"] = f"{type(e).__name__}: {e}"[:2000]
            rc = 1
    report["run_wall_s"] = time.perf_counter() - t0
    import transformers

    report["versions"]["transformers"] = transformers.__version__
    write(a, report)
    print(json.dumps(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
