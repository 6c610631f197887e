"""Vision-language training end to end on the tiny Qwen2.5-VL (CPU, fp32): RL (GRPO, REINFORCE++,
REINFORCE++-baseline, RLOO) with pictures through train_ppo, --freeze_visual_encoder, the reference
forward with pictures, multi-turn agents with environment pictures, the OpenAI executor's image parts,
and VLM SFT and DPO."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os

import pytest
import torch
from helpers import EVEN_REWARD
from vlm_helpers import picture

from rlhfkit.cli import train_dpo, train_ppo, train_sft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "tests", "openrlhf_scripts", "user_files", "vlm_multiturn_agent.py")


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> str:
    """The fraction of even characters of the response: never constant, so every step has a signal
    (a tiny random model never names the colour)."""
    path = tmp_path_factory.mktemp("reward") / "even.py"
    path.write_text(EVEN_REWARD)
    return str(path)


def vlm_rl_flags(model, data, save, *extra, steps=1, reward_file=None):
    return ["--pretrain", model, "--prompt_data", os.path.join(data, "shapes_prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--apply_chat_template", "--image_key", "images", "--max_images_per_prompt", "1",
            "--remote_rm_url", reward_file or os.path.join(ROOT, "examples", "reward_func.py"), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
            "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--micro_rollout_batch_size", "4", "--generate_max_len", "6", "--prompt_max_len", "64",
            "--init_kl_coef", "0", "--actor_learning_rate", "1e-2", "--lr_warmup_ratio", "0", "--param_dtype", "fp32",
            "--max_steps", str(steps), "--save_path", save, "--disable_progress", "--device", "cpu", *extra]


def weights(path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_freeze_keeps_every_vision_weight_while_the_language_model_moves(tiny_vlm_dir, shapes_dir, reward, tmp_path):
    before = weights(tiny_vlm_dir)
    frozen, trained = str(tmp_path / "frozen"), str(tmp_path / "trained")
    hist = train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, frozen, "--freeze_visual_encoder", steps=2,
                                       reward_file=reward))
    assert any(h.get("train/grad_norm", 0) > 0 for h in hist)  # some step had a signal to train on
    after = weights(frozen)
    vision = [n for n in before if ".visual." in f".{n}"]
    assert len(vision) > 20
    assert all(torch.equal(before[n], after[n]) for n in vision)
    assert any(not torch.equal(before[n], after[n]) for n in before if n not in vision)  # the LM moved
    train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, trained, steps=2, reward_file=reward))
    moved = weights(trained)
    assert any(not torch.equal(before[n], moved[n]) for n in vision)  # without the flag the tower trains
    assert os.path.exists(os.path.join(frozen, "preprocessor_config.json"))  # the export loads with its processor


def test_weight_sync_leaves_a_frozen_tower_out(tiny_vlm_dir):
    from rlhfkit.parallel.sharding import iter_full_params
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.loader import load_causal_lm

    def synced(freeze):
        model = load_causal_lm(ModelConfig(pretrain=tiny_vlm_dir, param_dtype="fp32", freeze_visual_encoder=freeze))
        return [n for n, _ in iter_full_params(model)]

    frozen, full = synced(True), synced(False)
    assert not any("visual" in n for n in frozen) and any("visual" in n for n in full)
    assert set(frozen) == {n for n in full if "visual" not in n}


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "rloo"])
def test_estimators_with_a_reference_that_sees_the_pictures(estimator, tiny_vlm_dir, shapes_dir, reward, tmp_path):
    """One step with a KL loss against the reference: the reference scores the same rows with the same
    pictures as the policy, so the first step's KL is 0 (a reference forward without pictures would not be)."""
    hist = train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, str(tmp_path / "run"), "--advantage_estimator",
                                       estimator, "--init_kl_coef", "0.01", "--use_kl_loss", "--kl_estimator", "k3",
                                       reward_file=reward))
    assert abs(hist[0]["train/kl"]) < 1e-6 and hist[0]["train/grad_norm"] > 0
    assert hist[0]["data/dropped_image_rows"] == 0


def test_hf_engine_rollouts(tiny_vlm_dir, shapes_dir, tmp_path):
    hist = train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, str(tmp_path / "run"), "--rollout_engine", "hf"))
    assert hist[0]["train/response_length"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--advantage_estimator", "gae"], "vision-language RL has no critic"),
    (["--rollout_engine", "vllm"], "--rollout_engine vllm does not take pictures"),
    (["--max_images_per_prompt", "-1"], "--max_images_per_prompt must be >= 0"),
])
def test_settings_vlm_mode_refuses(extra, message, tiny_vlm_dir, shapes_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, str(tmp_path / "run"), *extra))
    err = capsys.readouterr().err
    assert err.startswith("train_ppo: error: ") and message in err and err.count("\n") == 1


def test_text_model_refuses_pictures_and_packing_is_off(tiny_model_dir, tiny_vlm_dir, shapes_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_ppo.main(vlm_rl_flags(tiny_model_dir, shapes_dir, str(tmp_path / "a")))
    assert "needs a vision-language model; --pretrain" in capsys.readouterr().err
    train_ppo.main(vlm_rl_flags(tiny_vlm_dir, shapes_dir, str(tmp_path / "b"), "--packing_samples"))
    assert "--packing_samples has no effect with --max_images_per_prompt" in capsys.readouterr().out


@pytest.mark.parametrize("max_images, pictures", [(4, 2.0), (1, 1.0)])
def test_multi_turn_agent_sees_environment_pictures(max_images, pictures, tiny_vlm_dir, shapes_dir, tmp_path):
    """OpenRLHF's VLM agent (rlhfkit's copy): 3-4 turns, a screenshot on turn 2. With room for 4 pictures
    every episode holds the prompt's and the screenshot; with 1, the screenshot is left out (its
    placeholder stripped) and the run goes on."""
    flags = vlm_rl_flags(tiny_vlm_dir, shapes_dir, str(tmp_path / "run"), "--agent_func_path", AGENT,
                         "--max_len", "256")
    i = flags.index("--remote_rm_url")
    del flags[i:i + 2]
    flags[flags.index("--max_images_per_prompt") + 1] = str(max_images)
    hist = train_ppo.main(flags)
    assert hist[0]["train/episode_pictures"] == pictures


def test_sft_and_dpo_with_pictures(tiny_vlm_dir, shapes_dir, tmp_path):
    common = ["--pretrain", tiny_vlm_dir, "--apply_chat_template", "--image_key", "images",
              "--max_images_per_prompt", "1", "--max_len", "64", "--train_batch_size", "8",
              "--micro_train_batch_size", "4", "--max_steps", "2", "--param_dtype", "fp32", "--disable_progress",
              "--lr_warmup_ratio", "0"]
    sft = train_sft.main([*common, "--dataset", os.path.join(shapes_dir, "shapes_train.jsonl"), "--input_key",
                          "prompt", "--output_key", "output", "--learning_rate", "3e-3", "--save_path",
                          str(tmp_path / "sft")])
    assert len(sft) == 2 and sft[1]["train/loss"] < sft[0]["train/loss"]
    dpo = train_dpo.main([*common, "--dataset", os.path.join(shapes_dir, "shapes_preference.jsonl"),
                          "--prompt_key", "prompt", "--learning_rate", "1e-3", "--save_path", str(tmp_path / "dpo")])
    # policy == reference at the first step: the loss is -log sigmoid(0) exactly when both see the pictures alike
    assert dpo[0]["train/loss"] == pytest.approx(0.6931, abs=1e-4)


def test_openai_executor_takes_image_content_parts(tiny_vlm_dir):
    pytest.importorskip("openai")
    from rlhfkit.agents import AgentConfig, OpenAIAgentExecutor
    from rlhfkit.data.images import load_vision_processor
    from rlhfkit.models.vlm import VisionContext, VisionLayout, placeholder_text
    from rlhfkit.types import Completion, PromptSample, SamplingParams
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    layout = VisionLayout.of(AutoConfig.from_pretrained(tiny_vlm_dir))
    vision = VisionContext(load_vision_processor(tiny_vlm_dir), layout, placeholder_text(tok, layout), 2)

    class Engine:
        def __init__(self):
            self.requests = []

        async def agenerate(self, req):
            self.requests.append(req)
            ids = tok("red", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return [Completion(list(req.prompt_token_ids), ids, [-0.5] * len(ids), "stop", req.request_id)]

    raw = io.BytesIO()
    picture((200, 30, 30), (56, 56)).save(raw, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(raw.getvalue()).decode()

    async def agent(prompt, label, session):
        async with session.client() as client:
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
            reply = await client.chat.completions.create(model=session.model,
                                                         messages=[{"role": "user", "content": content}])
        return float(reply.choices[0].message.content == label)

    engine = Engine()
    cfg = AgentConfig(max_length=128, sampling_params=SamplingParams(max_new_tokens=8), vision=vision)
    ex = OpenAIAgentExecutor(run_agent=agent).setup(engine, tok, cfg)
    (t,) = asyncio.run(ex.run_episodes([PromptSample(prompt="Colour?", label="red")], 1)).trajectories
    req = engine.requests[0]
    pad = layout.image_token_id
    assert len(req.images) == 1 and req.prompt_token_ids.count(pad) == 4  # 56 x 56: 4 picture tokens
    assert t.reward == 1.0 and t.images is req.images and t.token_ids.count(pad) == 4
    assert t.token_ids[:t.prompt_len] == req.prompt_token_ids and sum(t.action_mask) == 4
    text_only = OpenAIAgentExecutor(run_agent=agent).setup(Engine(), tok, AgentConfig(
        max_length=128, sampling_params=SamplingParams(max_new_tokens=8)))
    from rlhfkit.agents import RewardFailure

    with pytest.raises(RewardFailure, match="400"):  # a text-only policy refuses pictures
        asyncio.run(text_only.run_episodes([PromptSample(prompt="Colour?", label="red")], 1))
