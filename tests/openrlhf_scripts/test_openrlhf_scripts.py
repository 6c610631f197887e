"""OpenRLHF's example scripts, adapted as a user would, run with rlhfkit on CPU (issue 15).

Each script under flat/ (OpenRLHF's flag names up to April 2026) and dotted/ (its names since
ed62d0e2) is the project's own copy of an OpenRLHF `examples/scripts/*.sh`: module renamed to
`rlhfkit`, models and datasets replaced by tiny offline ones (openrlhf_assets.py), GPU counts cut to
one CPU worker, sizes cut to one or two steps, `ray job submit` replaced by a direct run (the copies
join this test's Ray head through $RAY_ADDRESS; without it the CLI starts a local Ray), every other
flag as written. Each changed line carries a `# changed:` comment; the header names the OpenRLHF
commit. Flags are bash arrays, one flag a line, where OpenRLHF used a heredoc or backslash-continued
lines (a comment cannot follow a continued line). The test runs each copy with bash, checks exit
code 0 and the outputs it must leave (or, for the dotted copies marked "parsed" below, runs it with a python3
that records its arguments and compares what they resolve to with the flat copy's).

Selected (flat / dotted: the spelling was run; "parsed": the dotted copy's flags, read by the command's
parser, are the flat copy's run but for settings that change nothing here (PARSED_ONLY), so the flat run
stands for it; "-": OpenRLHF has no script in that spelling, e.g. it removed KTO, PRM, KD,
batch_inference, interactive_chat and the loops in v0.9.6, before the rename):

| OpenRLHF script | what it exercises | flat | dotted |
| --- | --- | --- | --- |
| train_sft.sh | SFT, packing, resume flag | ran | parsed |
| train_rm.sh | reward model, chat-template pairs | ran | parsed |
| train_dpo_llama.sh | DPO (flat: torchrun with NPROC_PER_NODE=1) | ran | ran |
| train_sft_mixtral_lora.sh + combine_lora.sh | LoRA SFT, then lora_combiner | ran | ran (dotted: table rename) |
| train_continue_pretrain_llama.sh | --pretrain_mode | ran | - |
| train_kto_llama.sh | KTO (micro batch 1 -> 2, see the script) | ran | - |
| train_prm_mistral.sh | PRM with the "ки" step tag | ran | - |
| train_knowledge_distillation.sh | KD with a teacher | ran | - |
| train_conditional.sh | batch_inference rm + csft, then SFT | ran | - |
| train_rejection_sampling.sh | 2 iterations: generate, rm + rs, SFT | ran | - |
| train_iterative_dpo.sh | 2 iterations: generate, rm + iter_dpo, DPO | ran | - |
| interactive_chat_llama.sh | interactive_chat fed from stdin | ran | - |
| serve_remote_rm.sh + train_ppo_llama_with_remote_rm.sh | serve_rm, PPO with --remote_rm_url http | ran | ran (PPO: table rename) |
| train_ppo_llama.sh | one-process train_ppo (GAE, reward model) | ran | - |
| train_ppo_llama_ray.sh | PPO, actor+ref and critic+reward colocated | ran | - |
| train_ppo_ray_hybrid_engine.sh | PPO hybrid engine, sleep, dynamic batch | ran | parsed |
| train_ppo_with_reward_fn.sh | PPO with a reward_func file | ran | ran |
| train_reinforce_llama_ray_hybrid_engine.sh | REINFORCE++ with a reward model | ran | - |
| train_gspo_ray_hybrid_engine.sh | GSPO loss, group_norm, no reference | ran | - |
| train_dapo_ray_hybrid_engine.sh | GRPO + clip-higher + dynamic sampling | ran | parsed |
| train_reinforce_baseline_hybrid_engine.sh | REINFORCE++-baseline, agent file, --ring_attn_size 2 (flat: --fsdp2_enable_sleep) | ran | ran (dotted: async script minus async) |
| train_reinforce_baseline_ray_agent_async.sh | --async_train with colocation, --ring_attn_size 2 (dotted: + --partial_rollout) | ran | ran |
| train_reinforce_baseline_ray_agent_multiturn.sh | multi-turn agent (rlhfkit's example agent) | ran | parsed (table rename) |
| train_prorlv2_math_hybrid_engine.sh | math_reward_func, eval, ICEPOP, penalties | ran | ran |
| train_sft_llama_tensor_parallelism.sh | SFT with --ds_tensor_parallel_size 2 (torchrun, 2 CPU processes) | ran | - |
| train_ppo_llama_ray_tensor_parallelism.sh | PPO, all models colocated, --ds_tensor_parallel_size 2 on 2 CPU workers a role | ran | - |
| train_vlm_math_hybrid_engine.sh | vision-language REINFORCE++-baseline: pictures, --freeze_visual_encoder (tiny Qwen3-VL) | ran | parsed |
| examples/python/vlm_multiturn_agent.py (train_vlm_multiturn_agent.sh) | multi-turn VLM agent, environment_images; run by its docstring's command on the VLM script's flags | ran | parsed |

Left out (they need what a CPU cannot give, or are not OpenRLHF training scripts):

| OpenRLHF script | reason |
| --- | --- |
| train_sft_jamba_lora.sh, train_sft_jamba_qlora.sh | Jamba (Mamba layers): CUDA kernels (mamba-ssm / causal-conv1d) |
| train_sft_llama_ring_attn.sh, train_dpo_ring_llama.sh, train_ppo_llama_ray_ring.sh | not copied yet; ring attention (--ring_attn_size 2) runs in the reinforce_baseline scripts above and in tests/distributed/test_context_parallel*.py |
| ckpt_ds_zero_to_universal.sh, test_sft_deepspeed.sh, compare_backends.sh | DeepSpeed checkpoint / backend tooling |
| install_flash_attn.sh, upgrade_flash_attn.sh, nvidia_docker_install.sh, docker_run.sh | installs flash-attn / CUDA docker |
| train_llama_slurm.sh, train_ppo_llama_ray_slurm.sh, train_ppo_ray_slurm.sh, train_nonrl_slurm.sh, slurm-template.sh | SLURM clusters |
| train_ppo_llama_ray_70b.sh, train_ppo_llama_ray_34b.sh, train_dpo_llama_34b.sh | the same commands as the 8B scripts above at other sizes |
| train_rloo_llama.sh | --advantage_estimator trl_rloo: an estimator name OpenRLHF itself later dropped (rloo is run above) |
| build_openllama2.sh, build_chatgpt.sh, train_decision_transformer*_llama.sh, inference_*.sh | 2023 scripts of scripts that no longer exist (../train_sft.py, --load_model) |

Spelling: "table rename" marks a dotted copy written from the flat script with OpenRLHF's flat ->
dotted table (reference §2.8) where no dotted version of that script was found; every other dotted
copy follows OpenRLHF's own dotted script. In scripts whose GPU counts went to 1, parallel degrees
went down with them (vLLM tensor parallel 2 -> 1), each marked on its line. The reinforce_baseline
hybrid-engine and async scripts keep their --ring_attn_size 2 (and --ring_head_stride 2) as written: they run
2 CPU workers for the actor and the reference (a ring of 2 each) and one engine of tensor parallel 2, and
the test checks from their log that the ring ran. The two *_tensor_parallelism.sh scripts keep
--ds_tensor_parallel_size 2 as written: 2 CPU processes (or 2 Ray workers a role) form one tensor-parallel
pair, on the tiny models with their vocabulary padded to 104 (TP_MODEL, TP_RM_MODEL: 2 must divide it);
`test_tensor_parallel_script` checks that the log shows the split and that the exported model holds full
(gathered) tensors.

Ray: the Ray cases share one Ray head (`ray start --block`, started on first use and stopped when the
worker leaves this module): with `--dist loadgroup` they run on one xdist worker (RAY_GROUP), one after
another, so Ray starts once per run.

Run alone: pytest tests/openrlhf_scripts -n 2 (part of `make test`)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
import warmstart

from openrlhf_assets import shared_assets
from helpers import free_port, subprocess_env

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OFFLINE_TIMEOUT_S = 240
RING_NOTE = "ring attention over 2 ranks"  # printed by the backend with --ring_attn_size 2
RAY_TIMEOUT_S = 300


@dataclass
class Case:
    script: str  # flat/x.sh or dotted/x.sh
    outputs: list[str]  # paths under $OUT that must exist afterwards
    ray: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ring: bool = False  # --ring_attn_size 2 as written: the log must show the ring
    # (metrics.jsonl under $OUT, metric, least mean over the run's steps) the run must have logged
    metric_min: tuple[str, str, float] | None = None

    @property
    def id(self) -> str:
        return self.script.replace("/", ":").removesuffix(".sh")


# Dotted copies that are parsed, not run: the flags each passes, read by the command's own parser, are the flat copy's
# but for these (flag: (flat value, dotted value); OpenRLHF's dotted script sets them otherwise), all of which
# change nothing that runs here: data.max_len 72 is the flat copy's prompt 64 + generation 8 (the dotted copies
# that run read it too), and ZeRO stage and vLLM memory share do nothing on one CPU worker. The flat copy's run is
# then this copy's run (test_dotted_copy_resolves_as_the_flat_one checks exactly these differences). The dotted
# copies that differ in what runs (no packing nor Adam offload, ICEPOP, --partial_rollout, ZeRO-3 with a ring of
# 2 ranks) and the DPO pair (the flat one runs under torchrun) run as well.
_LENS = {"max_len": (None, 72), "prompt_max_len": (64, 1024)}
PARSED_ONLY: dict[str, dict[str, tuple]] = {
    "train_sft": {},
    "train_rm": {},
    "train_ppo_ray_hybrid_engine": {**_LENS, "generate_max_len": (8, None)},
    "train_dapo_ray_hybrid_engine": {**_LENS, "generate_max_len": (8, None)},
    "train_reinforce_baseline_ray_agent_multiturn": _LENS,
    "train_vlm_math_hybrid_engine": {"zero_stage": (3, 2)},
    "train_vlm_multiturn_agent": {"zero_stage": (3, 2)},
}


def _cases() -> list[Case]:
    ck = "checkpoint"
    both = [
        ("train_sft", [f"{ck}/llama3-8b-sft/config.json", f"{ck}/llama3-8b-sft/metrics.jsonl"]),
        ("train_rm", [f"{ck}/llama3-8b-rm/config.json", f"{ck}/llama3-8b-rm/model.safetensors"]),
        ("train_dpo_llama", [f"{ck}/llama3-8b-dpo/config.json"]),
    ]
    cases = [Case(f"{sp}/{name}.sh", out) for sp in ("flat", "dotted") for name, out in both
             if sp == "flat" or name not in PARSED_ONLY]
    cases += [Case(f"flat/{name}.sh", out) for name, out in [
        ("train_continue_pretrain_llama", [f"{ck}/llama-2-7b-continue/config.json"]),
        ("train_kto_llama", [f"{ck}/llama3-8b-kto/config.json"]),
        ("train_prm_mistral", [f"{ck}/mistal-7b-prm/config.json"]),
        ("train_knowledge_distillation", [f"{ck}/llama3-8b-kd/config.json"]),
        ("train_conditional", [f"{ck}/llama-2-8b-csft/rm.jsonl", f"{ck}/llama-3-8b-csft/config.json"]),
        ("train_rejection_sampling", [f"{ck}/llama-3-8b-rejection/config.json", f"{ck}/llama-3-8b-rejection/iter.log"]),
        ("train_iterative_dpo", [f"{ck}/llama-3-8b-iter-dpo/checkpoint/config.json",
                                 f"{ck}/llama-3-8b-iter-dpo/rm.jsonl"]),
        ("train_ppo_llama", [f"{ck}/llama-3-8b-rlhf/config.json", f"{ck}/llama-3-8b-rlhf/metrics.jsonl"]),
    ]]
    ray_both = [
        ("train_ppo_ray_hybrid_engine", ["final/llama3-8b-rlhf/config.json"]),
        ("train_ppo_with_reward_fn", [f"{ck}/llama3-8b-rlhf/config.json"]),
        ("train_dapo_ray_hybrid_engine", ["final/llama3-8b-rlhf/config.json"]),
        ("train_reinforce_baseline_hybrid_engine", ["exp/Qwen3-4B-Thinking/config.json"]),
        ("train_reinforce_baseline_ray_agent_multiturn", [f"{ck}/llama3-8b-rlhf-rf_baseline/config.json"]),
        ("train_prorlv2_math_hybrid_engine", ["exp/DeepSeek-R1-Qwen-1.5B-PRORLV2/config.json"]),
    ]
    cases += [Case(f"{sp}/{name}.sh", out, ray=True, ring=name == "train_reinforce_baseline_hybrid_engine")
              for sp in ("flat", "dotted") for name, out in ray_both if sp == "flat" or name not in PARSED_ONLY]
    cases += [Case(f"{sp}/train_reinforce_baseline_ray_agent_async.sh", ["exp/Qwen3-4B-Thinking/config.json"],
                   ray=True, ring=True) for sp in ("flat", "dotted")]
    cases += [Case(f"{sp}/{name}.sh", out, ray=True) for sp in ("flat", "dotted") for name, out in [
        ("train_vlm_math_hybrid_engine", ["exp/Qwen3.5-2B-VLM-RLHF/config.json",
                                          "exp/Qwen3.5-2B-VLM-RLHF/preprocessor_config.json"]),
    ] if sp == "flat" or name not in PARSED_ONLY] + [
        Case(f"{sp}/train_vlm_multiturn_agent.sh", ["exp/Qwen3.5-0.8B-VLM-Agent/config.json"], ray=True,
             # every episode holds its prompt's picture and the screenshot of turn 2
             metric_min=("exp/Qwen3.5-0.8B-VLM-Agent/metrics.jsonl", "train/episode_pictures", 2.0))
        for sp in ("flat", "dotted") if sp == "flat" or "train_vlm_multiturn_agent" not in PARSED_ONLY]
    cases += [Case(f"flat/{name}.sh", out, ray=True) for name, out in [
        ("train_ppo_llama_ray", [f"{ck}/llama3-8b-rlhf/config.json"]),
        ("train_reinforce_llama_ray_hybrid_engine", ["final/llama3-8b-rlhf/config.json"]),
        ("train_gspo_ray_hybrid_engine", ["final/llama3-8b-gspo/config.json"]),
    ]]
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    env = shared_assets(tmp_path_factory)  # built once a run, for every worker
    env["REWARD_FUNC"] = os.path.join(HERE, "user_files", "reward_func.py")
    env["AGENT_FUNC"] = os.path.join(HERE, "user_files", "agent_func.py")
    return env


def _base_env() -> dict[str, str]:
    env = subprocess_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # python3 / torchrun of this venv
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               RAY_AUTH_MODE="token", RAY_DEDUP_LOGS="0", NPROC_PER_NODE="1", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    return env


class RayHead:
    """`ray start --head --block` on a free port with its own temp dir (so no other Ray user of the
    machine sees it as "the last ray start"); stopped by ending that process."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="rk-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        self.log = open(os.path.join(self.tmp, "head.log"), "w")
        warmstart.wait_ready(_base_env())  # the head's workers start warm only if the head does
        self.proc = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", f"--port={self.port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.tmp}",
             "--object-store-memory=200000000"],
            env=_base_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(120.0)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {open(self.log.name).read()[-3000:]}")
            if "Ray runtime started" in open(self.log.name).read():
                return
            time.sleep(0.5)
        raise RuntimeError(f"ray start not ready after {timeout:.0f} s: {open(self.log.name).read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops its processes (~4 s)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of this head's process group is left
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")  # stopped when its worker moves on to another module, not at the run's end
def ray_head():
    heads: list[RayHead] = []

    def get() -> RayHead:
        pytest.importorskip("ray")
        if not heads:
            heads.append(RayHead())
        return heads[0]

    yield get
    for h in heads:
        h.stop()


# ----------------------------------------------------------------------------- running a copy


def run_script(script: str, out: str, env: dict[str, str], timeout: float, args: tuple[str, ...] = (),
               stdin: str | None = None) -> subprocess.CompletedProcess:
    """bash SCRIPT in `out` with `env`; the log is out/<name>.log; the whole process group is killed on timeout."""
    log_path = os.path.join(out, os.path.basename(script).removesuffix(".sh") + ".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", os.path.join(HERE, script), *args], cwd=out, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                text=True, start_new_session=True)
        try:
            proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = open(log_path).read()
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, "")


def assert_ran(res: subprocess.CompletedProcess, out: str, outputs: list[str]) -> None:
    tail = res.stdout[-6000:]
    assert res.returncode == 0, f"{res.args[1]} exited with {res.returncode}:\n{tail}"
    missing = [p for p in outputs if not os.path.exists(os.path.join(out, p))]
    assert not missing, f"{res.args[1]} left no {missing}:\n{tail}"


def script_env(assets: dict[str, str], out: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = _base_env()
    env.update(assets)
    env["OUT"] = out
    env.update(extra or {})
    return env


# --dist loadgroup: the cases on Ray run on one worker, which starts the one Ray head of the run (about 6 s of CPU,
# then 2.5% of a core while the worker lives), not one head on every worker
RAY_GROUP = pytest.mark.xdist_group("openrlhf_ray")


def params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id, marks=[RAY_GROUP] if c.ray else []) for c in cases]


@pytest.mark.parametrize("case", params(CASES))
def test_script(case: Case, assets, ray_head, tmp_path):
    out = str(tmp_path)
    extra = dict(case.env)
    if case.ray:
        extra["RAY_ADDRESS"] = ray_head().address
    res = run_script(case.script, out, script_env(assets, out, extra), RAY_TIMEOUT_S if case.ray else OFFLINE_TIMEOUT_S)
    assert_ran(res, out, case.outputs)
    if case.ring:
        assert RING_NOTE in res.stdout, f"{case.script}: no ring attention in the log"
    if case.metric_min is not None:
        path, key, least = case.metric_min
        with open(os.path.join(out, path)) as f:
            values = [rec[key] for rec in map(json.loads, f) if key in rec]
        assert values and sum(values) / len(values) >= least, f"{case.script}: {key} {values} (want >= {least})"


def script_argv(script: str, env: dict[str, str], work: str) -> list[str]:
    """The arguments the copy passes to python3 (bash runs it with a python3 that records them and exits 0)."""
    stub_dir = os.path.join(work, "stub_bin")
    os.makedirs(stub_dir, exist_ok=True)
    record = os.path.join(work, "argv")
    for name in ("python", "python3"):
        with open(os.path.join(stub_dir, name), "w") as f:
            f.write(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {record}\n")
        os.chmod(os.path.join(stub_dir, name), 0o755)
    env = {**env, "PATH": stub_dir + os.pathsep + env["PATH"]}
    res = subprocess.run(["bash", os.path.join(HERE, script)], cwd=work, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and os.path.exists(record), (script, res.stdout[-2000:], res.stderr[-2000:])
    with open(record) as f:
        return f.read().split("\0")[:-1]


def resolved_flags(argv: list[str]) -> tuple[str, dict]:
    """(module, the namespace its parser makes of `argv` [-m module args...]), paths normalised."""
    import importlib

    i = argv.index("-m")
    module, args = argv[i + 1], argv[i + 2:]
    flags = vars(importlib.import_module(module).build_parser().parse(args, notes=False))
    return module, {k: os.path.normpath(v) if isinstance(v, str) and os.sep in v else v for k, v in flags.items()}


@pytest.mark.parametrize("name", sorted(PARSED_ONLY))
def test_dotted_copy_resolves_as_the_flat_one(name, assets, tmp_path):
    """The dotted copy's flags mean what the flat copy's do, but for the differences PARSED_ONLY lists."""
    env = script_env(assets, str(tmp_path))
    (flat_module, flat), (dotted_module, dotted) = (
        resolved_flags(script_argv(f"{sp}/{name}.sh", env, str(tmp_path / sp))) for sp in ("flat", "dotted"))
    assert flat_module == dotted_module
    differ = {k: (flat.get(k), dotted.get(k)) for k in sorted(set(flat) | set(dotted)) if flat.get(k) != dotted.get(k)}
    assert differ == PARSED_ONLY[name]
    assert len(flat) > 100  # the whole namespace of the command was compared


@pytest.mark.parametrize("spelling", ["flat", "dotted"])
def test_lora_sft_then_combine(spelling, assets, tmp_path):
    """train_sft_mixtral_lora.sh saves an adapter; combine_lora.sh merges it into the base model."""
    out = str(tmp_path)
    env = script_env(assets, out)
    assert_ran(run_script(f"{spelling}/train_sft_mixtral_lora.sh", out, env, OFFLINE_TIMEOUT_S), out,
               ["checkpoint/mixtral-sft-lora/adapter_config.json"])
    env["LORA_PATH"] = os.path.join(out, "checkpoint", "mixtral-sft-lora")
    assert_ran(run_script(f"{spelling}/combine_lora.sh", out, env, OFFLINE_TIMEOUT_S), out,
               ["checkpoint/llama-3-8b-sft-combined/config.json", "checkpoint/llama-3-8b-sft-combined/model.safetensors"])


def test_interactive_chat_fed_stdin(assets, tmp_path):
    """interactive_chat_llama.sh MODEL, two user lines then `exit` on stdin: two replies on stdout, exit 0."""
    out = str(tmp_path)
    with open(os.path.join(out, "interactive_chat.log"), "w") as err:
        res = subprocess.run(["bash", os.path.join(HERE, "flat", "interactive_chat_llama.sh"), assets["MODEL"]],
                             cwd=out, env=script_env(assets, out), input="12+34=\n5+6=\nexit\n", stdout=subprocess.PIPE,
                             stderr=err, text=True, timeout=OFFLINE_TIMEOUT_S)
    log = open(os.path.join(out, "interactive_chat.log")).read()[-4000:]
    assert res.returncode == 0, log
    assert len(res.stdout.splitlines()) == 2, (res.stdout, log)


def _wait_for_server(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    body = b'{"query": ["12+34=46"]}'
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve_rm exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"serve_rm not answering after {timeout:.0f} s:\n{open(log_path).read()[-4000:]}")


@RAY_GROUP
@pytest.mark.parametrize("spelling", ["flat", "dotted"])
def test_serve_remote_rm_then_ppo(spelling, assets, ray_head, tmp_path):
    """serve_remote_rm.sh serves the tiny reward model; train_ppo_llama_with_remote_rm.sh trains PPO with
    --remote_rm_url http://localhost:PORT/get_reward; the server stops on SIGTERM."""
    out = str(tmp_path)
    env = script_env(assets, out, {"RM_PORT": str(free_port()), "RAY_ADDRESS": ray_head().address})
    log_path = os.path.join(out, "serve_remote_rm.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", os.path.join(HERE, spelling, "serve_remote_rm.sh")], cwd=out, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        _wait_for_server(f"http://127.0.0.1:{env['RM_PORT']}/get_reward", server, log_path)
        res = run_script(f"{spelling}/train_ppo_llama_with_remote_rm.sh", out, env, RAY_TIMEOUT_S)
        assert_ran(res, out, ["checkpoint/llama3-8b-rlhf/config.json"])
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    assert server.returncode == 0 or server.returncode == -signal.SIGTERM, open(log_path).read()[-4000:]


TP_CASES = [
    Case("flat/train_sft_llama_tensor_parallelism.sh", ["checkpoint/llama3-8b-sft/config.json",
                                                        "checkpoint/llama3-8b-sft/metrics.jsonl"]),
    Case("flat/train_ppo_llama_ray_tensor_parallelism.sh", ["final/llama3-8b-rlhf/config.json"], ray=True),
]
TP_NOTE = "tensor parallelism: attention, MLP, embedding and lm_head split over 2 ranks"  # printed by apply_tp


@pytest.mark.parametrize("case", params(TP_CASES))
def test_tensor_parallel_script(case: Case, assets, ray_head, tmp_path):
    """OpenRLHF's AutoTP scripts with --ds_tensor_parallel_size 2 as written: the models were split (the note in
    the log) and the exported policy holds full tensors (the tiny Llama: vocabulary 104, hidden 64)."""
    from safetensors import safe_open

    out = str(tmp_path)
    extra = {"RAY_ADDRESS": ray_head().address} if case.ray else {}
    res = run_script(case.script, out, script_env(assets, out, extra), RAY_TIMEOUT_S if case.ray else OFFLINE_TIMEOUT_S)
    assert_ran(res, out, case.outputs)
    assert TP_NOTE in res.stdout, f"{case.script}: no tensor parallelism in the log:\n{res.stdout[-4000:]}"
    model_dir = os.path.dirname(os.path.join(out, case.outputs[0]))
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (104, 64), shapes
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 64), shapes
