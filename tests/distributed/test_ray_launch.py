"""The seeds' launch path and fault handling, on a Ray cluster started with `ray start --head`.

- `ray start --head --num-cpus 2 --block` in a subprocess (own temp dir and ports); the test ends
  it by SIGTERM to that process (`ray stop` would stop every Ray instance of the machine, other
  users' included). RAY_AUTH_MODE=disabled for the cluster and its clients: Ray 2.60 turns token
  auth on for `ray start` when ~/.ray/auth_token exists, but `ray job submit` does not send it.
- `ray job submit -- python -m rlhfkit.cli.train_ppo_ray ...` with the policy on 2 CPU workers
  (`--actor_num_gpus_per_node 2`: FSDP2 over a gloo group inside the actors) and one engine actor;
  the job must succeed and its metrics match one-process train_ppo. The two ranks add the same fp32
  terms in a different order (two partial sums all-reduced), so training metrics agree to rel 1e-4
  (as in test_rl_torchrun.py); sampled-token statistics to 1e-6.
- SIGKILL of the policy actor's process while the driver hangs in user code (a reward_func that
  sleeps): the health monitor sees the death and the driver exits non-zero within 60 s, naming
  `policy rank 0` and the death. The run (PPO: policy + ref colocated, a critic, the engine) saved
  policy and critic checkpoints every step; rerunning it with --load_checkpoint resumes from the
  last one, and its next step and final policy / critic weights equal an uninterrupted one-process
  run (single-rank groups run the same float operations as train_ppo: rel 1e-6).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers import even_reward_src, free_port, ppo_flags, pythonpath
import torch
from safetensors.torch import load_file

from rlhfkit.cli import train_ppo
from rlhfkit.tasks.addition import addition_splits

pytest.importorskip("ray")
pytestmark = pytest.mark.distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# the even-character reward; while the file `stall` exists (the fault test makes it), reward_func hangs
REWARD_FILE = even_reward_src(prefix='''
import os
import time

STALL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stall")
''', before='''    if os.path.exists(STALL):  # the fault test makes the driver hang here
        open(STALL + "ed", "w").close()
        time.sleep(300)
''')



def _dashboard_deps() -> bool:
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        return False
    return True


def flags(model: str, d: str, save: str, *extra: str) -> list[str]:
    return ppo_flags(model, os.path.join(d, "prompts.jsonl"), save, *extra, reward=os.path.join(d, "reward.py"),
                     actor_learning_rate="1e-3", lr_warmup_ratio=0)


def metrics(save: str) -> list[dict]:
    with open(os.path.join(save, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("rl_ray_launch"))
    rows, _ = addition_splits(12, 2, seed=7)
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"input": r["input"], "label": r["label"]}) + "\n" for r in rows)
    with open(os.path.join(d, "reward.py"), "w") as f:
        f.write(REWARD_FILE)
    return d


def _up(temp: str, dashboard: str | None) -> bool:
    with open(os.path.join(temp, "start.log")) as f:
        if "Ray runtime started" not in f.read():
            return False
    if dashboard is None:
        return True
    try:
        urllib.request.urlopen(dashboard + "/api/version", timeout=2)
    except urllib.error.HTTPError:  # any answer (e.g. 401 without Ray's auth token) means it is up
        pass
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster():
    """`ray start --head --block` on free ports; yields its addresses and the env to reach it.
    The dashboard (which serves `ray job submit`) starts only when ray[default]'s packages are there."""
    dashboard = _dashboard_deps()
    temp = tempfile.mkdtemp(prefix="rlkray", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
    ports = {k: free_port() for k in ("port", "dashboard-port", "ray-client-server-port",
                                       "dashboard-agent-listen-port")}
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=pythonpath(ROOT), OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", "--num-cpus", "2",
           "--disable-usage-stats", "--temp-dir", temp, "--node-ip-address", "127.0.0.1",
           "--include-dashboard", str(dashboard).lower(), *[f"--{k}={v}" for k, v in ports.items()]]
    log = open(os.path.join(temp, "start.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=temp)
    dash = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + 90
        while not _up(temp, dash if dashboard else None):
            assert proc.poll() is None, open(os.path.join(temp, "start.log")).read()[-3000:]
            assert time.monotonic() < deadline, "ray start --head: not up after 90 s"
            time.sleep(0.5)
        yield {"gcs": f"127.0.0.1:{ports['port']}", "dashboard": dash if dashboard else None, "env": env,
               "temp": temp}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_data_parallel_policy(tiny_model_dir, data_dir, cluster):
    if cluster["dashboard"] is None:
        pytest.skip("ray job submit needs the dashboard: pip install 'ray[default]'")
    save = os.path.join(data_dir, "job")
    extra = ("--max_steps", "2", "--init_kl_coef", "0", "--actor_num_gpus_per_node", "2",
             "--ray_num_cpus_per_worker", "0.5")
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address", cluster["dashboard"],
           "--", "python", "-m", "rlhfkit.cli.train_ppo_ray", *flags(tiny_model_dir, data_dir, save, *extra)]
    proc = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=240, cwd=cluster["temp"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "succeeded" in out, out[-5000:]
    assert "placement: policy rank 1" in out
    one = os.path.join(data_dir, "job_reference")
    train_ppo.main(flags(tiny_model_dir, data_dir, one, *extra[:4]))
    ref, got = metrics(one), metrics(save)
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(ref, got):
        for k in ("train/reward", "train/reward_std", "train/response_length"):
            assert b[k] == pytest.approx(a[k], abs=1e-6), f"step {a['step']} {k}"
        for k in ("train/policy_loss", "train/advantage", "train/grad_norm", "train/entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), f"step {a['step']} {k}: {b[k]} != {a[k]}"
    w1, w2 = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(save, "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)


class _Reader:
    """Collects a subprocess's output lines in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pred, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.text()):
            assert self.proc.poll() is None, f"run ended early:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"timed out:\n{self.text()[-4000:]}"
            time.sleep(0.2)


def test_killed_actor_ends_stuck_run_and_checkpoint_resumes(tiny_model_dir, data_dir, cluster):
    save, ckpt = os.path.join(data_dir, "killed"), os.path.join(data_dir, "killed_ckpt")
    extra = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--lr_scheduler", "constant",
             "--num_episodes", "100", "--critic_learning_rate", "1e-3", "--save_value_network",
             "--save_steps", "1", "--ckpt_path", ckpt, "--colocate_actor_ref", "--deepspeed_enable_sleep",
             "--ray_num_cpus_per_worker", "0.5", "--ray_health_interval", "2"]
    cmd = [sys.executable, "-m", "rlhfkit.cli.train_ppo_ray",
           *flags(tiny_model_dir, data_dir, save, "--max_steps", "300", *extra)]
    env = dict(cluster["env"], RAY_ADDRESS=cluster["gcs"])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = _Reader(proc)
    stall = os.path.join(data_dir, "stall")
    try:
        reader.wait_for(lambda t: "[step 2/" in t, timeout=150)
        open(stall, "w").close()  # the next reward_func call blocks: the driver sits in user code
        reader.wait_for(lambda t: os.path.exists(stall + "ed"), timeout=30)
        pid = int(next(line.split(" pid ")[1].split()[0] for line in reader.lines
                       if line.startswith("placement: policy rank 0")))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for f in (stall, stall + "ed"):
            if os.path.exists(f):
                os.remove(f)
    out = reader.text()
    assert proc.returncode != 0, out[-4000:]
    assert elapsed < 60
    errors = [line for line in out.splitlines() if line.startswith("train_ppo_ray: error:")]
    assert errors and f"policy rank 0 (pid {pid}" in errors[0] and "died" in errors[0], out[-4000:]

    with open(os.path.join(ckpt, "actor", "latest")) as f:
        last = int(f.read().strip().removeprefix("global_step"))
    assert last >= 2 and os.path.isdir(os.path.join(ckpt, "critic", f"global_step{last}"))
    resumed = subprocess.run([sys.executable, "-m", "rlhfkit.cli.train_ppo_ray", "--load_checkpoint",
                              *flags(tiny_model_dir, data_dir, save, "--max_steps", str(last + 1), *extra)],
                             env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"at step {last}" in resumed.stdout
    one = os.path.join(data_dir, "uninterrupted")
    train_ppo.main(flags(tiny_model_dir, data_dir, one, "--max_steps", str(last + 1), *extra[:11]))
    a, b = metrics(one)[-1], metrics(save)[-1]
    assert a["step"] == b["step"] == last + 1
    for k in ("train/reward", "train/reward_std", "train/policy_loss", "train/value_loss", "train/kl",
              "train/grad_norm", "train/critic_grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), f"step {last + 1} {k}: {b[k]} != {a[k]}"
    for suffix in ("", "_critic"):
        w1, w2 = load_file(os.path.join(one + suffix, "model.safetensors")), \
            load_file(os.path.join(save + suffix, "model.safetensors"))
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=0, msg=suffix + k)
