"""Exact-match math reward for `--remote_rm_url examples/reward_func.py --label_key answer`.

The file follows OpenRLHF's reward_func format, so it also works there. For each sample the
response is the query text after the prompt; its answer is, in order of preference, the content
of the last ``\\boxed{...}``, the number after ``####`` (GSM8K), or the response's first line (up
to an end-of-sequence marker). The reward is 1.0 when the answer equals the label (numbers are
compared as numbers: "4.0" matches "4"), else 0.0.
"""

import re

import torch

END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def response_of(query: str, prompt: str) -> str:
    """The generated part of ``query`` (prompt + response, special tokens kept)."""
    return query[len(prompt):] if query.startswith(prompt) else query.split(prompt)[-1]


def extract_answer(response: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
    if boxed:
        return boxed[-1].strip()
    hashes = re.findall(r"####\s*([^\s<]+)", response)
    if hashes:
        return hashes[-1].strip()
    for marker in END_MARKERS:
        response = response.split(marker)[0]
    line = response.strip().split("\n")[0].strip()
    return line or None


def same_answer(answer: str | None, label) -> bool:
    if answer is None:
        return False
    label = str(label).strip()
    try:
        return abs(float(answer.replace(",", "")) - float(label.replace(",", ""))) < 1e-6
    except ValueError:
        return answer == label


def reward_func(queries, prompts, labels):
    answers = [extract_answer(response_of(q, p)) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([float(same_answer(a, lab)) for a, lab in zip(answers, labels)])
    return {
        "rewards": rewards,  # advantages
        "scores": rewards,  # dynamic filtering (0/1)
        "extra_logs": {"answer_found": torch.tensor([float(a is not None) for a in answers])},
    }
