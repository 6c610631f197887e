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


def test_a_lone_surrogate_row_is_one_line_in_ppo_and_sft(tiny_model_dir, tmp_path, capsys):
    """Issue 42.7: `"\\ud800"` is valid JSON but no text; the tokenizer's TypeError came without file or row."""
    import pytest

    from rlhfkit.cli import train_ppo, train_sft

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "label": "2", "output": "2"}) + "\n"
                    + '{"input": "2+2=", "label": "4", "output": "\\ud800"}\n')
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    runs = {"train_ppo": (train_ppo, ["--prompt_data", str(data), "--label_key", "label", "--remote_rm_url",
                                      str(tmp_path / "r.py"), "--generate_max_len", "6", "--prompt_max_len", "16",
                                      "--rollout_batch_size", "1", "--train_batch_size", "1"]),
            "train_sft": (train_sft, ["--dataset", str(data), "--output_key", "output", "--max_len", "32"])}
    for prog, (cli, flags) in runs.items():
        with pytest.raises(SystemExit) as e:
            cli.main(["--pretrain", tiny_model_dir, "--input_key", "input", "--micro_train_batch_size", "1",
                      "--save_path", str(tmp_path / prog), *flags])
        err = capsys.readouterr().err
        assert e.value.code == 1 and "Traceback" not in err
        assert err.strip().splitlines()[-1] == (f"{prog}: error: {data} row 2: key 'output' is not valid Unicode text "
                                                "(a lone surrogate \\ud800 at character 0)")


def test_a_run_name_never_leads_tensorboard_out_of_its_folder(tiny_model_dir, tmp_path, capsys):
    import pytest

    from rlhfkit.cli import train_sft

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "1+1=", "output": "2"}) + "\n")
    (tmp_path / "tb").mkdir()
    with pytest.raises(SystemExit) as e:
        train_sft.main(["--pretrain", tiny_model_dir, "--dataset", str(data), "--output_key", "output", "--max_len",
                        "16", "--save_path", str(tmp_path / "o"), "--use_tensorboard", str(tmp_path / "tb"),
                        "--wandb_run_name", "../../escaped", "--train_batch_size", "1",
                        "--micro_train_batch_size", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1 and last.startswith("train_sft: error: --wandb_run_name '../../escaped': TensorBoard "
                                                 "writes a run into --use_tensorboard"), last
    assert not os.path.exists(tmp_path.parent / "escaped")
