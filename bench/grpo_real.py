"""GRPO on a pretrained model with a verifiable task, rlhfkit beside TRL's GRPOTrainer: held-out accuracy
before and after, reward and accuracy curves, step times and whole-run wall times, in one JSON.

    python bench/grpo_real.py --model_dir .cache/models/smollm2-135m-instruct --out bench/results/grpo_real_h100.json
    python bench/grpo_real.py --smoke --out /tmp/grpo_real_smoke.json      (CPU: 2 steps of 4 x 4 samples, SMOKE)

Task: "What is a+b? Answer with the number only." for two-digit a and b, as the user turn of the model's
chat template; the reward is 1 when the last integer in the completion equals a + b, else 0 (REWARD_SRC,
one function for both sides). Training and held-out questions are disjoint; training draws each training
question once (`--prompts` x `--steps` of them), each side in its own seeded order.

Both sides get the same model folder, questions, reward, batch (`--prompts` x `--n` completions a step,
one optimizer step per RL step), steps, AdamW (lr constant, no warm-up, betas 0.9 / 0.999, no weight
decay, gradient norm clipped at 1), PPO clip 0.2, no KL term, sampling (`--temperature`, top-p 1, no
top-k, at most `--new_tokens` tokens, ending at the tokenizer's eos), and on GPU bf16 compute with fp32
weights in the optimizer (no gradient checkpointing on either side). Group-normalised advantages
(r - mean) / std on both; both divide the policy loss by the batch's completion tokens (TRL's default
loss_type "dapo").

rlhfkit: `python -m rlhfkit.cli.train_ppo`'s flags (rlhfkit_argv), parsed and checked by the command's
own parser and `rl_run.resolve.resolve`, the trainer built by `rl_run.local.local_trainer`, then one `train_step()` per
step as `fit()` runs them (rl_step.py does the same); the builtin engine generates. TRL: `GRPOTrainer`
(transformers generate), steps timed between `on_step_end` callbacks.

Accuracy: one evaluator for everything (GreedyEval): greedy decoding of the `--eval_prompts` held-out
questions with transformers' generate (left-padded batches; bf16 on GPU), the answer's last integer
against a + b. `accuracy_before` is the model folder's; each side's curve (every `--eval_every` steps)
and final accuracy load that side's current weights into the evaluator's model.

Times: `step_s_each` is every step's wall time, the first one included; `wall_s` runs from the start of
building the trainer (model loading, engine) to the end of the last step, evaluation time left out (it is
recorded as `eval_s`). `wall_ratio` = rlhfkit's wall_s / TRL's.

`--skip_trl` / `--skip_rlhfkit` run one side; an `--out` file already holding the other side's record for
the same settings keeps it, so the two sides can run in separate processes (device calls) and still end
in one JSON (bench/run_grpo_real_1gpu.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Callable, Iterable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: rlhfkit, bench.harness

from bench.harness.models import device_name, free_memory, peak_gib  # noqa: E402
from bench.harness.report import package_version, write_report  # noqa: E402
from bench.harness.rl_run import load_reward_module, micro  # noqa: E402
from bench.harness.timing import median, sync  # noqa: E402

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
               ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(_k, _v)

Progress = Callable[[dict], None]  # a side's record so far (written with "partial": true; a killed run keeps it)
QUESTION = "What is {a}+{b}? Answer with the number only."
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "models",
                             "smollm2-135m-instruct")

REWARD_SRC = '''"""grpo_real's reward (rlhfkit reward_func API): 1 when the completion's last integer is the label."""
import re


def answer_correct(completion, label):
    numbers = re.findall(r"\\d+", completion)
    return 1.0 if numbers and numbers[-1] == str(label) else 0.0


def reward_func(queries, prompts, labels):
    out = [answer_correct(q[len(p):] if q.startswith(p) else q, lab) for q, p, lab in zip(queries, prompts, labels)]
    return {"rewards": out, "scores": out}
'''


# ----------------------------------------------------------------------------- task


def addition_questions(num_train: int, num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint training and held-out questions {"question", "label"} over a, b in 10..99."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if num_train + num_eval > len(pairs):
        raise SystemExit(f"grpo_real: at most {len(pairs)} questions exist; asked for {num_train + num_eval}")
    random.Random(seed).shuffle(pairs)
    rows = [{"question": QUESTION.format(a=a, b=b), "label": str(a + b)} for a, b in pairs[:num_train + num_eval]]
    return rows[num_eval:], rows[:num_eval]


def chat_ids(tok: Any, question: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)
    return list(enc["input_ids"])


class GreedyEval:
    """Greedy held-out accuracy with transformers' generate on one model (bf16 on CUDA, fp32 on CPU) whose
    weights are replaced by those of the model under test (`load`); the same for both sides."""

    def __init__(self, model_dir: str, rows: list[dict], device: str, max_new_tokens: int, batch_size: int,
                 answer_correct: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.device, self.max_new_tokens, self.batch_size = device, max_new_tokens, batch_size
        self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(device).eval()
        self.prompts = [chat_ids(self.tok, r["question"]) for r in rows]
        self.labels = [r["label"] for r in rows]
        self.correct = answer_correct

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every parameter of the evaluated model from `named` (HF names; tied weights once)."""
        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for name, t in named:
                if name in params:
                    params[name].copy_(t.detach().to(device=params[name].device, dtype=params[name].dtype))
                    seen.add(name)
        if seen != set(params):
            raise RuntimeError(f"grpo_real: weights missing for {sorted(set(params) - seen)[:5]}")

    @torch.no_grad()
    def accuracy(self) -> dict:
        sync(self.device)
        t0 = time.perf_counter()
        pad = self.tok.pad_token_id
        answers: list[str] = []
        for i in range(0, len(self.prompts), self.batch_size):
            batch = self.prompts[i:i + self.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=self.max_new_tokens, pad_token_id=pad,
                                      eos_token_id=self.tok.eos_token_id)
            answers += self.tok.batch_decode(out[:, width:], skip_special_tokens=True)
        right = [self.correct(a, lab) for a, lab in zip(answers, self.labels)]
        sync(self.device)
        return {"accuracy": sum(right) / len(right), "seconds": round(time.perf_counter() - t0, 3),
                "examples": [{"answer": a, "label": lab} for a, lab in zip(answers[:3], self.labels[:3])]}


# ----------------------------------------------------------------------------- rlhfkit


LEAN = ["--optim", "adamw_8bit", "--master_weights", "bf16_stochastic"]  # the memory-lean optimizer of one-GPU 7B runs


def rlhfkit_argv(a: argparse.Namespace, model_dir: str, data: str, reward: str, work: str,
                 side: str = "rlhfkit") -> list[str]:
    total = a.prompts * a.n
    mb = str(micro(total, a.micro_train_batch_size))
    return ["--pretrain", model_dir, "--prompt_data", data, "--input_key", "messages", "--label_key", "label",
            "--apply_chat_template", "--remote_rm_url", reward, "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", str(a.n), "--rollout_batch_size", str(a.prompts),
            "--train_batch_size", str(total), "--micro_train_batch_size", mb, "--micro_rollout_batch_size", mb,
            "--max_epochs", "1", "--max_steps", str(a.steps), "--init_kl_coef", "0",
            "--generate_max_len", str(a.new_tokens), "--prompt_max_len", "128",
            "--temperature", str(a.temperature), "--top_p", "1.0",
            "--actor_learning_rate", str(a.lr), "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
            "--adam_betas", "0.9", "0.999", "--l2", "0", "--max_norm", "1.0", "--eps_clip", "0.2",
            "--seed", str(a.seed), "--param_dtype", "bf16" if a.device.startswith("cuda") else "fp32",
            "--device", a.device, "--rollout_engine", "builtin", "--disable_progress",
            "--save_path", os.path.join(work, f"{side}_model"), "--run_dir", os.path.join(work, f"{side}_run")] \
        + (LEAN if side == "rlhfkit_lean" else [])


def run_rlhfkit(a: argparse.Namespace, model_dir: str, train: list[dict], work: str, ev: GreedyEval,
                progress: Progress, side: str = "rlhfkit") -> dict:
    """train_ppo's parser, checks and `local_trainer`, then `a.steps` timed `train_step()` calls, the held-out
    accuracy every `a.eval_every` steps and after the last (each also handed to `progress`)."""
    from rlhfkit.cli import train_ppo
    from rlhfkit.rl_run import builders
    from rlhfkit.rl_run.local import local_trainer
    from rlhfkit.rl_run.resolve import resolve
    from rlhfkit.cli.common import parallel_dims, set_seed
    from rlhfkit.parallel.dist import init_distributed
    from rlhfkit.parallel.mesh import attach_mesh

    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": r["question"]}], "label": r["label"]})
                     + "\n" for r in train)
    reward = os.path.join(work, "grpo_real_reward.py")
    with open(reward, "w") as f:
        f.write(REWARD_SRC)
    argv = rlhfkit_argv(a, model_dir, data, reward, work, side)
    parser = train_ppo.build_parser()
    parsed = parser.parse(argv)
    sync(a.device)
    t0 = time.perf_counter()
    dist = init_distributed(parsed.device)
    args = resolve(parsed, dist.world_size)
    dist = attach_mesh(dist, parallel_dims(args, dist))
    set_seed(args.seed, args.full_determinism)
    trainer, placement = local_trainer(args, dist)
    sync(a.device)
    build_s = time.perf_counter() - t0
    walls: list[float] = []
    metrics: list[dict] = []
    curve: list[dict] = []
    eval_s = 0.0
    try:
        for step in range(1, a.steps + 1):
            sync(a.device)
            t = time.perf_counter()
            m = trainer.train_step()
            trainer.state.step += 1
            sync(a.device)
            walls.append(time.perf_counter() - t)
            metrics.append(m)
            if step == a.steps or (a.eval_every and step % a.eval_every == 0):
                ev.load(placement.policy_backend.named_full_params(ev.dtype))
                r = ev.accuracy()
                eval_s += r["seconds"]
                curve.append({"step": step, "accuracy": r["accuracy"], "examples": r["examples"]})
                log(f"{side} step {step}: reward {m.get('reward')}, held-out accuracy {r['accuracy']:.3f}")
                progress({"framework": side, "build_s": build_s, "step_s_each": list(walls),
                          "reward_each": [x.get("reward") for x in metrics], "accuracy_curve": list(curve)})
    finally:
        builders.close_rollout(placement.engine)
        trainer.logger.close()
    wall = build_s + sum(walls)
    return {"framework": side, "argv": argv, "build_s": build_s, "first_step_s": walls[0], "wall_s": wall,
            "step_s_each": walls, "step_s_median": median(walls), "eval_s": eval_s,
            "reward_each": [m.get("reward") for m in metrics],
            "response_length_each": [m.get("response_length") for m in metrics],
            "generate_s_each": [m.get("time/generate") for m in metrics],
            "skipped_zero_advantage_steps": sum(int(m.get("skipped_zero_advantage", 0)) for m in metrics),
            "accuracy_curve": curve, "accuracy_after": curve[-1]["accuracy"], "peak_gpu_gib": peak_gib(a.device)}


# ----------------------------------------------------------------------------- TRL


def run_trl(a: argparse.Namespace, model_dir: str, train: list[dict], work: str, ev: GreedyEval,
            answer_correct: Any, progress: Progress) -> dict:
    """TRL's GRPOTrainer with the same model, questions, reward, batch, steps and optimizer settings."""
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    gpu = a.device.startswith("cuda")
    total = a.prompts * a.n
    mb = micro(total, a.trl_micro_train_batch_size or a.micro_train_batch_size)

    def addition_reward(completions: list, label: list[str], **kw: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        return [answer_correct(t, lab) for t, lab in zip(texts, label)]

    cfg = trl.GRPOConfig(
        output_dir=os.path.join(work, "trl"), per_device_train_batch_size=mb, gradient_accumulation_steps=total // mb,
        num_generations=a.n, max_completion_length=a.new_tokens, temperature=a.temperature, top_p=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group", loss_type="dapo",
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps, bf16=gpu, use_cpu=not gpu,
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no", seed=a.seed,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False, model_init_kwargs={"dtype": "float32"})
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "label": r["label"]}
                                     for r in train])
    timer = _StepTimer(a, ev, progress)
    sync(a.device)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[addition_reward], args=cfg, train_dataset=ds,
                              processing_class=tok)
    sync(a.device)
    build_s = time.perf_counter() - t0
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    timer.trainer, timer.build_s = trainer, build_s
    trainer.add_callback(timer.callback(TrainerCallback))
    if hasattr(trainer, "_generate_single_turn"):  # generation time (HF generate), as harness/trl_step.py measures it
        trainer._generate_single_turn = timer.wrap_generate(trainer._generate_single_turn)
    trainer.train()
    walls = timer.walls
    rewards = [g["reward"] for g in timer.logs if "reward" in g]
    lengths = [g["completions/mean_length"] for g in timer.logs if "completions/mean_length" in g]
    out = {"framework": "trl", "build_s": build_s, "first_step_s": walls[0] if walls else None,
           "wall_s": build_s + sum(walls), "step_s_each": walls, "step_s_median": median(walls),
           "eval_s": timer.eval_s, "reward_each": rewards, "response_length_each": lengths,
           "generate_s_each": timer.gen, "accuracy_curve": timer.curve,
           "accuracy_after": timer.curve[-1]["accuracy"] if timer.curve else None,
           "optimizer_steps": trainer.state.global_step, "per_device_train_batch_size": mb,
           "gradient_accumulation_steps": total // mb, "steps_per_generation": cfg.steps_per_generation,
           "trl_version": trl.__version__, "peak_gpu_gib": peak_gib(a.device)}
    del trainer
    return out


class _StepTimer:
    """TRL's step wall times (from the end of the previous step, or of the evaluation after it, to the end of
    this one; the first from the start of `train()`), its logs, its generation times, and the held-out
    accuracy every `eval_every` steps and after the last (the model's weights loaded into GreedyEval)."""

    def __init__(self, a: argparse.Namespace, ev: GreedyEval, progress: Progress) -> None:
        self.a, self.ev, self.progress, self.trainer = a, ev, progress, None
        self.build_s = 0.0
        self.walls: list[float] = []
        self.gen: list[float] = []
        self.logs: list[dict] = []
        self.curve: list[dict] = []
        self.eval_s, self.resume = 0.0, 0.0

    def callback(self, base: type) -> Any:
        timer = self

        class StepTimer(base):
            def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001
                sync(timer.a.device)
                timer.resume = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
                sync(timer.a.device)
                timer.walls.append(time.perf_counter() - timer.resume)
                step = state.global_step
                if step == timer.a.steps or (timer.a.eval_every and step % timer.a.eval_every == 0):
                    model = timer.trainer.accelerator.unwrap_model(timer.trainer.model)
                    timer.ev.load(model.named_parameters())
                    r = timer.ev.accuracy()
                    timer.eval_s += r["seconds"]
                    timer.curve.append({"step": step, "accuracy": r["accuracy"], "examples": r["examples"]})
                    log(f"trl step {step}: held-out accuracy {r['accuracy']:.3f}")
                    timer.progress({"framework": "trl", "build_s": timer.build_s, "step_s_each": list(timer.walls),
                                    "reward_each": [g["reward"] for g in timer.logs if "reward" in g],
                                    "accuracy_curve": list(timer.curve)})
                sync(timer.a.device)
                timer.resume = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
                timer.logs.append(dict(logs or {}))

        return StepTimer()

    def wrap_generate(self, fn: Any) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            sync(self.a.device)
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            sync(self.a.device)
            self.gen.append(time.perf_counter() - t0)
            return out

        return timed


# ----------------------------------------------------------------------------- driver


def log(msg: str) -> None:
    print(f"[grpo_real] {msg}", file=sys.stderr, flush=True)


SMOKE = {"prompts": 4, "n": 4, "steps": 2, "new_tokens": 32, "eval_prompts": 8, "eval_every": 1,
         "micro_train_batch_size": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", default=DEFAULT_MODEL, help="the pretrained model folder (make real-model)")
    ap.add_argument("--prompts", type=int, default=16, help="questions per step")
    ap.add_argument("--n", type=int, default=8, help="samples per question (GRPO group)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--new_tokens", type=int, default=64, help="most tokens of a completion (training and eval)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval_prompts", type=int, default=200, help="held-out questions")
    ap.add_argument("--eval_every", type=int, default=10, help="held-out accuracy every N steps (0: only at the end)")
    ap.add_argument("--eval_batch_size", type=int, default=200)
    ap.add_argument("--micro_train_batch_size", type=int, default=32, help="completions per forward/backward, both")
    ap.add_argument("--trl_micro_train_batch_size", type=int, default=0, help="TRL's (0: --micro_train_batch_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip_trl", action="store_true")
    ap.add_argument("--skip_rlhfkit", action="store_true")
    ap.add_argument("--rlhfkit_optim", choices=["fp32", "lean", "both"], default="fp32",
                    help="rlhfkit's optimizer: AdamW over fp32 masters (side 'rlhfkit'), 8-bit AdamW over bf16 "
                         "weights with stochastic rounding (side 'rlhfkit_lean'), or both, one after the other")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the whole script: 2 steps of 4 questions x 4 samples, 16 tokens, 8 held-out")
    ap.add_argument("--out", default=None, help="the JSON (a file with the other side's record is kept, see above)")
    if ap.parse_known_args(argv)[0].smoke:  # the smoke sizes are defaults: flags given on the command line win
        ap.set_defaults(**SMOKE)
    a = ap.parse_args(argv)
    if a.n < 2:
        raise SystemExit("grpo_real: --n must be >= 2 (GRPO groups)")
    for name in ("prompts", "steps", "new_tokens", "eval_prompts"):
        if getattr(a, name) < 1:
            raise SystemExit(f"grpo_real: --{name} must be >= 1")
    if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        raise SystemExit(f"grpo_real: --model_dir {a.model_dir}: no model there (make real-model, or "
                         "bench/real_model_parts.sh join on the GPU machine)")
    return a


SETTINGS = ("model_dir", "prompts", "n", "steps", "new_tokens", "temperature", "lr", "eval_prompts", "eval_every",
            "micro_train_batch_size", "trl_micro_train_batch_size", "seed", "device")



def headline(runs: dict[str, dict], before: float) -> dict:
    rk, tr = runs.get("rlhfkit", {}), runs.get("trl", {})
    out: dict[str, Any] = {"accuracy_before": before, "rlhfkit_accuracy_after": rk.get("accuracy_after"),
                           "trl_accuracy_after": tr.get("accuracy_after"), "rlhfkit_wall_s": rk.get("wall_s"),
                           "trl_wall_s": tr.get("wall_s"), "rlhfkit_first_step_s": rk.get("first_step_s"),
                           "trl_first_step_s": tr.get("first_step_s"),
                           "rlhfkit_step_s_median": rk.get("step_s_median"),
                           "trl_step_s_median": tr.get("step_s_median")}
    if rk.get("wall_s") and tr.get("wall_s"):
        out["wall_ratio"] = rk["wall_s"] / tr["wall_s"]
        out["rlhfkit_wall_at_most_half_of_trl"] = rk["wall_s"] <= 0.5 * tr["wall_s"]
    if rk.get("accuracy_after") is not None and tr.get("accuracy_after") is not None:
        out["rlhfkit_accuracy_at_least_trl"] = rk["accuracy_after"] >= tr["accuracy_after"]
    lean = runs.get("rlhfkit_lean", {})
    if lean.get("reward_each") and rk.get("reward_each"):
        out["lean_vs_fp32"] = lean_vs_fp32(rk, lean)
    return out


def lean_vs_fp32(fp32: dict, lean: dict, window: int = 20) -> dict:
    """The lean optimizer's learning beside fp32 AdamW's: mean reward over the last `window` steps of each, their
    difference, and the noise of that difference (the standard error from the steps' spread, both runs); held-out
    accuracy after each."""
    def tail(run: dict) -> list[float]:
        return [float(r) for r in run["reward_each"][-window:] if r is not None]

    a, b = tail(fp32), tail(lean)
    def se2(x: list[float]) -> float:
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / max(1, len(x) - 1) / len(x)

    diff = sum(b) / len(b) - sum(a) / len(a)
    noise = (se2(a) + se2(b)) ** 0.5
    return {"window_steps": window, "fp32_reward_tail_mean": sum(a) / len(a), "lean_reward_tail_mean": sum(b) / len(b),
            "difference": diff, "difference_standard_error": noise, "within_2_standard_errors": abs(diff) <= 2 * noise,
            "fp32_accuracy_after": fp32.get("accuracy_after"), "lean_accuracy_after": lean.get("accuracy_after")}


def report(a: argparse.Namespace, runs: dict[str, dict], before: dict, complete: bool) -> dict:
    settings = {k: getattr(a, k) for k in SETTINGS}
    if a.out and os.path.isfile(a.out):  # the other side, run by an earlier process with the same settings
        with open(a.out) as f:
            old = json.load(f)
        if old.get("settings") == settings:
            runs = {**{k: v for k, v in old.get("runs", {}).items() if k not in runs}, **runs}
    res = {"bench": "grpo_real", "device": device_name(a.device), "settings": settings,
           "task": QUESTION + " (two-digit a, b; reward 1 when the completion's last integer is a+b)",
           "compute_dtype": "bf16" if a.device.startswith("cuda") else "fp32", "master_dtype": "fp32",
           "complete": complete, "accuracy_before_detail": before,
           "versions": {d: package_version(d) for d in ("torch", "transformers", "accelerate", "trl", "datasets", "gguf")}}
    res.update(headline(runs, before["accuracy"]))
    res["runs"] = runs
    write_report(a.out, res)
    return res


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    answer_correct = None
    with tempfile.TemporaryDirectory(prefix="grpo_real_") as work:
        path = os.path.join(work, "reward_src.py")
        with open(path, "w") as f:
            f.write(REWARD_SRC)
        answer_correct = load_reward_module(path).answer_correct
        train, held = addition_questions(a.prompts * a.steps, a.eval_prompts, a.seed)
        ev = GreedyEval(a.model_dir, held, a.device, a.new_tokens, a.eval_batch_size, answer_correct)
        before = ev.accuracy()
        log(f"held-out accuracy before: {before['accuracy']:.3f} ({before['seconds']:.1f} s)")
        runs: dict[str, dict] = {}
        report(a, runs, before, complete=False)
        ours = {"fp32": ["rlhfkit"], "lean": ["rlhfkit_lean"], "both": ["rlhfkit", "rlhfkit_lean"]}[a.rlhfkit_optim]
        sides = ([] if a.skip_rlhfkit else ours) + ([] if a.skip_trl else ["trl"])
        for side in sides:
            t0 = time.perf_counter()

            def progress(record: dict, side: str = side) -> None:
                runs[side] = {**record, "partial": True, "process_s": time.perf_counter() - t0}
                report(a, runs, before, complete=False)

            try:
                if side.startswith("rlhfkit"):
                    runs[side] = run_rlhfkit(a, a.model_dir, train, work, ev, progress, side)
                else:
                    runs[side] = run_trl(a, a.model_dir, train, work, ev, answer_correct, progress)
            except Exception as e:  # noqa: BLE001 - the bench reports and goes on
                import traceback

                traceback.print_exc()
                runs[side] = {"framework": side, "error": f"{type(e).__name__}: {e}"[:2000]}
            runs[side]["process_s"] = time.perf_counter() - t0
            log(f"{side}: wall {runs[side].get('wall_s')} s, accuracy after {runs[side].get('accuracy_after')}, "
                f"error {runs[side].get('error')}")
            free_memory(a.device)
            report(a, runs, before, complete=False)
        res = report(a, runs, before, complete=True)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))
    return res


if __name__ == "__main__":
    main()
