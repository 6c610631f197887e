"""Shared pieces of the vision-language tests: pictures, prompts with placeholders, the training forward."""

from __future__ import annotations

from typing import Any, Sequence

import torch

PH = "<|vision_start|><|image_pad|><|vision_end|>"


def picture(colour: tuple[int, int, int], size: tuple[int, int], box: bool = True) -> Any:
    """A PIL picture of `colour` (with a white square in it when `box`)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, colour)
    if box:
        ImageDraw.Draw(img).rectangle([2, 2, size[0] // 2, size[1] // 2], fill=(255, 255, 255))
    return img


def load_vlm(model_dir: str) -> tuple[Any, Any, Any, Any]:
    """(HF model in fp32, eval mode; tokenizer; VisionLayout; VisionProcessor)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from rlhfkit.data.images import load_vision_processor
    from rlhfkit.models.vlm import VisionLayout

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir), VisionLayout.of(model.config), \
        load_vision_processor(model_dir)


def prompt(tok: Any, layout: Any, text: str, pics: Any) -> list[int]:
    """Token ids of `text` (one PH per picture) with each placeholder expanded to its picture's run."""
    from rlhfkit.models.vlm import expand_placeholders

    return expand_placeholders(tok(text, add_special_tokens=False)["input_ids"], pics, layout)


def training_logprobs(model: Any, layout: Any, rows: Sequence[list[int]], pics: Sequence[Any]) -> torch.Tensor:
    """`[B, L]` log-probs of right-padded rows through the training forward (pictures, 3-D positions)."""
    from rlhfkit.models.forward import token_logprobs
    from rlhfkit.models.vlm import batch_forward_kwargs

    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    kw = batch_forward_kwargs(ids, mask, list(pics), layout)
    with torch.no_grad():
        return token_logprobs(model, ids, attention_mask=mask, position_ids=kw.pop("position_ids"), model_kwargs=kw)


def max_gap(model: Any, layout: Any, prompt_ids: list[int], pics: Any, completions: Sequence[Any]) -> float:
    """Largest |engine log-prob - training log-prob| over the completions' tokens."""
    rows = [prompt_ids + list(c.token_ids) for c in completions]
    lp = training_logprobs(model, layout, rows, [pics] * len(rows))
    gaps = [abs(float(lp[i, len(prompt_ids) + j]) - c.logprobs[j])
            for i, c in enumerate(completions) for j in range(len(c.token_ids))]
    return max(gaps)
