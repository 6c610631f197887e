"""VLLMEngine: the RolloutEngine protocol over vLLM's offline `LLM` API (optional; vllm imported lazily).

    GenerationRequest -> vllm.SamplingParams + TokensPrompt(prompt_token_ids)
                      -> LLM.generate -> CompletionOutput.token_ids / .logprobs / .finish_reason

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) and
`logprobs=0`, which returns the sampled token's log-prob after temperature scaling and before
top-k/top-p, the same quantity the builtin engine reports. Weights are updated through
`LLM.collective_rpc` with a function that calls `load_weights` of each worker's model (the tensors
are pickled to the workers: fine for one GPU, slow for big models), then the prefix cache is
reset. `sleep(level)` / `wake_up()` call vLLM's (needs `enable_sleep_mode=True`).

Untested here (no vLLM in the CPU environment); written against vLLM's documented offline API.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from rlhfkit.rollout.engine_utils import ThreadBatchingAsync, validate_request
from rlhfkit.types import Completion, GenerationRequest, SamplingParams

VLLM_MISSING = "--rollout_engine vllm needs the vllm extra: pip install rlhfkit[vllm]"


def import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(VLLM_MISSING) from exc
    return vllm


def _load_weights_on_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (through collective_rpc)."""
    device = next(worker.model_runner.model.parameters()).device
    worker.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in named])


class VLLMEngine(ThreadBatchingAsync):
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_sleep_mode: bool = False,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, **llm_kwargs: Any):
        vllm = import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                            logprobs_mode="processed_logprobs", **llm_kwargs)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _sampling_params(self, p: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_new_tokens, min_tokens=p.min_new_tokens, stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop) or None, seed=p.seed, logprobs=0 if p.logprobs else None,
            detokenize=bool(p.stop))

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        for r in requests:
            validate_request(r, self.vocab_size, self.max_model_len)
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [self._sampling_params(r.params) for r in requests]
        outs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        return [[self._completion(r, o) for o in out.outputs] for r, out in zip(requests, outs)]

    @staticmethod
    def _completion(req: GenerationRequest, out: Any) -> Completion:
        ids = list(out.token_ids)
        lps = None
        if req.params.logprobs and out.logprobs is not None:
            lps = [float(step[t].logprob) for t, step in zip(ids, out.logprobs)]
        reason = "stop" if out.finish_reason == "stop" else "length"
        return Completion(list(req.prompt_token_ids), ids, lps, reason, req.request_id)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = [(n, t.detach().cpu()) for n, t in named_tensors]
        self.llm.collective_rpc(_load_weights_on_worker, args=(named,))
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
