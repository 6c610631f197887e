"""Which part of the builtin engine moves gpt-oss's bf16 log-probs away from fp32 on a GPU: the engine as a
user gets it, with the explicit (matmul) decode attention, and with the routed experts eager; beside
transformers' own bf16 gap (tests/gpu/test_engine_families_gpu.py's model and prompts)."""
import copy
import json
import sys

import torch

sys.path.insert(0, "tests/gpu")
from test_engine_families_gpu import _logprobs, _model  # noqa: E402

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.rollout.builtin.model import experts  # noqa: E402
from rlhfkit.types import GenerationRequest, SamplingParams  # noqa: E402

arch = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
model = _model(arch)
ref32 = copy.deepcopy(model).float()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
rows = []
for label, cfg, eager_experts in [("default", {}, False), ("matmul attention", {"decode_attention": "matmul"}, False),
                                  ("experts eager", {}, True), ("both", {"decode_attention": "matmul"}, True)]:
    if eager_experts:
        experts.routed.failed = "probe: eager"
    else:
        experts.routed.failed = None
    engine = BuiltinEngine(model, None, device="cuda", dtype=torch.bfloat16, eos_token_ids=[],
                           config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=128, **cfg))
    outs = engine.generate([GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=32), i)
                            for i, p in enumerate(prompts)])
    gaps = []
    for p, (c,) in zip(prompts, outs):
        full = p + c.token_ids
        fp32 = _logprobs(ref32, full, len(p))
        gaps.append([round((torch.tensor(c.logprobs) - fp32).abs().max().item(), 4),
                     round((_logprobs(model, full, len(p)) - fp32).abs().max().item(), 4)])
    engine.close()
    rows.append({"variant": label, "engine_vs_hf_gap_per_prompt": gaps})
    print(json.dumps(rows[-1]), flush=True)
