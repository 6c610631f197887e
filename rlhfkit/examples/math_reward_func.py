"""Math answer reward: `--remote_rm_url examples/math_reward_func.py --label_key answer`.

Written as an OpenRLHF user writes a reward_func file; for OpenRLHF only the import line differs
(`from openrlhf.utils import extract_boxed_answer, grade_answer`). The answer is the text after
the last "Answer:" of the response, else the content of its last \\boxed{...}; it earns 1.0 when
`grade_answer` finds it mathematically equal to the label (1/2 = 0.5 = \\frac{1}{2}, 1,000 = 1000,
x+1 = 1+x, ...), else 0.0.
"""

import re
from typing import List, Optional

import torch

from rlhfkit.utils import extract_boxed_answer, grade_answer

END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def answer_after_tag(response: str) -> Optional[str]:
    """The rest of the line after the last "Answer:" (any case), or None."""
    found = re.findall(r"answer:\s*(.+?)\s*(?:\n|$)", response, flags=re.IGNORECASE)
    return found[-1] if found else None


def model_answer(response: str) -> Optional[str]:
    for marker in END_MARKERS:
        response = response.replace(marker, "\n")
    tagged = answer_after_tag(response)
    return tagged if tagged is not None else extract_boxed_answer(response)


def reward_func(queries: List[str], prompts: List[str], labels: List[str], **kwargs) -> dict:
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        pred = model_answer(response)
        rewards.append(1.0 if grade_answer(pred, label) else 0.0)
    rewards = torch.tensor(rewards, dtype=torch.float)
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {"math_accuracy": rewards.mean()},
    }
