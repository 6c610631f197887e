"""Metrics sinks for every trainer: console, `metrics.jsonl`, TensorBoard, wandb, and a plot.

    logger = MetricsLogger(run_dir, tensorboard_dir=..., wandb=WandbSettings(...) or None)
    logger.log(step, {"loss": 1.2, "lr": 1e-5})     # one JSON object per call in metrics.jsonl
    logger.close()                                   # writes metrics.png (curves of the main keys)

Only rank 0 should construct a real logger; other ranks use `NullLogger`.
The JSONL file is appended to and flushed per line, so a crash loses nothing already logged. A
resumed run first calls `truncate(step)`: the records a killed run wrote after the checkpoint it
resumes from (and a half-written last line) are dropped, in one atomic rewrite, so that no step
appears twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from rlhfkit.fileio import atomic_write_text
from rlhfkit.optional import require


@dataclass
class WandbSettings:
    key: str | None = None
    project: str = "rlhfkit"
    org: str | None = None
    group: str | None = None
    run_name: str | None = None


class NullLogger:
    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:  # noqa: D401
        pass

    def truncate(self, keep_through: int) -> None:
        pass

    def close(self) -> None:
        pass


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        out[k] = v
    return out


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard_dir: str | None = None,
                 wandb: WandbSettings | None = None, config: dict[str, Any] | None = None,
                 plot_keys: tuple[str, ...] = ("loss", "eval_loss", "reward", "eval_reward", "eval_pass1")) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a")
        self.plot_keys = plot_keys
        self._tb = None
        if tensorboard_dir:
            require("tensorboard", "--use_tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        self._wandb = None
        if wandb is not None:
            self._wandb = _init_wandb(wandb, config or {})
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        rec = {"step": int(step), **_clean(metrics)}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if console:
            body = " ".join(f"{k}={_fmt(v)}" for k, v in rec.items() if k != "step")
            print(f"[step {step}] {body}", flush=True)
        for k, v in rec.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            if self._tb is not None:
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in rec.items() if k != "step"}, step=step)

    def truncate(self, keep_through: int) -> None:
        """Keep only the records of steps <= `keep_through` (a resume; -1 drops them all)."""
        self._f.close()
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut by the kill
                    continue
                if isinstance(rec, dict) and int(rec.get("step", 0)) <= keep_through:
                    kept.append(line if line.endswith("\n") else line + "\n")
        atomic_write_text(self.path, "".join(kept))
        self._f = open(self.path, "a")

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        try:
            plot_metrics(self.path, os.path.join(self.run_dir, "metrics.png"), self.plot_keys)
        except Exception as e:  # a plot must never lose a finished run
            print(f"warning: could not write metrics.png: {e}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _init_wandb(s: WandbSettings, config: dict[str, Any]):
    wandb = require("wandb", "--use_wandb")
    if s.key and s.key not in ("True", "true", "1"):
        wandb.login(key=s.key)
    return wandb.init(project=s.project, entity=s.org, group=s.group, name=s.run_name, config=config,
                      reinit=True)


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(jsonl_path: str, png_path: str, keys: tuple[str, ...]) -> str | None:
    """Plot each of `keys` present in the JSONL against step, one panel per key."""
    rows = read_metrics(jsonl_path)
    present = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not present:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.2), squeeze=False)
    for ax, k in zip(axes[0], present):
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
