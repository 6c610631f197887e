"""The metric names (train/, eval/, time/), console lines, --best_metric_key with OpenRLHF's names,
wandb (a fake module: typed config, the logged keys), the plot's panels and smoothing, and model cards."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest

from rlhfkit.trainers import metrics as M
from rlhfkit.trainers import model_card as C
from rlhfkit.trainers import plot as P


def test_names_of_a_record():
    rec = M.metrics_record(3, {"loss": 1.5, "eval/loss": 2.0, "time/step": 0.25, "grad_norm": float("inf")})
    assert rec == {"step": 3, "train/loss": 1.5, "eval/loss": 2.0, "time/step": 0.25, "train/grad_norm": "inf"}


def test_console_lines():
    rec = {"step": 4, "train/epoch": 0, "train/grad_norm": 2.5, "train/loss": 1.23456, "train/lr": 2e-5,
           "train/step_time": 0.5, "eval/loss": 1.1, "eval/acc": 0.75}
    assert M.console_lines(rec, total=10) == ["[step 4/10] loss=1.235 grad_norm=2.5 lr=2.000e-05 (0.5 s/step)",
                                              "[eval step 4] loss=1.1 acc=0.75"]
    assert M.console_lines(rec, train=False) == ["[eval step 4] loss=1.1 acc=0.75"]  # under a progress bar
    rl = {"step": 1, "train/reward": 0.5, "train/kl": 0.0, "time/step": 2.0, "train/even_frac": 0.5}
    assert M.console_lines(rl) == ["[step 1] reward=0.5 kl=0 (2 s/step)"]
    assert M.console_lines({"step": 2, "train/reward_mean": 0.1}) == ["[step 2] reward_mean=0.1"]


def test_sample_lines_show_the_end_of_the_prompt_and_the_completion():
    system = "<|im_start|>system\nYou are a careful assistant who answers arithmetic questions. " * 3
    prompt = system + "<|im_end|>\n<|im_start|>user\nWhat is 17+25?<|im_end|>\n<|im_start|>assistant\n"
    completion = "Let me add the units first. " * 8 + "So the answer is 42."
    header, line = M.sample_lines(4, [M.SampleRow(prompt, completion, 1.0, "42")])
    assert header == "[samples step 4]"
    assert line.startswith("  reward=1 label='42' ...'") and "You are a careful" not in line  # not the system prompt
    shown_prompt, shown_completion = line.split(" -> ")
    assert shown_prompt.endswith(r"user\nWhat is 17+25?<|im_end|>\n<|im_start|>assistant\n'")
    assert len(shown_prompt) - len("  reward=1 label='42' ") == M.PROMPT_CHARS
    assert shown_completion.startswith("'Let me add the units first.") and shown_completion.endswith(
        "So the answer is 42.'") and " ... " in shown_completion and len(shown_completion) <= M.COMPLETION_CHARS
    assert M.sample_lines(1, [M.SampleRow("1+2=", "3</s>", 0.5, None)])[1] == "  reward=0.5 '1+2=' -> '3</s>'"


def test_a_training_line_kept_off_the_console_is_in_the_run_log(tmp_path, capsys):
    from rlhfkit import logs

    logs.setup("info")
    path = logs.add_run_log(str(tmp_path))
    logger = M.MetricsLogger(str(tmp_path))
    logger.log(1, {"loss": 1.5}, total=2)
    logger.log(2, {"loss": 1.25}, console=False, total=2)
    logger.close()
    logs.close_run_logs()
    assert capsys.readouterr().out.splitlines() == ["[step 1/2] loss=1.5"]
    text = open(path).read()
    assert "INFO rlhfkit.trainers.metrics: [step 1/2] loss=1.5" in text and "[step 2/2] loss=1.25" in text


def test_best_metric_key_accepts_openrlhf_names():
    names = ["train/reward", "eval/reward", "eval/pass1", "eval/pass4"]
    for key in ("eval_reward", "eval/reward", "reward"):
        assert M.resolve_eval_key(key, names) == "eval/reward", key
    assert M.resolve_eval_key("", names) == "eval/pass1"
    assert M.resolve_eval_key("eval_pass4", names) == "eval/pass4"
    assert M.resolve_eval_key("eval_acc", names) is None and M.resolve_eval_key("", ["train/reward"]) is None


def test_wandb_gets_typed_config_and_the_same_names(tmp_path, monkeypatch):
    from rlhfkit.cli import train_sft
    from rlhfkit.cli.common import make_logger

    seen: dict = {"logged": []}

    class Run:
        def log(self, data, step=None):
            seen["logged"].append((step, dict(data)))

        def finish(self):
            seen["finished"] = True

    fake = types.ModuleType("wandb")
    fake.login = lambda key=None: seen.setdefault("key", key)
    fake.init = lambda **kw: (seen.update(init=kw), Run())[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = train_sft.build_parser().parse([
        "--pretrain", "m", "--dataset", "d.jsonl", "--save_path", str(tmp_path), "--use_wandb", "True",
        "--wandb_run_name", "r1", "--learning_rate", "3e-4", "--packing_samples", "--adam_betas", "0.8", "0.9"])
    logger = make_logger(args, rank=0, plot_keys=P.OFFLINE_PANELS)
    logger.log(1, {"loss": 2.0, "lr": 3e-4}, console=False)
    logger.log(2, {"loss": 1.5, "eval/loss": 1.7}, console=False)
    logger.close()
    init = seen["init"]
    assert init["project"] == "rlhfkit_train_sft" and init["name"] == "r1" and "key" not in seen
    cfg = init["config"]
    assert cfg["learning_rate"] == 3e-4 and isinstance(cfg["learning_rate"], float)
    assert cfg["max_len"] == args.max_len and type(cfg["max_len"]) is int
    assert cfg["packing_samples"] is True and cfg["gradient_checkpointing"] is False
    assert cfg["adam_betas"] == [0.8, 0.9] and cfg["eval_dataset"] is None and "use_wandb" not in cfg
    assert seen["logged"] == [(1, {"train/loss": 2.0, "train/lr": 3e-4}),
                              (2, {"train/loss": 1.5, "eval/loss": 1.7})]
    rows = M.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
    assert [set(r) - {"step"} for r in rows] == [set(d) for _, d in seen["logged"]] and seen["finished"]


def test_smoothing_worked_by_hand():
    a, b, c = math.exp(-0.5), math.exp(-2.0), math.exp(-4.5)  # sigma 1: distances 1, 2, 3 (4 is cut)
    x = [0.0, 3.0, 0.0, 0.0, 0.0]
    assert P.gaussian_smooth(x, 1.0) == pytest.approx([3 * a / (1 + a + b + c), 3 / (1 + 2 * a + b + c),
                                                       3 * a / (1 + 2 * a + 2 * b), 3 * b / (1 + 2 * a + b + c),
                                                       3 * c / (1 + a + b + c)])
    assert P.gaussian_smooth([2.0] * 9, 2.5) == pytest.approx([2.0] * 9) and P.gaussian_smooth(x, 0) == x
    assert [P.smoothing_sigma(n) for n in (7, 8, 90, 300)] == [0.0, 1.0, 3.0, 10.0]


def test_panels_follow_the_data(tmp_path):
    rows = [{"step": 0, "eval/reward": 0.1, "eval/pass1": 0.0, "eval/pass8": 0.2}]
    rows += [{"step": s, "train/reward": s / 10, "train/kl": 0.01 * s, "train/policy_loss": -0.1,
              "train/value_loss": 1.0, "train/grad_norm": 1.0, "train/actor_lr": 1e-4, "time/step": 1.0}
             for s in range(1, 21)]
    chosen = {p.title: ks for p, ks in P.panels_with_data(rows, P.RL_PANELS)}
    assert chosen == {"reward": ["train/reward", "eval/reward"],
                      "eval accuracy (pass@k)": ["eval/pass1", "eval/pass8"], "KL to the reference": ["train/kl"],
                      "policy / value loss": ["train/policy_loss", "train/value_loss"],
                      "grad norm": ["train/grad_norm"], "learning rate": ["train/actor_lr"]}
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert P.plot_metrics(str(path), str(tmp_path / "m.png"), P.RL_PANELS) == str(tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 10_000
    assert P.plot_metrics(str(path), str(tmp_path / "none.png"), ("loss", "acc")) is None


def test_model_card_of_a_snapshot(tmp_path):
    run, model = tmp_path / "run", tmp_path / "global_step2_hf"
    run.mkdir()
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    (run / "run_config.json").write_text(json.dumps({"pretrain": "Qwen/Qwen2.5-0.5B", "dataset": "OpenRLHF/pairs",
                                                     "eval_dataset": str(run), "learning_rate": 9e-6,
                                                     "lora_alpha": 16, "lora_rank": 0, "seed": 0}))
    recs = [{"step": 1, "train/loss": 0.7, "train/step_time": 1.0}, {"step": 2, "train/loss": 0.6, "eval/acc": 0.8},
            {"step": 3, "train/loss": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    path = C.write_model_card(str(model), run_dir=str(run), step=2, trainer="rm", command="python -m x --y 1")
    card = open(path).read()
    head = card.split("---")[1]
    assert "base_model: Qwen/Qwen2.5-0.5B" in head and "datasets:\n- OpenRLHF/pairs\n" in head
    assert str(run) not in head and "- reward-model" in head and "pipeline_tag: text-classification" in head
    assert f"`OpenRLHF/pairs`, `{run}`" in card and "a snapshot at step 2" in card
    assert "| `train/loss` | 0.6 | 2 |" in card and "| `eval/acc` | 0.8 | 2 |" in card
    assert "step_time" not in card and "lora_alpha" not in card and "| `seed` | `0` |" in card
    assert "python -m x --y 1" in card and "AutoModelForSequenceClassification" in card
    assert C.write_model_card(str(tmp_path / "elsewhere")) is None  # not on this host: nothing written


def test_completions_table_goes_to_jsonl_console_tensorboard_and_wandb(tmp_path, monkeypatch, capsys):
    seen: list = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, data, step=None):
            seen.append((step, data))

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init, fake.Table = (lambda **kw: Run()), Table
    monkeypatch.setitem(sys.modules, "wandb", fake)
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    logger = M.MetricsLogger(str(tmp_path / "run"), tensorboard_dir=str(tb), wandb=M.WandbSettings())
    rows = [M.SampleRow("1+2=", "3</s>", 1.0, "3"), M.SampleRow("4+4=", "9</s>", 0.0, "8"),
            M.SampleRow("a|b\n", "x", 0.5, None), M.SampleRow("5+5=", "01</s>", 1.0, "01")]
    logger.log_completions(3, rows)
    logger.truncate(2)  # a resume from step 2 drops the step-3 table too
    logger.log_completions(3, rows[:1])
    logger.close()
    got = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert got == [{"step": 3, "prompt": "1+2=", "completion": "3</s>", "reward": 1.0, "label": "3"}]
    out = capsys.readouterr().out
    assert "[samples step 3] (first 3 of 4; all in completions.jsonl)" in out
    assert "  reward=1 label='3' '1+2=' -> '3</s>'" in out and "'5+5='" not in out
    (step, data), = seen[:1]
    assert step == 3 and data["completions"].columns == ["step", "prompt", "completion", "reward", "label"]
    assert data["completions"].data[1] == [3, "4+4=", "9</s>", 0.0, "8"]
    md = M.sample_markdown(rows[2:3])
    assert md.splitlines()[2] == "| a\\|b\\n | x | 0.5 |  |"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    assert any("completions" in t for t in acc.Tags()["tensors"])


def test_tensorboard_run_folders(tmp_path, monkeypatch):
    """Each run writes <root>/<run name>: --wandb_run_name, else the run directory's name and the time;
    a folder that exists already gets a suffix, so two runs never merge into one TensorBoard run."""
    root = str(tmp_path / "tb")
    monkeypatch.setattr(M.time, "strftime", lambda fmt: "20250102-030405")
    assert M.tensorboard_run_dir(root, "exp1", "ckpt/sft") == os.path.join(root, "exp1")
    first = M.tensorboard_run_dir(root, None, "ckpt/sft/")
    assert first == os.path.join(root, "sft_20250102-030405")
    os.makedirs(first)
    assert M.tensorboard_run_dir(root, None, "ckpt/sft") == first + "-2"


def test_axis_ticks_are_readable_at_any_scale():
    """A curve moving in its fifth digit gets distinct tick labels (not "3.17" five times); large and
    small magnitudes keep 3 significant digits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert P.tick_digits([3.17012, 3.17014, 3.17016]) == 6 and P.tick_digits([0.0, 0.5, 1.0]) == 3
    for values in ([3.1701 + 1e-4 * i for i in range(9)], [1e-7 * i for i in range(9)], [1e6 + i for i in range(9)]):
        rows = [{"step": i + 1, "train/entropy": v} for i, v in enumerate(values)]
        fig, ax = plt.subplots()
        P._draw(ax, P.PANELS["entropy"], ["train/entropy"], rows)
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        plt.close(fig)
        assert len(labels) >= 3 and len(set(labels)) == len(labels), labels


def test_seconds_per_step_is_the_mean_since_the_last_line(tmp_path, monkeypatch, capsys):
    """Steps 1-2 take 10 s in all, steps 3-4 (with an evaluation between) 38 s: the lines say 5 and 19
    s/step, whatever the last step's own time (0.39 s) was."""
    clock = iter([10.0, 48.0])
    logger = M.MetricsLogger(str(tmp_path))
    monkeypatch.setattr(M.time, "monotonic", lambda: 0.0)
    logger.start(0)
    monkeypatch.setattr(M.time, "monotonic", lambda: next(clock))
    logger.log(2, {"loss": 1.0, "step_time": 0.39}, total=4)
    logger.log(4, {"loss": 0.5, "step_time": 0.39, "eval/loss": 0.7}, total=4)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[step 2/4] loss=1 (5 s/step)" and out[1] == "[step 4/4] loss=0.5 (19 s/step)"
    assert out[2] == "[eval step 4] loss=0.7"
