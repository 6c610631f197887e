"""examples/math_reward_func.py (an OpenRLHF-style reward file using rlhfkit.utils) scores by hand
and drives two train_ppo steps on the tiny model as `--remote_rm_url`."""

from __future__ import annotations

from functools import wraps

import json
import os

import torch

from helpers import ppo_flags
from rlhfkit.cli import train_ppo
from rlhfkit.rewards.reward_file import load_reward_func
from rlhfkit.roles.actor import ActorRole

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD_FILE = os.path.join(ROOT, "examples", "math_reward_func.py")


def test_math_reward_file_scores_answers_by_hand():
    reward_func = load_reward_func(REWARD_FILE)
    p = "<|im_start|>user\nHalf of 1?<|im_end|>\n<|im_start|>assistant\n"
    queries = [
        p + "It is \\boxed{\\frac{1}{2}}.<|im_end|>",    # boxed, equal as numbers -> 1
        p + "Answer: 0.5</s>",                          # tag form -> 1
        p + "\\boxed{2} hmm, no. Answer: 1/2",          # the tag wins over the box -> 1
        p + "\\boxed{\\dfrac{1}{3}}",                   # wrong -> 0
        p + "no answer at all",                         # nothing to grade -> 0
        p + "\\boxed{\\left(1, \\frac{3}{2}\\right)}",  # tuple vs label (1, 1.5) -> 1
    ]
    labels = ["0.5", "\\frac{1}{2}", "0.5", "0.5", "0.5", "(1, 1.5)"]
    out = reward_func(queries, [p] * len(queries), labels)
    assert out["rewards"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert torch.equal(out["scores"], out["rewards"])
    assert abs(float(out["extra_logs"]["math_accuracy"]) - 4 / 6) < 1e-6


def test_math_reward_file_drives_train_ppo(tiny_model_dir, tmp_path, monkeypatch):
    rows = [{"input": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 2), (5, 1))]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    real = ActorRole.train_on
    monkeypatch.setattr(ActorRole, "train_on", wraps(real)(lambda self, b, kl=0.0: seen.append(b.to("cpu")) or real(self, b, kl)))
    train_ppo.main(ppo_flags(tiny_model_dir, str(prompts), str(tmp_path / "out"), reward=REWARD_FILE, label_key="answer",
                             advantage_estimator="reinforce_baseline", rollout_batch_size=2, train_batch_size=4,
                             generate_max_len=8, max_steps=2, init_kl_coef="0.01", use_kl_loss=True))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reward_func = load_reward_func(REWARD_FILE)
    labels = {r["input"]: r["answer"] for r in rows}
    assert len(seen) == 2
    for batch in seen:  # the rewards trained on are the file's rewards for the generated text
        queries, prompts_, labels_ = [], [], []
        for i in range(batch.batch_size):
            ids = batch.input_ids[i, :int(batch.attention_mask[i].sum())].tolist()
            plen = ids.index(tok.convert_tokens_to_ids("=")) + 1
            prompt = tok.decode(ids[:plen])
            queries.append(tok.decode(ids, skip_special_tokens=False))
            prompts_.append(prompt)
            labels_.append(labels[prompt])
        want = reward_func(queries, prompts_, labels_)["rewards"]
        torch.testing.assert_close(batch.rewards.float(), want, atol=0, rtol=0)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2]
    assert all("train/math_accuracy" in r for r in recs)  # the file's extra_logs reach the metrics
