"""A tiny VLM learns to answer from the picture: SFT, then GRPO, on `make_data shapes` (the colour of a
picture's background; every prompt has the same text, so a policy that ignores the picture is right at
most as often as the commonest colour). Held-out accuracy (greedy, pictures never trained on):

    random tiny Qwen2.5-VL          0.00    (it never writes a colour)
    after SFT (32 steps)           ~0.47    (the eval at GRPO's step 0)
    after GRPO (12 steps, n = 8)   ~1.00    (docs/vlm.md records the numbers of this run)

The accuracies come from the RL loop's own evaluation (--eval_dataset, greedy, eval/pass1 = the mean
exact-match score of examples/reward_func.py) and, for the untrained model, from greedy generation
with the builtin engine scored by the same function.
"""

from __future__ import annotations

import collections
import json
import os

import torch
from vlm_helpers import load_vlm, prompt

from rlhfkit.cli import make_data, train_ppo, train_sft
from rlhfkit.data.images import check_image
from rlhfkit.rollout import build_engine
from rlhfkit.types import GenerationRequest, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD = os.path.join(ROOT, "examples", "reward_func.py")
COMMON = ["--apply_chat_template", "--image_key", "images", "--max_images_per_prompt", "1", "--param_dtype", "fp32",
          "--lr_warmup_ratio", "0", "--lr_scheduler", "constant", "--disable_progress"]


def greedy_accuracy(model_dir: str, data: str) -> float:
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_func", REWARD)
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    model, tok, layout, proc = load_vlm(model_dir)
    rows = [json.loads(line) for line in open(os.path.join(data, "shapes_eval.jsonl"))]
    reqs = []
    for i, r in enumerate(rows):
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
                                        r["prompt"].replace("<image>", "")}]}], tokenize=False,
                                       add_generation_prompt=True)
        pics = proc.process([check_image(os.path.join(data, r["images"][0]), "eval", proc.limits)[1]])
        reqs.append(GenerationRequest(prompt(tok, layout, text, pics), SamplingParams(temperature=0, max_new_tokens=8),
                                      i, pics))
    engine = build_engine("builtin", model, tok, device="cpu", dtype=torch.float32, max_model_len=64, max_num_seqs=64)
    answers = [tok.decode(o[0].token_ids, skip_special_tokens=False) for o in engine.generate(reqs)]
    return sum(reward.same_answer(reward.extract_answer(a), r["label"]) for a, r in zip(answers, rows)) / len(rows)


def test_sft_then_grpo_learns_what_only_the_picture_shows(tiny_vlm_dir, tmp_path):
    data = str(tmp_path / "data")
    make_data.main(["shapes", "--out", data, "--num_train", "128", "--num_prompts", "128", "--num_eval", "64",
                    "--num_pairs", "8"])
    labels = [json.loads(line)["label"] for line in open(os.path.join(data, "shapes_eval.jsonl"))]
    text_only_best = max(collections.Counter(labels).values()) / len(labels)  # a policy blind to the picture
    base = greedy_accuracy(tiny_vlm_dir, data)
    sft = str(tmp_path / "sft")
    train_sft.main(["--pretrain", tiny_vlm_dir, "--dataset", os.path.join(data, "shapes_train.jsonl"), "--input_key",
                    "prompt", "--output_key", "output", "--max_len", "64", "--train_batch_size", "16",
                    "--micro_train_batch_size", "16", "--max_epochs", "4", "--learning_rate", "3e-3",
                    "--save_path", sft, *COMMON])
    hist = train_ppo.main(["--pretrain", sft, "--prompt_data", os.path.join(data, "shapes_prompts.jsonl"),
                           "--input_key", "prompt", "--label_key", "label", "--remote_rm_url", REWARD,
                           "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
                           "--rollout_batch_size", "16", "--train_batch_size", "128", "--micro_train_batch_size", "32",
                           "--micro_rollout_batch_size", "32", "--generate_max_len", "8", "--prompt_max_len", "64",
                           "--init_kl_coef", "0", "--actor_learning_rate", "1e-3", "--temperature", "1.0",
                           "--eval_dataset", os.path.join(data, "shapes_eval.jsonl"), "--eval_steps", "12",
                           "--eval_temperature", "0", "--eval_n_samples_per_prompt", "1", "--max_steps", "12",
                           "--num_episodes", "10", "--seed", "1", "--save_path", str(tmp_path / "grpo"), *COMMON])
    evals = {h["step"]: h["eval/pass1"] for h in hist if "eval/pass1" in h}
    after_sft, after_grpo = evals[0], evals[12]
    print(f"held-out accuracy: base {base:.3f}, after SFT {after_sft:.3f}, after GRPO {after_grpo:.3f}, "
          f"best text-only {text_only_best:.3f}")
    assert base <= 0.1
    assert after_sft > base and after_grpo > after_sft + 0.2
    assert after_grpo >= 0.9 > text_only_best + 0.4  # far beyond what the text alone allows
