"""`torchrun --nproc_per_node 2 -m rlhfkit.cli.batch_inference --tp_size 2` (builtin engine, gloo, CPU)
writes the same greedy generations as one process: one tensor-parallel engine over both ranks, shard 0
serving the requests and writing the file, shard 1 running its steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import free_port, pythonpath
from rlhfkit.cli.batch_inference import main

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tp2_batch_inference_equals_one_process(tiny_qwen2_dir, tmp_path):
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"{i}+{2 * i}=?"}) + "\n" for i in range(6)))
    flags = ["--eval_task", "generate", "--pretrain", tiny_qwen2_dir, "--dataset", str(prompts),
             "--input_key", "question", "--input_template", "Q: {}\nA: ", "--max_new_tokens", "12",
             "--greedy_sampling", "--best_of_n", "1", "--device", "cpu", "--disable_progress"]
    main(flags + ["--output_path", str(tmp_path / "one.jsonl")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "rlhfkit.cli.batch_inference", *flags,
           "--tp_size", "2", "--output_path", str(tmp_path / "tp2.jsonl")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one = [json.loads(x) for x in open(tmp_path / "one.jsonl")]
    two = [json.loads(x) for x in open(tmp_path / "tp2.jsonl")]
    assert len(one) == 6 and [r["output"] for r in two] == [r["output"] for r in one]
    assert any(r["output"] for r in one)


def test_tp_size_without_torchrun_names_the_launcher(tiny_qwen2_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "1+1=?"}) + "\n")
    with pytest.raises(SystemExit):
        main(["--eval_task", "generate", "--pretrain", tiny_qwen2_dir, "--dataset", str(prompts), "--input_key",
              "question", "--max_new_tokens", "4", "--tp_size", "2", "--device", "cpu",
              "--output_path", str(tmp_path / "o.jsonl")])
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().err
