"""Vision-language mode of the commands (train_ppo, train_ppo_ray, train_sft, train_dpo): its flag
checks and the objects built from the flags (docs/vlm.md).

    --max_images_per_prompt N > 0   turns the mode on: rows' --image_key pictures go with each sample
    vision_context(args, tok)       the processor, the model's layout and the placeholder text
    row_images(args, vision)        what datasets use to read and place a row's pictures

RL in this mode has no critic (group or REINFORCE-style estimators, as OpenRLHF) and no packing;
tensor and context parallelism of the trained models are not available for VLMs.
"""

from __future__ import annotations

import argparse
from typing import Any

from rlhfkit.cli.common import UsageError
from rlhfkit.config.notes import note_once
from rlhfkit.data.images import ImageDataConfig, ImageLimits, RowImages, load_vision_processor
from rlhfkit.models.vlm import VisionContext, VisionLayout, VisionModelError, is_vlm_config, placeholder_text

IMAGE_FLAGS = {"image_key": "images", "image_failure": "stop", "max_image_bytes": 32 * 2**20,
               "max_image_pixels": 4096 * 4096}


def vlm_mode(args: argparse.Namespace) -> bool:
    return getattr(args, "max_images_per_prompt", 0) > 0


def check_image_flags(args: argparse.Namespace) -> None:
    """Shared by every command with the image flags: a negative count is an error; image flags set
    without the mode say that they have no effect."""
    if args.max_images_per_prompt < 0:
        raise UsageError(f"--max_images_per_prompt must be >= 0, got {args.max_images_per_prompt}")
    if not vlm_mode(args):
        changed = [f"--{k}" for k, d in IMAGE_FLAGS.items() if getattr(args, k) != d]
        if changed:
            note_once(f"note: {', '.join(changed)} have no effect without --max_images_per_prompt > 0")


def check_vlm_offline_flags(args: argparse.Namespace) -> None:
    """train_sft / train_dpo: what vision-language mode excludes."""
    check_image_flags(args)
    if not vlm_mode(args):
        return
    _check_parallel(args)
    if getattr(args, "pretrain_mode", False):
        raise UsageError("--max_images_per_prompt: --pretrain_mode reads no pictures (it has no prompt)")
    _no_packing(args)


def _check_parallel(args: argparse.Namespace) -> None:
    if args.ring_attn_size > 1:
        raise UsageError("--ring_attn_size > 1 is not available with --max_images_per_prompt (vision-language "
                         "samples run padded, on one rank each)")
    if args.ds_tensor_parallel_size > 1:
        raise UsageError("--ds_tensor_parallel_size > 1 is not available with --max_images_per_prompt")


def _no_packing(args: argparse.Namespace) -> None:
    if args.packing_samples:
        note_once("note: --packing_samples has no effect with --max_images_per_prompt: vision-language samples "
                  "run padded (pictures stay per sample), as in OpenRLHF")
        args.packing_samples = False


def check_vlm_rl_flags(args: argparse.Namespace) -> None:
    """The RL commands' settings that vision-language mode excludes (one error or note each)."""
    check_image_flags(args)
    if not vlm_mode(args):
        return
    if args.advantage_estimator == "gae":
        raise UsageError("--max_images_per_prompt: vision-language RL has no critic (as in OpenRLHF); use "
                         "--advantage_estimator group_norm, reinforce, reinforce_baseline, rloo or dr_grpo")
    if args.reward_pretrain and not (args.remote_rm_url or args.agent_func_path):
        raise UsageError("--max_images_per_prompt: a --reward_pretrain model scores text only; score "
                         "vision-language samples with --remote_rm_url (a reward_func file or server) or an agent")
    if args.rollout_engine == "vllm":
        raise UsageError("--rollout_engine vllm does not take pictures in rlhfkit yet; vision-language rollouts run on "
                         "--rollout_engine auto (the default), builtin or hf")
    _check_parallel(args)
    _no_packing(args)


def vision_context(args: argparse.Namespace, tokenizer: Any, flag: str = "--pretrain") -> VisionContext | None:
    """The executors' and datasets' picture handling of the model at --pretrain (None without the mode)."""
    if not vlm_mode(args):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.pretrain, trust_remote_code=False)
    if not is_vlm_config(config):
        raise UsageError(f"--max_images_per_prompt {args.max_images_per_prompt} needs a vision-language model; "
                         f"{flag} {args.pretrain} has no vision_config")
    try:
        layout = VisionLayout.of(config, flag)
    except VisionModelError as e:
        raise UsageError(str(e)) from None
    processor = load_vision_processor(args.pretrain, ImageLimits(args.max_image_bytes, args.max_image_pixels), flag)
    return VisionContext(processor, layout, placeholder_text(tokenizer, layout), args.max_images_per_prompt)


def row_images(args: argparse.Namespace, vision: VisionContext | None) -> RowImages | None:
    if vision is None:
        return None
    cfg = ImageDataConfig(args.image_key, args.max_images_per_prompt, args.image_failure,
                          ImageLimits(args.max_image_bytes, args.max_image_pixels))
    return RowImages(cfg, vision.processor, vision.placeholder_text, vision.layout.image_token_id,
                     vision.layout.special_ids)
