"""Multi-turn environment of a vision-language policy: `--agent_func_path examples/agent_func_vlm.py`
with `--max_images_per_prompt 2` (the prompt's picture and one the environment sends).

The policy answers the prompt's question about its picture (e.g. `make_data shapes`: "What colour is
the background?"). The first line of a right answer (equal to the label) ends the episode with reward
1.0. A wrong one gets a second try: the environment sends a colour chart (a picture of red, green,
blue and yellow quarters) with one picture placeholder in its feedback and asks again; a right second
answer earns 0.5, a wrong one 0. The feedback uses ChatML markers (`<|im_start|>` ...), as Qwen-VL
models and the tiny VLMs of `make_tiny_model` do.
"""

import torch
from PIL import Image

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one picture, as the chat template writes it
CHART = [(220, 30, 30), (30, 170, 40), (30, 60, 220), (235, 205, 20)]


def colour_chart(side: int = 56) -> Image.Image:
    img = Image.new("RGB", (side, side))
    half = side // 2
    for i, colour in enumerate(CHART):
        img.paste(colour, (half * (i % 2), half * (i // 2), half * (i % 2 + 1), half * (i // 2 + 1)))
    return img


def first_line(text: str) -> str:
    for marker in ("</s>", "<|im_end|>", "<|endoftext|>"):
        text = text.split(marker)[0]
    return text.strip().split("\n")[0].strip()


class AgentInstance(AgentInstanceBase):
    async def reset(self, states: dict, **kwargs) -> dict:
        self.tries = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        self.tries += 1
        right = first_line(states["action_text"]) == str(states["label"]).strip()
        if right or self.tries == 2:
            reward = (1.0 if self.tries == 1 else 0.5) if right else 0.0
            return {"rewards": torch.tensor(reward), "scores": torch.tensor(float(right)),
                    "environment_feedback": "", "done": True, "extra_logs": {"tries": float(self.tries)}}
        return {"rewards": torch.tensor(0.0), "done": False, "environment_images": [colour_chart()],
                "environment_feedback": "<|im_end|>\n<|im_start|>user\n" + PLACEHOLDER
                + "These are the colours: red, green, blue, yellow. Look again.<|im_end|>\n<|im_start|>assistant\n"}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
