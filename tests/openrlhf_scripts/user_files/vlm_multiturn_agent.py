"""rlhfkit's copy of OpenRLHF examples/python/vlm_multiturn_agent.py (OpenRLHF 6c6056da), a multi-turn
agent of a vision-language policy: pictures in the prompt (from the dataset) and in the environment's
feedback (screenshots). A file written for OpenRLHF differs only in its import line (changed:
openrlhf.utils.agent -> rlhfkit.agents).

Each episode lasts 3 or 4 turns, drawn at random. On an even intermediate turn the environment
answers with a screenshot (a random 28 x 28 picture) and one picture placeholder in its feedback;
on an odd one with text only. The last turn earns 1.0 when the label appears in the action.

Run with:
    python3 -m rlhfkit.cli.train_ppo_ray --train.agent_func_path vlm_multiturn_agent.py \\
        --actor.model_name_or_path MODEL --data.image_key images --data.max_images_per_prompt 4 ...
"""

import random
from typing import Any, Dict

import numpy as np
import torch
from PIL import Image

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor  # changed: openrlhf.utils.agent -> rlhfkit.agents

# Qwen's chat markers and one picture's placeholder (as the model's chat template writes them)
USER_START = "\n<|im_start|>user\n"
USER_END = "<|im_end|>\n<|im_start|>assistant\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def screenshot() -> Image.Image:
    """Stands in for a capture of the environment's screen: random pixels."""
    rng = np.random.RandomState(random.randint(0, 10000))
    return Image.fromarray(rng.randint(0, 256, (28, 28, 3), dtype=np.uint8))


def score(action_text: str, label: str) -> float:
    """1.0 when the label shows up in the action, else 0.0."""
    return 1.0 if label.lower() in action_text.lower() else 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.choice([3, 4])

    async def reset(self, states: dict, **kwargs):
        self.step_idx = 0
        self.max_steps = random.choice([3, 4])
        return {"observation": states["observation"]}  # the prompt, with its picture placeholders

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        if self.step_idx >= self.max_steps:  # the last turn scores the action
            reward = score(states["action_text"], states["label"])
            return {
                "rewards": torch.tensor(reward),
                "scores": torch.tensor(reward),
                "environment_feedback": "\n<|im_end|>\n",
                "done": True,
                "extra_logs": {"step_count": self.step_idx, "max_steps": self.max_steps},
            }
        if self.step_idx % 2 == 0:  # a new screenshot, one placeholder for it in the feedback
            return {
                "rewards": torch.tensor(0.0),
                "environment_feedback": f"{USER_START}{IMAGE_PLACEHOLDER}\nThe screen now. What next?\n{USER_END}",
                "environment_images": [screenshot()],
                "done": False,
            }
        return {
            "rewards": torch.tensor(0.0),
            "environment_feedback": f"{USER_START}Not yet. Look again and retry.\n{USER_END}",
            "done": False,
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
