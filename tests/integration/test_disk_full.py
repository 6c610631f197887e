"""A full disk during a run (train_sft on the tiny model, free space faked): a periodic save that does
not fit is one warning and the run goes on with the checkpoints it has; a final save that does not fit
writes the resumable checkpoint instead and says so in one line (exit 1); resuming writes the model."""

from __future__ import annotations

import os

import pytest

from rlhfkit.checkpoint import sharded as ckpt
from rlhfkit.checkpoint import hf_export
from rlhfkit.cli import train_sft
from rlhfkit.fileio import GB
from rlhfkit.trainers.metrics import read_metrics

from test_run_folders import sft, write_qa


def test_full_disk_at_a_save_and_at_the_final_save(tiny_model_dir, tmp_path, monkeypatch, capsys):
    data = write_qa(tmp_path / "d.jsonl")
    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints")
    calls = {"n": 0}

    def ckpt_free(path):  # room for the step-1 checkpoint, none for step 2's, room again for the fallback
        calls["n"] += 1
        return 0 if calls["n"] == 2 else 10 * GB

    monkeypatch.setattr(ckpt, "free_bytes", ckpt_free)
    monkeypatch.setattr(hf_export, "free_bytes", lambda path: 1000)
    with pytest.raises(SystemExit) as e:
        train_sft.main(sft(tiny_model_dir, data, out, "--save_steps", "1", "--max_steps", "3"))
    cap = capsys.readouterr()
    warnings = [x for x in cap.err.splitlines() if x.startswith("warning:")]
    assert warnings == [f"warning: step 2: not saved: no space left on {ck}: need "
                        f"{warnings[0].split('need ')[1].split(' GB')[0]} GB, have 0 GB; the checkpoints saved "
                        "before are kept"], cap.err
    last = cap.err.strip().splitlines()[-1]
    assert e.value.code == 1 and last.startswith(f"train_sft: error: no space left on {out}: need ") and last.endswith(
        f"have 9.31e-07 GB; the trained state is saved as the resumable checkpoint {ck}/global_step3 instead: "
        "free space, then run the same command with --load_checkpoint to write the model"), last
    assert sorted(os.listdir(ck)) == ["global_step1", "global_step3", "latest"]
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    monkeypatch.undo()
    history = train_sft.main(sft(tiny_model_dir, data, out, "--save_steps", "1", "--max_steps", "3",
                                 "--load_checkpoint"))
    assert history == [] and os.path.isfile(os.path.join(out, "model.safetensors"))
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]


def test_enospc_inside_a_periodic_dcp_save_is_a_warning_and_training_goes_on(tiny_model_dir, tmp_path, monkeypatch,
                                                                              capsys):
    """The disk fills while torch.distributed.checkpoint writes step 2's shards (its CheckpointException is a
    BaseException, wrapping OSError ENOSPC): one warning naming the folder and the bytes needed, no
    `global_step2.tmp` left, steps 3 and 4 trained and saved, the model written."""
    from dcp_faults import fill_dcp_writes

    data = write_qa(tmp_path / "d.jsonl")
    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints")
    real = ckpt._write_checkpoint

    def disk_fills_at_step_2(backend, root, tag, *args):
        with monkeypatch.context() as m:
            if tag == "global_step2":
                fill_dcp_writes(m)
            return real(backend, root, tag, *args)

    monkeypatch.setattr(ckpt, "_write_checkpoint", disk_fills_at_step_2)
    train_sft.main(sft(tiny_model_dir, data, out, "--save_steps", "1", "--max_steps", "4", "--max_ckpt_num", "5"))
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1, err
    assert warnings[0].startswith(f"warning: step 2: not saved: no space left on {ck}: need "), warnings
    assert warnings[0].endswith("; the checkpoints saved before are kept"), warnings
    assert sorted(os.listdir(ck)) == ["global_step1", "global_step3", "global_step4", "latest"]
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_a_final_save_that_cannot_complete_names_the_last_good_checkpoint(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    data = write_qa(tmp_path / "d.jsonl")
    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints")
    calls = {"n": 0}

    def ckpt_free(path):  # room for the step-2 checkpoint, none for the final fallback's
        calls["n"] += 1
        return 10 * GB if calls["n"] == 1 else 0

    monkeypatch.setattr(ckpt, "free_bytes", ckpt_free)
    monkeypatch.setattr(hf_export, "free_bytes", lambda path: 1000)
    with pytest.raises(SystemExit) as e:
        train_sft.main(sft(tiny_model_dir, data, out, "--save_steps", "2", "--max_steps", "3"))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1 and last.startswith(f"train_sft: error: no space left on {out}: need "), last
    assert f"; the resumable checkpoint was not saved either: no space left on {ck}: need " in last, last
    assert last.endswith(f"; the last good checkpoint is {ck}/global_step2: free space, then run the same command "
                         "with --load_checkpoint to go on from it"), last
    assert sorted(os.listdir(ck)) == ["global_step2", "latest"]
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
