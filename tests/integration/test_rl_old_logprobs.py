"""The old policy's log-prob pass is skipped when a rollout makes one optimizer step.

Then the policy that scores the samples in training is the old one, so the training pass's own
log-probs (detached) are the old log-probs and the ratio is 1 (TRL's GRPOTrainer does the same).

    equivalence   GRPO on the tiny model (rl_flags: 8 samples, --train_batch_size 8, KL as a loss),
                  3 steps with the pass (--recompute_old_logprobs) and without: the same rewards
                  (1e-6: the same samples), policy_loss / kl_loss / kl / grad_norm within rel 1e-4,
                  final weights within 1e-4 (mean difference < 1e-7) while the steps move them by
                  > 1e-3; only the run without
                  the pass logs old_logprobs_pass 0 and ppo_kl / clip_ratio of exactly 0
    decision      the pass runs for 2 epochs, for 2 mini-batches, for a KL penalty in the reward, for
                  an adaptive KL controller, while the actor is frozen, with --recompute_old_logprobs
                  and without the update shape; it is skipped for one step (KL loss or no reference)
    guard         an actor given no old log-probs for 2 optimizer steps refuses
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import read_run, rl_flags, write_rl_data

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.cli import train_ppo
from rlhfkit.trainers.rl import RLLoopConfig, RLTrainer

pytestmark = pytest.mark.slow


@pytest.fixture
def data_dir(tmp_path) -> str:
    return write_rl_data(str(tmp_path))


SAMPLE_KEYS = ["train/reward", "train/reward_std", "train/response_length"]
TRAIN_KEYS = ["train/policy_loss", "train/kl_loss", "train/kl", "train/grad_norm"]


def test_skipped_pass_equals_recomputed_pass(tiny_model_dir, data_dir):
    runs = {}
    for name, extra in (("skip", ()), ("pass", ("--recompute_old_logprobs",))):
        save = os.path.join(data_dir, name)
        train_ppo.main(rl_flags(tiny_model_dir, data_dir, save, *extra, steps=3))
        runs[name] = read_run(save)
    (rs, ws), (rp, wp) = runs["skip"], runs["pass"]
    assert [r["step"] for r in rs] == [r["step"] for r in rp] == [1, 2, 3]
    for a, b in zip(rs, rp):
        assert a["train/old_logprobs_pass"] == 0.0 and b["train/old_logprobs_pass"] == 1.0
        assert a["train/ppo_kl"] == 0.0 and a["train/clip_ratio"] == 0.0
        for k in SAMPLE_KEYS:
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
        for k in TRAIN_KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    assert rs[-1]["train/kl"] > 0  # the KL the policy reported is a real one
    _, w0 = read_run_initial(tiny_model_dir)
    moved = max((ws[k] - w0[k]).abs().max().item() for k in ws if k in w0)
    assert moved > 1e-3
    # the two passes differ by float32 rounding (~1e-7 in a log-prob), which Adam's scale-free update
    # can lift to ~lr x 1e-2 on an element whose gradient is itself at rounding level
    diffs = torch.cat([(ws[k] - wp[k]).abs().flatten() for k in ws])
    assert diffs.max().item() < 1e-4 and diffs.mean().item() < 1e-7, (diffs.max().item(), diffs.mean().item())


def read_run_initial(model_dir: str):
    from safetensors.torch import load_file

    return None, load_file(os.path.join(model_dir, "model.safetensors"))


def _decide(*, batch_rows=8, ref=True, **cfg) -> bool:
    base = dict(rollout_batch_size=4, n_samples_per_prompt=2, use_kl_loss=True, policy_max_epochs=1,
                policy_train_batch_size=8, show_progress=False)
    base.update(cfg)
    fake = SimpleNamespace(cfg=RLLoopConfig(**base), ref=object() if ref else None, state=SimpleNamespace(step=0),
                           kl_ctl=SimpleNamespace(value=0.01, adaptive=False), dist=DistInfo(rank=0, world_size=1))
    batch = SimpleNamespace(batch_size=batch_rows)
    return RLTrainer._old_logprobs_pass(fake, batch)


def test_when_the_pass_runs():
    assert not _decide()
    assert not _decide(ref=False, use_kl_loss=False)  # no reference: no KL anywhere
    assert _decide(policy_max_epochs=2)
    assert _decide(batch_rows=16)  # 16 samples, 8 per optimizer step: two steps
    assert _decide(use_kl_loss=False)  # KL penalty in the reward, computed before training
    assert _decide(recompute_old_logprobs=True)
    assert _decide(policy_train_batch_size=None)
    assert _decide(freezing_actor_steps=1)
    fake_adaptive = SimpleNamespace(value=0.01, target=6.0, adaptive=True)
    base = dict(rollout_batch_size=4, n_samples_per_prompt=2, use_kl_loss=True, policy_train_batch_size=8,
                show_progress=False)
    fake = SimpleNamespace(cfg=RLLoopConfig(**base), ref=object(), state=SimpleNamespace(step=0),
                           kl_ctl=fake_adaptive, dist=DistInfo(rank=0, world_size=1))
    assert RLTrainer._old_logprobs_pass(fake, SimpleNamespace(batch_size=8))


def test_actor_refuses_missing_old_logprobs_for_two_steps(tiny_model_dir, data_dir, capsys):
    save = os.path.join(data_dir, "guard")
    # two optimizer steps per rollout with the decision forced off: the actor must not guess
    import rlhfkit.trainers.rl as rl

    orig = rl.RLTrainer._old_logprobs_pass
    rl.RLTrainer._old_logprobs_pass = lambda self, batch: False
    try:
        with pytest.raises(SystemExit):
            train_ppo.main(rl_flags(tiny_model_dir, data_dir, save, "--max_epochs", "2", steps=1))
        assert "only when the rollout makes one optimizer step (2 epoch(s)" in capsys.readouterr().err
    finally:
        rl.RLTrainer._old_logprobs_pass = orig
