"""Model flags given as hub ids, end to end with HF_HUB_OFFLINE=1 and a temporary Hugging Face cache
(laid out as huggingface_hub writes it): `train_sft --pretrain org/tiny --lora_rank 4` trains from the
cached snapshot; `lora_combiner --model_path org/tiny` merges that run's adapter, and the merged model's
logits equal base + adapter under peft; an id that is not cached is one error line naming the flag, the
id and the fix (exit 1, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import subprocess_env
from hub_cache import place_in_hub_cache

# --dist loadgroup: one worker builds its hub cache and LoRA run, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("hub_models_cli")

REPO = "org/tiny"


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hub")
    cache = str(d / "cache")
    snapshot = place_in_hub_cache(tiny_model_dir, cache, REPO)
    data = str(d / "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"q": f"{a}+{a % 7}=", "r": str(a + a % 7)}) + "\n" for a in range(32))
    return {"dir": d, "cache": cache, "snapshot": snapshot, "data": data,
            "env": subprocess_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache, HF_HOME=str(d / "home"))}


def _run(hub, module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"rlhfkit.cli.{module}", *args], env=hub["env"],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sft_lora(hub):
    out = str(hub["dir"] / "sft_lora")
    r = _run(hub, "train_sft", "--pretrain", REPO, "--dataset", hub["data"], "--input_key", "q",
             "--output_key", "r", "--input_template", "{}", "--max_len", "32", "--train_batch_size", "8",
             "--micro_train_batch_size", "8", "--max_steps", "2", "--lr_warmup_ratio", "0", "--learning_rate",
             "2e-2", "--lora_rank", "4", "--lora_alpha", "8", "--param_dtype", "fp32", "--save_path", out,
             "--disable_progress")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out, r


@pytest.mark.slow
def test_train_sft_loads_a_cached_hub_id_offline(hub, sft_lora):
    out, _ = sft_lora
    with open(os.path.join(out, "run_config.json")) as f:
        assert json.load(f)["pretrain"] == hub["snapshot"]  # resolved once, before training
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))


@pytest.mark.slow
def test_uncached_hub_id_offline_is_one_line(hub, tmp_path):
    r = _run(hub, "train_sft", "--pretrain", "org/not-cached", "--dataset", hub["data"], "--save_path",
             str(tmp_path / "o"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("train_sft: error: --pretrain org/not-cached: no such local directory and not in "
                               "the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in lines[0] and "hf download org/not-cached" in lines[0]


@pytest.mark.slow
def test_lora_combiner_merges_train_sft_adapter(hub, sft_lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter, _ = sft_lora
    merged_dir = str(hub["dir"] / "merged")
    r = _run(hub, "lora_combiner", "--model_path", REPO, "--lora_path", adapter, "--output_path", merged_dir,
             "--param_dtype", "fp32")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not os.path.exists(os.path.join(merged_dir, "adapter_config.json"))  # a plain model, no adapter

    tok = AutoTokenizer.from_pretrained(merged_dir)
    batch = tok(["3+4=7", "12+5=17", "x"], return_tensors="pt", padding=True, add_special_tokens=False)
    base = AutoModelForCausalLM.from_pretrained(hub["snapshot"], dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
        adapted = PeftModel.from_pretrained(base, adapter).eval()
        want = adapted(**batch).logits
        got = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(**batch).logits
    mask = batch["attention_mask"].bool()
    assert (want - base_logits)[mask].abs().max() > 1e-3  # training moved the adapter off B = 0
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
