"""Offline tiny vision-language models (Qwen2.5-VL, Qwen3-VL) with their image processor.

`make_tiny_model(path, TinyModelSpec(arch="qwen2_5_vl"))` (or `--arch qwen2_5_vl` of the
`make_tiny_model` command) writes a normal Hugging Face VLM directory:

    model = AutoModelForImageTextToText.from_pretrained(d)     # random weights
    tok = AutoTokenizer.from_pretrained(d)                      # character tokenizer + vision tokens
    image_processor = AutoImageProcessor.from_pretrained(d)    # Qwen2-VL patches (14 px; Qwen3-VL 16 px)

The tokenizer is the character tokenizer of `tiny.py` plus `<|vision_start|>`, `<|vision_end|>`,
`<|image_pad|>` and `<|video_pad|>`; its chat template renders content parts (`{"type": "image"}`
becomes `<|vision_start|><|image_pad|><|vision_end|>`), as Qwen's templates do. The image processor
accepts small pictures (from one merged patch, 28 x 28 pixels, to 4 x 4 merged patches), so a
picture costs 1 to 16 tokens. The language model has the text spec's sizes; the vision tower has
two blocks of width 32 (Qwen3-VL: one deepstack layer).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_SPECIALS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# patch size of each family's vision tower; one merged patch is (merge x patch) pixels square
PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}
MERGE_SIZE = 2
MAX_MERGED_SIDE = 4  # largest picture: 4 x 4 merged patches (16 tokens)


def mrope_sections(arch: str, head_dim: int) -> list[int]:
    """The rotary frequencies (head_dim / 2 of them) each position component (t, h, w) drives,
    in the families' proportions (Qwen2.5-VL 16/24/24 of 64, Qwen3-VL 24/20/20, interleaved)."""
    half = head_dim // 2
    if arch == "qwen3_vl":
        s = half * 5 // 16
        return [half - 2 * s, s, s]
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_vlm_config(spec: Any, tok: Any) -> Any:
    """The transformers config of a tiny VLM of `spec.arch` (text sizes from `spec`)."""
    from transformers import AutoConfig

    heads = spec.num_attention_heads
    head_dim = spec.hidden_size // heads
    text = dict(
        vocab_size=len(tok), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=spec.num_key_value_heads or heads,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": mrope_sections(spec.arch, head_dim)})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=spec.hidden_size,
                  patch_size=PATCH_SIZE[spec.arch], spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if spec.arch == "qwen2_5_vl":
        vision.update(window_size=PATCH_SIZE[spec.arch] * MERGE_SIZE * 2, fullatt_block_indexes=[1])
    else:
        text.update(head_dim=head_dim)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
            ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END))}
    return AutoConfig.for_model(spec.arch, text_config=text, vision_config=vision,
                                tie_word_embeddings=spec.tie_word_embeddings, **ids)


def image_processor_config(arch: str) -> dict[str, Any]:
    """preprocessor_config.json of the tiny VLM: Qwen2-VL's processor with small pixel bounds.
    Written as a file (not a class instance) so that each transformers version loads its own
    implementation of `Qwen2VLImageProcessor`."""
    side = PATCH_SIZE[arch] * MERGE_SIZE
    lo, hi = side * side, (side * MAX_MERGED_SIDE) ** 2
    mean, std = (([0.5] * 3, [0.5] * 3) if arch == "qwen3_vl"
                 else ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]))
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_normalize": True,
            "do_rescale": True, "do_resize": True, "image_mean": mean, "image_std": std,
            "rescale_factor": 1 / 255, "resample": 3, "patch_size": PATCH_SIZE[arch], "merge_size": MERGE_SIZE,
            "temporal_patch_size": 2, "min_pixels": lo, "max_pixels": hi,
            "size": {"shortest_edge": lo, "longest_edge": hi}}


def make_tiny_vlm(save_path: str, spec: Any, tok: Any) -> str:
    """Write `tok` (tiny.build_tokenizer(VISION_SPECIALS, VLM_CHAT_TEMPLATE)), the image processor and a
    random tiny VLM of `spec.arch` to `save_path`."""
    from transformers import AutoModelForImageTextToText

    config = build_vlm_config(spec, tok)
    torch.manual_seed(spec.seed)
    model = AutoModelForImageTextToText.from_config(config)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    os.makedirs(save_path, exist_ok=True)
    model.save_pretrained(save_path, safe_serialization=True)
    tok.save_pretrained(save_path)
    with open(os.path.join(save_path, "preprocessor_config.json"), "w") as f:
        json.dump(image_processor_config(spec.arch), f, indent=2)
    return save_path
