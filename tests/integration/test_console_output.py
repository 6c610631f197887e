"""What a user sees on the console (the tiny model on CPU):

- on a terminal the step lines print every --logging_steps above the progress bar, and on a terminal of
  size 0x0 (CI runners, `docker run -t`) as plain lines without a bar; train.log has them either way
  (train_sft and train_ppo under a pty, as subprocesses);
- an RL step line names the truncated share and the share of groups of equal rewards, and a step whose
  groups all had equal rewards prints one hint, once per run;
- transformers' load report goes to train.log only, unless --verbose;
- Ctrl-C in the Python API names `load_checkpoint=True`, not the command line's flag."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
from helpers import rl_flags, subprocess_env, write_rl_data

from test_logging_output import write_qa


def run_in_pty(args: list[str], cols: int, rows: int, timeout: float = 240) -> str:
    """Run `python -m <args>` with stdin, stdout and stderr on a pty of `cols` x `rows`; everything it wrote."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=subprocess_env(), start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the pty
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        proc.wait(timeout=30)
    text = out.decode("utf-8", "replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def step_numbers(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\[step (\d+)/\d+\] ", text)]


def without_line_ends(text: str) -> str:
    return text.replace("\r\n", "\n")  # a pty turns each "\n" into "\r\n": what is left are bar redraws


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory) -> str:
    return write_rl_data(str(tmp_path_factory.mktemp("rl_data")))


@pytest.mark.parametrize("cols,rows", [(120, 40), (0, 0)], ids=["120cols", "0x0"])
def test_step_lines_on_a_terminal(tiny_model_dir, rl_data, tmp_path, cols, rows):
    data, sft_out, rl_out = write_qa(str(tmp_path / "qa.jsonl"), 64), str(tmp_path / "sft"), str(tmp_path / "rl")
    sft = run_in_pty(["rlhfkit.cli.train_sft", "--pretrain", tiny_model_dir, "--dataset", data, "--input_key",
                      "question", "--output_key", "response", "--input_template", "{}", "--max_len", "32",
                      "--train_batch_size", "8", "--micro_train_batch_size", "8", "--max_steps", "4",
                      "--logging_steps", "2", "--learning_rate", "1e-3", "--save_path", sft_out], cols, rows)
    flags = [f for f in rl_flags(tiny_model_dir, rl_data, rl_out, "--logging_steps", "1", steps=3)
             if f != "--disable_progress"]
    rl = run_in_pty(["rlhfkit.cli.train_ppo", *flags], cols, rows)
    for text, out, want, bar in ((sft, sft_out, [2, 4], "train:"), (rl, rl_out, [1, 2, 3], "rl:")):
        assert step_numbers(text) == want, text[-3000:]  # on the console, every --logging_steps
        assert step_numbers(open(os.path.join(out, "train.log")).read()) == want  # and in the run's log
        if cols:  # a bar below them, redrawn in place
            assert f"\r{bar}" in text and "\r" in without_line_ends(text), text[-3000:]
        else:  # a terminal without a size: plain lines, no bar
            assert "\r" not in without_line_ends(text) and "it/s" not in text, text[-3000:]
    line = next(x for x in rl.splitlines() if x.startswith("[step 1/3]"))
    assert re.search(r" truncated_rate=\S+ equal_reward_groups=\S+ ", line), line
    # the shares, from step 1's samples (completions.jsonl holds all 8: 4 prompts x 2)
    samples = [r for r in read_jsonl(os.path.join(rl_out, "completions.jsonl")) if r["step"] == 1]
    groups: dict[str, list[float]] = {}
    for r in samples:
        groups.setdefault(r["prompt"], []).append(r["reward"])
    assert len(samples) == 8 and sorted(map(len, groups.values())) == [2, 2, 2, 2]
    rec = read_jsonl(os.path.join(rl_out, "metrics.jsonl"))[0]
    assert rec["train/equal_reward_groups"] == sum(len(set(g)) == 1 for g in groups.values()) / 4
    assert f" equal_reward_groups={rec['train/equal_reward_groups']:.4g} " in line
    assert f" truncated_rate={rec['train/truncated_rate']:.4g} " in line


CONSTANT_REWARD = "def reward_func(queries, prompts, labels):\n    return [0.5 for _ in queries]\n"


def test_a_step_without_learning_signal_prints_one_hint(tiny_model_dir, tmp_path):
    d = write_rl_data(str(tmp_path), reward_src=CONSTANT_REWARD)
    out = str(tmp_path / "rl")
    r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_ppo", *rl_flags(tiny_model_dir, d, out, steps=3)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    hints = [x for x in r.stderr.splitlines() if x.startswith("hint: ")]
    assert len(hints) == 1, r.stderr  # once, not at each of the 3 flat steps
    assert hints[0].startswith("hint: step 1: in every group the 2 samples of a prompt got the same reward; every "
                               "sample got reward 0.5, so the advantages (group_norm) are all 0: no learning signal")
    assert "--n_samples_per_prompt" in hints[0] and "check the reward" in hints[0]
    lines = [x for x in r.stdout.splitlines() if x.startswith("[step ")]
    assert len(lines) == 3 and all(" equal_reward_groups=1 " in x and " truncated_rate=" in x for x in lines), lines
    assert " policy_loss=0 " in lines[0]


def test_transformers_load_report_only_with_verbose(tiny_model_dir, tmp_path):
    """train_rm loads the tiny causal LM as a sequence classifier: transformers reports the new score head."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join('{"prompt": "%d+1=", "chosen": "%d", "rejected": "0"}\n' % (i, i + 1) for i in range(16)))

    def train_rm(name: str, *extra: str) -> tuple[str, str]:
        out = str(tmp_path / name)
        r = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_rm", "--pretrain", tiny_model_dir, "--dataset",
                            str(data), "--max_len", "16", "--train_batch_size", "8", "--micro_train_batch_size", "8",
                            "--max_steps", "1", "--save_path", out, "--disable_progress", *extra],
                           capture_output=True, text=True, env=subprocess_env(), timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout + r.stderr, open(os.path.join(out, "train.log")).read()

    console, log = train_rm("quiet")
    assert "LOAD REPORT" not in console and "score.weight" not in console, console
    assert "WARNING transformers" in log and "LOAD REPORT" in log and "score.weight" in log  # kept in the run's log
    assert "note: third-party warnings (transformers' load reports" in console and "--verbose" in console
    assert "[step 1/1]" in console
    console, log = train_rm("verbose", "--verbose")
    assert "LOAD REPORT" in console and "score.weight" in console and "note: third-party" not in console


def test_ctrl_c_in_the_api_names_load_checkpoint_true(tiny_model_dir, tmp_path):
    from rlhfkit import SFTConfig, SFTTrainer
    from rlhfkit.trainers.stop import RunStopped

    rows = [{"input": f"{i}+1=", "output": str(i + 1)} for i in range(32)]

    def ctrl_c_at_step_2(state, metrics, backend):
        if state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in a terminal or a notebook's interrupt
        return False

    args = SFTConfig(output_key="output", input_template="{}", max_len=16, train_batch_size=8,
                     micro_train_batch_size=8, max_steps=50, learning_rate=1e-3, save_path=str(tmp_path / "sft"),
                     disable_progress=True)
    trainer = SFTTrainer(tiny_model_dir, args=args, train_dataset=rows, on_step_end=ctrl_c_at_step_2)
    with pytest.raises(RunStopped) as e:
        trainer.train()
    ck = os.path.join(str(tmp_path / "sft"), "checkpoints", "global_step2")
    assert str(e.value) == (f"stopped by SIGINT after step 2: checkpoint {ck}; resume with: the same trainer and "
                            "data, SFTConfig(..., load_checkpoint=True), then train()")
    assert e.value.saved == ck and os.path.isdir(ck)
    args.load_checkpoint, args.max_steps = True, 3  # what the message says resumes the run
    history = SFTTrainer(tiny_model_dir, args=args, train_dataset=rows).train()
    assert [h["step"] for h in history] == [3]
