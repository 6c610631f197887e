"""`RLCheckpointer`: the RL run's checkpoints -- the policy's and the critic's saved as a pair, the best
checkpoint by an evaluation metric, Hugging Face snapshots with a model card (train_ppo / train_ppo_ray)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.backend.base import CheckpointingBackend
from rlhfkit.config.errors import UsageError
from rlhfkit.parallel.dist import DistInfo

log = logging.getLogger(__name__)


@dataclass
class RLCheckpointer:
    """Saves/loads the trainable roles' checkpoints under one root (actor/, critic/).

    The critic is saved first and keeps one checkpoint more than --max_ckpt_num; the actor's
    checkpoint completes the pair. Loading takes the newest actor checkpoint whose critic
    checkpoint of the same tag is complete, so a kill between the two saves (or during either)
    resumes from the previous pair, never from an actor and a critic of different steps; a pair
    with a damaged checkpoint (checksums, or one written before them that does not read) is
    skipped for the previous pair the same way.
    `--save_hf_ckpt` adds a Hugging Face snapshot `<root>/<tag>_hf` (the EMA weights under
    --enable_ema) with a model card (README.md, from the run's files in `run_dir`);
    `--disable_ds_ckpt` leaves out the resumable checkpoint.

    Best checkpoint (`keep_best`, --best_metric_key): after each evaluation, when the metric (""
    = the first `eval/*pass1` one; "eval/reward", "reward" and OpenRLHF's "eval_reward" all name
    eval/reward; higher is better) beats every earlier evaluation, the step is saved
    as above under `<root>/best/` and the previous best is removed; its client state records the
    key and value, so a resumed run goes on comparing with it."""

    policy_backend: CheckpointingBackend
    critic_backend: CheckpointingBackend | None = None
    save_hf: bool = False
    tokenizer: Any = None
    save_ds: bool = True
    best_metric_key: str | None = None
    best_value: float | None = None
    run_dir: str | None = None
    dist: DistInfo = field(default_factory=DistInfo)  # the ranks that resume together

    def save(self, root: str, tag: str, client: dict, max_keep: int) -> None:
        if self.save_ds:
            self.save_resumable(root, tag, client, max_keep)
        if self.save_hf:
            self.policy_backend.save_hf(os.path.join(root, f"{tag}_hf"), self.tokenizer)
            if self.run_dir is not None:
                from rlhfkit.parallel.dist import is_rank0
                from rlhfkit.trainers.model_card import write_model_card

                if is_rank0():
                    step = tag.removeprefix("global_step")
                    write_model_card(os.path.join(root, f"{tag}_hf"), run_dir=self.run_dir,
                                     step=int(step) if step.isdigit() else None)

    def save_resumable(self, root: str, tag: str, client: dict, max_keep: int) -> str:
        """The resumable pair only (whatever --disable_ds_ckpt says: a stopped run and the final save's
        fallback need it); returns the actor checkpoint's path."""
        if self.critic_backend is not None:
            self.critic_backend.save_checkpoint(os.path.join(root, "critic"), tag, client, max_keep + 1)
        return self.policy_backend.save_checkpoint(os.path.join(root, "actor"), tag, client, max_keep)

    def keep_best(self, root: str, step: int, metrics: dict[str, float], client: dict) -> bool:
        """Save step `step` as the best checkpoint if its eval metric is the best so far (True then)."""
        if self.best_metric_key is None:
            return False
        from rlhfkit.trainers.metrics import resolve_eval_key

        key = resolve_eval_key(self.best_metric_key, metrics)
        if key is None:
            if not self.best_metric_key:
                return False
            evals = ", ".join(sorted(k for k in metrics if k.startswith("eval/")))
            raise UsageError(f"--best_metric_key {self.best_metric_key} is not an evaluation metric; "
                             f"there are: {evals}")
        value, best_root = float(metrics[key]), os.path.join(root, "best")
        if self.best_value is None:
            self.best_value = _saved_best(best_root, key)
        if not math.isfinite(value) or (self.best_value is not None and value <= self.best_value):
            return False
        self.best_value = value
        tag = f"global_step{step}"
        self.save(best_root, tag, {**client, "best_metric_key": key, "best_metric_value": value}, 1)
        _remove_old_snapshots(best_root, keep=f"{tag}_hf")
        return True

    def load(self, root: str) -> dict | None:
        actor, critic = os.path.join(root, "actor"), os.path.join(root, "critic")
        if self.critic_backend is None:
            return self.policy_backend.load_checkpoint(actor)
        from rlhfkit.checkpoint.layout import list_checkpoints

        critic_tags = {t for _, t in list_checkpoints(critic)}
        pairs = [t for _, t in list_checkpoints(actor) if t in critic_tags]
        if not pairs:
            if list_checkpoints(actor) or critic_tags:
                raise FileNotFoundError(f"--load_checkpoint: no step has a complete checkpoint in both {actor} "
                                        f"and {critic}")
            return self.policy_backend.load_checkpoint(actor)  # none at all (or only incomplete: an error)
        from rlhfkit.checkpoint.errors import UnreadableCheckpointError

        left = pairs[::-1]
        skipped: list[str] = []
        while True:
            tag = _newest_intact_pair(actor, critic, left, self.dist, skipped)
            try:
                client = self.policy_backend.load_checkpoint(actor, tag)
                self.critic_backend.load_checkpoint(critic, tag)
                return client
            except UnreadableCheckpointError as e:  # one without checksums that does not read: the pair before
                line = f"{str(e).removeprefix('--load_checkpoint: ')}; skipped"
                log.warning("%s", line)
                skipped.append(line)
                left = left[left.index(tag) + 1:]


def _newest_intact_pair(actor: str, critic: str, tags: list[str], dist: DistInfo, earlier: list[str]) -> str:
    """The first of `tags` (newest first) whose actor and critic checkpoints both match their checksums;
    a damaged one is skipped with a line naming it (rlhfkit.checkpoint.integrity.newest_intact). `earlier`:
    the lines of pairs skipped before (named in the error when none is left)."""
    from rlhfkit.checkpoint.integrity import newest_intact

    def pick() -> tuple[str | None, list[str]]:
        skipped: list[str] = list(earlier)
        for tag in tags:
            ok_a, lines_a = newest_intact(actor, [tag])
            ok_c, lines_c = newest_intact(critic, [tag]) if ok_a else (None, [])
            skipped += lines_a + lines_c
            if ok_a and ok_c:
                return tag, skipped
        return None, skipped

    mine: tuple[str | None, list[str]] = pick() if dist.is_rank0 else (None, [])  # other ranks take rank 0's
    tag, skipped = dist.from_rank0(mine)
    if tag is None:
        raise FileNotFoundError(f"--load_checkpoint: no step has an intact checkpoint in both {actor} and "
                                f"{critic}: " + "; ".join(skipped))
    return tag


def _remove_old_snapshots(root: str, keep: str) -> None:
    """Rank 0 deletes the Hugging Face snapshots of earlier best checkpoints under `root`."""
    import shutil

    from rlhfkit.parallel.dist import is_rank0

    if is_rank0() and os.path.isdir(root):
        for name in os.listdir(root):
            if name.endswith("_hf") and name != keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _saved_best(best_root: str, key: str) -> float | None:
    """The metric value of the best checkpoint an earlier run left under `best_root` (same key)."""
    import json

    from rlhfkit.checkpoint.layout import list_checkpoints

    found = list_checkpoints(os.path.join(best_root, "actor"))
    if not found:
        return None
    try:
        with open(os.path.join(best_root, "actor", found[-1][1], "client_state.json")) as f:
            client = json.load(f)
    except (OSError, ValueError):
        return None
    return float(client["best_metric_value"]) if client.get("best_metric_key") == key else None
