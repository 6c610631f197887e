"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): what the rest of rlhfkit needs to know.

    VisionLayout.of(config)      token ids of the placeholders, the vision tower's spatial merge,
                                 the multimodal rotary layout (Qwen-VL "M-RoPE")
    expand_placeholders(ids, …)  one `<|image_pad|>` per picture -> the picture's run of t*h*w/merge^2
    rope_positions(ids, grids)   `[3, L]` (temporal, height, width) positions of one sequence
    batch_forward_kwargs(...)    pixel values, grids and `[3, B, L]` positions for a padded batch
    mrope_cos_sin(...)           the rotary tables of given 3-D positions (the builtin engine's prefill)
    freeze_visual_encoder(model) the vision tower's weights stop training (`--freeze_visual_encoder`)

Positions follow Qwen2-VL's multimodal rotary positions (M-RoPE): a text token has the
same value t = h = w, one more than the previous token's largest; a picture's tokens (grid
T x H x W after the merge) get (s + t, s + h, s + w) for s the position where the picture starts,
and the text after it continues at s + max(T, H, W). The rotary frequencies are split between the
three components: in contiguous sections (Qwen2/2.5-VL, `mrope_section`) or interleaved t, h, w,
t, h, w, ... (Qwen3-VL). For a text token all three are equal, so its rotation is ordinary 1-D
RoPE at that position; a whole sequence shifted by a constant rotates every query and key alike,
which leaves attention unchanged.

rlhfkit computes the positions itself and hands them to the model (`position_ids` `[3, B, L]`), so
the training forward does not depend on how a transformers version derives them, and the builtin
engine uses the same function; tests/parity/test_vlm_parity.py checks it against transformers' own
`get_rope_index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from rlhfkit.types import ImageInputs, ImageRef

if TYPE_CHECKING:
    from rlhfkit.data.images import VisionProcessor

MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VISION_PREFIXES = ("model.visual.", "visual.")


class VisionModelError(ValueError):
    """A model or sample that the vision-language path cannot handle; the message names what."""


def is_vlm_config(config: Any) -> bool:
    """Whether a transformers config describes a vision-language model (it has a vision config)."""
    return getattr(config, "vision_config", None) is not None


@dataclass(frozen=True)
class VisionLayout:
    """What a Qwen-VL model's config says about pictures (see the module docstring)."""

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]
    interleaved: bool  # Qwen3-VL: t, h, w frequencies interleaved
    deepstack_layers: int  # Qwen3-VL: vision features added after the first k decoder layers
    patch_dim: int = 1176  # values of one patch: channels x temporal patch x patch x patch

    @classmethod
    def of(cls, config: Any, flag: str = "--pretrain") -> "VisionLayout":
        mtype = getattr(config, "model_type", "")
        if mtype not in MROPE_TYPES:
            raise VisionModelError(f"{flag}: vision-language model type {mtype!r} is not supported (supported: "
                                   f"{', '.join(MROPE_TYPES)})")
        text = getattr(config, "text_config", None) or config
        rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        default = [16, 24, 24] if mtype != "qwen3_vl" else [24, 20, 20]
        section = tuple(int(x) for x in rope.get("mrope_section", default))
        if sum(section) != head_dim // 2:
            raise VisionModelError(f"{flag}: mrope_section {list(section)} does not sum to head_dim / 2 = "
                                   f"{head_dim // 2}")
        vision = config.vision_config
        return cls(model_type=mtype, image_token_id=int(config.image_token_id),
                   video_token_id=int(getattr(config, "video_token_id", -1) or -1),
                   vision_start_token_id=int(config.vision_start_token_id),
                   vision_end_token_id=int(getattr(config, "vision_end_token_id", -1) or -1),
                   spatial_merge_size=int(vision.spatial_merge_size), mrope_section=section,
                   interleaved=mtype == "qwen3_vl",
                   deepstack_layers=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
                   patch_dim=_patch_dim(vision))

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The vision marker tokens a policy should never generate (the engines do not sample them)."""
        return tuple(i for i in (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                                 self.vision_end_token_id) if i >= 0)

    def components(self) -> torch.Tensor:
        """`[head_dim / 2]`: which position component (0 t, 1 h, 2 w) drives each rotary frequency."""
        half = sum(self.mrope_section)
        if not self.interleaved:
            return torch.cat([torch.full((n,), i) for i, n in enumerate(self.mrope_section)])
        comp = torch.zeros(half, dtype=torch.long)
        for c in (1, 2):
            comp[c:self.mrope_section[c] * 3:3] = c
        return comp


def _patch_dim(vision: Any) -> int:
    def first(v: Any) -> int:
        return int(v[0] if isinstance(v, (list, tuple)) else v)

    patch, temporal = first(getattr(vision, "patch_size", 14)), first(getattr(vision, "temporal_patch_size", 2))
    return int(getattr(vision, "in_channels", 3)) * temporal * patch * patch


def layout_of_model(model: Any) -> VisionLayout | None:
    """The layout of a (possibly wrapped) HF model, or None for a text model."""
    config = getattr(model, "config", None)
    return VisionLayout.of(config) if config is not None and is_vlm_config(config) else None


@dataclass
class VisionContext:
    """What executors need for pictures: the processor (pictures -> `ImageInputs`), the model's
    layout, the text of one placeholder, and `max_images` (--max_images_per_prompt: the most
    pictures an episode may hold, its prompt's and the environment's together)."""

    processor: "VisionProcessor"
    layout: VisionLayout
    placeholder_text: str
    max_images: int

    def inputs_of(self, refs: Sequence[ImageRef]) -> ImageInputs | None:
        return self.processor.process_refs(refs)

    def process(self, pictures: Sequence[Any]) -> ImageInputs | None:
        return self.processor.process(pictures)

    def expand(self, ids: Sequence[int], images: ImageInputs | None, where: str = "sample") -> list[int]:
        return expand_placeholders(ids, images, self.layout, where)


def placeholder_text(tokenizer: Any, layout: VisionLayout) -> str:
    """The text of one picture's placeholder: `<|vision_start|><|image_pad|><|vision_end|>`."""
    ids = [layout.vision_start_token_id, layout.image_token_id] + (
        [layout.vision_end_token_id] if layout.vision_end_token_id >= 0 else [])
    return "".join(tokenizer.convert_ids_to_tokens(ids))


# ----------------------------------------------------------------------------- placeholders


def expand_placeholders(ids: Sequence[int], images: ImageInputs | None, layout: VisionLayout,
                        where: str = "sample") -> list[int]:
    """Token ids with each single image placeholder replaced by its picture's run of tokens.

    A sample holds one `image_token_id` per picture (what the chat template writes); the count
    must equal the number of pictures."""
    ids = list(ids)
    pad = layout.image_token_id
    n = ids.count(pad)
    have = 0 if images is None else len(images)
    if n != have:
        raise VisionModelError(f"{where}: {n} image placeholder(s) in the text but {have} picture(s)")
    if not have:
        return ids
    counts = iter(images.token_counts(layout.spatial_merge_size))
    out: list[int] = []
    for t in ids:
        out.extend([pad] * next(counts) if t == pad else [t])
    return out


def placeholder_runs(ids: Sequence[int], images: ImageInputs | None, layout: VisionLayout,
                     where: str = "sample") -> list[tuple[int, int]]:
    """`(start, length)` of each picture's run of placeholder tokens in `ids` (already expanded):
    picture k takes the next `token_counts[k]` placeholder tokens from where picture k - 1 ended."""
    counts = [] if images is None else images.token_counts(layout.spatial_merge_size)
    return token_runs(ids, counts, layout.image_token_id, where)


def token_runs(ids: Sequence[int], counts: Sequence[int], pad: int, where: str = "sample") -> list[tuple[int, int]]:
    """`placeholder_runs` given each picture's token count."""
    ids = list(ids)
    total = sum(1 for t in ids if t == pad)
    if total != sum(counts):
        raise VisionModelError(f"{where}: {total} image placeholder tokens but its {len(counts)} picture(s) fill "
                               f"{sum(counts)} (a generated placeholder token, or pictures that do not match "
                               "the text)")
    runs, i = [], 0
    for n in counts:
        while ids[i] != pad:
            i += 1
        if ids[i:i + n] != [pad] * n:
            raise VisionModelError(f"{where}: a picture's {n} placeholder tokens are not contiguous")
        runs.append((i, n))
        i += n
    return runs


# ----------------------------------------------------------------------------- positions


def rope_positions(ids: Sequence[int], images: ImageInputs | None, layout: VisionLayout,
                   where: str = "sample") -> torch.Tensor:
    """`[3, L]` long positions of one (unpadded) sequence (module docstring)."""
    n = len(ids)
    out = torch.empty(3, n, dtype=torch.long)
    runs = placeholder_runs(ids, images, layout, where)
    grids = [] if images is None else images.grid_thw.tolist()
    m = layout.spatial_merge_size
    pos, i = 0, 0
    for (start, length), (t, h, w) in zip(runs, grids):
        out[:, i:start] = torch.arange(pos, pos + start - i)
        pos += start - i
        gt, gh, gw = int(t), int(h) // m, int(w) // m
        out[0, start:start + length] = pos + torch.arange(gt).repeat_interleave(gh * gw)
        out[1, start:start + length] = pos + torch.arange(gh).repeat_interleave(gw).repeat(gt)
        out[2, start:start + length] = pos + torch.arange(gw).repeat(gt * gh)
        pos += max(gt, gh, gw)
        i = start + length
    out[:, i:] = torch.arange(pos, pos + n - i)
    return out


def batch_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       images: Sequence[ImageInputs | None], layout: VisionLayout) -> torch.Tensor:
    """`[3, B, L]` positions of a right-padded batch (padding: 0)."""
    b, length = input_ids.shape
    out = torch.zeros(3, b, length, dtype=torch.long)
    ids_host, lens = input_ids.cpu(), attention_mask.sum(-1).tolist()
    for r in range(b):
        n = int(lens[r])
        out[:, r, :n] = rope_positions(ids_host[r, :n].tolist(), images[r], layout, f"row {r}")
    return out.to(input_ids.device)


def batch_forward_kwargs(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         images: Sequence[ImageInputs | None], layout: VisionLayout) -> dict[str, Any]:
    """Keyword arguments of an HF Qwen-VL forward for a right-padded batch: the rows' pictures in
    row order (`pixel_values`, `image_grid_thw`) and the `[3, B, L]` positions."""
    kw: dict[str, Any] = {"position_ids": batch_position_ids(input_ids, attention_mask, images, layout)}
    joined = ImageInputs.concat(list(images))
    if joined is not None:
        kw["pixel_values"] = joined.pixel_values.to(input_ids.device)
        kw["image_grid_thw"] = joined.grid_thw.to(input_ids.device)
    return kw


def with_picture_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[ImageInputs | None] | None,
                     layout: VisionLayout) -> tuple[torch.Tensor, torch.Tensor, list[ImageInputs | None]]:
    """The batch plus one row `[vision_start, image_pad, vision_end]` showing a blank picture of one
    merged patch (callers drop its log-probs): under data parallelism every rank must run the vision
    tower in every forward pass (its sharded blocks gather their weights collectively), also for
    micro-batches of text rows."""
    m = layout.spatial_merge_size
    row = [layout.vision_start_token_id, layout.image_token_id] + (
        [layout.vision_end_token_id] if layout.vision_end_token_id >= 0 else [])
    b, width = input_ids.shape
    ids = input_ids.new_zeros(b + 1, max(width, len(row)))
    mask = attention_mask.new_zeros(b + 1, ids.shape[1])
    ids[:b, :width], mask[:b, :width] = input_ids, attention_mask
    ids[b, :len(row)] = torch.tensor(row, device=ids.device)
    mask[b, :len(row)] = 1
    blank = ImageInputs(torch.zeros(m * m, layout.patch_dim), torch.tensor([[1, m, m]]), ["rlhfkit-blank"])
    return ids, mask, list(images or [None] * b) + [blank]


def picture_logprob_kwargs(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
    """`token_logprobs` keywords of a padded batch whose rows carry pictures (`batch.images`): the
    3-D `position_ids` and the pictures as `model_kwargs`; {} for text batches or text models."""
    images = getattr(batch, "images", None)
    if images is None or getattr(batch, "attention_mask", None) is None:
        return {}
    layout = layout_of_model(model)
    if layout is None:
        raise VisionModelError("rows with pictures reached a model without a vision tower")
    kw = batch_forward_kwargs(batch.input_ids, batch.attention_mask, images, layout)
    return {"position_ids": kw.pop("position_ids"), "model_kwargs": kw}


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, layout: VisionLayout,
                  scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos / sin `[..., L, head_dim]` (fp32) of `[3, ..., L]` positions: frequency f turns
    with component `components()[f]` of the position; halves repeated (rotate-half layout)."""
    comp = layout.components().to(positions.device)
    pos = positions.float()  # [3, ..., L]
    chosen = pos[comp]  # [half, ..., L]
    freqs = chosen.movedim(0, -1) * inv_freq.to(positions.device).float()  # [..., L, half]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


# ----------------------------------------------------------------------------- training


def vision_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the vision tower's parameters (the visual encoder and its merger)."""
    return [n for n, _ in model.named_parameters() if is_vision_name(n)]


def is_vision_name(name: str) -> bool:
    """Whether an HF parameter name belongs to the vision tower (`model.visual.*` / `visual.*`, peft prefixes too)."""
    return any(name.startswith(p) or f".{p}" in name for p in VISION_PREFIXES)


FROZEN_VISION_ATTR = "rlhfkit_frozen_vision"  # set on a model whose vision tower `freeze_visual_encoder` froze


def freeze_visual_encoder(model: torch.nn.Module) -> int:
    """`requires_grad = False` on every vision-tower parameter; returns how many were frozen. The
    model is marked (`FROZEN_VISION_ATTR`), so weight sync leaves those parameters out
    (`synced_name`): the engines loaded the same ones."""
    names = set(vision_parameter_names(model))
    if not names:
        raise VisionModelError("--freeze_visual_encoder: the model has no vision tower (model.visual)")
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    setattr(model, FROZEN_VISION_ATTR, True)
    return len(names)


def synced_name(model: torch.nn.Module) -> Any:
    """A predicate on parameter names: False for the frozen vision tower of a model marked by
    `freeze_visual_encoder`, True for everything else (what weight sync sends)."""
    if not getattr(model, FROZEN_VISION_ATTR, False):
        return lambda name: True
    return lambda name: not is_vision_name(name)
