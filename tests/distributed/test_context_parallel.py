"""Context parallelism (--ring_attn_size) equals one process: cp_worker.py under torchrun, gloo, fp32.

One process (the reference) and a ring of 2 (dp 1 x cp 2) run the same global batches through the
FSDP2 backend and the real tasks and roles: SFT and DPO (loss and every parameter's full gradient
after one backward), padded and packed (--packing_samples), an RL step (old log-probs, entropy,
PPO metrics and the weights after the update, padded and packed), critic values, a left-padded
reward score and a critic update, and two steps of the SFT loop (metric reductions, eval). A 4-rank dp 2 x cp 2 run
must equal 2 ranks of pure data parallelism (same data shares and shuffles).

Tolerance 1e-5 (absolute on gradients of size ~0.1-0.3 and on losses ~2-5; the ring adds the same
terms in another order, observed differences are ~1e-7). The worker's --break modes (targets shifted
per shard instead of on the full row; FSDP sharded over dp only, so the cp ranks' partial gradients
are never summed) must break the comparison: the test is able to fail.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import subprocess_env, torchrun_cmd

# --dist loadgroup: one worker builds its one-process reference, not each worker that runs one of the tests
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("context_parallel")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "cp_worker.py")
TOL = 1e-5


def run(nproc: int, cp: int, model: str, out: str, *extra: str) -> dict:
    args = ["--model", model, "--cp", str(cp), "--out", out, *extra]
    cmd = torchrun_cmd(nproc, WORKER, *args) if nproc > 1 else [sys.executable, WORKER, *args]
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def max_diff(a, b) -> float:
    """Largest absolute difference over nested dicts / lists of tensors and numbers."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list):
        assert len(a) == len(b)
        return max((max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return abs(float(a) - float(b))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """2 layers, 4 query heads over 2 key/value heads (grouped-query attention; stride 1: two ring passes)."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    path = str(tmp_path_factory.mktemp("cp_llama"))
    return make_tiny_model(path, TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=256))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict:
    return run(1, 1, model_dir, str(tmp_path_factory.mktemp("cp_ref") / "ref.pt"))


def _gloo():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def test_ring2_equals_one_process(model_dir, reference, tmp_path):
    _gloo()
    ring = run(2, 2, model_dir, str(tmp_path / "cp2.pt"))
    assert ring.keys() == reference.keys()
    for case in reference:
        assert max_diff(reference[case], ring[case]) < TOL, case
    # the values compared are real: losses, gradients, clipping and updates all non-trivial
    assert reference["sft_padded"]["loss"] > 1.0 and reference["dpo"]["loss"] > 0.1
    assert float(reference["sft_padded"]["grads"]["lm_head.weight"].abs().max()) > 1e-2
    assert reference["rl"]["metrics"]["ppo_clip_ratio"] > 0.05
    assert abs(reference["rl"]["metrics"]["policy_loss"]) > 1e-3
    assert float(reference["rl"]["entropy"].abs().max()) > 1.0
    assert reference["critic"]["metrics"]["value_loss"] > 1e-2


def test_packed_equals_padded_under_ring(reference):
    """--packing_samples changes nothing: one process already checks it, and the ring equals one process."""
    for a, b in (("sft_padded", "sft_packed"), ("dpo", "dpo_packed"), ("rl", "rl_packed")):
        assert max_diff(reference[a], reference[b]) < TOL, (a, b)


def test_dp2_cp2_equals_two_rank_data_parallel(model_dir, tmp_path):
    _gloo()
    cases = ["--cases", "sft_padded,dpo_packed,rl,sft_loop"]
    dp = run(2, 1, model_dir, str(tmp_path / "dp2.pt"), *cases)
    mesh = run(4, 2, model_dir, str(tmp_path / "dp2_cp2.pt"), *cases)
    for case in dp:
        assert max_diff(dp[case], mesh[case]) < TOL, case


@pytest.mark.parametrize("broken,cases", [("shift", ("dpo", "rl")), ("grad", ("sft_padded", "rl", "critic"))])
def test_a_wrong_shift_or_gradient_sum_is_caught(model_dir, reference, tmp_path, broken, cases):
    _gloo()
    bad = run(2, 2, model_dir, str(tmp_path / f"{broken}.pt"), "--cases", ",".join(cases), "--break", broken)
    for case in cases:
        assert max_diff(reference[case], bad[case]) > 100 * TOL, case


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_other_families(arch, tmp_path):
    """Qwen2 (biased q/k/v) and Mixtral (mixture of experts) equal one process as Llama does. Mixtral's
    router loss is each rank's own tokens' loss averaged over the ring: equal on the cp ranks (the worker
    checks) and close to the whole-sequence value, not equal (load balancing is not additive over tokens;
    summed instead of averaged it would be about twice the value)."""
    _gloo()
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    model = make_tiny_model(str(tmp_path / arch), TinyModelSpec(arch=arch, hidden_size=64, num_hidden_layers=2,
                                                               num_attention_heads=4, num_key_value_heads=2,
                                                               max_position_embeddings=256))
    cases = ["--cases", "sft_packed,dpo" + (",sft_aux" if arch == "mixtral" else "")]
    one = run(1, 1, model, str(tmp_path / "one.pt"), *cases)
    ring = run(2, 2, model, str(tmp_path / "ring.pt"), *cases)
    for case in ("sft_packed", "dpo"):
        assert max_diff(one[case], ring[case]) < TOL, case
    if arch == "mixtral":
        assert ring["sft_aux"]["aux"] == pytest.approx(one["sft_aux"]["aux"], rel=0.05)
