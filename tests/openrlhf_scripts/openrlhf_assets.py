"""Tiny offline stand-ins for the models and datasets that OpenRLHF's example scripts name.

`build_assets(root)` writes, once per test session:

    models/llama        tiny Llama (character tokenizer, ChatML template, 512 positions): every policy,
                        reference, teacher and base model of the scripts
    models/rm           a reward model on the same backbone (value head `score`, mean/std stored, so
                        --normalize_reward works): every --reward_pretrain / RM path
    models/prm          the tiny Llama whose tokenizer also knows Math-Shepherd's step tag "ки"
                        (train_prm_mistral.sh keeps --placeholder_token ки as written)
    models/llama_tp,    the tiny Llama and its reward model with the vocabulary padded from 103 to 104
    models/rm_tp        rows (the tokenizer is unchanged), so --ds_tensor_parallel_size 2 divides it
                        (the *_tensor_parallelism.sh scripts: TP_MODEL, TP_RM_MODEL)
    models/vlm          a tiny Qwen3-VL with its image processor (the VLM scripts' Qwen3.5: VLM_MODEL)
    data/*.jsonl        rows with the keys each script reads (see DATASETS)
    data/geometry3k.jsonl + data/geo/*.png   hiyouga/geometry3k's keys (prompt as chat messages with an
                        image part, images, label): one small picture per addition question

Prompts are 2-digit additions ("12+34="), labels their sums, so reward files and agents get a
label to compare with. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
from typing import Any, Callable

ROWS = 8  # rows per dataset: 1-2 optimizer steps at the scripts' reduced batch sizes
TP_VOCAB = 104  # the character tokenizer's 103 ids, padded so a tensor-parallel size of 2 divides them


def _additions(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"{a}+{b}=", str(a + b)) for a, b in ((rng.randrange(10, 50), rng.randrange(10, 50)) for _ in range(n))]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _conv(q: str, a: str) -> list[dict[str, str]]:
    return _user(q) + [{"role": "assistant", "content": a}]


def _wrong(a: str) -> str:
    return str(int(a) + 1)


# dataset file -> row builder (index, question, answer) -> row; the keys are those of the dataset the script names
DATASETS: dict[str, Callable[[int, str, str], dict[str, Any]]] = {
    # Open-Orca/OpenOrca (train_sft, train_sft_mixtral_lora, train_knowledge_distillation)
    "openorca.jsonl": lambda i, q, a: {"question": q, "response": a},
    # continued pre-training text (--pretrain_mode reads --input_key input)
    "pretrain.jsonl": lambda i, q, a: {"input": q + a},
    # OpenRLHF/preference_dataset_mixture2_and_safe_pku: chosen / rejected conversations
    "preference.jsonl": lambda i, q, a: {"chosen": _conv(q, a), "rejected": _conv(q, _wrong(a))},
    # Dylan2048/ultrafeedback-unpaired-preferences (train_kto): instruction, response, score (bool)
    "unpaired.jsonl": lambda i, q, a: {"instruction": q, "response": a if i % 2 else _wrong(a),
                                       "score": bool(i % 2)},
    # zhuzilin/Math-Shepherd (train_prm): steps ending in "ки", one +/- label per step
    "math_shepherd.jsonl": lambda i, q, a: {"input": f"{q} ки {a} ки", "value": ["+", "+" if i % 2 else "-"]},
    # OpenRLHF/prompt-collection-v0.1: context_messages
    "prompt_collection.jsonl": lambda i, q, a: {"context_messages": _user(q)},
    # zhuzilin/dapo-math-17k, OpenRLHF/dapo-math-17k, OpenRLHF/aime-2024: prompt + label
    "math.jsonl": lambda i, q, a: {"prompt": _user(q), "label": a},
    # OpenRLHF/gem_guess_game: query + label
    "guess_game.jsonl": lambda i, q, a: {"query": q, "label": a},
}


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def build_models(models: str) -> dict[str, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model
    from rlhfkit.models.value import load_value_model, save_value_model

    spec = TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=512)
    llama = make_tiny_model(os.path.join(models, "llama"), spec)
    rm = os.path.join(models, "rm")
    tok = AutoTokenizer.from_pretrained(llama)
    save_value_model(load_value_model(llama, init_value_head=True), rm, tok, mean=0.1, std=2.0)
    prm = os.path.join(models, "prm")
    tok.add_tokens(["ки"])
    model = AutoModelForCausalLM.from_pretrained(llama)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(prm)
    tok.save_pretrained(prm)
    tok = AutoTokenizer.from_pretrained(llama)
    llama_tp, rm_tp = os.path.join(models, "llama_tp"), os.path.join(models, "rm_tp")
    model = AutoModelForCausalLM.from_pretrained(llama)
    model.resize_token_embeddings(TP_VOCAB, mean_resizing=False)
    model.save_pretrained(llama_tp)
    tok.save_pretrained(llama_tp)
    value = load_value_model(rm, init_value_head=False)
    value.resize_token_embeddings(TP_VOCAB, mean_resizing=False)
    save_value_model(value, rm_tp, tok, mean=0.1, std=2.0)
    return {"MODEL": llama, "RM_MODEL": rm, "PRM_MODEL": prm, "TP_MODEL": llama_tp, "TP_RM_MODEL": rm_tp}


def build_vlm(models: str) -> str:
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(os.path.join(models, "vlm"), TinyModelSpec(
        arch="qwen3_vl", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512))


def write_geometry(data: str, pairs: list[tuple[str, str]]) -> str:
    """geometry3k's keys: a user message of an image part and the question, the picture's path
    (relative to this file's folder), the answer."""
    from rlhfkit.tasks.shapes import draw

    os.makedirs(os.path.join(data, "geo"), exist_ok=True)
    rng = random.Random(5)
    rows = []
    for i, (q, a) in enumerate(pairs):
        rel = os.path.join("geo", f"{i}.png")
        draw(rng.choice(["red", "green", "blue", "yellow"]), 1 + i % 3, rng).save(os.path.join(data, rel))
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Find x. {q}"}]}]
        rows.append({"prompt": prompt, "images": [rel], "label": a})
    return write_jsonl(os.path.join(data, "geometry3k.jsonl"), rows)


def build_assets(root: str) -> dict[str, str]:
    """Models and data under `root`; returns the environment the scripts read (MODEL, RM_MODEL, DATA...)."""
    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    env = build_models(os.path.join(root, "models"))
    env["VLM_MODEL"] = build_vlm(os.path.join(root, "models"))
    pairs = _additions(ROWS, seed=0)
    for name, row in DATASETS.items():
        write_jsonl(os.path.join(data, name), [row(i, q, a) for i, (q, a) in enumerate(pairs)])
    write_geometry(data, pairs)
    env["DATA"] = data
    return env


def shared_assets(tmp_path_factory) -> dict[str, str]:
    """build_assets once for the whole pytest run, under a lock: every xdist worker and every module that asks gets
    the same folder (the scripts and the tests only read it; what they write goes under their own $OUT)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, above the workers'
    target = os.path.join(str(root), "openrlhf_assets")
    done = os.path.join(target, "env.json")
    with open(os.path.join(str(root), "openrlhf_assets.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(done):
            env = build_assets(target)
            with open(done + ".tmp", "w") as f:
                json.dump(env, f)
            os.replace(done + ".tmp", done)
    with open(done) as f:
        return json.load(f)


if __name__ == "__main__":
    import sys

    print(json.dumps(build_assets(sys.argv[1]), indent=2))
