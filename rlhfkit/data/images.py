"""Pictures of vision-language data: read, checked and processed into `ImageInputs`.

A row's `--image_key` value is one picture or a list of them; each may be

    a file path           absolute, relative to the working directory, or to the data file's folder
    an http(s) URL        downloaded once when the data is read (30 s timeout)
    a data URI            data:image/png;base64,....
    a datasets Image cell {"bytes": ..., "path": ...} (what `datasets` stores), or raw bytes
    a PIL image           rows given in memory (the Python API)

`ImageLimits` bound what is accepted: `--max_image_bytes` (the encoded file) and
`--max_image_pixels` (width x height). A picture that is missing, unreadable, not an image or over
a limit is an error naming the file, row and picture:

    data/train.jsonl row 4 image 1: cannot read 'pics/missing.png': no such file

or, under `--image_failure drop`, its row is left out and counted. `ImageRef`s keep what was
checked (a resolved path or the encoded bytes), so reading a picture again at rollout time never
downloads it twice.

`VisionProcessor` turns pictures into `ImageInputs` with the model's Hugging Face image processor
(`AutoImageProcessor`: resizing to multiples of the merged patch, normalising, cutting patches) and
gives each picture a content hash, the key under which an engine keeps its vision-tower output.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlhfkit.config.configs import VisionFlags
from rlhfkit.config.declare import default_of
from rlhfkit.data.rows import DataError
from rlhfkit.types import ImageInputs, ImageRef

IMAGE_TAG = "<image>"  # OpenRLHF's tag for a picture inside a text prompt
URL_TIMEOUT_S = 30.0
FAILURE_POLICIES = ("stop", "drop")


@dataclass(frozen=True)
class ImageLimits:
    """[--max_image_bytes] [--max_image_pixels]."""

    max_bytes: int = default_of(VisionFlags, "max_image_bytes")
    max_pixels: int = default_of(VisionFlags, "max_image_pixels")

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise DataError(f"--max_image_bytes must be positive, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise DataError(f"--max_image_pixels must be positive, got {self.max_pixels}")


def _short(source: Any) -> str:
    if isinstance(source, str):
        return repr(source if len(source) <= 80 else source[:60] + "...")
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    return f"<{type(source).__name__}>"


def _read_bytes(source: Any, base_dir: str | None, limits: ImageLimits) -> bytes | str:
    """The encoded picture (bytes), or a resolved file path; raises ValueError with the reason."""
    if isinstance(source, dict):
        if source.get("bytes"):
            source = source["bytes"]
        elif source.get("path"):
            source = source["path"]
        else:
            raise ValueError("an image cell needs 'bytes' or 'path'")
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ValueError("a data URI must be base64 encoded (data:image/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError as e:
            raise ValueError(f"bad base64: {e}") from None
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=URL_TIMEOUT_S) as r:
                data = r.read(limits.max_bytes + 1)
        except OSError as e:
            raise ValueError(f"download failed: {e}") from None
    elif isinstance(source, str):
        path = os.path.expanduser(source)
        if not os.path.isabs(path) and not os.path.exists(path) and base_dir:
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            raise ValueError("no such file")
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise ValueError(f"{size} bytes, over --max_image_bytes {limits.max_bytes}")
        return os.path.abspath(path)
    else:
        raise ValueError(f"expected a path, URL, data URI or image bytes, got {type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise ValueError(f"over --max_image_bytes {limits.max_bytes}")
    return data


def _open(data: bytes | str, limits: ImageLimits) -> Any:
    from PIL import Image

    img = Image.open(data if isinstance(data, str) else io.BytesIO(data))
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ValueError(f"{w} x {h} pixels, over --max_image_pixels {limits.max_pixels}")
    img.load()
    return img.convert("RGB")


def check_image(source: Any, where: str, limits: ImageLimits, base_dir: str | None = None
                ) -> tuple[ImageRef, Any]:
    """(a checked `ImageRef`, the decoded RGB picture); DataError naming `where` and the source."""
    try:
        if hasattr(source, "convert") and hasattr(source, "size"):  # a PIL image
            w, h = source.size
            if w * h > limits.max_pixels:
                raise ValueError(f"{w} x {h} pixels, over --max_image_pixels {limits.max_pixels}")
            return ImageRef(source, where), source.convert("RGB")
        data = _read_bytes(source, base_dir, limits)
        img = _open(data, limits)
    except ValueError as e:
        raise DataError(f"{where}: cannot read image {_short(source)}: {e}") from None
    except Exception as e:  # PIL: UnidentifiedImageError, DecompressionBombError, truncated files, ...
        raise DataError(f"{where}: cannot read image {_short(source)}: {type(e).__name__}: {e}") from None
    return ImageRef(data, where), img


def load_image(ref: ImageRef, limits: ImageLimits | None = None) -> Any:
    """The RGB picture of a checked ref (or of a path / bytes / PIL image given directly)."""
    src = ref.source
    if hasattr(src, "convert") and hasattr(src, "size"):
        return src.convert("RGB")
    try:
        data = src if isinstance(src, (str, bytes)) else _read_bytes(src, None, limits or ImageLimits())
        return _open(data, limits or ImageLimits())
    except Exception as e:  # noqa: BLE001 - a file changed since the data was read
        raise DataError(f"{ref.where}: cannot read image {_short(src)}: {type(e).__name__}: {e}") from None


def as_list(value: Any) -> list[Any]:
    """An `--image_key` value as a list of pictures (None / missing: none)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [v for v in value]
    return [value]


# ----------------------------------------------------------------------------- processing


def picture_key(pixels: torch.Tensor, grid: torch.Tensor) -> str:
    """A content hash of one processed picture."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(grid.tolist()).encode())
    h.update(pixels.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class VisionProcessor:
    """Pictures -> `ImageInputs` with an HF image processor; remembers the last `cache_size`
    refs it processed (the n samples of a prompt, an episode's turns)."""

    def __init__(self, image_processor: Any, merge_size: int, limits: ImageLimits | None = None,
                 cache_size: int = 256) -> None:
        self.image_processor = image_processor
        self.merge_size = merge_size
        self.limits = limits or ImageLimits()
        self._cache: OrderedDict[Any, ImageInputs] = OrderedDict()
        self.cache_size = cache_size

    def process(self, pictures: Sequence[Any]) -> ImageInputs | None:
        """Decoded pictures (PIL) -> their `ImageInputs` (None for no pictures)."""
        if not pictures:
            return None
        out = self.image_processor(images=list(pictures), return_tensors="pt")
        pixels, grid = out["pixel_values"], out["image_grid_thw"].long()
        counts = grid.prod(-1).tolist()
        keys, start = [], 0
        for i, n in enumerate(counts):
            keys.append(picture_key(pixels[start:start + n], grid[i]))
            start += n
        return ImageInputs(pixels, grid, keys)

    def process_refs(self, refs: Sequence[ImageRef]) -> ImageInputs | None:
        """The `ImageInputs` of checked refs (cached by the refs' identity)."""
        if not refs:
            return None
        key = tuple(id(r.source) if not isinstance(r.source, (str, bytes)) else r.source for r in refs)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        res = self.process([load_image(r, self.limits) for r in refs])
        self._cache[key] = res
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return res

    def num_tokens(self, picture: Any) -> int:
        """Placeholder tokens one decoded picture fills."""
        out = self.image_processor(images=[picture], return_tensors="pt")
        return int(out["image_grid_thw"].long().prod()) // (self.merge_size ** 2)


def load_vision_processor(path: str, limits: ImageLimits | None = None, flag: str = "--pretrain") -> VisionProcessor:
    """The `VisionProcessor` of the VLM at `path` (its `preprocessor_config.json`)."""
    from transformers import AutoImageProcessor

    try:
        ip = AutoImageProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loading failure: one line naming the flag
        raise DataError(f"{flag} {path}: cannot load its image processor ({type(e).__name__}: {e})") from None
    merge = getattr(ip, "merge_size", None)
    if not merge:
        raise DataError(f"{flag} {path}: its image processor ({type(ip).__name__}) has no merge_size; rlhfkit reads "
                        "pictures for Qwen-VL models")
    return VisionProcessor(ip, int(merge), limits)


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class ImageDataConfig:
    """[--image_key] [--max_images_per_prompt] [--image_failure] and the limits."""

    image_key: str = default_of(VisionFlags, "image_key")
    max_images_per_prompt: int = default_of(VisionFlags, "max_images_per_prompt")
    image_failure: str = default_of(VisionFlags, "image_failure")
    limits: ImageLimits = ImageLimits()

    def __post_init__(self) -> None:
        if self.image_failure not in FAILURE_POLICIES:
            raise DataError(f"--image_failure must be one of {FAILURE_POLICIES}, got {self.image_failure!r}")


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part
                                       or "image_url" in part)


def _tagged_parts(text: str) -> list[dict[str, Any]]:
    """'<image>What is it?' -> [{"type": "image"}, {"type": "text", "text": "What is it?"}]."""
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(IMAGE_TAG)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


class RowImages:
    """A row's pictures and their placeholders in its prompt.

    `read(row)` checks the `--image_key` value (at most `--max_images_per_prompt` pictures; each
    readable and within the limits) and returns the refs; `place(value, n, ...)` writes one
    placeholder per picture into the prompt value: `<image>` tags in a string become image content
    parts (chat template) or the model's placeholder text (no template); image parts of chat
    messages stay as they are. With no tag or part at all the pictures go in front of the first
    user turn; a different count is an error naming the row.
    """

    def __init__(self, cfg: ImageDataConfig, processor: VisionProcessor, placeholder_text: str,
                 image_token_id: int, no_loss_ids: tuple[int, ...] = ()) -> None:
        self.cfg, self.processor, self.placeholder_text = cfg, processor, placeholder_text
        self.image_token_id, self.no_loss_ids = image_token_id, no_loss_ids
        self.num_dropped = 0  # rows left out for a bad picture (--image_failure drop)

    def read_or_drop(self, row: Any) -> list[ImageRef] | None:
        """`read`, or None (counted) for a bad picture under --image_failure drop."""
        try:
            return self.read(row)
        except DataError:
            if self.cfg.image_failure != "drop":
                raise
            self.num_dropped += 1
            return None

    def expand(self, ids: list[int], refs: Sequence[ImageRef], row: Any, mask: list[int] | None = None
               ) -> tuple[list[int], list[int] | None]:
        """Each picture's single placeholder token -> its run of `num_tokens` (the mask, if given,
        is 0 there); the count of placeholders must match the pictures (an error naming the row)."""
        pad = self.image_token_id
        found = ids.count(pad)
        if found != len(refs):
            raise row.error(f"the text holds {found} image placeholder token(s) for {len(refs)} picture(s)")
        counts = iter(r.num_tokens for r in refs)
        out_ids: list[int] = []
        out_mask: list[int] = []
        for i, t in enumerate(ids):
            n = next(counts) if t == pad else 1
            out_ids.extend([t] * n)
            if mask is not None:
                out_mask.extend([0] * n if t == pad else [mask[i]])
        return out_ids, (out_mask if mask is not None else None)

    def intact(self, ids: Sequence[int], refs: Sequence[ImageRef]) -> bool:
        """Whether every picture's placeholder run survived truncation."""
        return sum(1 for t in ids if t == self.image_token_id) == sum(r.num_tokens for r in refs)

    def mask_out(self, ids: Sequence[int], mask: list[int]) -> list[int]:
        """The loss mask with the vision placeholder and marker tokens set to 0."""
        banned = set(self.no_loss_ids) | {self.image_token_id}
        return [0 if t in banned else m for t, m in zip(ids, mask)]

    def read(self, row: Any) -> list[ImageRef]:
        values = as_list(row.opt(self.cfg.image_key))
        if len(values) > self.cfg.max_images_per_prompt:
            raise row.error(f"{len(values)} pictures in {self.cfg.image_key!r} (--image_key), more than "
                            f"--max_images_per_prompt {self.cfg.max_images_per_prompt}")
        base = os.path.dirname(os.path.abspath(row.source)) if os.path.isfile(str(row.source)) else None
        refs = []
        for i, v in enumerate(values):
            ref, img = check_image(v, f"{row.where} image {i + 1}", self.cfg.limits, base)
            refs.append(ImageRef(ref.source, ref.where, self.processor.num_tokens(img)))
        return refs

    def place(self, value: Any, n: int, row: Any, key: str, chat: bool) -> Any:
        """The prompt value with one placeholder per picture (see the class docstring)."""
        if chat:
            return self._place_chat(value, n, row, key)
        if not isinstance(value, str):
            return value  # PromptFormat reports the missing --apply_chat_template
        tags = value.count(IMAGE_TAG)
        if tags == 0 and n:
            return self.placeholder_text * n + value
        self._check_count(tags, n, row, key)
        return value.replace(IMAGE_TAG, self.placeholder_text)

    def _place_chat(self, value: Any, n: int, row: Any, key: str) -> Any:
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            return value  # to_messages reports it
        msgs, count = [], 0
        for m in value:
            if isinstance(m, dict) and isinstance(m.get("content"), str) and IMAGE_TAG in m["content"]:
                m = {**m, "content": _tagged_parts(m["content"])}
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                count += sum(1 for p in m["content"] if _is_image_part(p))
            msgs.append(m)
        if count == 0 and n:
            first = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"), None)
            if first is None:
                raise row.error(f"key {key!r}: {n} picture(s) but no user message to put them in")
            content = msgs[first].get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) and content else \
                (list(content) if isinstance(content, list) else [])
            msgs[first] = {**msgs[first], "content": [{"type": "image"}] * n + text}
            return msgs
        self._check_count(count, n, row, key)
        return msgs

    def _check_count(self, found: int, n: int, row: Any, key: str) -> None:
        if found != n:
            raise row.error(f"key {key!r} has {found} picture placeholder(s) (<image> tags or image parts) but "
                            f"{self.cfg.image_key!r} (--image_key) holds {n} picture(s)")
