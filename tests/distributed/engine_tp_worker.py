"""One shard of a tensor-parallel builtin engine (run by test_engine_tp.py under torchrun, gloo, CPU).

Shard 0 serves requests and compares each result with an unsharded engine on the same weights;
the other shards run `serve()`. Usage: worker.py <model dir> <out json>
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import torch.distributed as dist

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.model.tensor_parallel import make_group
from rlhfkit.types import GenerationRequest, SamplingParams

CFG = dict(max_num_seqs=8, max_model_len=96, sync_every=5)


def requests(vocab: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, vocab, (n,), generator=g).tolist() for n in (5, 11, 3, 17, 8)]
    greedy = [GenerationRequest(p, SamplingParams(temperature=0.0, max_new_tokens=10 + 3 * i, logprobs=True), f"g{i}")
              for i, p in enumerate(prompts)]
    sampled = GenerationRequest(prompts[1], SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=7,
                                                           logprobs=True), "s")
    penalised = GenerationRequest(prompts[2], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                             repetition_penalty=1.3, logprobs=True), "p")
    topk = GenerationRequest(prompts[3], SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=9,
                                                        seed=5, logprobs=True), "k")
    return greedy + [sampled, penalised, topk]


def outputs(results) -> list[dict]:
    return [{"id": c.request_id, "tokens": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason}
            for group in results for c in group]


def compare(a: list[dict], b: list[dict]) -> dict:
    same = all(x["tokens"] == y["tokens"] for x, y in zip(a, b)) and len(a) == len(b)
    gaps = [abs(p - q) for x, y in zip(a, b) if x["tokens"] == y["tokens"] for p, q in zip(x["logprobs"], y["logprobs"])]
    return {"same_tokens": same, "max_logprob_gap": max(gaps) if gaps else None,
            "tokens": sum(len(x["tokens"]) for x in a)}


def perturbed(path: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return list(model.state_dict().items())


def main() -> None:
    path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    from rlhfkit.parallel.rendezvous import destroy_at_exit

    destroy_at_exit()  # gloo's threads settle before interpreter teardown
    torch.manual_seed(0)
    tp = make_group()
    cfg = BuiltinEngineConfig(**CFG)
    engine = BuiltinEngine(path, None, device="cpu", dtype=torch.float32, config=cfg, eos_token_ids=[], tp=tp)
    if tp.rank != 0:
        ops = engine.serve()
        with open(f"{out_path}.rank{tp.rank}", "w") as f:
            json.dump({"ops": ops, "lm_head_rows": engine.model.weights.lm_head.shape[0],
                       "heads": engine.spec.num_heads, "kv_heads": engine.spec.num_kv_heads}, f)
        dist.destroy_process_group()
        return
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = BuiltinEngine(hf, None, device="cpu", dtype=torch.float32, config=BuiltinEngineConfig(**CFG),
                        eos_token_ids=[])
    reqs = requests(ref.spec.vocab_size)
    report: dict = {"shard": {"heads": engine.spec.num_heads, "kv_heads": engine.spec.num_kv_heads,
                              "intermediate": engine.spec.intermediate_size,
                              "lm_head_rows": engine.model.weights.lm_head.shape[0]}}
    base = outputs(ref.generate(reqs))
    report["before"] = compare(outputs(engine.generate(reqs)), base)

    async def concurrent(eng):
        return await asyncio.gather(*(eng.agenerate(r) for r in reqs[:4]))
    report["async"] = compare(outputs(asyncio.run(concurrent(engine))), base[:4])

    new = perturbed(path)
    ref.update_weights(iter(new))
    engine.update_weights(iter(new))
    after = outputs(ref.generate(reqs))
    report["after"] = compare(outputs(engine.generate(reqs)), after)
    report["update_changed_outputs"] = any(x["tokens"] != y["tokens"] for x, y in zip(base, after))

    engine.sleep(1)
    engine.wake_up()
    report["after_wake"] = compare(outputs(engine.generate(reqs)), after)
    engine.close()
    with open(out_path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
