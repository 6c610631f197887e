"""`rlhfkit make_data`: every row checked against the arithmetic it states, the same seed writes the
same bytes, held-out questions never appear in the training rows, the shipped example files are
copied verbatim, and bad requests are one clear line."""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env

from rlhfkit.cli import make_data
from rlhfkit.cli.main import main as rlhfkit_main
from rlhfkit.examples import FILES


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _sum(q: str) -> int:
    a, b = re.fullmatch(r"(\d+)\+(\d+)=", q).groups()
    return int(a) + int(b)


def _make(out, *extra):
    make_data.main(["all", "--out", str(out), "--num_train", "300", "--num_eval", "40", "--num_pairs", "60",
                    "--num_prompts", "50", *extra])
    return str(out)


def test_rows_state_true_sums_in_reversed_digit_order(tmp_path):
    d = _make(tmp_path / "d")
    train, prompts, held = (_rows(os.path.join(d, n)) for n in ("train.jsonl", "prompts.jsonl", "eval.jsonl"))
    assert (len(train), len(prompts), len(held)) == (300, 50, 40)
    for r in train + held:
        assert r["output"] == r["label"] == str(_sum(r["input"]))[::-1]
    assert prompts == [{"input": r["input"], "label": r["label"]} for r in train[:50]]
    assert not {r["input"] for r in held} & {r["input"] for r in train}
    for name in ("preference.jsonl", "preference_eval.jsonl"):
        for r in _rows(os.path.join(d, name)):
            s = _sum(r["prompt"])
            assert r["chosen"] == str(s)[::-1] and int(r["rejected"][::-1]) != s
    kto = _rows(os.path.join(d, "kto.jsonl"))
    assert len(kto) == 60 and sum(r["label"] for r in kto) == 30
    for r in kto:
        assert r["label"] == (r["output"] == str(_sum(r["input"]))[::-1])
    for r in _rows(os.path.join(d, "prm.jsonl")):
        steps = r["input"].split("#")
        assert steps[-1] == "" and len(steps) - 1 == len(r["value"])
        for step, lab in zip(steps, r["value"]):
            q, ans = step.split("=")
            assert lab == ("+" if ans == str(_sum(q + "="))[::-1] else "-")
    chat = _rows(os.path.join(d, "chat.jsonl"))
    assert [m["role"] for m in chat[0]["messages"]] == ["user", "assistant"]
    assert chat[0]["messages"][1]["content"] == str(_sum(chat[0]["messages"][0]["content"]))[::-1]
    assert not os.path.exists(os.path.join(d, "reward_func.py"))  # `all` is data only


def test_plain_order_and_determinism(tmp_path):
    a, b, c = _make(tmp_path / "a"), _make(tmp_path / "b"), _make(tmp_path / "c", "--seed", "1")
    names = sorted(os.listdir(a))
    assert filecmp.cmpfiles(a, b, names, shallow=False)[0] == names
    assert not filecmp.cmp(os.path.join(a, "train.jsonl"), os.path.join(c, "train.jsonl"), shallow=False)
    plain = _make(tmp_path / "p", "--plain_order")
    for r in _rows(os.path.join(plain, "train.jsonl")):
        assert r["output"] == str(_sum(r["input"]))
    for r in _rows(os.path.join(plain, "preference.jsonl")):
        assert int(r["rejected"]) != _sum(r["prompt"])


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: make_data imported above
def test_examples_are_copied_verbatim_through_the_console_script(tmp_path, capsys):
    rlhfkit_main(["make_data", "examples", "--out", str(tmp_path / "ex")])
    for name in FILES:
        assert filecmp.cmp(os.path.join(ROOT, "rlhfkit", "examples", name), tmp_path / "ex" / name, shallow=False)
    assert os.access(tmp_path / "ex" / "scripts" / "iterative_dpo.sh", os.X_OK)
    assert "reward_func.py" in capsys.readouterr().out
    # copying onto the shipped files themselves (the repository's examples/ links) changes nothing
    make_data.main(["examples", "--out", os.path.join(ROOT, "examples")])


def test_bad_requests_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_data.main(["addition", "--num_eval", "6000", "--out", str(tmp_path)])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip() == \
        "make_data: error: at most 5000 held-out questions exist for 2-digit addition"
    with pytest.raises(SystemExit) as e:
        make_data.main(["additon", "--out", str(tmp_path)])
    assert e.value.code == 2 and "unknown KIND 'additon' (did you mean addition?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_data.main(["--out", str(tmp_path)])
    assert "name what to write: one or more of addition, preference" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_data.main(["kto", "--num_pairs", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_does_not_import_torch():
    code = "import sys, rlhfkit.cli.make_data, rlhfkit.tasks.addition; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], env=subprocess_env()).returncode == 0
