"""A single-turn environment in OpenRLHF's agent format: `--agent_func_path examples/agent_func.py`.

One action per episode: the environment checks the answer against the label (exact match, as in
``examples/reward_func.py``) and ends the episode. A file written for OpenRLHF differs only in
its import line (``from openrlhf.utils.agent import ...``).
"""

from typing import Any, Dict

import torch

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor

END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>")


def first_line(text: str) -> str:
    for marker in END_MARKERS:
        text = text.split(marker)[0]
    return text.strip().split("\n")[0].strip()


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.label = None

    async def reset(self, states: dict, **kwargs) -> dict:
        self.label = states["label"]
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        correct = first_line(states["action_text"]) == str(states["label"]).strip()
        reward = torch.tensor(1.0 if correct else 0.0)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "",
            "done": True,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"correct": float(correct)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
