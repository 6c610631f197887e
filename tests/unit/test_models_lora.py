"""LoRA merge (lora_combiner): merged weights are W + alpha/r * B A; merged outputs equal the adapted model's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfkit.cli.lora_combiner import main as combiner
from rlhfkit.config.configs import ModelConfig
from rlhfkit.models.loader import load_causal_lm, load_tokenizer
from rlhfkit.models.value import load_value_model, reward_at_last_token, save_value_model

RANK, ALPHA = 4, 8


def _randomise_adapters(model) -> None:
    """Train-free adapter: B is 0 at init, so give every A and B random values."""
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.normal_(0.0, 0.2)


def _batch(tok):
    return tok(["the reward is", "12+34=46", "x"], return_tensors="pt", padding=True)


def test_merge_causal_lm(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32", lora_rank=RANK, lora_alpha=ALPHA)
    peft_model = load_causal_lm(cfg).eval()
    _randomise_adapters(peft_model)
    adapter, out = str(tmp_path / "adapter"), str(tmp_path / "merged")
    peft_model.save_pretrained(adapter)
    load_tokenizer(tiny_model_dir).save_pretrained(adapter)  # as train_sft --lora_rank saves it: no config.json
    combiner(["--model_path", tiny_model_dir, "--lora_path", adapter, "--output_path", out,
              "--param_dtype", "fp32"])

    card = open(os.path.join(out, "README.md")).read()  # the model card names base and adapter
    assert f"| base model | `{tiny_model_dir}` |" in card and f"| `lora_path` | `{adapter}` |" in card
    assert "pipeline_tag: text-generation" in card and "- lora-merged" in card
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    expected = base.model.layers[0].self_attn.q_proj.weight + (ALPHA / RANK) * q.lora_B["default"].weight @ \
        q.lora_A["default"].weight
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, expected)
    tok = load_tokenizer(out)
    b = _batch(tok)
    with torch.no_grad():
        got, want = merged(**b).logits, peft_model(**b).logits
        assert not torch.allclose(want, base(**b).logits, atol=1e-3)  # the adapter changes the outputs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_merge_reward_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg = ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32", lora_rank=RANK, lora_alpha=ALPHA)
    rm = load_value_model(tiny_model_dir, init_value_head=True, cfg=cfg).eval()
    _randomise_adapters(rm)
    tok = load_tokenizer(tiny_model_dir)
    adapter, out = str(tmp_path / "adapter"), str(tmp_path / "merged")
    save_value_model(rm, adapter, tok, mean=0.5, std=1.5)  # adapter + head + reward config
    assert os.path.isfile(os.path.join(adapter, "adapter_config.json"))
    combiner(["--model_path", tiny_model_dir, "--lora_path", adapter, "--output_path", out, "--is_rm",
              "--param_dtype", "fp32"])

    with open(os.path.join(out, "config.json")) as f:
        saved = json.load(f)
    assert (saved["mean"], saved["std"], saved["value_head_prefix"]) == (0.5, 1.5, "score")
    assert "pipeline_tag: text-classification" in open(os.path.join(out, "README.md")).read()
    ref = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    b = _batch(tok)
    with torch.no_grad():
        want = reward_at_last_token(rm(**b), b["attention_mask"])
        got = ref(**b).logits.squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_merge_errors(tiny_model_dir, tmp_path, capsys):
    """Each is one line on stderr naming the flag, exit 1 (no traceback)."""
    def error_line(model: str, lora: str) -> str:
        with pytest.raises(SystemExit) as e:
            combiner(["--model_path", model, "--lora_path", lora, "--output_path", str(tmp_path / "o")])
        assert e.value.code == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("lora_combiner: error: "), err
        return err

    assert "--lora_path" in (e := error_line(tiny_model_dir, str(tmp_path))) and "no adapter_config.json" in e
    assert "--model_path" in error_line(str(tmp_path / "x"), str(tmp_path))
    assert "--lora_path" in (e := error_line(tiny_model_dir, str(tmp_path / "x"))) and "no such directory" in e


def test_weight_sync_stream_merges_lora_like_peft(tiny_model_dir):
    """The (name, tensor) stream an engine gets from a LoRA policy equals peft's merge_and_unload():
    the base model's names, W + (alpha / r) B A for every adapted layer, the rest as it is."""
    import copy

    from rlhfkit.parallel.sharding import iter_full_params
    from rlhfkit.models.lora import lora_layers

    model = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32", lora_rank=4, lora_alpha=16))
    layers = lora_layers(model)
    assert layers and all(s == 4.0 for s, _ in layers.values())  # alpha / r
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init: give the adapters an effect
                p.copy_(torch.randn(p.shape, generator=g))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = dict(iter_full_params(model))  # one tensor at a time: a layer's base weight, A and B apart
    assert set(got) == set(want)
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=1e-5, atol=1e-5, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="fp32")).state_dict()[q]
    assert (got[q] - base).abs().max() > 1e-2  # the update really is in there


def test_all_linear_on_a_vlm_adapts_every_linear_layer_and_merges_like_peft(tiny_vlm_dir):
    """A VLM's vision merger has linear layers named `0`, `2` beside the vision blocks `blocks.0`: peft
    matches target names by suffix, so those are named in full. Every linear layer but the output layer
    gets an adapter, and the weights the engines receive (`merged_lora_weights`) are peft's merge."""
    from rlhfkit.models.lora import linear_module_names, lora_layers, merged_lora_weights

    cfg = ModelConfig(pretrain=tiny_vlm_dir, param_dtype="fp32", lora_rank=RANK, lora_alpha=ALPHA)
    peft_model = load_causal_lm(cfg).eval()
    base = peft_model.get_base_model()
    linears = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and not hasattr(m, "lora_A")
               and ".lora_" not in n and ".base_layer" not in n]
    assert linears == ["lm_head"]  # every other linear layer was wrapped
    names = linear_module_names(load_causal_lm(ModelConfig(pretrain=tiny_vlm_dir, param_dtype="fp32")))
    assert "q_proj" in names and any(n.endswith("merger.mlp.0") for n in names)
    _randomise_adapters(peft_model)
    got = dict(merged_lora_weights(((n, p.detach()) for n, p in peft_model.named_parameters()),
                                   lora_layers(peft_model)))
    want = peft_model.merge_and_unload().state_dict()
    assert sorted(got) == sorted(k for k in want if k in got) and len(got) == len(dict(base.named_parameters()))
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)


def test_all_linear_on_a_routed_experts_model_adapts_attention_only_and_expert_names_are_refused():
    """peft turns MLP names into adapters of transformers 5's 3-D expert weights, which the RL weight sync cannot
    merge: all-linear leaves them out, and naming them is an error that names the flag."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.lora import apply_lora, linear_module_names
    from rlhfkit.models.tiny import TinyModelSpec, build_config, build_tokenizer

    tok = build_tokenizer()
    cfg = build_config(TinyModelSpec(arch="qwen3_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2),
                       len(tok), tok)
    names = linear_module_names(AutoModelForCausalLM.from_config(cfg))
    assert names and all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in names)
    model = apply_lora(AutoModelForCausalLM.from_config(cfg), ModelConfig(lora_rank=4))
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_" in n}
    assert adapted and not any(".experts" in n for n in adapted)
    with pytest.raises(ValueError, match="--target_modules: LoRA on routed experts"):
        apply_lora(AutoModelForCausalLM.from_config(cfg), ModelConfig(lora_rank=4, target_modules=["down_proj"]))
