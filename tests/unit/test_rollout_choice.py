"""--rollout_engine auto (issue 41, part 2): `builtin_support` asks the builtin engine's own checks,
`choose_engine` takes builtin when they pass and otherwise vllm (installed) or hf with its reason,
an explicit builtin refuses naming the flag; packed rows are refused for layers with a state.
Configs only: no weights are built here (tests/integration/test_rl_engine_fallback.py runs GRPO)."""

from __future__ import annotations

import pytest
import transformers
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from rlhfkit.cli import batch_inference, train_ppo

from rlhfkit.rl_run.resolve import resolve
from rlhfkit.config.errors import UsageError
from rlhfkit.models.forward import packing_refusal
from rlhfkit.rollout import build_engine
from rlhfkit.rollout.builtin import builtin_support
from rlhfkit.rollout.choice import CHOICES, EngineChoice, choose_engine

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def qwen3_5_text(**kw):
    """A tiny Qwen3.5 language model config: one gated-delta-rule (linear attention) layer, one full."""
    cls = getattr(transformers, "Qwen3_5TextConfig", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    return cls(**SMALL, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], **kw)


def test_builtin_support_accepts_the_fast_path_families():
    assert builtin_support(LlamaConfig(**SMALL)) is None
    assert builtin_support(Qwen2Config(**SMALL), max_model_len=256) is None


def test_builtin_support_gives_the_engines_own_reason_in_one_line():
    why = builtin_support(qwen3_5_text())
    assert why is not None and "'qwen3_5_text'" in why
    assert "--rollout_engine" not in why and "\n" not in why  # the caller says what runs instead
    dynamic = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "'dynamic'" in builtin_support(dynamic)


def test_builtin_support_checks_rope_at_the_engines_length():
    """Sliding windows run on the builtin engine at any length; longrope only within its original length."""
    windowed = MistralConfig(**SMALL, sliding_window=32)
    assert builtin_support(windowed, max_model_len=64) is None
    from transformers import Phi3Config

    longrope = Phi3Config(**SMALL, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    assert builtin_support(longrope, max_model_len=64) is None
    assert "longrope" in builtin_support(longrope, max_model_len=128)


def test_auto_takes_the_builtin_engine_when_it_can():
    choice = choose_engine("auto", LlamaConfig(**SMALL), max_model_len=64, vllm_installed=True)
    assert choice == EngineChoice("builtin") and not choice.fell_back
    assert choose_engine("auto", transformers.LlamaForCausalLM(LlamaConfig(**SMALL))) == choice  # a module


def test_auto_falls_back_with_its_reason_in_one_line():
    config = qwen3_5_text()
    hf = choose_engine("auto", config, vllm_installed=False)
    assert hf.name == "hf" and hf.fell_back
    line = hf.describe()
    assert line.startswith("rollout engine: hf (auto: ") and "'qwen3_5_text'" in line and "vLLM" in line
    assert "\n" not in line
    assert choose_engine("auto", config, vllm_installed=True).name == "vllm"
    with_pictures = choose_engine("auto", config, pictures=True, vllm_installed=True)
    assert with_pictures.name == "hf" and "pictures" in with_pictures.reason


def test_an_explicit_builtin_refuses_naming_the_flag():
    with pytest.raises(UsageError, match=r"--rollout_engine builtin cannot run this model: .*'qwen3_5_text'.*"
                                         r"--rollout_engine auto"):
        choose_engine("builtin", qwen3_5_text())
    assert choose_engine("builtin", LlamaConfig(**SMALL)) == EngineChoice("builtin")


def test_hf_and_vllm_run_as_asked_without_reading_the_model():
    assert choose_engine("hf", "/no/such/model") == EngineChoice("hf")
    assert choose_engine("vllm", "/no/such/model") == EngineChoice("vllm")
    with pytest.raises(UsageError, match="--rollout_engine must be one of auto, builtin, hf, vllm"):
        choose_engine("sglang", "/no/such/model")


def test_auto_with_an_unreadable_config_falls_back(tmp_path):
    choice = choose_engine("auto", str(tmp_path), vllm_installed=False)
    assert choice.name == "hf" and "config could not be read" in choice.reason


def test_the_flags_default_to_auto():
    for parser in (train_ppo.build_parser(), batch_inference.build_parser()):
        action = next(a for a in parser._actions if a.dest == "rollout_engine")
        assert action.default == "auto" and tuple(action.choices) == CHOICES
    with pytest.raises(ValueError, match="resolve --rollout_engine auto first"):
        build_engine("auto", "/no/such/model")


def test_train_ppo_resolves_auto_once_into_the_flag(tiny_model_dir, tmp_path, caplog):
    (tmp_path / "r.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    argv = ["--pretrain", tiny_model_dir, "--prompt_data", "p.jsonl", "--remote_rm_url", str(tmp_path / "r.py"),
            "--save_path", str(tmp_path), "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
            "--generate_max_len", "8", "--prompt_max_len", "8"]
    args = train_ppo.build_parser().parse(argv)
    assert args.rollout_engine == "auto"
    with caplog.at_level("INFO"):
        resolved = resolve(args, 1)
    assert resolved.rollout_engine == "builtin"  # the fast path is not announced
    assert not any(r.getMessage().startswith("rollout engine:") for r in caplog.records)


def test_packing_is_refused_for_layers_with_a_state():
    assert packing_refusal(LlamaConfig(**SMALL)) is None
    assert "linear_attention layers" in packing_refusal(qwen3_5_text())
    mamba = transformers.MambaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    assert "model_type 'mamba' has" in packing_refusal(mamba)
    rwkv = transformers.RwkvConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2)  # no layer_types
    assert "'rwkv' has recurrent (state-space) layers" in packing_refusal(rwkv)
