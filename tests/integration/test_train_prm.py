"""train_prm end to end on a tiny model: the step-label loss falls and accuracy rises.

Each row holds one or two steps "a+b=c#"; "#" ends a step (--placeholder_token) and the label
is "+" for a correct sum, "-" for a wrong one (--reward_tokens + -).
"""

from __future__ import annotations

import json
import random

from rlhfkit.cli.train_prm import build_parser, run
from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.loader import load_causal_lm


def prm_rows(seed: int = 0, n: int = 5, count: int = 96) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        text, labels = "", []
        for _ in range(rng.choice([1, 2])):
            a, b = rng.randrange(n), rng.randrange(n)
            ok = rng.random() < 0.5
            c = a + b if ok else rng.choice([x for x in range(2 * n - 1) if x != a + b])
            text += f"{a}+{b}={c}#"
            labels.append("+" if ok else "-")
        rows.append({"text": text, "steps": labels})
    return rows


def test_prm_loss_falls_and_accuracy_rises(tiny_model_dir, tmp_path):
    path = str(tmp_path / "prm.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in prm_rows()) + "\n")
    args = build_parser().parse([
        "--pretrain", tiny_model_dir, "--dataset", path, "--eval_dataset", path, "--input_key", "text",
        "--label_key", "steps", "--placeholder_token", "#", "--reward_tokens", "+", "-", "--packing_samples",
        "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_epochs", "100", "--max_steps", "40",
        "--eval_steps", "40", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--max_len", "64",
        "--save_path", str(tmp_path / "out"), "--disable_progress"])
    result = run(args)
    task = result.task
    batches = [task.collate(result.eval_items[i:i + 16]) for i in range(0, len(result.eval_items), 16)]
    base = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32"))
    start = task.eval_metrics(base.eval(), batches)
    end = result.state.history[-1]
    assert end["step"] == 40
    assert end["eval/loss"] < start["eval/loss"] - 0.1, (start, end)
    assert end["eval/acc"] > max(start["eval/acc"], 0.6), (start, end)
