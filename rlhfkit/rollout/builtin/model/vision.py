"""Pictures in the builtin engine: the vision tower, its output cache, and the multimodal prefill.

    front end (shard 0)                                   every shard (StepRunner.admit)
    VisionIndex.plan(admissions, width)  -> MultimodalPlan: encode the pictures not cached (one
      which pictures each prompt row shows,                vision-tower call), evict, splice each
      which are not cached yet (to encode),                picture's features into its placeholder
      which to evict; the rows' 3-D positions              run, rotary tables from the 3-D positions

The vision tower is the model's own Hugging Face module (`model.visual`, its weights copied in like
the decoder's), replicated on every tensor-parallel shard. Its output for a picture is kept under
the picture's content key (`ImageInputs.keys`), so the n samples of a prompt, which the RL loop
submits as n requests, and the later turns of an episode, which resend the transcript with its
pictures, run the tower once per picture; `VisionTower.pictures_encoded` counts. A weight update
that carries vision-tower weights empties the cache (a frozen tower, --freeze_visual_encoder,
sends none and keeps it).

Positions: a prompt's 3-D M-RoPE positions (rlhfkit.models.vlm.rope_positions) are shifted so that
the token after the prompt sits at 1-D position `len(prompt)`, its cache index. For text tokens the
three components are equal, so every decode step is ordinary 1-D RoPE at the cache index, which is
what the decode kernels and CUDA graphs already do; a constant shift of all positions leaves
attention unchanged (RoPE is relative). Qwen3-VL's deepstack features are added to the hidden states
at the picture positions after the first decoder layers, as transformers does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F

from rlhfkit.models.vlm import VisionLayout, is_vision_name, mrope_cos_sin, rope_positions, token_runs
from rlhfkit.types import ImageInputs

DEFAULT_CACHE_PICTURES = 1024


@dataclass
class MultimodalPlan:
    """The pictures of one prefill batch (host values, replayable on every shard).

    keys[r]: the picture keys of plan row r in placeholder order ([] for a text row); encode: the
    pictures to run through the tower first, `(key, pixel_values [p, D], grid [t, h, w])`; evict:
    keys to drop from the cache; positions `[3, b, P]`: each row's shifted 3-D positions."""

    keys: list[list[str]]
    encode: list[tuple[str, torch.Tensor, list[int]]]
    evict: list[str]
    positions: torch.Tensor


@dataclass
class PrefillInputs:
    """What `DecoderModel.prefill` takes instead of embedding token ids: the spliced embeddings
    `[b, P, H]`, rotary tables `[b, P, 1, D]`, and the deepstack features with the `(rows, cols)`
    of the picture tokens they add to."""

    embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None


def shifted_positions(ids: list[int], images: ImageInputs | None, layout: VisionLayout) -> torch.Tensor:
    """`[3, L]` positions moved so that the next token's is L (see the module docstring)."""
    pos = rope_positions(ids, images, layout)
    return pos + (len(ids) - int(pos.max()) - 1)


class VisionIndex:
    """The front end's record of which picture keys the shards' caches hold (LRU, the same on
    every shard because they follow the same plans)."""

    def __init__(self, layout: VisionLayout, capacity: int = DEFAULT_CACHE_PICTURES) -> None:
        self.layout, self.capacity = layout, capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def clear(self) -> None:
        self._keys.clear()

    def plan(self, requests: list[Any], width: int) -> MultimodalPlan | None:
        """The plan of prefill rows whose requests are `requests` (GenerationRequests), padded to
        `width` tokens; None when no row shows a picture."""
        if not any(r.images is not None and len(r.images) for r in requests):
            return None
        positions = torch.zeros(3, len(requests), width, dtype=torch.long)
        keys: list[list[str]] = []
        encode: list[tuple[str, torch.Tensor, list[int]]] = []
        wanted: set[str] = set()
        for row, req in enumerate(requests):
            ids = req.prompt_token_ids
            positions[:, row, :len(ids)] = shifted_positions(ids, req.images, self.layout)
            row_keys = [] if req.images is None else list(req.images.keys)
            keys.append(row_keys)
            for i, k in enumerate(row_keys):
                wanted.add(k)
                if k in self._keys:
                    self._keys.move_to_end(k)
                elif all(k != e[0] for e in encode):
                    pic = req.images.picture(i)
                    encode.append((k, pic.pixel_values.cpu(), [int(x) for x in pic.grid_thw[0].tolist()]))
        for k, _, _ in encode:
            self._keys[k] = None
        evict = []
        while len(self._keys) > self.capacity:
            k = next(iter(self._keys))
            if k in wanted:  # needed by this very batch: keep it (the cache may run over for one batch)
                break
            self._keys.pop(k)
            evict.append(k)
        return MultimodalPlan(keys, encode, evict, positions)


def _vision_module_class(config: Any) -> Any:
    """The transformers class of the model's vision tower (built on the meta device: no memory)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        full = AutoModelForImageTextToText.from_config(config)
    return type(full.model.visual)


def vision_weight_key(name: str) -> str:
    """An HF parameter name of the tower -> its name inside `model.visual`."""
    for prefix in ("module.", "model.visual.", "visual."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


class VisionTower:
    """The model's vision tower on `device` in `dtype`, and its per-picture output cache."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = VisionLayout.of(config)
        self.dtype, self.device = dtype, device
        from transformers import AutoModel

        with torch.device(device):
            try:
                module = AutoModel.from_config(config.vision_config)
            except (ValueError, KeyError):
                module = _vision_module_class(config)._from_config(config.vision_config)
        self.module = module.to(dtype).eval()
        self._params = dict(self.module.named_parameters())
        self._params.update(dict(self.module.named_buffers()))
        self.cache: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.calls = 0  # tower forward passes
        self.pictures_encoded = 0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the vision-tower tensors among `named` (full HF names) in place; returns their names."""
        done = set()
        for name, t in named:
            if not is_vision_name(name.removeprefix("module.")):
                continue
            key = vision_weight_key(name)
            dst = self._params.get(key)
            if dst is None:
                raise KeyError(f"weight {name!r} has no place in the engine's vision tower")
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} does not match {tuple(dst.shape)}")
            dst.copy_(t.detach().to(dst.device, dst.dtype))
            done.add(name)
        if done:
            self.cache.clear()
        return done

    def expected(self) -> set[str]:
        return {k for k, _ in self.module.named_parameters()}

    def to(self, device: torch.device) -> None:
        self.module.to(device)
        self.cache.clear()
        self._params = dict(self.module.named_parameters())
        self._params.update(dict(self.module.named_buffers()))

    # ------------------------------------------------------------------ pictures
    @torch.no_grad()
    def encode(self, items: list[tuple[str, torch.Tensor, list[int]]]) -> None:
        """One tower pass over the pictures `items` (key, patches, grid); each picture's merged
        features (and deepstack features) go to the cache under its key."""
        if not items:
            return
        pixels = torch.cat([p for _, p, _ in items]).to(self.device, self.dtype)
        grid = torch.tensor([g for _, _, g in items], dtype=torch.long, device=self.device)
        out = self.module(pixels, grid_thw=grid)
        embeds, deep = _tower_outputs(out)
        m2 = self.layout.spatial_merge_size ** 2
        counts = [int(t * h * w) // m2 for _, _, (t, h, w) in items]
        parts = torch.split(embeds, counts)
        deep_parts = [torch.split(d, counts) for d in deep]
        for i, (key, _, _) in enumerate(items):
            self.cache[key] = (parts[i], [d[i] for d in deep_parts])
        self.calls += 1
        self.pictures_encoded += len(items)

    def evict(self, keys: list[str]) -> None:
        for k in keys:
            self.cache.pop(k, None)

    def prefill_inputs(self, plan: MultimodalPlan, tokens: torch.Tensor, host_tokens: Any, embed: torch.Tensor,
                       inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> PrefillInputs:
        """Embeddings with the pictures spliced in, rotary tables and deepstack features of a prefill
        batch (`tokens [b, P]` on the device, `host_tokens` the same on the host; `embed`: the
        embedding matrix)."""
        self.evict(plan.evict)
        self.encode(plan.encode)
        x = F.embedding(tokens, embed)
        layers = self.layout.deepstack_layers
        rows: list[int] = []
        cols: list[int] = []
        feats: list[torch.Tensor] = []
        deep: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        host = host_tokens
        for r, keys in enumerate(plan.keys):
            if not keys:
                continue
            pics = [self.cache[k] for k in keys]
            counts = [p[0].shape[0] for p in pics]
            for start, length in token_runs(host[r].tolist(), counts, self.layout.image_token_id, f"prefill row {r}"):
                rows.extend([r] * length)
                cols.extend(range(start, start + length))
            feats.extend(p[0] for p in pics)
            for li in range(layers):
                deep[li].extend(p[1][li] for p in pics)
        ri = torch.tensor(rows, dtype=torch.long, device=tokens.device)
        ci = torch.tensor(cols, dtype=torch.long, device=tokens.device)
        x[ri, ci] = torch.cat(feats).to(x.dtype)
        stacks = [torch.cat(d).to(x.dtype) for d in deep]
        pos = plan.positions.to(tokens.device)
        cos, sin = mrope_cos_sin(pos, inv_freq, self.layout, scaling)  # [b, P, D] fp32
        return PrefillInputs(x, cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :], stacks, ri, ci)


def _tower_outputs(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(merged features `[N, H]`, deepstack features) from what a transformers version's vision
    tower returns: a tensor, a tuple (features, deepstack list), or an output with `pooler_output`."""
    if isinstance(out, torch.Tensor):
        return out, []
    if isinstance(out, tuple) and not hasattr(out, "keys"):
        return out[0], list(out[1]) if len(out) > 1 and out[1] is not None else []
    fields = out if isinstance(out, Mapping) else {}  # a ModelOutput: a mapping of the fields it has
    merged = fields.get("pooler_output")
    if merged is None:
        merged = out[0]
    return merged, list(fields.get("deepstack_features") or [])


def load_vision_tower(model: Any, config: Any, dtype: torch.dtype, device: torch.device) -> VisionTower | None:
    """The vision tower of a VLM given as the engine's model is (a directory read tensor by tensor,
    an HF module, or a config: HF's random initialisation); None for a text model."""
    from transformers import PretrainedConfig

    from rlhfkit.models.vlm import is_vlm_config

    if not is_vlm_config(config):
        return None
    tower = VisionTower(config, dtype, device)
    if isinstance(model, PretrainedConfig):
        return tower
    loaded: set[str] = set()
    if isinstance(model, str):
        from safetensors import safe_open

        from rlhfkit.rollout.builtin.model.weights import safetensors_files

        for fname in safetensors_files(model):
            with safe_open(fname, framework="pt") as f:
                for name in f.keys():
                    if is_vision_name(name.removeprefix("module.")):
                        loaded |= {vision_weight_key(n) for n in tower.load([(name, f.get_tensor(name))])}
    else:
        loaded = {vision_weight_key(n) for n in tower.load(model.state_dict().items())}
    missing = sorted(tower.expected() - loaded)
    if missing:
        raise ValueError(f"the model's weights lack vision-tower tensors {missing[:5]}")
    return tower
