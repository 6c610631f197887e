"""One shard of a tensor-parallel builtin engine serving a vision-language model (run by
test_vlm_engine_tp.py under torchrun, gloo, CPU, fp32).

Shard 0 generates for picture + text prompts and compares with the training forward (the HF model with
the pictures and the 3-D positions) and with an unsharded engine; then it loads perturbed weights (vision
tower included) and compares again. Every shard reports its vision-tower calls.
Usage: worker.py <model dir> <out json>
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (vlm_helpers)

from vlm_helpers import PH, load_vlm, max_gap, picture, prompt  # noqa: E402

from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig  # noqa: E402
from rlhfkit.rollout.builtin.model.tensor_parallel import make_group  # noqa: E402
from rlhfkit.types import GenerationRequest, SamplingParams  # noqa: E402

CFG = dict(max_num_seqs=8, max_model_len=128, sync_every=5)


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    from rlhfkit.parallel.rendezvous import destroy_at_exit

    destroy_at_exit()
    torch.manual_seed(0)
    tp = make_group()
    engine = BuiltinEngine(path, None, device="cpu", dtype=torch.float32, config=BuiltinEngineConfig(**CFG), tp=tp)
    calls = [0]
    engine._local.vision.module.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    if tp.rank != 0:
        ops = engine.serve()
        with open(f"{out_path}.rank{tp.rank}", "w") as f:
            json.dump({"ops": ops, "tower_calls": calls[0], "heads": engine.spec.num_heads}, f)
        dist.destroy_process_group()
        return
    model, tok, layout, proc = load_vlm(path)
    pics = proc.process([picture((200, 30, 30), (56, 28)), picture((30, 40, 220), (100, 64))])
    ids = prompt(tok, layout, chat(f"ab{PH}cd{PH}e"), pics)
    reqs = [GenerationRequest(ids, SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=1), 0, pics),
            GenerationRequest(ids, SamplingParams(temperature=0.0, max_new_tokens=12), 1, pics)]
    ref = BuiltinEngine(path, tok, device="cpu", dtype=torch.float32, config=BuiltinEngineConfig(**CFG))
    report = {"heads": engine.spec.num_heads}
    out, base = engine.generate(reqs), ref.generate(reqs)
    comps = out[0] + out[1]
    report["before_gap"] = max_gap(model, layout, ids, pics, comps)
    report["before_same_as_tp1"] = [c.token_ids for c in comps] == [c.token_ids for c in base[0] + base[1]]
    report["tokens"] = sum(len(c.token_ids) for c in comps)
    report["tower_calls_before"] = calls[0]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.update_weights(list(model.named_parameters()))
    after = engine.generate(reqs)
    report["after_gap"] = max_gap(model, layout, ids, pics, after[0] + after[1])
    report["update_changed"] = [c.token_ids for c in after[1]] != [c.token_ids for c in out[1]]
    report["tower_calls"] = calls[0]
    engine.close()
    with open(out_path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
