"""A multi-turn environment with textual feedback, in OpenRLHF's agent format:
`--agent_func_path examples/agent_func_multiturn.py --label_key answer`.

The model has up to MAX_ATTEMPTS tries to give the label. After a wrong try the environment
answers "too low" / "too high" (numbers) or "wrong" as a new user turn and asks again; the
feedback is tokenized and appended to the transcript (never trained on). The reward is given
once, at the end: 1.0 for a right answer at attempt k is discounted to 1.0 * DISCOUNT**(k-1);
0.0 when every attempt was wrong. The feedback uses ChatML turns (the chat template of the tiny
models and of Qwen); change TURN for another template.
"""

from typing import Any, Dict

import torch

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor

MAX_ATTEMPTS = 3
DISCOUNT = 0.5
TURN = "<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>")


def first_line(text: str) -> str:
    for marker in END_MARKERS:
        text = text.split(marker)[0]
    return text.strip().split("\n")[0].strip()


def hint(answer: str, label: str) -> str:
    try:
        return "too low" if float(answer) < float(label) else "too high"
    except ValueError:
        return "wrong"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.attempt = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.attempt = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.attempt += 1
        label = str(states["label"]).strip()
        answer = first_line(states["action_text"])
        correct = answer == label
        done = correct or self.attempt >= MAX_ATTEMPTS
        reward = DISCOUNT ** (self.attempt - 1) if correct else 0.0
        if done:
            feedback = ""
        else:
            feedback = TURN.format(text=f"{answer!r} is {hint(answer, label)}. Try again.")
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(float(correct)),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"attempts": self.attempt, "correct": float(correct)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
