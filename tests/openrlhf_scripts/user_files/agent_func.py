"""A stand-in for OpenRLHF's examples/python/agent_func.py: a 1-2 step environment with textual
feedback and a 0/1 reward that does not depend on the model being any good (the tiny models never
answer right), so dynamic filtering keeps the groups whose samples differ. Deterministic: the
parity of a checksum of the action. A file written for OpenRLHF differs only in its import line."""

import zlib
from typing import Any, Dict

import torch

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        self.step_idx = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        bit = zlib.crc32(states["action_text"].encode()) % 2
        done = self.step_idx >= 2 or bit == 1
        reward = torch.tensor(float(bit)) if done else torch.tensor(0.0)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "" if done else "\nTry again: ",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"steps": torch.tensor(float(self.step_idx))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
