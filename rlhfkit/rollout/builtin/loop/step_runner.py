"""The builtin engine's device side: `StepRunner` owns the weights, the KV cache, the slot state and
the decode runner, and exposes the few operations the front end (loop/front_end.py) needs, each taking
host values only (lists, numpy arrays, scalars):

    admit(plan)            prefill the planned prompts, fan their K/V out to the sample slots,
                           write the slots' sampling settings, sample each slot's first token
    decode(rows, kv_len, filtered, steps)   `steps` decode steps over rows 0..rows-1
    read_out(reads, width, wait)            done flags, lengths and new tokens -> host (no mutation)
    release(slots) / move(src, dst, length) / fail_all()
    update_weights(named) / sleep(level) / wake_up() / warmup(rows, kv_lens, filtered) / shutdown()

Because every argument is a host value, an operation can be replayed on another process (mirror.py: how a
tensor-parallel engine runs).

`sleep()` frees the KV cache and the CUDA graphs but keeps the decode runner and its compiled
functions, so `wake_up()` reallocates memory without recompiling: the first steps after a wake
only recapture graphs (a few decode steps each), instead of paying torch.compile again.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from rlhfkit.rollout.builtin.loop.decode_runner import DecodeRunner
from rlhfkit.rollout.builtin.loop.sampling import SlotState
from rlhfkit.rollout.builtin.model.decoder import DecoderModel, KVCache
from rlhfkit.rollout.builtin.model.vision import MultimodalPlan, VisionIndex, VisionTower
from rlhfkit.rollout.builtin.model.weights import copy_named_tensors
from rlhfkit.rollout.engine_utils import to_device


@dataclass
class AdmitPlan:
    """One prefill batch, as host values (built by the front end, replayable on every shard).

    tokens `[b, P]` right-padded prompts; lengths `[b]`; first_slots `[b]` (each prompt's first
    sample slot; `step` > 0 when they are evenly spaced); fan_src / fan_dst copy a prompt's K/V to
    its other sample slots; `slots` and `row_of` list every sample slot and its prompt row;
    `settings` holds one tuple per slot for `SlotState.admit` (columns: slot, pos, temperature,
    top_p, top_k, min_new, max_new, stop ids, stop valid, banned, seed, penalty: the stop-id columns
    also carry the `banned` ids, never sampled); `penalised` lists `(slots, prompt ids)` of requests
    with a repetition penalty; `vocab` sizes its mask. `mm`: the pictures of the batch (model/vision.py).
    """

    tokens: np.ndarray
    lengths: list[int]
    first_slots: list[int]
    step: int
    fan_src: list[int]
    fan_dst: list[int]
    slots: list[int]
    row_of: list[int]
    settings: list[tuple]
    penalised: list[tuple[list[int], list[int]]]
    filtered: bool
    vocab: int
    mm: MultimodalPlan | None = None

    @classmethod
    def from_admissions(cls, admissions: list[Any], vocab: int, max_stop_ids: int, banned: tuple[int, ...] = (),
                        vision: VisionIndex | None = None) -> "AdmitPlan":
        """The plan of one prefill call from the scheduler's `Admission`s (their requests' prompts,
        sampling settings and seeds; `max_stop_ids` pads each slot's stop ids and `banned` ids;
        `vision` plans the pictures of a VLM's requests)."""
        prompts = [a.req.request.prompt_token_ids for a in admissions]
        plen = max(len(p) for p in prompts)
        padded = np.zeros((len(prompts), plen), dtype=np.int64)  # row by row: 3x faster than torch.tensor(lists)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        first_slots = [a.slots[0] for a in admissions]
        step = first_slots[1] - first_slots[0] if len(first_slots) > 1 else 1
        evenly = step >= 1 and first_slots == list(range(first_slots[0], first_slots[0] + step * len(first_slots), step))
        settings = []  # a full batch admits hundreds at once
        for a in admissions:
            p, req = a.req.request.params, a.req
            cols = stop_columns(req.stop_ids, banned, max_stop_ids)
            const = (req.prompt_len - 1, p.temperature, p.top_p, p.top_k if 0 < p.top_k < vocab else vocab,
                     p.min_new_tokens, p.max_new_tokens, *cols)
            for i, slot in enumerate(a.slots):
                settings.append((slot, *const, hash((req.seed, a.first_sample + i)) & (2**63 - 1),
                                 p.repetition_penalty))
        return cls(
            tokens=padded, lengths=[len(p) for p in prompts], first_slots=first_slots, step=step if evenly else 0,
            fan_src=[a.slots[0] for a in admissions for _ in a.slots[1:]],
            fan_dst=[s for a in admissions for s in a.slots[1:]],
            slots=[s for a in admissions for s in a.slots],
            row_of=[i for i, a in enumerate(admissions) for _ in a.slots],
            settings=settings,
            penalised=[(list(a.slots), list(a.req.request.prompt_token_ids)) for a in admissions
                       if a.req.request.params.repetition_penalty != 1.0],
            filtered=any(a.req.filtered for a in admissions), vocab=vocab,
            mm=vision.plan([a.req.request for a in admissions], plen) if vision is not None else None)


def stop_columns(stop_ids: list[int], banned: tuple[int, ...], width: int) -> tuple[list[int], list[bool], list[bool]]:
    """A slot's (ids, is-stop, is-banned) columns: its stop ids, then the banned ids, padded to `width`
    with copies of the first entry that are neither stops nor banned."""
    ids = list(stop_ids) + [t for t in banned if t not in stop_ids]
    stop = [True] * len(stop_ids) + [False] * (len(ids) - len(stop_ids))
    ban = [False] * len(stop_ids) + [True] * (len(ids) - len(stop_ids))
    if not ids:
        ids, stop, ban = [0], [False], [False]
    pad = width - len(ids)
    return ids + [ids[0]] * pad, stop + [stop[0]] * pad, ban + [False] * pad


class StepRunner:
    """See the module docstring. `model` holds the (sharded) weights; sizes come from `config`."""

    def __init__(self, model: DecoderModel, *, num_slots: int, max_model_len: int, max_stop_ids: int,
                 device: torch.device, dtype: torch.dtype, cuda_graphs: bool, compile_step: bool,
                 compile_prefill: bool, compile_mode: str | None, fast_sampling: bool,
                 vision: VisionTower | None = None, inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0):
        self.model, self.device, self.dtype = model, device, dtype
        self.vision, self.inv_freq, self.rope_scaling = vision, inv_freq, rope_scaling
        self.num_slots, self.max_model_len, self.max_stop_ids = num_slots, max_model_len, max_stop_ids
        self._h2d = functools.partial(to_device, device=device)
        self.lock = threading.RLock()
        self.asleep = 0
        self.cache: KVCache | None = None  # None while asleep
        self.state: SlotState | None = None
        cache, state = self._allocate()
        self.runner = DecodeRunner(model, cache, state, max_model_len, cuda_graphs=cuda_graphs,
                                   compile_step=compile_step, compile_prefill=compile_prefill,
                                   compile_mode=compile_mode)
        self.runner.fast_sampling = fast_sampling

    # ---------------------------------------------------------------- memory
    def _allocate(self) -> tuple[KVCache, SlotState]:
        spec = self.model.spec
        need = KVCache.bytes_needed(spec, self.num_slots, self.max_model_len, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise ValueError(f"the KV cache needs {need / 2**30:.1f} GiB ({self.num_slots} slots x "
                                 f"{self.max_model_len} tokens) but {free / 2**30:.1f} GiB are free: lower "
                                 "max_num_seqs or max_model_len")
        self.cache = cache = KVCache.allocate(spec, self.num_slots, self.max_model_len, self.dtype, self.device)
        self.state = state = SlotState.allocate(self.num_slots, self.max_model_len, self.max_stop_ids, self.device)
        return cache, state

    def _awake(self) -> tuple[KVCache, SlotState]:
        if self.cache is None or self.state is None:
            raise RuntimeError("the engine is asleep: wake_up() first")
        return self.cache, self.state

    def sleep(self, level: int) -> None:
        """Free the KV cache, slot state and graphs (level 1); level 2 also moves the weights to CPU.
        The decode runner and its compiled functions stay."""
        with self.lock:
            self.runner.reset()
            self.runner.cache = self.runner.state = None
            self.cache = self.state = None
            if self.vision is not None:
                self.vision.cache.clear()  # (the front end forgets its index at the same time)
            if level == 2:
                self._move_weights(torch.device("cpu"))
            self.asleep = level
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake_up(self) -> None:
        with self.lock:
            if not self.asleep:
                return
            if self.asleep == 2:
                self._move_weights(self.device)
            self.runner.cache, self.runner.state = self._allocate()
            self.asleep = 0

    def _move_weights(self, device: torch.device) -> None:
        w = self.model.weights
        w.replace_tensors({k: v.to(device) for k, v in w.tensors().items()})
        self.model.move_tables(device)
        if self.vision is not None:
            self.vision.to(device)

    @torch.no_grad()
    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full HF-named tensors (this shard's slices) into the weights in place; graphs stay valid.
        A VLM's vision-tower tensors go to the tower (which then forgets its cached outputs); the LoRA
        adapters of a policy whose weights the engine shares are copied from the policy again."""
        with self.lock:
            if self.vision is None:  # (a stream of tensors: never held all at once)
                n = len(copy_named_tensors(self.model.weights, self.model.spec, named))
            else:
                named = list(named)
                n = len(copy_named_tensors(self.model.weights, self.model.spec, named)) + len(self.vision.load(named))
            self.model.weights.refresh_lora()
            return n

    # ---------------------------------------------------------------- generation
    def admit(self, plan: AdmitPlan) -> None:
        with self.lock, torch.inference_mode():
            h2d, (cache, _) = self._h2d, self._awake()
            slot_slice = (slice(plan.first_slots[0], plan.first_slots[-1] + 1, plan.step) if plan.step > 0 else None)
            tokens = h2d(torch.from_numpy(plan.tokens))
            mm = None
            if plan.mm is not None:
                if self.vision is None:
                    raise ValueError("a request with pictures reached an engine whose model has no vision tower")
                assert self.inv_freq is not None  # the engine gives a vision tower its rope frequencies
                mm = self.vision.prefill_inputs(plan.mm, tokens, plan.tokens, self.model.weights.embed, self.inv_freq,
                                                self.rope_scaling, self.dtype)
            logits = self.runner.prefill(cache, tokens, h2d(plan.lengths), h2d(plan.first_slots), slot_slice, mm)
            if plan.fan_dst:
                cache.copy_rows(h2d(plan.fan_src), h2d(plan.fan_dst), plan.tokens.shape[1])
            self._init_slots(plan)
            self.runner.sample(h2d(plan.slots), logits[h2d(plan.row_of)], plan.filtered)

    def _init_slots(self, plan: AdmitPlan) -> None:
        st, h2d = self._awake()[1], self._h2d
        idx = st.admit(h2d, *(list(c) for c in zip(*plan.settings)))
        if plan.penalised and st.track_seen(plan.vocab):
            self.runner.reset()  # graphs captured before the mask existed do not update it
        if st.seen.shape[1]:
            st.seen[idx] = False
            if plan.penalised:  # each sample slot starts from its prompt's tokens
                rows, cols = [], []
                for slots, prompt in plan.penalised:
                    for slot in slots:
                        rows.extend([slot] * len(prompt))
                        cols.extend(prompt)
                st.seen[h2d(rows), h2d(cols)] = True

    def decode(self, rows: int, kv_len: int, filtered: bool, steps: int) -> None:
        with self.lock, torch.inference_mode():
            self.runner.run(rows, kv_len, filtered, steps)

    def read_out(self, reads: list[int], width: int, wait: bool) -> tuple:
        with self.lock, torch.inference_mode():
            return self._awake()[1].read_out(self._h2d(reads), width, wait or self.device.type != "cuda")

    def release(self, slots: list[int]) -> None:
        with self.lock, torch.inference_mode():
            self._awake()[1].done[self._h2d(slots)] = True

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        with self.lock, torch.inference_mode():
            s, d = self._h2d(src), self._h2d(dst)
            cache, state = self._awake()
            cache.copy_rows(s, d, length)
            state.move_rows(s, d)
            state.done[s] = True

    def fail_all(self) -> None:
        with self.lock:
            if self.state is not None:
                self.state.done.fill_(True)

    def warmup(self, rows: int, kv_lens: list[int], filtered: bool) -> None:
        with self.lock, torch.inference_mode():
            self.runner.warmup(rows, kv_lens, filtered)

    def shutdown(self) -> None:
        """Nothing to free locally; ends a shard's `serve()` loop when mirrored."""


# ----------------------------------------------------------------------------- tensor parallelism
