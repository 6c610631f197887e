"""HFEngine: the reference rollout engine, on Hugging Face `generate` (slow, simple, obviously right).

    requests -> (prompt, sample) rows grouped by identical sampling settings (and seed)
             -> left-padded batches of <= max_batch_size rows -> model.generate(output_logits=True)
             -> per row: cut at the first stop id / stop string (rlhfkit.rollout.stops),
                log-probs = log_softmax(raw logits / T)[token] (T = 1 for greedy), finish reason

The n samples of a request are n copies of its prompt (no prefix sharing). A vision-language
model's requests carry their pictures (`GenerationRequest.images`), which go to `generate` with the
rows (pixel values in row order, grids, and the token types newer transformers read to place the
3-D positions); the vision markers are suppressed (never sampled), while the reported log-probs
come from the raw logits. A seeded group runs
under `torch.manual_seed(seed)` inside `torch.random.fork_rng`, so it is reproducible for the same
batch. `agenerate` collects the requests that arrive while a batch runs and generates them
together in a worker thread.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F

from rlhfkit.models.hf_config import ConfigFields
from rlhfkit.models.vlm import layout_of_model, placeholder_runs
from rlhfkit.rollout.engine_utils import ThreadBatchingAsync, eos_ids_of, make_decode, validate_request
from rlhfkit.rollout.stops import finish_completion
from rlhfkit.types import Completion, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _group_key(p: SamplingParams, stop_ids: tuple[int, ...]) -> tuple:
    return (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.min_new_tokens, stop_ids, tuple(p.stop), p.seed,
            p.repetition_penalty)


class HFEngine(ThreadBatchingAsync):
    """RolloutEngine on `model.generate`; `tokenizer` is needed only for stop strings."""

    def __init__(self, model: PreTrainedModel, tokenizer: Any = None, *, device: str | torch.device | None = None,
                 eos_token_ids: list[int] | None = None, max_batch_size: int = 64, pad_token_id: int | None = None):
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # transformers wraps Module.to with functools.wraps, whose type does not bind self
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self._decode = make_decode(tokenizer)
        self.eos_token_ids = (eos_ids_of(model.generation_config, tokenizer) if eos_token_ids is None
                              else list(eos_token_ids))
        self.max_batch_size = max_batch_size
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = ConfigFields.of(model.config).pad_token_id
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layout = layout_of_model(model)  # a VLM's; None for text
        self._on_cpu = False

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        for r in requests:
            validate_request(r, self.vocab_size, None)
            if self.layout is not None:
                placeholder_runs(r.prompt_token_ids, r.images, self.layout, f"request {r.request_id}")
            elif r.images is not None and len(r.images):
                raise ValueError(f"request {r.request_id}: pictures for a model without a vision tower")
            if r.params.stop and self._decode is None:
                raise ValueError(f"request {r.request_id}: SamplingParams.stop needs a tokenizer")
        out: list[list[Completion | None]] = [[None] * r.params.n for r in requests]
        groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for i, r in enumerate(requests):
            key = _group_key(r.params, self._stop_ids(r.params))
            groups[key].extend((i, s) for s in range(r.params.n))
        for rows in groups.values():
            params = requests[rows[0][0]].params
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start:start + self.max_batch_size]
                comps = self._run_batch([requests[i] for i, _ in chunk], params)
                for (i, s), c in zip(chunk, comps):
                    out[i][s] = c
        return out  # type: ignore[return-value]

    def _stop_ids(self, p: SamplingParams) -> tuple[int, ...]:
        return tuple(sorted(set(self.eos_token_ids) | set(p.stop_token_ids)))

    def _generation_kwargs(self, p: SamplingParams) -> dict[str, Any]:
        from transformers import GenerationConfig

        stop_ids = list(self._stop_ids(p))
        sample = p.temperature > 0
        cfg = GenerationConfig(
            do_sample=sample, temperature=p.temperature if sample else None,
            top_p=p.top_p if sample else None, top_k=(p.top_k if p.top_k > 0 else 0) if sample else None,
            max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens or None,
            eos_token_id=stop_ids or None, pad_token_id=self.pad_token_id,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
            suppress_tokens=list(self.layout.special_ids) if self.layout is not None else None,
            output_logits=True, return_dict_in_generate=True)
        kw: dict[str, Any] = {"generation_config": cfg}
        if p.stop and p.min_new_tokens == 0 and self.tokenizer is not None and hasattr(self.tokenizer, "decode"):
            cfg.stop_strings = list(p.stop)
            kw["tokenizer"] = self.tokenizer
        return kw

    def _run_batch(self, reqs: list[GenerationRequest], p: SamplingParams) -> list[Completion]:
        prompts = [r.prompt_token_ids for r in reqs]
        plen = max(len(x) for x in prompts)
        ids = torch.full((len(prompts), plen), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(prompts):  # left padding
            ids[i, plen - len(x):] = torch.tensor(x)
            mask[i, plen - len(x):] = 1
        kw = self._generation_kwargs(p)
        kw.update(self._picture_kwargs(reqs, ids))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if p.seed is not None:
                torch.manual_seed(p.seed)
            res = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        new = res.sequences[:, plen:]
        temp = p.temperature if p.temperature > 0 else 1.0
        lps = torch.stack([F.log_softmax(step.float() / temp, dim=-1).gather(1, new[:, t:t + 1]).squeeze(1)
                           for t, step in enumerate(res.logits)], dim=1)
        stop_set = set(self._stop_ids(p))
        comps = []
        for r, toks, lp in zip(reqs, new.tolist(), lps.tolist()):
            t, l, reason = finish_completion(toks, lp, stop_set, p.min_new_tokens, p.stop, self._decode)
            comps.append(Completion(list(r.prompt_token_ids), t, l if p.logprobs else None, reason, r.request_id))
        return comps

    def _picture_kwargs(self, reqs: list[GenerationRequest], ids: torch.Tensor) -> dict[str, Any]:
        """`generate` keywords of a batch's pictures (none for text rows)."""
        from rlhfkit.types import ImageInputs

        joined = ImageInputs.concat([r.images for r in reqs])
        if self.layout is None or joined is None:
            return {}
        kw: dict[str, Any] = {"pixel_values": joined.pixel_values.to(self.device),
                              "image_grid_thw": joined.grid_thw.to(self.device)}
        if "mm_token_type_ids" in inspect.signature(self.model.forward).parameters:
            kw["mm_token_type_ids"] = (ids == self.layout.image_token_id).int().to(self.device)
        return kw

    # ---------------------------------------------------------------- weights and memory
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors by HF name into the model's parameters and buffers (tied names included)."""
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            key = name[len("module."):] if name.startswith("module.") else name
            if key not in targets:
                raise KeyError(f"weight {name!r} is not a parameter of the HF engine's model")
            dst = targets[key]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.data.copy_(tensor.detach())

    def sleep(self, level: int = 1) -> None:
        """Move the model to CPU (both levels; the HF engine holds no separate KV cache)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._on_cpu = True

    def wake_up(self) -> None:
        if self._on_cpu:
            self.model.to(self.device)
            self._on_cpu = False
