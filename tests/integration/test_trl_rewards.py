"""Reward functions in TRL's shape, `reward(prompts, completions, **columns)`, and the `rlhfkit grpo` / `rloo` commands.

- A TRL-shaped callable given to GRPOTrainer receives the dataset's prompts as they are, the completions as text
  without special tokens (no EOS: `c.strip() == label` can hold), `completion_ids`, and the row's other columns by
  name (`label`); GRPO with it gives the same run, step for step, as the native reward_func computing the same
  reward from the queries on the same seed (the even-character share of the completion, which rises under GRPO).
- `per_sample(fn)` hands `fn` the completion without special tokens (and with them on request).
- On the command line the same function in a file (`--reward_funcs reward.py`, or `file.py:name`) runs in the
  reward worker processes with the same arguments.
- A callable or file that fits neither shape is refused when the trainer is built (before any model loads), in
  one line naming both shapes.
- `rlhfkit grpo --pretrain M --dataset D --reward_funcs R.py --output_dir OUT` runs with no other flag, with TRL's
  GRPOConfig defaults; `grpo` is an --advantage_estimator name; `rlhfkit gpro` suggests grpo.
"""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from rlhfkit import GRPOConfig, GRPOTrainer, metric_values, per_sample
from rlhfkit.cli import main as cli
from rlhfkit.cli import train_grpo, train_ppo, train_rloo
from rlhfkit.tasks.addition import addition_splits

CPU = dict(device="cpu", param_dtype="fp32", disable_progress=True, lr_warmup_ratio=0.0)


def rows(n: int = 4, seed: int = 5) -> list[dict]:
    data, _ = addition_splits(n, 0, digits=2, seed=seed)
    return [{"input": r["input"], "label": r["label"], "topic": f"sum{i}"} for i, r in enumerate(data)]


def even_share(text: str) -> float:
    return sum(ord(ch) % 2 == 0 for ch in text) / max(len(text), 1)


def config(save: str, **kw) -> GRPOConfig:
    fields = dict(label_key="label", input_template="{}", n_samples_per_prompt=4, rollout_batch_size=4,
                  train_batch_size=16, micro_train_batch_size=8, generate_max_len=6, prompt_max_len=16,
                  max_steps=1, actor_learning_rate=3e-3, save_path=save, seed=11, **CPU)
    fields.update(kw)
    return GRPOConfig(**fields)


def test_trl_shaped_reward_gets_clean_completions_and_columns_and_learns_as_the_native_form(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    specials = [t for t in tok.all_special_tokens if t]
    seen: list[dict] = []

    def reward(prompts, completions, label, **kwargs):
        seen.append({"prompts": list(prompts), "completions": list(completions), "label": list(label),
                     "topic": list(kwargs["topic"]), "ids": kwargs["completion_ids"]})
        return [even_share(c) for c in completions]

    def native(queries, prompts, labels):  # the same reward from OpenRLHF's arguments
        out = []
        for q, p in zip(queries, prompts):
            c = q[len(p):]
            for t in specials:
                c = c.replace(t, "")
            out.append(even_share(c))
        return out

    data = rows()
    steps = dict(max_steps=10, n_samples_per_prompt=8, train_batch_size=32, actor_learning_rate=1e-2)
    h_trl = GRPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=data,
                        args=config(str(tmp_path / "trl"), **steps)).train()
    h_nat = GRPOTrainer(tiny_model_dir, reward_funcs=native, train_dataset=data,
                        args=config(str(tmp_path / "native"), **steps)).train()
    by_prompt = {r["input"]: r for r in data}
    calls = [(p, c, lab, top, ids) for s in seen
             for p, c, lab, top, ids in zip(s["prompts"], s["completions"], s["label"], s["topic"], s["ids"])]
    assert len(calls) == 10 * 32
    ended = 0
    for p, c, lab, top, ids in calls:
        assert by_prompt[p]["label"] == lab and by_prompt[p]["topic"] == top  # the row's own columns
        assert not any(t in c for t in specials), c
        assert c == tok.decode(ids, skip_special_tokens=True)
        ended += tok.eos_token_id in ids
    assert ended > 0  # some completions did end with the EOS, which the text does not show
    r_trl, r_nat = metric_values(h_trl, "reward"), metric_values(h_nat, "reward")
    assert r_trl == r_nat and metric_values(h_trl, "policy_loss") == metric_values(h_nat, "policy_loss")
    assert sum(r_trl[-3:]) / 3 > sum(r_trl[:3]) / 3 + 0.2, r_trl  # it learns: measured 0.54 -> 0.89


def test_per_sample_strips_special_tokens_unless_asked(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    got: dict[str, list[str]] = {"clean": [], "raw": []}

    def clean(completion, prompt, label):
        got["clean"].append(completion)
        return even_share(completion)

    def raw(completion, prompt, label):
        got["raw"].append(completion)
        return 0.0

    GRPOTrainer(tiny_model_dir, reward_funcs=[per_sample(clean), per_sample(raw, keep_special_tokens=True)],
                train_dataset=rows(), args=config(str(tmp_path / "o"))).train()
    specials = [t for t in tok.all_special_tokens if t]

    def strip(text: str) -> str:
        for t in specials:
            text = text.replace(t, "")
        return text

    assert len(got["clean"]) == len(got["raw"]) == 16
    assert sum(strip(r) != r for r in got["raw"]) >= 2  # an EOS, a stray BOS: text the model never "wrote"
    assert sorted(got["clean"]) == sorted(strip(r) for r in got["raw"])
    assert all(strip(c) == c for c in got["clean"])


TRL_FILE = '''
import json, os

def {name}(prompts, completions, label, **kwargs):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as f:
        for p, c, l in zip(prompts, completions, label):
            f.write(json.dumps({{"prompt": p, "completion": c, "label": l}}) + "\\n")
    return [float(c.strip() == l) + sum(ch in "02468" for ch in c) / 10 for c, l in zip(completions, label)]
'''


def write_prompts(path, key: str = "prompt", n: int = 2) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({key: r["input"], "label": r["label"]}) + "\n" for r in rows(n))
    return str(path)


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> str:
    """The tiny Llama with 2048 positions: TRL's defaults give --max_len 1024 + 512."""
    from rlhfkit.models.tiny import TinyModelSpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny2k")),
                           TinyModelSpec(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         max_position_embeddings=2048))


def test_grpo_command_runs_with_no_other_flag(long_tiny, tmp_path):
    (tmp_path / "reward.py").write_text(TRL_FILE.format(name="reward_func"))
    data = write_prompts(tmp_path / "p.jsonl", n=1)
    history = train_grpo.main(["--pretrain", long_tiny, "--dataset", data, "--reward_funcs",
                               str(tmp_path / "reward.py"), "--output_dir", str(tmp_path / "out")])
    cfg = json.load(open(tmp_path / "out" / "run_config.json"))
    assert (cfg["advantage_estimator"], cfg["n_samples_per_prompt"], cfg["generate_max_len"], cfg["init_kl_coef"],
            cfg["actor_learning_rate"], cfg["rollout_batch_size"], cfg["num_episodes"]) == \
        ("group_norm", 8, 512, 0.0, 1e-6, 1, 3)
    assert history[-1]["step"] == 3  # 1 prompt a step, 3 passes
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 3 * 8
    labels = {r["input"]: r["label"] for r in rows(1)}
    tok = AutoTokenizer.from_pretrained(long_tiny)
    assert all(labels[c["prompt"]] == c["label"] and tok.eos_token not in c["completion"] for c in calls)


def test_rloo_command_and_named_function_in_a_file(tiny_model_dir, tmp_path):
    (tmp_path / "rewards.py").write_text(TRL_FILE.format(name="accuracy"))
    data = write_prompts(tmp_path / "p.jsonl", key="question")
    train_rloo.main(["--model_name_or_path", tiny_model_dir, "--dataset", data, "--input_key", "question",
                     "--reward_funcs", f"{tmp_path / 'rewards.py'}:accuracy", "--output_dir", str(tmp_path / "out"),
                     "--max_completion_length", "8", "--num_train_epochs", "1", "--rollout_batch_size", "2",
                     "--per_device_train_batch_size", "4", "--train_batch_size", "4", "--prompt_max_len", "32",
                     "--device", "cpu"])
    cfg = json.load(open(tmp_path / "out" / "run_config.json"))
    assert (cfg["advantage_estimator"], cfg["n_samples_per_prompt"], cfg["init_kl_coef"], cfg["use_kl_loss"]) == \
        ("rloo", 2, 0.05, False)
    assert len(open(tmp_path / "calls.jsonl").read().splitlines()) == 4


BAD = "def reward_func(completion):\n    return [0.0]\n"


def test_a_signature_of_neither_shape_fails_when_the_trainer_is_built(tmp_path, capsys):
    def bad(completion):
        return [0.0]

    with pytest.raises(TypeError, match=r"bad\(completion\) is not a reward function's signature; write "
                                        r"reward_func\(queries, prompts, labels\) .* or reward\(prompts, completions"):
        GRPOTrainer(str(tmp_path / "no_model_here"), reward_funcs=bad, train_dataset=rows())
    (tmp_path / "bad.py").write_text(BAD)
    with pytest.raises(SystemExit) as e:  # checked before the (missing) model is looked at
        train_grpo.main(["--pretrain", str(tmp_path / "no_model_here"), "--dataset", write_prompts(tmp_path / "p.jsonl"),
                         "--reward_funcs", str(tmp_path / "bad.py"), "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("train_grpo: error: --remote_rm_url") and \
        "reward_func(completion) is not a reward function's signature" in err[0], err
    (tmp_path / "none.py").write_text("def helper(x):\n    return x\n")
    with pytest.raises(AttributeError, match=r"must define reward_func: .* \(or name another function: "
                                             r"--remote_rm_url .*none.py:NAME\)"):
        GRPOTrainer(str(tmp_path / "m"), reward_funcs=str(tmp_path / "none.py"), train_dataset=rows())


def test_grpo_estimator_name_and_commands(capsys):
    from rlhfkit.algo.advantages import get_advantage_estimator

    parser = train_ppo.build_parser()
    assert parser.parse(["--advantage_estimator", "grpo"], notes=False).advantage_estimator == "grpo"
    assert GRPOConfig(advantage_estimator="grpo").to_args(notes=False).advantage_estimator == "grpo"
    assert get_advantage_estimator("grpo") is get_advantage_estimator("group_norm")
    defaults = train_grpo.build_parser().parse([], notes=False)
    assert (defaults.n_samples_per_prompt, defaults.input_key, defaults.use_kl_loss) == (8, "prompt", True)
    assert train_ppo.build_parser().parse([], notes=False).n_samples_per_prompt == 1  # ppo keeps its defaults
    cli.main(["--help"])
    listed = capsys.readouterr().out
    assert "\n  grpo " in listed and "\n  rloo " in listed
    with pytest.raises(SystemExit):
        cli.main(["gpro"])
    assert "unknown command 'gpro' (did you mean 'grpo'?)" in capsys.readouterr().err
