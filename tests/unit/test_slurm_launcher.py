"""examples/slurm/train_ppo_ray.sbatch, run under fake `srun`, `scontrol`, `hostname`, `ray` and
`python` that log their calls: the Ray head starts on the first node, one worker per other node
joins the head's address, and train_ppo_ray is submitted once with the node count and the engine
count worked out from it (3 nodes x 4 GPUs / TP 2 = 6 engines), with token auth off."""

from __future__ import annotations

import os
import subprocess

from helpers import ROOT

SCRIPT = os.path.join(ROOT, "examples", "slurm", "train_ppo_ray.sbatch")

FAKES = {
    # srun [--opt=value | --overlap ...] CMD...: logs the node and the command, then runs the command
    "srun": '''node=?; while [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && node=${1#--nodelist=}; shift; done
echo "srun@$node $*" >> "$LOG"; exec "$@"''',
    "scontrol": 'echo node-a; echo node-b; echo node-c',
    "hostname": 'echo "10.0.0.1 fe80::1"',
    "ray": 'echo "ray RAY_AUTH_MODE=$RAY_AUTH_MODE $*" >> "$LOG"',
    # the node count the script polls for, given once every background `ray start` has logged its call: the
    # script's EXIT trap ends those jobs, and with `sleep` faked nothing else waits for them to start
    "python": '''for _ in $(seq 300); do (($(grep -c "^ray .* start " "$LOG" 2>/dev/null) >= 3)) && break; /bin/sleep 0.05; done
echo "$FAKE_ALIVE"''',
    "sleep": 'true',
}


def _run(tmp_path, alive: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / f"calls_{alive}.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "FAKE_ALIVE": alive, "HOME": str(tmp_path),
           "SLURM_JOB_NODELIST": "node-[a-c]", "SLURM_JOB_ID": "77", "GPUS_PER_NODE": "4", "MODEL": "/m"}
    proc = subprocess.run(["bash", SCRIPT, "--max_steps", "5"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def test_script_parses():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def test_head_workers_and_one_submission(tmp_path):
    proc, calls = _run(tmp_path, "3")
    assert proc.returncode == 0, proc.stderr
    ray = [c for c in calls if c.startswith("ray ")]
    starts = [c for c in ray if " start " in c]
    assert len(starts) == 3
    heads = [c for c in starts if " --head " in c]  # the fake srun backgrounds them: log order varies
    assert len(heads) == 1
    assert "--head --node-ip-address=10.0.0.1 --port=6379" in heads[0] and "--num-gpus=4" in heads[0]
    assert [c for c in calls if c.startswith("srun@node-a ray start --head")]
    for node in ("node-b", "node-c"):
        assert [c for c in calls if c.startswith(f"srun@{node} ray start --address=10.0.0.1:6379 --num-gpus=4")]
    submits = [c for c in ray if " job submit " in c]
    assert len(submits) == 1
    sub = submits[0]
    assert sub.startswith("ray RAY_AUTH_MODE=disabled job submit --address=http://127.0.0.1:8265 -- python -m "
                          "rlhfkit.cli.train_ppo_ray")
    assert "--actor_num_nodes 3 --actor_num_gpus_per_node 4" in sub
    assert "--vllm_num_engines 6 --vllm_tensor_parallel_size 2" in sub
    assert "--pretrain /m" in sub and f"--save_path {tmp_path}/ckpt/grpo-ray-77" in sub
    assert sub.endswith("--max_steps 5")  # the sbatch arguments reach train_ppo_ray


def test_missing_node_stops_before_submitting(tmp_path):
    proc, calls = _run(tmp_path, "2")
    assert proc.returncode == 1 and "not every node joined" in proc.stderr
    assert not [c for c in calls if " job submit " in c]
