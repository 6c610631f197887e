"""A GEM game as a multi-turn environment: `--agent_func_path examples/agent_func_gem.py`
(needs `pip install gem-llm`; the environment id comes from $GEM_ENV_ID).

The agent API is OpenRLHF's (as in its `agent_func_gem_multiturn.py`): each episode makes a game
with `gem.make(ENV_ID)`; `env.reset(seed)` gives the game's instructions, which become the first
user turn (the dataset prompt is not used; an integer label seeds the game, else it is random);
each action is passed to `env.step(action_text)`, whose (observation, reward, terminated,
truncated, info) becomes the next user turn, the step reward (at least -1) and the end of the
episode. Turns are ChatML, as Qwen models and the tiny test models use. The reward of the episode
is the sum of the step rewards; only the model's actions are trained on.
"""

import os
import random
from typing import Any, Dict

import gem
import torch

from rlhfkit.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

ENV_ID = os.environ.get("GEM_ENV_ID", "game:GuessTheNumber-v0-easy")
END_OF_ACTION = "<|im_end|>\n"  # closes the assistant turn (the decoded action has no special tokens)


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def game_seed(label: Any) -> int:
    try:
        return int(label)
    except (TypeError, ValueError):
        return random.randint(0, 2**31 - 1)


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.env = gem.make(ENV_ID)
        self.turns = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        instructions, _info = self.env.reset(game_seed(states.get("label")))
        self.turns = 0
        return {"observation": user_turn(instructions)}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        observation, reward, terminated, truncated, _info = self.env.step(states["action_text"])
        self.turns += 1
        reward = torch.tensor(max(float(reward), -1.0))
        done = bool(terminated or truncated)
        feedback = END_OF_ACTION + (f"<|im_start|>user\n{observation}<|im_end|>\n" if done else user_turn(observation))
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"turn_count": torch.tensor(float(self.turns))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
