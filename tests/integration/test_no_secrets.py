"""No secret on disk or on the console: a wandb key (both spellings), the password and token of a
--remote_rm_url and a secret environment variable go through every training command that takes them
(a stub wandb module, a local reward server), and no file the runs wrote (run directory, checkpoints,
snapshots, model cards, TensorBoard events, the lock), no console line and no wandb config holds one."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import types

import pytest
from helpers import rl_flags, write_rl_data

WANDB_KEY = "W4ndbK3y7f3a9c1e"
URL_PASSWORD = "pw81f2c9d0e7"
URL_TOKEN = "tk55aa77bb99"
ENV_TOKEN = "envsecret3c3c3c3c"
SECRETS = (WANDB_KEY, URL_PASSWORD, URL_TOKEN, ENV_TOKEN)


@pytest.fixture()
def stub_wandb(monkeypatch):
    calls = {"login": [], "config": []}
    mod = types.ModuleType("wandb")
    mod.login = lambda key=None, **kw: calls["login"].append(key)

    class Run:
        def log(self, *a, **kw):
            pass

        def finish(self):
            pass

    def init(config=None, **kw):
        calls["config"].append(json.dumps(config, default=str))
        return Run()

    class Table:  # the completions table the RL trainer logs
        def __init__(self, columns=None, data=None, **kw):
            calls["config"].append(json.dumps({"columns": columns, "data": data}, default=str))

    mod.init, mod.Table = init, Table
    monkeypatch.setitem(sys.modules, "wandb", mod)
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    return calls


@pytest.fixture()
def reward_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
            body = json.dumps({"rewards": [0.5] * n}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://rm:{URL_PASSWORD}@127.0.0.1:{server.server_address[1]}/get_reward?token={URL_TOKEN}"
    server.shutdown()


def jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def offline_commands(model: str, d) -> dict[str, list[str]]:
    qa = jsonl(d / "qa.jsonl", [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(4) for b in range(4)])
    pairs = jsonl(d / "pairs.jsonl", [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)} for a in range(8)])
    kto = jsonl(d / "kto.jsonl", [{"q": f"{a}+1=", "a": str(a + 1 - k), "good": not k} for a in range(4) for k in (0, 1)])
    prm = jsonl(d / "prm.jsonl", [{"text": f"{a}+1={a + 1}#", "steps": ["+"]} for a in range(8)])
    return {
        "train_sft": ["--dataset", qa, "--input_key", "q", "--output_key", "a"],
        "train_rm": ["--dataset", pairs, "--prompt_key", "prompt"],
        "train_dpo": ["--dataset", pairs, "--prompt_key", "prompt"],
        "train_kto": ["--dataset", kto, "--input_key", "q", "--output_key", "a", "--label_key", "good"],
        "train_prm": ["--dataset", prm, "--input_key", "text", "--label_key", "steps", "--placeholder_token", "#",
                      "--reward_tokens", "+", "-"],
        "train_kd": ["--dataset", qa, "--input_key", "q", "--output_key", "a", "--teacher_model", model],
    }


def scan(root) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            found += [f"{path}: {s}" for s in SECRETS if s.encode() in data]
    return found


def test_no_secret_in_any_file_or_line(tiny_model_dir, tmp_path, stub_wandb, reward_server, capfd, monkeypatch):
    import importlib

    runs = tmp_path / "runs"
    runs.mkdir()
    data = tmp_path / "data"
    data.mkdir()
    cmds = offline_commands(tiny_model_dir, data)
    for i, (cmd, extra) in enumerate(cmds.items()):
        key = ["--use_wandb", WANDB_KEY] if i % 2 else [f"--logger.wandb.key={WANDB_KEY}"]
        argv = ["--pretrain", tiny_model_dir, *extra, "--input_template", "{}", "--max_len", "32",
                "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_steps", "1", "--save_steps", "1",
                "--save_hf_ckpt", "--param_dtype", "fp32", "--lr_warmup_ratio", "0", "--save_path", str(runs / cmd),
                "--use_tensorboard", str(runs / f"{cmd}_tb"), *key, "--disable_progress", "--device", "cpu"]
        if cmd in ("train_rm", "train_prm"):
            argv.remove("--input_template")
            argv.remove("{}")
        monkeypatch.setattr(sys, "argv", [f"/x/rlhfkit/cli/{cmd}.py", *argv])
        importlib.import_module(f"rlhfkit.cli.{cmd}").main(argv)
        assert os.path.isfile(runs / cmd / "README.md")
    d = write_rl_data(str(data))
    argv = rl_flags(tiny_model_dir, d, str(runs / "train_ppo"), "--save_steps", "1", "--save_hf_ckpt",
                    "--use_tensorboard", str(runs / "ppo_tb"), "--use_wandb", WANDB_KEY, steps=1)
    argv[argv.index("--remote_rm_url") + 1] = reward_server
    monkeypatch.setattr(sys, "argv", ["/x/rlhfkit/cli/train_ppo.py", *argv])
    from rlhfkit.cli import train_ppo

    assert [h["step"] for h in train_ppo.main(argv)] == [1]

    out, err = capfd.readouterr()
    assert stub_wandb["login"] == [WANDB_KEY] * 7  # the key reached wandb, and only wandb
    assert scan(tmp_path) == []
    assert [s for s in SECRETS if s in out + err] == []
    assert [s for s in SECRETS if any(s in c for c in stub_wandb["config"])] == []
    card = (runs / "train_ppo" / "README.md").read_text()
    assert "--use_wandb '***'" in card and "http://rm:***@127.0.0.1:" in card and "token=***" in card
    assert any(os.path.isfile(os.path.join(p, "README.md")) for p in (runs / "train_sft" / "checkpoints").iterdir())
    # the TensorBoard events (one sub-folder per run) exist, so the scan above read them
    assert any(f.startswith("events.out.tfevents") for _, _, fs in os.walk(runs / "ppo_tb") for f in fs)
