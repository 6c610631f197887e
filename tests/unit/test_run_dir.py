"""One run per folder (rlhfkit.runs.directory): the lock, earlier runs, the default checkpoint folder,
unwritable outputs; and the resume settings check (rlhfkit.trainers.run_settings)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from rlhfkit.cli.common import UsageError
from rlhfkit.runs.directory import LOCK, RunDirectory
from rlhfkit.cli.train_sft import build_parser
from rlhfkit.trainers.run_settings import ResumeMismatch, allowed_changes, check_same_run, run_settings


def args(save: str, *extra: str):
    return build_parser().parse(["--pretrain", "m", "--dataset", "d.jsonl", "--save_path", save, *extra])


def write_lock(folder: str, pid: int, host: str | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    with open(path, "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname(), "started": "2030-01-01 00:00:00"}, f)
    return path


def test_default_ckpt_path_is_under_the_run_directory(tmp_path):
    a = args(str(tmp_path / "run"))
    with RunDirectory(a):
        assert a.ckpt_path == str(tmp_path / "run" / "checkpoints")
        lock = json.load(open(tmp_path / "run" / LOCK))
        assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname() and lock["started"]
    assert not (tmp_path / "run" / LOCK).exists()  # released
    b = args(str(tmp_path / "run2"), "--run_dir", str(tmp_path / "logs"))
    with RunDirectory(b):
        assert b.ckpt_path == str(tmp_path / "logs" / "checkpoints")
        assert (tmp_path / "run2" / LOCK).exists() and (tmp_path / "logs" / LOCK).exists()


def test_a_folder_locked_by_a_live_run_is_refused_in_one_line(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(str(tmp_path / "run"), holder.pid)
        with pytest.raises(UsageError, match=rf"^--save_path {tmp_path}/run is in use by another run \(pid "
                                             rf"{holder.pid} on {socket.gethostname()}, started 2030-01-01 "
                                             r"00:00:00\): wait for it to end or choose another --save_path$"):
            with RunDirectory(args(str(tmp_path / "run"))):
                pass
        # an explicit --ckpt_path shared with that run is refused too
        write_lock(str(tmp_path / "ck"), holder.pid)
        with pytest.raises(UsageError, match=r"^--ckpt_path .*/ck is in use by another run"):
            with RunDirectory(args(str(tmp_path / "other"), "--ckpt_path", str(tmp_path / "ck"))):
                pass
        assert not (tmp_path / "other" / LOCK).exists()  # the lock it took first was given back
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(str(tmp_path / "run"), dead.pid)
    with RunDirectory(args(str(tmp_path / "run"))):
        assert json.load(open(tmp_path / "run" / LOCK))["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert f"taking over the lock of a run that ended without releasing it (pid {dead.pid}" in out


def test_a_lock_of_another_host_is_refused_with_the_way_out(tmp_path):
    path = write_lock(str(tmp_path / "run"), 1, host="elsewhere")
    with pytest.raises(UsageError, match=rf"in use by another run \(pid 1 on elsewhere, .*\): .*; if that run is "
                                         rf"gone, remove {path}$"):
        with RunDirectory(args(str(tmp_path / "run"))):
            pass


def test_an_earlier_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "run_config.json").write_text(json.dumps({"pretrain": "m", "learning_rate": 5e-6}))
    # no checkpoint: --load_checkpoint leads nowhere, and is not suggested
    with pytest.raises(UsageError, match=rf"^--save_path {run} holds an earlier run \(2 logged steps in "
                                         rf"{run}/metrics.jsonl\) and no checkpoint to resume: start over with "
                                         r"--overwrite_output_dir, or choose another --save_path$"):
        with RunDirectory(args(str(run))):
            pass
    (run / "config.json").write_text("{}")  # a finished run: its saved model
    with pytest.raises(UsageError, match=r"holds an earlier run \(2 logged steps .*; a saved model in "):
        with RunDirectory(args(str(run))):
            pass
    os.makedirs(run / "checkpoints" / "global_step2")
    (run / "checkpoints" / "latest").write_text("global_step2")
    with pytest.raises(UsageError, match=rf"^--save_path {run} holds an earlier run \(2 logged steps in "
                                         rf"{run}/metrics.jsonl; a saved model in {run}; checkpoints in "
                                         rf"{run}/checkpoints\): resume it with --load_checkpoint, start over with "
                                         r"--overwrite_output_dir, or choose another --save_path$"):
        with RunDirectory(args(str(run))):
            pass
    with RunDirectory(args(str(run), "--load_checkpoint")):  # resuming (a finished run too) is allowed
        pass
    with pytest.raises(UsageError, match="give one"):
        with RunDirectory(args(str(run), "--load_checkpoint", "--overwrite_output_dir")):
            pass
    with RunDirectory(args(str(run), "--overwrite_output_dir")):
        pass
    assert not (run / "metrics.jsonl").exists() and not (run / "run_config.json").exists()
    assert os.listdir(run / "checkpoints") == []
    assert (f"--overwrite_output_dir: removed the earlier run's metrics.jsonl, run_config.json from {run} and "
            f"checkpoints global_step2, latest from --ckpt_path {run}/checkpoints; nothing else there was touched") in \
        capsys.readouterr().out


def test_an_external_ckpt_path_with_checkpoints_is_never_emptied(tmp_path):
    ck = tmp_path / "ck"
    os.makedirs(ck / "global_step1")
    (ck / "latest").write_text("global_step1")
    with pytest.raises(UsageError, match=r"holds an earlier run \(checkpoints in .*/ck\)"):
        with RunDirectory(args(str(tmp_path / "run"), "--ckpt_path", str(ck))):
            pass
    with pytest.raises(UsageError, match=r"--ckpt_path .*/ck holds checkpoints of an earlier run and lies outside"):
        with RunDirectory(args(str(tmp_path / "run"), "--ckpt_path", str(ck), "--overwrite_output_dir")):
            pass
    assert (ck / "latest").exists()


def test_resuming_a_run_with_other_settings_names_the_flags(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    os.makedirs(run / "checkpoints" / "global_step1")
    old = vars(args(str(run), "--learning_rate", "2e-4", "--train_batch_size", "8"))
    (run / "run_config.json").write_text(json.dumps(old, default=str))
    with pytest.raises(ResumeMismatch, match=rf"^--load_checkpoint: the run in --save_path {run} was made by a run "
                                             r"with other settings: --train_batch_size 8 \(now 16\); --learning_rate "
                                             r"0.0002 \(now 0.0001\)\. Resume with the same settings, or pass "
                                             r"--allow_resume_changes train_batch_size,learning_rate to change"):
        with RunDirectory(args(str(run), "--load_checkpoint", "--learning_rate", "1e-4", "--train_batch_size", "16")):
            pass
    with RunDirectory(args(str(run), "--load_checkpoint", "--learning_rate", "1e-4", "--train_batch_size", "16",
                           "--allow_resume_changes", "learning_rate,--train_batch_size")):
        pass
    with RunDirectory(args(str(run), "--load_checkpoint", "--learning_rate", "2e-4", "--train_batch_size", "8",
                           "--max_steps", "99")):  # the same run, only longer
        pass


def test_run_settings_compare_paths_and_skip_what_cannot_be_given(tmp_path):
    (tmp_path / "m").mkdir()
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        rel = run_settings({"pretrain": "m", "dataset": object(), "seed": 1})
    finally:
        os.chdir(here)
    assert rel == {"pretrain": str(tmp_path / "m"), "seed": 1}  # a real path; an object is not compared
    check_same_run(rel, run_settings({"pretrain": str(tmp_path / "m") + "/", "seed": 1}), (), "x")
    # a model the Python API got as an object: --pretrain names its origin, compared as given
    api = "a LlamaForCausalLM passed to the Python API"
    assert run_settings({"pretrain": api}) == {"pretrain": api}
    with pytest.raises(ResumeMismatch, match=r"--seed 1 \(now 2\)"):
        check_same_run(rel, run_settings({"pretrain": str(tmp_path / "m"), "seed": 2}), (), "x")
    assert allowed_changes("all") >= {"seed", "pretrain", "learning_rate"}


@pytest.mark.parametrize("flag", ["--save_path", "--ckpt_path"])
def test_unwritable_outputs_are_refused_at_start(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = str(blocker / "sub")  # under a regular file: never creatable, whoever runs the test
    a = args(str(tmp_path / "run")) if flag == "--ckpt_path" else args(bad)
    if flag == "--ckpt_path":
        a.ckpt_path = bad
    with pytest.raises(UsageError, match=rf"^{flag} {bad} is not writable: "):
        with RunDirectory(a):
            pass


def test_training_in_place_from_the_folder_sets_the_earlier_run_aside(tmp_path, capsys):
    """OpenRLHF's iterative scripts train each round from --save_path into --save_path."""
    run = tmp_path / "policy"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "run_config.json").write_text("{}")
    os.makedirs(run / "checkpoints" / "global_step1")
    (run / "checkpoints" / "latest").write_text("global_step1")
    a = build_parser().parse(["--pretrain", str(run), "--dataset", "d.jsonl", "--save_path", str(run)])
    with RunDirectory(a):
        pass
    (kept,) = os.listdir(run / "earlier_runs")
    assert sorted(os.listdir(run / "earlier_runs" / kept)) == ["checkpoints", "metrics.jsonl", "run_config.json"]
    assert not (run / "metrics.jsonl").exists() and (run / "config.json").exists()  # the model it trains from stays
    assert f"the earlier run's metrics.jsonl, run_config.json, checkpoints moved to {run}/earlier_runs/" in \
        capsys.readouterr().out


# ----------------------------------------------------------------------------- issue #42: what a run owns


def earlier_checkpoints(root, rl: bool = False) -> None:
    """What a run of rlhfkit leaves in a checkpoint folder (rl: RL's actor/ and critic/ folders of them)."""
    for sub in (["actor", "critic"] if rl else [""]):
        base = root / sub
        os.makedirs(base / "global_step2" / "dcp")
        (base / "global_step2" / "meta.json").write_text("{}")
        os.makedirs(base / "global_step3.tmp")  # a save cut short by a kill
        (base / "latest").write_text("global_step2")
    os.makedirs(root / "global_step2_hf")  # --save_hf_ckpt
    (root / "global_step2_hf" / "config.json").write_text("{}")


def users_files(folder) -> dict[str, str]:
    """Files of the user's own in a run folder (one looks like a checkpoint's meta.json)."""
    files = {"NOTES.txt": "my notes", "mydata/rows.jsonl": "{}\n", "mydata/meta.json": "{}",
             "checkpoints_old/readme.txt": "mine"}
    for rel, text in files.items():
        os.makedirs(os.path.dirname(folder / rel), exist_ok=True)
        (folder / rel).write_text(text)
    return files


def assert_kept(folder, files: dict[str, str]) -> None:
    assert {rel: (folder / rel).read_text() for rel in files} == files


def test_overwrite_with_ckpt_path_at_save_path_removes_only_what_a_run_wrote(tmp_path, capsys):
    run = tmp_path / "same"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "run_config.json").write_text("{}")
    (run / "train.log").write_text("old log\n")
    earlier_checkpoints(run)
    mine = users_files(run)
    with RunDirectory(args(str(run), "--ckpt_path", str(run), "--overwrite_output_dir")):
        assert (run / LOCK).exists()  # this run's lock is not removed with the earlier run
        assert sorted(os.listdir(run)) == [LOCK, "NOTES.txt", "checkpoints_old", "mydata"]
    assert_kept(run, mine)
    out = capsys.readouterr().out
    assert (f"note: --overwrite_output_dir: removed the earlier run's metrics.jsonl, run_config.json, train.log "
            f"from {run} and checkpoints global_step2, global_step2_hf, global_step3.tmp, latest from "
            f"--ckpt_path {run}; nothing else there was touched") in out


def test_overwrite_keeps_the_users_files_in_the_checkpoint_folder(tmp_path):
    run = tmp_path / "run"
    earlier_checkpoints(run / "checkpoints", rl=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    mine = users_files(run / "checkpoints")
    with RunDirectory(args(str(run), "--overwrite_output_dir")):
        pass
    assert sorted(os.listdir(run / "checkpoints")) == ["NOTES.txt", "checkpoints_old", "mydata"]
    assert_kept(run / "checkpoints", mine)


def test_training_in_place_with_ckpt_path_at_save_path_sets_aside_only_what_a_run_wrote(tmp_path, capsys):
    run = tmp_path / "policy"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    earlier_checkpoints(run)
    mine = users_files(run)
    a = build_parser().parse(["--pretrain", str(run), "--dataset", "d.jsonl", "--save_path", str(run),
                              "--ckpt_path", str(run)])
    with RunDirectory(a):
        pass
    assert sorted(os.listdir(run)) == ["NOTES.txt", "checkpoints_old", "config.json", "earlier_runs", "mydata"]
    assert_kept(run, mine)
    (kept,) = os.listdir(run / "earlier_runs")
    assert sorted(os.listdir(run / "earlier_runs" / kept)) == ["checkpoints", "metrics.jsonl"]
    assert sorted(os.listdir(run / "earlier_runs" / kept / "checkpoints")) == [
        "global_step2", "global_step2_hf", "global_step3.tmp", "latest"]
    assert f"the earlier run's metrics.jsonl, checkpoints moved to {run}/earlier_runs/" in capsys.readouterr().out


# ----------------------------------------------------------------------------- issue #42: a live run's folders


def sharing_runs(tmp_path) -> list[tuple[list[str], str, str, str]]:
    """Runs B that would share a folder of run A (which trains into tmp_path/lk): B's arguments, the flag
    refused, its folder, and how it meets A's folder."""
    lk, other = tmp_path / "lk", str(tmp_path / "b")
    ck = str(lk / "checkpoints")
    return [([other, "--ckpt_path", ck, "--load_checkpoint"], "--ckpt_path", ck, "is inside"),
            ([other, "--ckpt_path", ck], "--ckpt_path", ck, "is inside"),
            ([ck], "--save_path", ck, "is inside"),
            ([other, "--run_dir", str(lk / "logs")], "--run_dir", str(lk / "logs"), "is inside"),
            ([str(tmp_path)], "--save_path", str(tmp_path), "holds")]


def test_a_live_runs_folders_and_all_inside_them_are_never_shared(tmp_path):
    lk = tmp_path / "lk"
    earlier_checkpoints(lk / "checkpoints")
    (lk / "metrics.jsonl").write_text('{"step": 2}\n')
    with RunDirectory(args(str(lk), "--load_checkpoint")):  # run A, live
        a_lock = json.load(open(lk / LOCK))
        for b_args, flag, folder, how in sharing_runs(tmp_path):
            with pytest.raises(UsageError) as e:
                with RunDirectory(args(*b_args)):
                    pass
            line = str(e.value)
            assert line == (f"{flag} {folder} {how} {lk}, the folder of a live run (pid {os.getpid()} on "
                            f"{socket.gethostname()}, started {a_lock['started']}, command: {a_lock['command']}): "
                            f"wait for it to end or choose another {flag}"), line
            assert "\n" not in line and "--load_checkpoint" not in line.split("):")[-1]
            assert not (lk / "checkpoints" / LOCK).exists() and not (tmp_path / LOCK).exists()
        assert json.load(open(lk / LOCK)) == a_lock  # A's lock untouched
    for b_args, *_ in sharing_runs(tmp_path):  # A is gone: each is allowed
        if "--ckpt_path" in b_args and "--load_checkpoint" not in b_args:  # A's checkpoints: now the earlier-run
            with pytest.raises(UsageError, match=r"holds an earlier run \(checkpoints in .*: resume it with "
                                                 "--load_checkpoint"):  # check, whose advice holds now
                with RunDirectory(args(*b_args)):
                    pass
            continue
        with RunDirectory(args(*b_args)):
            pass


def test_a_lock_of_a_killed_run_covers_nothing(tmp_path):
    lk = tmp_path / "lk"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(str(lk), dead.pid)
    for b_args, *_ in sharing_runs(tmp_path):
        with RunDirectory(args(*b_args)):
            pass
    assert json.load(open(lk / LOCK))["pid"] == dead.pid  # not B's folder: left for a run there to take over


def test_load_checkpoint_with_nothing_to_resume_never_replaces_an_earlier_run(tmp_path, capsys):
    # an earlier run that saved no checkpoint (--save_steps -1): its model and metrics are never replaced
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.json").write_text("{}")
    os.makedirs(run / "checkpoints" / "global_step1_hf")  # a Hugging Face snapshot is nothing to resume
    with pytest.raises(UsageError, match=rf"^--load_checkpoint: --ckpt_path {run}/checkpoints holds no checkpoint to "
                                         rf"resume, and --save_path {run} holds an earlier run \(1 logged steps in "
                                         rf"{run}/metrics.jsonl; a saved model in {run}; checkpoints in "
                                         rf"{run}/checkpoints\) that saved none \(checkpoints are written every "
                                         r"--save_steps steps and when a run is stopped\): start over with "
                                         r"--overwrite_output_dir instead, or choose another --save_path$"):
        with RunDirectory(args(str(run), "--load_checkpoint")):
            pass
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and (run / "config.json").exists()
    # RL keeps its checkpoints under actor/: those resume
    os.makedirs(run / "checkpoints" / "actor" / "global_step1")
    with RunDirectory(args(str(run), "--load_checkpoint")):
        pass
    # fresh folders (OpenRLHF's scripts pass --load_checkpoint on first runs too): a new run, with a note
    fresh = tmp_path / "fresh"
    capsys.readouterr()
    with RunDirectory(args(str(fresh), "--load_checkpoint")):
        pass
    assert capsys.readouterr().out == (f"note: --load_checkpoint: --ckpt_path {fresh}/checkpoints holds no checkpoint "
                                       "to resume; this run starts from --pretrain\n")


def test_pretrain_is_save_path_with_load_checkpoint_and_no_checkpoint_sets_the_earlier_run_aside(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with RunDirectory(args(str(run), "--load_checkpoint", "--pretrain", str(run))):  # OpenRLHF's iterative scripts
        pass
    assert not (run / "metrics.jsonl").exists() and len(os.listdir(run / "earlier_runs")) == 1
    assert "holds no checkpoint to resume; this run starts from --pretrain" in capsys.readouterr().out
