"""batch_inference end to end on the tiny model: generate slicing and seeds, greedy parity with HF
`generate`, reward scoring against a direct forward of the reward model, the post-processors on a
hand-made scored file, and errors that name file, row and key."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfkit.cli.batch_inference import main
from rlhfkit.inference.generate import write_jsonl_atomic
from rlhfkit.data.io import DataError, load_rows
from rlhfkit.data.post_processors import (conditional_sft, iterative_dpo, rejection_sampling, resolve_post_processor,
                                          scored_samples)

# --dist loadgroup: one worker builds its reward model, not each worker that runs one of the tests
pytestmark = pytest.mark.xdist_group("batch_inference")

TEMPLATE = "Q: {}\nA: "
MEAN, STD = 0.5, 2.0


def _write(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _read(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("bi_prompts")
    return _write(d / "prompts.jsonl", [{"question": f"{i}+{i}=?"} for i in range(7)])


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory) -> str:
    from rlhfkit.models.loader import load_tokenizer
    from rlhfkit.models.value import load_value_model, save_value_model

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("bi_rm"))
    save_value_model(load_value_model(tiny_model_dir, init_value_head=True), path, load_tokenizer(tiny_model_dir),
                     mean=MEAN, std=STD)
    return path


def _generate(model_dir, prompts, out, *extra, task="generate") -> list[dict]:
    main(["--eval_task", task, "--pretrain", model_dir, "--dataset", prompts, "--input_key", "question",
          "--input_template", TEMPLATE, "--max_new_tokens", "6", "--output_path", str(out),
          "--disable_progress", *extra])
    return _read(out)


# ----------------------------------------------------------------------------- generate


def test_generate_best_of_n_and_iter_slices(tiny_model_dir, prompts, tmp_path):
    # 7 prompts, slices of 3: iter 1 -> prompts 3, 4, 5; iter 2 -> prompt 6 only; 2 samples each
    it1 = _generate(tiny_model_dir, prompts, tmp_path / "it1.jsonl", "--best_of_n", "2", "--iter", "1",
                    "--rollout_batch_size", "3")
    assert [r["input"] for r in it1] == [TEMPLATE.replace("{}", f"{i}+{i}=?") for i in (3, 3, 4, 4, 5, 5)]
    assert all(set(r) == {"input", "output"} and isinstance(r["output"], str) for r in it1)
    it2 = _generate(tiny_model_dir, prompts, tmp_path / "it2.jsonl", "--best_of_n", "2", "--iter", "2",
                    "--rollout_batch_size", "3", "--enable_csft", "--csft_prompt", "<rm_score>: 4.50")
    assert [r["input"] for r in it2] == [TEMPLATE.replace("{}", "6+6=?") + " <rm_score>: 4.50 "] * 2
    # no --iter: the first --max_samples prompts; a prompt's samples do not depend on its slice
    everything = _generate(tiny_model_dir, prompts, tmp_path / "all.jsonl", "--best_of_n", "2",
                           "--max_samples", "5")
    assert len(everything) == 10
    assert everything[6:10] == it1[0:4]  # prompts 3 and 4, same seeds (seed, dataset index)
    assert it1[0]["output"] != it1[1]["output"] or it1[2]["output"] != it1[3]["output"]  # n samples differ


def test_the_builtin_engine_holds_the_loaded_weights_once(tiny_model_dir):
    """The loaded model's parameters become views of the builtin engine's tensors (no second copy)."""
    from transformers import AutoTokenizer

    from rlhfkit.cli.batch_inference import build_parser, load_engine

    args = build_parser().parse(["--eval_task", "generate", "--pretrain", tiny_model_dir, "--dataset", "unused.jsonl",
                                 "--output_path", "unused.jsonl", "--param_dtype", "fp32"])
    engine = load_engine(args, AutoTokenizer.from_pretrained(tiny_model_dir), "cpu", 64)
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model_dir, "model.safetensors"), "pt") as f:
        assert engine.shared_names == set(f.keys())


@pytest.mark.parametrize("engine", ["builtin", "hf"])
def test_greedy_equals_hf_generate(tiny_model_dir, prompts, tmp_path, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _generate(tiny_model_dir, prompts, tmp_path / "g.jsonl", "--greedy_sampling", "--max_samples", "1",
                     "--max_new_tokens", "12", "--rollout_engine", engine, task="generate_vllm")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = TEMPLATE.replace("{}", "0+0=?")
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert rows == [{"input": prompt, "output": expected}]


def test_generate_with_repetition_penalty_matches_hf(tiny_model_dir, prompts, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _generate(tiny_model_dir, prompts, tmp_path / "pen.jsonl", "--greedy_sampling", "--max_samples", "2",
                     "--repetition_penalty", "1.8")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    outs = []
    for row in rows:
        ids = torch.tensor([tok(row["input"], add_special_tokens=False)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             repetition_penalty=1.8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        outs.append(tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    assert [r["output"] for r in rows] == outs


def test_generate_refuses_bad_penalty_and_bad_slice(tiny_model_dir, prompts, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _generate(tiny_model_dir, prompts, tmp_path / "x.jsonl", "--repetition_penalty", "0")
    assert e.value.code == 1 and "--repetition_penalty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _generate(tiny_model_dir, prompts, tmp_path / "x.jsonl", "--iter", "3", "--rollout_batch_size", "3")
    assert "--iter 3" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.jsonl")


# ----------------------------------------------------------------------------- rm scoring


SCORED_INPUT = [
    {"input": "Q: 1+1=?\nA: ", "output": "2", "id": 0},
    {"input": "Q: 1+1=?\nA: ", "output": "two, I think\n", "id": 1},
    {"input": "Q: 2+3=?\nA: ", "output": "5", "id": 2},
]


def _score(rm_dir, data, out, *extra) -> list[dict]:
    main(["--eval_task", "rm", "--pretrain", rm_dir, "--dataset", data, "--micro_batch_size", "2",
          "--param_dtype", "fp32", "--output_path", str(out), "--disable_progress", *extra])
    return _read(out)


@pytest.mark.parametrize("normalize", [False, True])
def test_rm_scores_equal_direct_forward(rm_dir, tmp_path, normalize):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = _write(tmp_path / "gen.jsonl", SCORED_INPUT)
    rows = _score(rm_dir, data, tmp_path / "rm.jsonl", *(["--normalize_reward"] if normalize else []))
    tok = AutoTokenizer.from_pretrained(rm_dir)
    ref = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1, dtype=torch.float32).eval()
    assert [{k: v for k, v in r.items() if k != "reward"} for r in rows] == SCORED_INPUT  # keys pass through
    for src, row in zip(SCORED_INPUT, rows):  # one unpadded row at a time: prompt ids + response ids + eos
        ids = (tok(src["input"], add_special_tokens=False)["input_ids"]
               + tok(src["output"].rstrip("\n"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        with torch.no_grad():
            raw = ref(input_ids=torch.tensor([ids])).logits[0, 0].item()
        expected = (raw - MEAN) / STD if normalize else raw
        assert row["reward"] == pytest.approx(expected, abs=1e-4)


def test_rm_post_processor_equals_functions(rm_dir, tmp_path):
    data = _write(tmp_path / "gen.jsonl", SCORED_INPUT)
    scored = scored_samples(load_rows(_write(tmp_path / "s.jsonl", _score(rm_dir, data, tmp_path / "rm.jsonl"))))
    assert _score(rm_dir, data, tmp_path / "rs.jsonl", "--post_processor", "rejection_sampling") == \
        rejection_sampling(scored)
    pairs = _score(rm_dir, data, tmp_path / "dpo.jsonl", "--post_processor", "iter_dpo")
    assert pairs == iterative_dpo(scored)[0]
    assert [p["prompt"] for p in pairs] == ["Q: 1+1=?\nA: "]  # the single-sample prompt has no pair


def test_bad_row_names_file_row_and_key(rm_dir, tmp_path, capsys):
    data = _write(tmp_path / "bad.jsonl", [SCORED_INPUT[0], {"input": "Q: 3+3=?\nA: ", "response": "6"}])
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as e:
        _score(rm_dir, data, out)
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert f"{data} row 2" in err and "'output'" in err and "--output_key" in err
    assert not out.exists()


def test_write_is_atomic(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_jsonl_atomic(str(path), [{"a": 1}, {"b": object()}])  # fails half-way through
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]
    write_jsonl_atomic(str(path), [{"a": 1}])
    assert _read(path) == [{"a": 1}]


# ----------------------------------------------------------------------------- post-processors


HAND_SCORED = [  # prompt a: 3 samples, b: 2, c: 1 (interleaved, as several files would give)
    {"input": "a", "output": "x1", "reward": 1.0},
    {"input": "a", "output": "x2", "reward": 3.0},
    {"input": "b", "output": "y1", "reward": -1.0},
    {"input": "a", "output": "x3", "reward": 2.0},
    {"input": "b", "output": "y2", "reward": -0.5},
    {"input": "c", "output": "z1", "reward": 0.7},
]


def test_post_processors_hand_worked(tmp_path):
    samples = scored_samples(load_rows(_write(tmp_path / "scored.jsonl", HAND_SCORED)))
    assert rejection_sampling(samples) == [{"input": "a", "output": "x2", "reward": 3.0},
                                           {"input": "b", "output": "y2", "reward": -0.5},
                                           {"input": "c", "output": "z1", "reward": 0.7}]
    pairs, dropped = iterative_dpo(samples)
    assert pairs == [{"prompt": "a", "chosen": "x2", "chosen_reward": 3.0, "rejected": "x1", "rejected_reward": 1.0},
                     {"prompt": "b", "chosen": "y2", "chosen_reward": -0.5, "rejected": "y1",
                      "rejected_reward": -1.0}]
    assert dropped == 1  # c: one sample, no preference
    csft = conditional_sft(samples)
    assert [r["input"] for r in csft] == ["a <rm_score>: 1.00 ", "a <rm_score>: 3.00 ", "b <rm_score>: -1.00 ",
                                          "a <rm_score>: 2.00 ", "b <rm_score>: -0.50 ", "c <rm_score>: 0.70 "]
    assert [r["output"] for r in csft] == [r["output"] for r in HAND_SCORED]
    prefixed = conditional_sft(samples, "<rm_score>: {reward} {input}")
    assert prefixed[4]["input"] == "<rm_score>: -0.50 b"
    assert [resolve_post_processor(n) for n in ("rs", "iterative_dpo", "conditional_sft", "null", None)] == \
        ["rs", "iter_dpo", "csft", None, None]
    with pytest.raises(DataError, match="--post_processor"):
        resolve_post_processor("best_of")
    with pytest.raises(DataError, match=r"\{reward\}"):
        conditional_sft(samples, "{input} score")


def test_scored_rows_are_validated(tmp_path):
    path = _write(tmp_path / "s.jsonl", [HAND_SCORED[0], {"input": "a", "output": "x", "reward": "high"}])
    with pytest.raises(DataError, match=r"s\.jsonl row 2: key 'reward' must be a finite number"):
        scored_samples(load_rows(path))


def test_zero_stage_of_openrlhf_command_lines_is_accepted_with_a_note(tiny_model_dir, prompts, tmp_path, capsys):
    """OpenRLHF's batch_inference took DeepSpeed's --zero_stage (its loops pass 0); here one process holds the
    model, so 0 is silent and 1-3 run the same, with a note naming the flag."""
    a = _generate(tiny_model_dir, prompts, tmp_path / "a.jsonl", "--zero_stage", "0")
    assert "--zero_stage" not in capsys.readouterr().out
    b = _generate(tiny_model_dir, prompts, tmp_path / "b.jsonl", "--ds.zero_stage", "3")
    assert "note: --zero_stage has no effect" in capsys.readouterr().out
    assert a == b


def test_rm_scores_conversations_without_output_key(rm_dir, tmp_path):
    """OpenRLHF's conditional SFT script scores `--input_key chosen --apply_chat_template` with no
    --output_key: each conversation's last (assistant) message is the output. Same scores as rows of
    (templated prompt, the rest of the templated conversation); an explicit --output_key still
    requires the key."""
    from rlhfkit.data.templates import render_chat
    from rlhfkit.models.loader import load_tokenizer

    convs = [[{"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": a}] for a in ("2", "three")]
    data = _write(tmp_path / "conv.jsonl", [{"chosen": c} for c in convs])
    got = _score(rm_dir, data, tmp_path / "c.jsonl", "--input_key", "chosen", "--apply_chat_template")
    tok = load_tokenizer(rm_dir)
    prompt = render_chat(tok, convs[0][:1], add_generation_prompt=True)
    flat = _write(tmp_path / "flat.jsonl", [{"input": prompt, "output": render_chat(tok, c)[len(prompt):]}
                                            for c in convs])
    want = _score(rm_dir, flat, tmp_path / "f.jsonl")
    assert [r["reward"] for r in got] == pytest.approx([r["reward"] for r in want], abs=1e-6)
    assert got[0]["reward"] != pytest.approx(got[1]["reward"])
    with pytest.raises(SystemExit):
        _score(rm_dir, data, tmp_path / "x.jsonl", "--input_key", "chosen", "--apply_chat_template",
               "--output_key", "output")
