"""Helpers the tests share (importable as `helpers`: tests/ is on sys.path through its conftest):
a free port, the subprocess environment for torchrun / CLI runs, the RL tests' reward files, data,
flag list and run reader, and JSON over HTTP."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import urllib.error
import urllib.request

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the fraction of even-numbered characters in a completion (`query` minus its `prompt`): rises when GRPO works,
# never constant. Reward files paste EVEN_FRACTION_DEF and wrap it (even_reward_src, or their own reward_func).
EVEN_FRACTION_DEF = '''
def even_fraction(query, prompt):
    c = query[len(prompt):]
    return sum(ord(ch) % 2 == 0 for ch in c) / max(len(c), 1)
'''


def even_reward_src(scores: bool = True, extra_logs: bool = False, prefix: str = "", before: str = "") -> str:
    """A reward file whose reward_func returns {"rewards": even fractions} (+ the same as "scores", + them as
    extra_logs["even_frac"]); `prefix` is module code before it (imports, state), `before` lines run first in
    reward_func (4-space indented)."""
    ret = '{"rewards": rewards'
    ret += ', "scores": rewards' if scores else ""
    ret += ', "extra_logs": {"even_frac": rewards}' if extra_logs else ""
    return (prefix + EVEN_FRACTION_DEF + "\n\ndef reward_func(queries, prompts, labels):\n" + before
            + "    rewards = [even_fraction(q, p) for q, p in zip(queries, prompts)]\n"
            + "    return " + ret + "}\n")


EVEN_REWARD = even_reward_src(scores=True, extra_logs=True)


def length_reward_src(before: str = "") -> str:
    """A reward file whose reward_func returns a plain list: the query's length mod 3, halved (0, 0.5 or 1: never
    constant over a group); `before` lines run first (4-space indented)."""
    return ("def reward_func(queries, prompts, labels):\n" + before
            + "    return [len(q) % 3 / 2.0 for q in queries]\n")


# even digits in the completion, over 3
DIGIT_REWARD = '''
def reward_func(queries, prompts, labels):
    rewards = [sum(ch in "02468" for ch in q[len(p):]) / 3.0 for q, p in zip(queries, prompts)]
    return {"rewards": rewards, "scores": rewards}
'''


# Ports for the tests' servers and rendezvous: below the kernel's ephemeral range (32768 and up, where a port
# just freed by bind(0) can be handed to anyone's next outgoing or listening socket) and above Ray's worker
# ports (10002-19999), in one slice per pytest-xdist worker, so two workers never pick the same port.
_PORT_BASE, _PORT_SLICE, _PORT_SLICES = 20000, 3000, 4
_port_offsets = itertools.count(random.randrange(_PORT_SLICE))  # not the same ports as a run just before


def free_port() -> int:
    """A TCP port nothing listens on now, from this process's slice of 20000-31999, a different one each call."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    idx = int(worker[2:]) % _PORT_SLICES if worker[2:].isdigit() else _PORT_SLICES - 1
    lo = _PORT_BASE + idx * _PORT_SLICE
    for _ in range(_PORT_SLICE):
        port = lo + next(_port_offsets) % _PORT_SLICE
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}-{lo + _PORT_SLICE - 1}")


def listening_pid(port: int) -> int | None:
    """The pid of this machine's process listening on TCP `port` (Linux /proc), None when none is found: the
    server itself, also when a launcher (or a warm interpreter of tests/warmstart) stands between it and us."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # state 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def pythonpath(*dirs: str) -> str:
    """PYTHONPATH with `dirs` first, then this process's entries; no empty entry (one would put the
    child's working folder on its sys.path)."""
    parts = [*dirs, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process running this checkout's rlhfkit (no torchrun variables
    inherited, one thread per process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node nproc` on a free local port, then `args`."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *args]


def write_rl_data(d: str, num_prompts: int = 12, reward_src: str = EVEN_REWARD, seed: int = 7) -> str:
    """`d/prompts.jsonl` (2-digit additions: input, label) and `d/reward.py`; returns `d`."""
    from rlhfkit.tasks.addition import addition_splits

    rows, _ = addition_splits(num_prompts, 2, seed=seed)
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in rows)
    with open(os.path.join(d, "reward.py"), "w") as f:
        f.write(reward_src)
    return d


def cli_flags(**kw) -> list[str]:
    """`--name value` per keyword, in order: True gives the bare flag, None or False leaves it out, a list or
    tuple gives several values (`--critic.adam.betas 0.8 0.9`); a dotted flag is spelled with "__"."""
    out: list[str] = []
    for name, value in kw.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("__", "."))
        if value is True:
            continue
        out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


# the RL tests' common run: GRPO (group_norm) on CPU, 2 samples of 4 prompts a step, completions of 6 tokens
RL_BASE = dict(input_key="input", label_key="label", advantage_estimator="group_norm", n_samples_per_prompt=2,
               rollout_batch_size=4, train_batch_size=8, micro_train_batch_size=2, generate_max_len=6,
               prompt_max_len=16, disable_progress=True, device="cpu")


def ppo_flags(model: str, prompts: str, save: str, *extra: str, reward: str | None = None, **kw) -> list[str]:
    """train_ppo's command line: --pretrain model, --prompt_data prompts, --remote_rm_url reward (if given),
    RL_BASE updated by `kw` (None drops a flag of RL_BASE), --save_path save, then `extra` (last: it wins)."""
    head = ["--pretrain", model, "--prompt_data", prompts] + (["--remote_rm_url", reward] if reward else [])
    return [*head, *cli_flags(**{**RL_BASE, **kw}), "--save_path", save, *extra]


def rl_flags(model: str, d: str, save: str, *extra: str, steps: int = 2) -> list[str]:
    """GRPO on the tiny model: 4 prompts x 2 samples a step, one optimizer step per RL step, KL as a
    loss against a reference model, the builtin engine on CPU (the RL equivalence tests' run), on the
    prompts and reward file of write_rl_data(d)."""
    return ppo_flags(model, os.path.join(d, "prompts.jsonl"), save, *extra, reward=os.path.join(d, "reward.py"),
                     max_steps=steps, init_kl_coef="0.01", use_kl_loss=True, actor_learning_rate="1e-3",
                     lr_warmup_ratio=0)


def read_run(save: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(metrics.jsonl records, final weights) of a run directory."""
    from safetensors.torch import load_file

    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return recs, load_file(os.path.join(save, "model.safetensors"))


def post_json(url: str, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())
