"""Model cards: the README.md written into every model directory rlhfkit saves.

    write_model_card(model_dir, run_dir=run_dir)            # a trainer's final model or HF snapshot
    write_model_card(out, base_model=..., settings={...})   # lora_combiner (no run directory)

The card starts with the YAML header the Hugging Face hub reads (`library_name: rlhfkit`, `tags`,
`pipeline_tag`, and `base_model` / `datasets` when they are hub ids: a local path is no hub id,
so it is named only in the body), then: the base model and data, the command line that ran, the key
settings (from the run's run_config.json) and the final metrics (each metric's last value in the run's
metrics.jsonl, up to `step` for a snapshot saved mid-run), and how to load the model.

Called by the save functions on rank 0 (the driver under Ray), after the weights are written.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from rlhfkit.fileio import atomic_write_text, read_json_object
from rlhfkit.redact import redact_argv, redact_config, redact_text
from rlhfkit.trainers.metric_names import CONSOLE_KEYS

# run_config.json flags shown under "Key settings", in this order (those set)
KEY_SETTINGS = (
    "advantage_estimator", "n_samples_per_prompt", "rollout_batch_size", "train_batch_size", "micro_train_batch_size",
    "max_epochs", "num_episodes", "max_steps", "learning_rate", "actor_learning_rate", "critic_learning_rate",
    "lr_scheduler", "lr_warmup_ratio", "init_kl_coef", "use_kl_loss", "kl_estimator", "beta", "ipo",
    "label_smoothing", "loss_type", "kd_coef", "max_len", "prompt_max_len", "generate_max_len", "packing_samples",
    "lora_rank", "lora_alpha", "load_in_4bit", "param_dtype", "seed", "reward_pretrain", "ref_pretrain",
    "critic_pretrain", "teacher_model", "remote_rm_url", "agent_func_path", "apply_chat_template",
    "input_template", "input_key", "output_key", "chosen_key", "rejected_key", "label_key")
DATA_FLAGS = ("dataset", "prompt_data", "eval_dataset", "pretrain_data")
WHAT = {"sft": "supervised fine-tuning (train_sft)", "rm": "reward model training (train_rm)",
        "dpo": "preference optimisation (train_dpo)", "kto": "KTO (train_kto)",
        "prm": "process reward model training (train_prm)", "kd": "knowledge distillation (train_kd)",
        "rl": "reinforcement learning (train_ppo)", "critic": "the critic of reinforcement learning (train_ppo)",
        "lora_combiner": "a LoRA adapter merged into its base model (lora_combiner)"}
TAGS = {"sft": "sft", "rm": "reward-model", "dpo": "dpo", "kto": "kto", "prm": "process-reward-model",
        "kd": "knowledge-distillation", "rl": "reinforcement-learning", "critic": "value-model",
        "lora_combiner": "lora-merged"}


def write_model_card(model_dir: str, *, run_dir: str | None = None, step: int | None = None,
                     trainer: str | None = None, command: str | None = None, base_model: str | None = None,
                     datasets: list[str] | None = None, settings: dict[str, Any] | None = None) -> str | None:
    """Write `model_dir`/README.md; returns its path (None when `model_dir` is not on this host).

    `run_dir`: the run's directory (run_config.json, metrics.jsonl) that the base model, data,
    settings and metrics come from; the keywords override or replace them. `command`: default
    this process's command line."""
    if not os.path.isdir(model_dir):
        return None
    config = read_json_object(os.path.join(run_dir, "run_config.json")) if run_dir else {}
    rows = _read_rows(os.path.join(run_dir, "metrics.jsonl")) if run_dir else []
    base = base_model if base_model is not None else config.get("pretrain")
    data = datasets if datasets is not None else list(dict.fromkeys(str(config[k]) for k in DATA_FLAGS
                                                                     if config.get(k)))
    chosen = redact_config(settings if settings is not None else key_settings(config))
    kind = trainer or _trainer_of(config)
    final = final_metrics(rows, step)
    # a card is made to be published: no key, token or URL credential in it (rlhfkit.redact)
    text = render_card(model_dir, redact_text(base) if base else base, [redact_text(d) for d in data],
                       redact_text(command) if command else this_command(), chosen, final, kind,
                       _pipeline_tag(model_dir), step)
    path = os.path.join(model_dir, "README.md")
    atomic_write_text(path, text)
    return path


def key_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The KEY_SETTINGS flags that are set (LoRA's only with --lora_rank)."""
    out = {}
    for k in KEY_SETTINGS:
        v = config.get(k)
        if v is None or v is False or v == "" or (k.startswith("lora_") and not config.get("lora_rank")):
            continue
        with_critic = config.get("critic_pretrain") or config.get("advantage_estimator") == "gae"
        if k.startswith("critic_") and not with_critic:
            continue
        out[k] = v
    return out


def task_kind(task: Any) -> str:
    """"sft", "rm", "dpo", "kto", "prm", "kd": the trainer tag of an offline task (SFTTask -> "sft")."""
    return type(task).__name__.lower().removesuffix("task")


def final_metrics(rows: list[dict[str, Any]], step: int | None = None) -> dict[str, tuple[int, Any]]:
    """The last (step, value) in `rows` (records of steps <= `step`) of every eval/ metric and of the
    main train/ ones (those a console line shows)."""
    main = {"train/" + k for k in CONSOLE_KEYS}
    out: dict[str, tuple[int, Any]] = {}
    for r in rows:
        s = int(r.get("step", 0))
        if step is not None and s > step:
            continue
        for k, v in r.items():
            if k.startswith("eval/") or k in main:
                out[k] = (s, v)
    return out


def this_command(args: list[str] | None = None) -> str:
    """This process's command line (secrets replaced: rlhfkit.redact), as `python -m rlhfkit.cli.<name>
    ...` when it ran an rlhfkit CLI; `args` in place of its arguments when given."""
    argv = list(sys.argv) or ["python"]
    script = os.path.abspath(argv[0]) if argv[0] else ""
    cli = os.path.join("rlhfkit", "cli") + os.sep
    rest = redact_argv(list(argv[1:] if args is None else args))
    if cli in script and script.endswith(".py"):
        mod = "rlhfkit.cli." + os.path.basename(script)[:-3]
        return shlex.join(["python", "-m", mod, *rest])
    return shlex.join([os.path.basename(argv[0]) if argv[0] else "python", *rest])


def render_card(model_dir: str, base: str | None, data: list[str], command: str, settings: dict[str, Any],
                final: dict[str, tuple[int, Any]], kind: str | None, pipeline_tag: str, step: int | None) -> str:
    tags = ["rlhfkit"] + ([TAGS.get(kind, kind)] if kind else [])
    head = ["---", "library_name: rlhfkit"]
    if base and is_hub_id(base):
        head.append(f"base_model: {base}")
    hub_data = [d for d in data if is_hub_id(d)]
    if hub_data:
        head += ["datasets:"] + [f"- {d}" for d in hub_data]
    head += ["tags:"] + [f"- {t}" for t in tags] + [f"pipeline_tag: {pipeline_tag}", "---", ""]
    name = os.path.basename(os.path.normpath(model_dir))
    what = WHAT.get(kind or "", f"{kind} training" if kind else "training")
    body = [f"# {name}", "",
            f"Saved by rlhfkit: {what}" + (f", a snapshot at step {step}" if step is not None else "") + ".", ""]
    body += ["| | |", "| --- | --- |", f"| base model | {_code(base) if base else 'unknown'} |"]
    body += [f"| data | {', '.join(_code(d) for d in data) if data else 'none recorded'} |", ""]
    body += ["## Command", "", "The command line of the process that saved this model:", "",
             "```bash", command, "```", ""]
    if settings:
        body += ["## Key settings", "", "| setting | value |", "| --- | --- |"]
        body += [f"| `{k}` | {_code(_show(v))} |" for k, v in settings.items()]
        body += ["", "Every flag's value is in the run directory's `run_config.json`.", ""]
    if final:
        body += ["## Final metrics", "", "| metric | value | step |", "| --- | --- | --- |"]
        body += [f"| `{k}` | {_show(v)} | {s} |" for k, (s, v) in sorted(final.items(), key=_metric_order)]
        body += [""]
    body += ["## Usage", "", "```python", *_usage(pipeline_tag, model_dir), "```", ""]
    return "\n".join(head + body)


def _usage(pipeline_tag: str, model_dir: str) -> list[str]:
    auto = "AutoModelForSequenceClassification" if pipeline_tag == "text-classification" else "AutoModelForCausalLM"
    extra = ", num_labels=1" if pipeline_tag == "text-classification" else ""
    return [f"from transformers import {auto}, AutoTokenizer", "",
            f"path = {model_dir!r}  # this directory",
            "tok = AutoTokenizer.from_pretrained(path)",
            f"model = {auto}.from_pretrained(path{extra})"]


def _metric_order(item: tuple[str, tuple[int, Any]]) -> tuple[int, str]:
    return (0 if item[0].startswith("eval/") else 1, item[0])


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    return str(v)


def _code(s: str) -> str:
    return "`" + str(s).replace("`", "'").replace("|", "\\|") + "`"


def is_hub_id(s: str) -> bool:
    """`owner/name` (or `name`) that is no local path."""
    if os.path.exists(s) or s.startswith((".", "/", "~")) or "@" in s or "," in s or s.count("/") > 1:
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in s.split("/"))


def _trainer_of(config: dict[str, Any]) -> str | None:
    if config.get("prompt_data") and config.get("advantage_estimator"):
        return "rl"
    return None


def _pipeline_tag(model_dir: str) -> str:
    archs = read_json_object(os.path.join(model_dir, "config.json")).get("architectures") or []
    return "text-classification" if any(str(a).endswith("ForSequenceClassification") for a in archs) \
        else "text-generation"


def _read_rows(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except OSError:
        pass
    return out
