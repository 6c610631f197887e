"""`BuiltinEngineConfig`: sizes and switches of the builtin rollout engine."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.rollout.builtin.model.decoder import DECODE_ATTENTION, DECODE_GEMM


@dataclass
class BuiltinEngineConfig:
    """Sizes and switches of the builtin engine (KV cache = 2 x layers x slots x kv_heads x len x dim)."""

    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: min(max_position_embeddings, 2048)
    max_prefill_tokens: int = 16384
    sync_every: int = 16
    sync_every_batch: int = 64  # in generate() when no request waits and no stop strings are watched
    cuda_graphs: bool | None = None  # default: on for CUDA devices
    # torch.compile the decode step: about 10% faster decoding of a 0.5B model, but its compilation
    # costs 20-30 s on the first generate (bench/results/first_step_h100.json); eager kernels replayed
    # as CUDA graphs start in a few seconds. None: off
    compile: bool | None = None
    max_stop_ids: int = 8
    seed: int = 0
    compile_prefill: bool | None = None  # torch.compile the prefill layer too; default: as `compile`
    compile_mode: str | None = None  # torch.compile mode of the decode layer / head, e.g. "max-autotune-no-cudagraphs"
    # "auto": "triton" (fused RoPE + K/V write + attention kernel) on CUDA when Triton and the head
    # shape allow, else "sdpa"; "matmul": two batched matmuls (no SDPA kernel)
    decode_attention: str = "auto"
    fast_sampling: bool = True  # on CUDA, the one-pass Triton sampler for batches without top-k / top-p
    # "auto": "triton" (fused gate/up + SiLU and split-K o / down projections) on CUDA for batches of at
    # least `gemm_min_rows` rows when Triton and the model allow, else "torch" (cuBLAS)
    decode_gemm: str = "auto"
    gemm_min_rows: int = 64
    lookahead_steps: int | None = None  # decode steps queued while a batch-mode sync is read; default 4 on CUDA, 0 on CPU
    # an idle engine woken by a request waits until no request has arrived for this long (at most 10x
    # as long in all), so that a burst (an RL step's episodes start together) is prefilled and decoded
    # as one batch instead of its first group running alone for a chunk of steps; 0: start at once
    admit_window_ms: float = 2.0
    vision_cache_pictures: int = 256  # a VLM's vision-tower outputs kept per picture (LRU; model/vision.py)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_prefill_tokens", "sync_every", "sync_every_batch", "max_stop_ids",
                     "gemm_min_rows", "vision_cache_pictures"):
            if getattr(self, name) < 1:
                raise ValueError(f"BuiltinEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.admit_window_ms < 0:
            raise ValueError(f"BuiltinEngineConfig.admit_window_ms must be >= 0, got {self.admit_window_ms}")
        if self.lookahead_steps is not None and self.lookahead_steps < 0:
            raise ValueError(f"BuiltinEngineConfig.lookahead_steps must be >= 0, got {self.lookahead_steps}")
        if self.decode_attention not in ("auto",) + DECODE_ATTENTION:
            raise ValueError(f"BuiltinEngineConfig.decode_attention must be one of {('auto',) + DECODE_ATTENTION}, "
                             f"got {self.decode_attention!r}")
        if self.decode_gemm not in ("auto",) + DECODE_GEMM:
            raise ValueError(f"BuiltinEngineConfig.decode_gemm must be one of {('auto',) + DECODE_GEMM}, "
                             f"got {self.decode_gemm!r}")
