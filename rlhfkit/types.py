"""Records that cross layers (docs/architecture.md, "Conventions").

Shapes use B = batch rows, L = padded row length, T = total packed tokens.

    data  --PromptSample-->  agents  --GenerationRequest-->  engine
    engine --Completion-->   agents  --Trajectory-->         algo
    algo  --ExperienceBatch--> losses / roles

Every field is typed; no dicts with magic keys travel inside the framework. A vision-language
sample's pictures travel as `ImageInputs` (processed patches) with the request, the trajectory and
the experience rows; its token ids hold one run of image placeholder tokens per picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ImageInputs:
    """The processed pictures of one sequence, in the order of their placeholders.

    pixel_values: `[P, D]` patches of every picture, picture after picture (P = sum of t*h*w).
    grid_thw: `[N, 3]` long, each picture's patch grid (temporal, height, width).
    keys: one content hash per picture (the same picture gives the same key), so an engine can
        reuse a picture's vision-tower output.
    A picture fills grid t*h*w / merge**2 placeholder tokens (merge: the vision tower's spatial merge).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    keys: list[str]

    def __len__(self) -> int:
        return len(self.keys)

    def patch_counts(self) -> list[int]:
        return [int(x) for x in self.grid_thw.prod(-1).tolist()]

    def token_counts(self, merge: int) -> list[int]:
        return [n // (merge * merge) for n in self.patch_counts()]

    def picture(self, i: int) -> "ImageInputs":
        """Picture `i` alone."""
        counts = self.patch_counts()
        start = sum(counts[:i])
        return ImageInputs(self.pixel_values[start:start + counts[i]], self.grid_thw[i:i + 1], [self.keys[i]])

    @staticmethod
    def concat(parts: "list[ImageInputs | None]") -> "ImageInputs | None":
        """The pictures of `parts` one after the other (None when there are none)."""
        parts = [p for p in parts if p is not None and len(p)]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.grid_thw for p in parts]),
                           [k for p in parts for k in p.keys])


@dataclass(frozen=True)
class ImageRef:
    """One picture a data row names, checked when the data was read (`rlhfkit.data.images`).

    source: a resolved file path, the picture's encoded bytes (a URL's download, a base64 data
    URI, a datasets `Image` cell), or an in-memory PIL image. where: the row and the picture's
    position in it, for errors ("data.jsonl row 3 image 1"). num_tokens: placeholder tokens it
    fills once processed (0 when unknown).
    """

    source: Any
    where: str
    num_tokens: int = 0


@dataclass
class PromptSample:
    """One prompt from a prompt dataset.

    `prompt` is the already-templated text fed to the tokenizer (chat template or
    `--input_template` applied); `label` is the `--label_key` column, passed untouched
    to `reward_func` and agents. `images` (vision-language prompts, `--image_key`): the row's
    pictures, one placeholder each in `prompt`. `input` is the `--input_key` value as the row has it
    (text or messages) and `columns` the row's other columns: what a reward function in TRL's shape
    receives as `prompts` and as keyword arguments (rlhfkit.rewards.shapes).
    """

    prompt: str
    label: Any = None
    datasource: str = "default"
    index: int = 0
    images: list[ImageRef] = field(default_factory=list)
    input: Any = None
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """Sampling settings for one request (a subset of vLLM's SamplingParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    logprobs: bool = True
    # HF / vLLM semantics: a logit of a token already in the prompt or the completion is divided by
    # the penalty when positive and multiplied by it when negative, before temperature and top-k / top-p;
    # the reported log-probs stay those of the unpenalised distribution (like temperature-only sampling)
    repetition_penalty: float = 1.0

    def replace(self, **kw: Any) -> "SamplingParams":
        d = dict(self.__dict__)
        d.update(kw)
        return SamplingParams(**d)


@dataclass
class GenerationRequest:
    """Prompt token ids in; `params.n` completions come back for it. `images`: the pictures of a
    vision-language prompt, whose placeholder runs `prompt_token_ids` holds."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: int = 0
    images: ImageInputs | None = None


@dataclass
class Completion:
    """One generated continuation.

    `logprobs[i]` is the engine's log-probability of `token_ids[i]` under the
    sampling distribution's *unprocessed* model logits scaled by temperature.
    `finish_reason` is "stop" (eos / stop token / stop string) or "length".
    `policy_versions[i]`: the policy version (weight updates loaded) of the weights that sampled
    `token_ids[i]` (and gave `logprobs[i]`); it changes inside a completion when the weights were
    updated while it was generated (partial rollout). None where the engine does not track it.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    request_id: int = 0
    policy_versions: list[int] | None = None


@dataclass
class Trajectory:
    """A finished episode (single- or multi-turn), token in and token out.

    token_ids: prompt + actions + environment feedback, in order.
    action_mask: 1 where the policy produced the token (loss is taken there), same length
        as `token_ids`; the prompt and environment feedback are 0.
    rollout_logprobs: engine log-probs aligned with `token_ids` (0 where action_mask is 0).
    reward: the scalar reward used for advantages; score: the raw score (dynamic filtering,
        pass@k). truncated: generation stopped by length.
    policy_versions: aligned with `token_ids`: the policy version that sampled each action token
        (-1 where action_mask is 0); None when the engine did not report versions.
    policy_version: the oldest version among its action tokens (the one it started with); set by
        the Ray loop, which knows the version of the batch when the engine reports none.
    images: the pictures whose placeholder runs `token_ids` holds (the prompt's, then those the
        environment returned), for the training forward passes; None for text.
    """

    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    prompt_len: int
    reward: float = 0.0
    score: float = 0.0
    truncated: bool = False
    prompt: str = ""
    response: str = ""
    label: Any = None
    group_index: int = 0
    extra_logs: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0
    policy_versions: list[int] | None = None
    images: ImageInputs | None = None


@dataclass
class ExperienceBatch:
    """A padded batch of trajectories ready for log-prob passes and losses.

    All tensors are `[B, L]` and right padded. Position `t` of `*_logprobs`, `values`,
    `advantages`, `returns` and `loss_mask` refers to the prediction of token `t + 1` from
    token `t` shifted so that index `t` lines up with `input_ids[:, t]` being *predicted*:
    i.e. `logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`, with `logprobs[:, 0] = 0`.
    `loss_mask[:, t]` is 1 where `input_ids[:, t]` is an action token.

    `num_loss_tokens` is the global (all ranks, all micro-batches of an optimizer step)
    count of loss tokens; losses divide by it so results do not depend on micro-batching.
    `images` (vision-language rows): one `ImageInputs` or None per row; `select` keeps them with
    their rows, `to` leaves them on the host (the forward pass moves them).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # [B] scalar reward per row
    num_loss_tokens: float | None = None
    num_samples: float | None = None
    images: list[ImageInputs | None] | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ExperienceBatch":
        """Every tensor on `device`; `non_blocking` copies host tensors to CUDA through pinned memory
        without waiting for the GPU (a plain copy from pageable memory synchronises the stream)."""
        dev = torch.device(device)
        pin = non_blocking and dev.type == "cuda"
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                if pin and v.device.type == "cpu":
                    v = v.pin_memory()
                v = v.to(dev, non_blocking=pin)
            out[k] = v
        return ExperienceBatch(**out)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: torch.Tensor | list[int]) -> "ExperienceBatch":
        """Rows `idx` of every tensor (counts are left as they are)."""
        out = {}
        rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        for k, v in self.__dict__.items():
            out[k] = v[idx] if isinstance(v, torch.Tensor) else v
        if self.images is not None:
            out["images"] = [self.images[i] for i in rows]
        return ExperienceBatch(**out)
