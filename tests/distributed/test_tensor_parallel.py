"""Tensor parallelism (--ds_tensor_parallel_size) equals one process: losses, gradients, checkpoints.

tp_worker.py runs under torchrun with gloo on CPU in fp32 and computes, on every rank, the one-process
reference on the global batch next to the tensor-parallel run (module docstring there). Two meshes:

Cases: SFT (padded and packed), DPO (reference model tensor-parallel too), an RL policy-loss step with entropy, and
a reward / value model (squared error of its last-token rewards).

    TP 2          2 ranks, a Llama with grouped-query attention (4 heads, 2 KV heads), untied head
    FSDP 2 x TP 2 4 ranks, a Qwen2 (q/k/v biases) with tied embeddings; also one optimizer step,
                  a DCP checkpoint, an HF export and the full state dict, loaded here in one process

Tolerances: the reference and the sharded run add the same fp32 terms in different orders (the
vocabulary's log-sum-exp in two halves, row-wise matmuls summed over ranks), so losses and
gradients agree to ~1e-7; 1e-5 is the issue's bar. The wrong-offset check must miss by far more.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOL = 1e-5
# Weights after Adam steps: Adam divides each gradient by its own running size, so where a gradient is
# near zero the order of a sum (2 shards vs 1) shows in the step (seen: 1.5e-5 on AVX-512 CPUs); a wrong
# split moves a weight by about the learning rate a step (1e-3 and 3e-3 here), 10 to 30 times this.
WEIGHT_TOL = 1e-4


def tiny_tp_model(path: str, arch: str, tied: bool) -> str:
    """The tiny model with an even vocabulary (the character tokenizer has 103 ids: padded to 104)."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    make_tiny_model(path, TinyModelSpec(arch=arch, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                        tie_word_embeddings=tied))
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    model.resize_token_embeddings(104, mean_resizing=False)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return tiny_tp_model(str(tmp_path_factory.mktemp("tp_llama")), "llama", tied=False)


@pytest.fixture(scope="module")
def qwen2_tied_dir(tmp_path_factory) -> str:
    return tiny_tp_model(str(tmp_path_factory.mktemp("tp_qwen2")), "qwen2", tied=True)


def run_worker(nproc: int, model_dir: str, out: str, *extra: str) -> dict:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    cmd = torchrun_cmd(nproc, os.path.join(HERE, "tp_worker.py"), "--model", model_dir, "--tp", "2", "--out", out,
                       *extra)
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def check_equal(res: dict) -> None:
    ok, bad = res["kernel"]["ok"], res["kernel"]["bad"]
    assert max(ok.values()) < TOL, ok
    # a shard offset off by one reads the neighbour's logit as the target: log-probs and gradients move
    assert bad["lp"] > 1e-2 and bad["grad"] > 1e-2, bad
    for case in ("sft", "sft_packed", "dpo", "rl", "rm"):
        r = res[case]
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=TOL), (case, r)
        assert r["grad_diff"] < TOL, (case, r)
        assert r["grad_scale"] > 1e-2, (case, r)  # real gradients, not zeros compared with zeros
    assert res["sft"]["ref_loss"] > 1.0  # an NLL over a 104-token vocabulary
    assert res["sft_packed"]["ref_loss"] == pytest.approx(res["sft"]["ref_loss"], abs=TOL)
    assert abs(res["rl"]["ref_loss"]) > 1e-3
    # every TP log-prob pass (SFT padded and packed, DPO policy and reference, RL) went through the
    # vocabulary-parallel kernel on 104 / 2 logits a rank, never the full 104
    assert res["vocab_parallel"]["calls"] >= 5 and res["vocab_parallel"]["local_vocab"] == [52]


def test_tp2_equals_one_process(llama_dir, tmp_path):
    check_equal(run_worker(2, llama_dir, str(tmp_path / "tp2.json")))


def test_fsdp2_x_tp2_equals_one_process_and_checkpoints_load_in_one_process(qwen2_tied_dir, tmp_path):
    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
    from rlhfkit.models.loader import load_causal_lm

    ck = tmp_path / "ck"
    res = run_worker(4, qwen2_tied_dir, str(tmp_path / "fsdp2_tp2.json"), "--ckpt", str(ck))
    check_equal(res)
    # the global gradient norm mixes (dp, tp) DTensors with dp-only ones (the norms)
    assert res["ckpt"]["grad_norm"] == pytest.approx(res["ckpt"]["ref_grad_norm"], rel=1e-5)

    full = torch.load(ck / "full.pt")
    before = load_causal_lm(ModelConfig(pretrain=qwen2_tied_dir), master_dtype="fp32").state_dict()
    assert max(float((full[k] - before[k]).abs().max()) for k in full) > 1e-3  # the step moved the weights
    assert full["lm_head.weight"].shape == (104, 64) and full["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)

    hf = load_causal_lm(ModelConfig(pretrain=str(ck / "hf")), master_dtype="fp32")
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    sd = hf.state_dict()
    assert set(full) <= set(sd)
    assert all(torch.equal(sd[k], full[k]) for k in full)

    one = FSDP2Backend(load_causal_lm(ModelConfig(pretrain=qwen2_tied_dir), master_dtype="fp32"),
                       BackendConfig(param_dtype="fp32", zero_stage=2),
                       OptimConfig(learning_rate=1e-2, lr_warmup_ratio=0.0), 10, DistInfo())
    assert one.load_checkpoint(str(ck / "dcp")) == {"step": 1}
    sd = one.model.state_dict()
    assert all(torch.equal(sd[k], full[k]) for k in full)
    assert one.steps_done == 1 and len(one.optimizer.state) > 0


def test_train_sft_cli_tp2_first_steps_equal_one_process(llama_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m rlhfkit.cli.train_sft ... --ds_tensor_parallel_size 2`: the
    logged losses and gradient norms of 2 steps and the exported weights equal a 1-process run."""
    import sys

    from safetensors.torch import load_file

    from rlhfkit.trainers.metrics import read_metrics

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    data = tmp_path / "qa.jsonl"
    g = torch.Generator().manual_seed(0)
    with open(data, "w") as f:
        for _ in range(16):
            a, b = torch.randint(0, 50, (2,), generator=g).tolist()
            f.write(json.dumps({"question": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    args = ["--pretrain", llama_dir, "--dataset", str(data), "--input_key", "question", "--output_key", "response",
            "--input_template", "{}", "--max_len", "32", "--train_batch_size", "8", "--micro_train_batch_size", "2",
            "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--disable_progress", "--param_dtype", "fp32",
            "--max_steps", "2", "--logging_steps", "1"]
    runs = {}
    for name, cmd in (("tp", torchrun_cmd(2, "-m", "rlhfkit.cli.train_sft", "--ds_tensor_parallel_size", "2")),
                      ("one", [sys.executable, "-m", "rlhfkit.cli.train_sft"])):
        out = str(tmp_path / name)
        proc = subprocess.run([*cmd, *args, "--save_path", out], env=subprocess_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[name] = (read_metrics(os.path.join(out, "metrics.jsonl")), load_file(os.path.join(out, "model.safetensors")))
    (tp_rows, tp_w), (one_rows, one_w) = runs["tp"], runs["one"]
    assert [r["step"] for r in tp_rows] == [r["step"] for r in one_rows] == [1, 2]
    for a, b in zip(tp_rows, one_rows):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=TOL)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=TOL)
    assert one_rows[0]["train/loss"] > 1.0
    assert sorted(tp_w) == sorted(one_w)
    assert max(float((tp_w[k] - one_w[k]).abs().max()) for k in one_w) < WEIGHT_TOL


def test_train_ppo_cli_tp2_equals_one_process(llama_dir, data_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m rlhfkit.cli.train_ppo ... --ds_tensor_parallel_size 2`: GRPO with a KL
    loss against a tensor-parallel reference, the builtin engine fed by the weight sync (gathered TP
    shards). Step 2 samples with the weights synced after step 1, so equal rewards there check the sync."""
    import sys

    from helpers import read_run, rl_flags

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    runs = {}
    for name, cmd in (("tp", torchrun_cmd(2, "-m", "rlhfkit.cli.train_ppo", "--ds_tensor_parallel_size", "2")),
                      ("one", [sys.executable, "-m", "rlhfkit.cli.train_ppo"])):
        out = str(tmp_path / name)
        proc = subprocess.run([*cmd, *rl_flags(llama_dir, data_dir, out, steps=2)], env=subprocess_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[name] = read_run(out)
    (tp_rows, tp_w), (one_rows, one_w) = runs["tp"], runs["one"]
    assert [r["step"] for r in tp_rows] == [r["step"] for r in one_rows] == [1, 2]
    for a, b in zip(tp_rows, one_rows):
        for k in ("train/reward", "train/response_length", "train/kl", "train/grad_norm", "train/entropy"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])
    assert one_rows[0]["train/grad_norm"] > 1e-2
    assert max(float((tp_w[k] - one_w[k]).abs().max()) for k in one_w) < WEIGHT_TOL
