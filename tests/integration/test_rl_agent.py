"""A multi-turn agent file in OpenRLHF's format (examples/agent_func_multiturn.py) drives train_ppo.

The environment answers a wrong attempt with a ChatML user turn ("'7' is too low. Try again.")
and allows 3 attempts. A spy on the policy's `train_on` keeps the experience it trains on; the
test replays each trajectory from its tokens alone (action = up to --generate_max_len tokens or
through eos, then the feedback text the environment gives for that action, tokenized) and checks
that `loss_mask` is 1 exactly on the action tokens and 0 on the prompt and on every feedback
token, that advantages and rollout log-probs are 0 there too, and that feedback was appended.
"""

from __future__ import annotations

from functools import wraps

import importlib.util
import json
import os

import torch
from helpers import ppo_flags

from rlhfkit.cli import train_ppo
from rlhfkit.roles.actor import ActorRole
from rlhfkit.tasks.addition import addition_splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_FILE = os.path.join(ROOT, "examples", "agent_func_multiturn.py")
GEN, MAX_LEN = 6, 128


def load_env():
    spec = importlib.util.spec_from_file_location("agent_env_for_test", AGENT_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expected_mask(ids: list[int], label: str, tok, env, eos: int) -> tuple[list[int], int]:
    """Replay one episode from its tokens: (action mask, number of feedback tokens)."""
    prompt_end = ids.index(tok.convert_tokens_to_ids("=")) + 1  # prompts are "a+b="
    mask, pos, attempt, feedback_tokens = [0] * prompt_end, prompt_end, 0, 0
    while pos < len(ids):
        end = pos
        while end < min(pos + GEN, MAX_LEN, len(ids)):
            end += 1
            if ids[end - 1] == eos:
                break
        action = ids[pos:end]
        mask += [1] * len(action)
        pos, attempt = end, attempt + 1
        answer = env.first_line(tok.decode(action, skip_special_tokens=True))
        done = answer == label or attempt >= env.MAX_ATTEMPTS
        text = "" if done else env.TURN.format(text=f"{answer!r} is {env.hint(answer, label)}. Try again.")
        fb = tok(text, add_special_tokens=False)["input_ids"][:MAX_LEN - pos]
        assert ids[pos:pos + len(fb)] == fb, "the environment's feedback is not what follows the action"
        mask += [0] * len(fb)
        pos, feedback_tokens = pos + len(fb), feedback_tokens + len(fb)
        if done:
            break
    assert pos == len(ids), "tokens left over after the last turn"
    return mask, feedback_tokens


def test_multi_turn_agent_masks_environment_tokens(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    rows, _ = addition_splits(4, 2, seed=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": r["input"], "answer": r["label"]}) + "\n" for r in rows))
    seen = []
    real = ActorRole.train_on
    monkeypatch.setattr(ActorRole, "train_on", wraps(real)(lambda self, b, kl=0.0: seen.append(b) or real(self, b, kl)))
    train_ppo.main(ppo_flags(tiny_model_dir, str(prompts), str(tmp_path / "out"), "--agent_func_path", AGENT_FILE,
                             label_key="answer", advantage_estimator="reinforce_baseline", rollout_batch_size=2,
                             train_batch_size=4, generate_max_len=GEN, max_len=MAX_LEN, max_steps=2,
                             init_kl_coef="0.01", use_kl_loss=True))

    env, tok = load_env(), AutoTokenizer.from_pretrained(tiny_model_dir)
    labels = {r["input"]: r["label"] for r in rows}
    assert len(seen) == 2
    total_feedback = 0
    for batch in seen:
        for i in range(batch.batch_size):
            n = int(batch.attention_mask[i].sum())
            ids = batch.input_ids[i, :n].tolist()
            prompt = tok.decode(ids[:ids.index(tok.convert_tokens_to_ids("=")) + 1])
            want, fb = expected_mask(ids, labels[prompt], tok, env, tok.eos_token_id)
            got = batch.loss_mask[i, :n].tolist()
            assert got == want, f"row {i}: loss_mask {got} != replayed action mask {want}"
            assert not batch.loss_mask[i, n:].any()
            off = ~batch.loss_mask[i].bool()
            assert not batch.advantages[i][off].any() and not batch.rollout_logprobs[i][off].any()
            total_feedback += fb
    assert total_feedback > 0, "no episode got environment feedback: the test would not show the masking"
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2]
    assert all("train/attempts" in r and 1 <= r["train/attempts"] <= 3 for r in recs)  # the agent's extra_logs
    torch.testing.assert_close(torch.tensor([r["train/reward"] for r in recs]),
                               torch.stack([b.rewards.float().mean() for b in seen]), atol=1e-6, rtol=0)
