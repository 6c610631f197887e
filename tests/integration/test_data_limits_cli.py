"""Data errors end a run with exit code 1 and one line naming the file and row (train_ppo, train_sft)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT, pythonpath


def run(module: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300, env=env)


def test_rl_null_label_and_oversized_row(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "label": "2"}) + "\n" + json.dumps({"input": "2+2=", "label": None})
                    + "\n")
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    common = ["--pretrain", tiny_model_dir, "--prompt_data", str(data), "--input_key", "input", "--label_key", "label",
              "--remote_rm_url", str(tmp_path / "r.py"), "--generate_max_len", "6", "--prompt_max_len", "16",
              "--rollout_batch_size", "1", "--train_batch_size", "1", "--micro_train_batch_size", "1",
              "--save_path", str(tmp_path / "o"), "--device", "cpu"]
    r = run("rlhfkit.cli.train_ppo", *common)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"train_ppo: error: {data} row 2: key 'label' (--label_key) is null; "
                                                 "every prompt needs a label when --label_key is given")
    assert "Traceback" not in r.stderr
    r = run("rlhfkit.cli.train_ppo", *common, "--max_row_bytes", "20")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        f"train_ppo: error: {data} row 1: 31 bytes, more than --max_row_bytes 20")


def test_sft_non_utf8_row(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_bytes(b'{"question": "1+1=", "response": "2"}\n{"question": "\xff", "response": "2"}\n')
    r = run("rlhfkit.cli.train_sft", "--pretrain", tiny_model_dir, "--dataset", str(data), "--input_key", "question",
            "--output_key", "response", "--max_len", "32", "--save_path", str(tmp_path / "o"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"train_sft: error: {data} row 2: not valid UTF-8 text"
