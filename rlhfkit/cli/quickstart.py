"""The quickstart: SFT then GRPO on 2-digit addition with a tiny character-level model, on a CPU.

    rlhfkit quickstart [--run_dir runs/quickstart] [--seed 0] [--rl_steps 100]

1. builds a tiny Llama and its character tokenizer offline (`make_tiny_model`);
2. writes the built-in task (`rlhfkit.tasks.addition`): train prompts and a held-out set;
3. SFT with `train_sft` for a short while (the model learns the format, and some sums);
4. GRPO with `train_ppo` (`--advantage_estimator group_norm`, groups of 8) and the exact-match
   `reward_func`;
5. prints greedy held-out accuracy before and after RL and writes `results.json`, the metrics and
   `reward_curve.png` (the training reward, and the held-out accuracy every tenth of the RL steps)
   into the run directory.
Everything goes through the same CLIs a user runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from rlhfkit.config.declare import add_fields
from rlhfkit.config.flags import FlagParser, add_arithmetic_flags, add_run_dir_flag, add_seed_flag
from rlhfkit.models.tiny_spec import TinyModelSpec

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__


def build_parser() -> FlagParser:
    p = FlagParser("quickstart", __doc__ or "")
    with p.group("run"):
        add_run_dir_flag(p, "where the model, data, both runs, results.json and reward_curve.png go")
        add_seed_flag(p, "seed of the data, the model and both runs")
    with p.group("task"):
        add_arithmetic_flags(p, train_help="training questions (SFT data and RL prompts)",
                             eval_help="held-out questions (never trained on)")
        p.flag("--num_val", type=int, default=100, help="validation questions that decide when SFT stops")
    with p.group("SFT and RL"):
        p.flag("--sft_target", type=float, default=0.3, help="SFT stops at this greedy validation accuracy")
        p.flag("--sft_min_steps", type=int, default=200, help="SFT steps before --sft_target is checked")
        p.flag("--sft_max_steps", type=int, default=800, help="SFT stops after this many steps at most")
        p.flag("--rl_steps", type=int, default=100, help="GRPO steps")
        p.flag("--sft_lr", type=float, default=1e-3, help="SFT learning rate")
        p.flag("--rl_lr", type=float, default=1e-4, help="GRPO learning rate")
    with p.group("model"):
        add_fields(p, TinyModelSpec, ["hidden_size", "num_hidden_layers"], here=True,
                   help={"hidden_size": "width of the residual stream of the tiny model",
                         "num_hidden_layers": "transformer blocks of the tiny model"})
    p.set_defaults(run_dir="runs/quickstart", seed=0, num_train=20000, num_eval=200)
    return p


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def greedy_accuracy(model, tok, rows: list[dict]) -> float:
    """Exact-match accuracy of greedy decoding with the builtin engine (`model`: a directory or module)."""
    from rlhfkit.rollout import build_engine
    from rlhfkit.tasks.addition import completion_answer
    from rlhfkit.types import GenerationRequest, SamplingParams

    engine = build_engine("builtin", model, tok, device="cpu", max_num_seqs=len(rows))
    sp = SamplingParams(temperature=0.0, max_new_tokens=args_digits_budget(rows))
    reqs = [GenerationRequest(tok(r["input"])["input_ids"], sp, i) for i, r in enumerate(rows)]
    outs = engine.generate(reqs)
    hits = sum(completion_answer(tok.decode(o[0].token_ids, skip_special_tokens=True)) == r["label"]
               for o, r in zip(outs, rows))
    return hits / len(rows)


def args_digits_budget(rows: list[dict]) -> int:
    return max(len(r["label"]) for r in rows) + 2


def plot_curve(run_dir: str, rl_dir: str) -> str:
    from rlhfkit.trainers.plot import plot_metrics

    return plot_metrics(os.path.join(rl_dir, "metrics.jsonl"), os.path.join(run_dir, "reward_curve.png"),
                        ("reward", "eval_accuracy")) or ""


def quiet() -> list[str]:
    """Progress bars in a terminal; plain periodic log lines when output goes to a file or pipe."""
    return [] if sys.stdout.isatty() else ["--disable_progress"]


def sft_args(args, base: str, run: str, sft_dir: str) -> list[str]:
    return [*quiet(), "--pretrain", base, "--dataset", os.path.join(run, "train.jsonl"), "--input_key", "input",
            "--output_key", "output", "--input_template", "{}", "--max_len", "32",
            "--train_batch_size", "64", "--micro_train_batch_size", "64", "--max_epochs", "100",
            "--max_steps", str(args.sft_max_steps), "--learning_rate", str(args.sft_lr), "--lr_warmup_ratio", "0.02",
            "--lr_scheduler", "constant_with_warmup", "--param_dtype", "fp32", "--attn_implementation", "eager",
            "--save_path", sft_dir, "--overwrite_output_dir",  # the quickstart remakes all it trains on
            "--logging_steps", "20", "--seed", str(args.seed), "--device", "cpu"]


def rl_args(args, sft_dir: str, run: str, rl_dir: str, reward_file: str, max_new: int) -> list[str]:
    """GRPO; every --eval_steps the held-out questions are answered greedily (eval/pass1: the accuracy
    the quickstart reports, drawn in reward_curve.png)."""
    evals = ["--eval_dataset", os.path.join(run, "eval.jsonl"), "--eval_steps", str(max(args.rl_steps // 10, 1)),
             "--eval_temperature", "0", "--eval_n_samples_per_prompt", "1"]
    return [*quiet(), *evals, "--pretrain", sft_dir, "--remote_rm_url", reward_file,
            "--prompt_data", os.path.join(run, "train.jsonl"),
            "--input_key", "input", "--label_key", "label", "--input_template", "{}", "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt", "8", "--rollout_batch_size", "16", "--train_batch_size", "128",
            "--micro_train_batch_size", "128", "--micro_rollout_batch_size", "128", "--max_epochs", "1",
            "--temperature", "1.0", "--generate_max_len", str(max_new), "--prompt_max_len", "16",
            "--init_kl_coef", "0", "--actor_learning_rate", str(args.rl_lr), "--lr_warmup_ratio", "0",
            "--lr_scheduler", "constant", "--max_steps", str(args.rl_steps), "--param_dtype", "fp32",
            "--attn_implementation", "eager", "--save_path", rl_dir, "--overwrite_output_dir", "--logging_steps", "5",
            "--seed", str(args.seed), "--device", "cpu"]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse(argv)
    from rlhfkit.cli import train_ppo, train_sft
    from rlhfkit.models.loader import load_tokenizer
    from rlhfkit.models.tiny import make_tiny_model
    from rlhfkit.tasks.addition import addition_splits

    t0 = time.time()
    run = os.path.abspath(args.run_dir)
    os.makedirs(run, exist_ok=True)
    base, sft_dir, rl_dir = (os.path.join(run, d) for d in ("base", "sft", "rl"))
    make_tiny_model(base, TinyModelSpec(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                        num_attention_heads=4, max_position_embeddings=64, seed=args.seed))
    tok = load_tokenizer(base)
    train, held = addition_splits(args.num_train, args.num_val + args.num_eval, args.digits, seed=args.seed,
                                  reverse_answer=not args.plain_order)
    val, test = held[:args.num_val], held[args.num_val:]
    write_jsonl(os.path.join(run, "train.jsonl"), train)
    write_jsonl(os.path.join(run, "eval.jsonl"), test)
    reward_file = os.path.join(run, "reward_func.py")
    with open(reward_file, "w") as f:
        f.write("from rlhfkit.tasks.addition import reward_func  # exact match of the sum\n")
    log.info(f"[quickstart] tiny model; {len(train)} train, {len(val)} validation, {len(test)} held-out questions "
             f"in {run}")

    def stop_at_target(state, metrics, backend) -> bool:
        """SFT until greedy validation accuracy reaches --sft_target: a mediocre start for RL."""
        if state.step < args.sft_min_steps or state.step % 20:
            return False
        acc = greedy_accuracy(backend.unwrap(), tok, val)
        log.info(f"[quickstart] SFT step {state.step}: validation accuracy {acc:.1%}")
        return acc >= args.sft_target

    train_sft.run(train_sft.build_parser().parse(sft_args(args, base, run, sft_dir)), on_step_end=stop_at_target)
    before = greedy_accuracy(sft_dir, tok, test)
    log.info(f"[quickstart] after SFT: held-out greedy accuracy {before:.1%} ({time.time() - t0:.0f}s)")

    train_ppo.main(rl_args(args, sft_dir, run, rl_dir, reward_file, args_digits_budget(test)))
    after = greedy_accuracy(rl_dir, tok, test)
    elapsed = time.time() - t0
    result = {"held_out": len(test), "accuracy_after_sft": before, "accuracy_after_rl": after,
              "gain_points": 100 * (after - before), "seconds": elapsed, "seed": args.seed}
    with open(os.path.join(run, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
    png = plot_curve(run, rl_dir)
    log.info("\n| stage | held-out greedy accuracy |\n| --- | --- |")
    log.info(f"| after SFT | {before:.1%} |\n| after GRPO | {after:.1%} |")
    log.info(f"\n[quickstart] {100 * (after - before):+.1f} points in {elapsed:.0f}s; curves: {png}; "
             f"metrics: {rl_dir}/metrics.jsonl")
    sys.stdout.flush()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
