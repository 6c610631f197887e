"""Metrics sinks for every trainer: console, `metrics.jsonl`, TensorBoard and wandb (the plot: plot.py).

    logger = MetricsLogger(run_dir, tensorboard_dir=..., wandb=WandbSettings(...) or None)
    logger.log(step, {"loss": 1.2, "lr": 1e-5, "eval/loss": 1.3})
    logger.close()                                   # writes metrics.png (plot.py)

Names (metric_names.py): one scheme in metrics.jsonl, TensorBoard tags and wandb keys, as
OpenRLHF's wandb logs: `train/<name>`, `eval/<name>`, `time/<name>` (seconds per RL phase), and
"step" (the optimizer step; wandb's step) in every record. `metrics_record` applies the rule; the
loops' `state.history` holds the same records as metrics.jsonl.

Console: one line per logged step (every --logging_steps) and one per evaluation; the seconds per
step are the mean since the previous line (evaluations and checkpoints in between count), measured
from `start(step)`:

    [step 5/12] reward=0.4 kl=0.001 response_length=6 truncated_rate=1 equal_reward_groups=0.25 ...
    [eval step 5] loss=2.596

Lines go through the `logging` module (rlhfkit.logs), so they are always in the run's train.log too.
A tqdm bar is drawn below them only when stdout and stderr are both terminals of a known size
(`terminal()`) and --disable_progress is off; the lines are then written above it (tqdm.write, in
rlhfkit.logs). Otherwise (a log redirected to a file or a pipe, a terminal of size 0x0 as CI runners and
`docker run -t` give, --disable_progress) there is no bar and no carriage return, only the lines.

Only rank 0 should construct a real logger; other ranks use `NullLogger`.
The JSONL file is appended to and flushed per line, so a crash loses nothing already logged. A
resumed run first calls `truncate(step)`: the records a killed run wrote after the checkpoint it
resumes from (and a half-written last line) are dropped, in one atomic rewrite, so that no step
appears twice.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from rlhfkit import logs
from rlhfkit.config.errors import UsageError
from rlhfkit.fileio import atomic_write_text
from rlhfkit.optional import require
from rlhfkit.trainers.metric_names import (CONSOLE_KEYS, EVAL, SECONDS_KEYS, TIME, TRAIN,  # noqa: F401
                                           qualified, read_metrics)

log = logging.getLogger(__name__)


@dataclass
class WandbSettings:
    key: str | None = None
    project: str = "rlhfkit"
    org: str | None = None
    group: str | None = None
    run_name: str | None = None


class PhaseClock(dict):
    """Wall seconds per phase of one step (`with clock("train"): ...`; a phase entered twice adds up).
    Each phase is also a profiler range named `rl/<phase>`, which bench/rl_step.py --profile uses to split
    the GPU's kernels by phase (a no-op when no profiler runs)."""

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        import torch

        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"rl/{name}"):
                yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - t0


def metrics_record(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """{"step": step, <qualified name>: value ...}: one line of metrics.jsonl (and of state.history)."""
    return {"step": int(step), **{qualified(k): v for k, v in _clean(metrics).items()}}


def terminal() -> bool:
    """True when both stdout and stderr are terminals and stderr's has a size: progress bars; otherwise
    plain lines. A terminal of 0 columns (a pty nobody sized: CI runners, `docker run -t`) gets plain lines:
    a bar there is drawn 0 characters wide, redrawn at every update, and shows nothing."""
    try:
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            return False
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream, or one without a size
        return False


def progress_bar(total: int, initial: int, desc: str, enabled: bool):
    """A tqdm bar on stderr when `enabled` (rank 0 asked for one) and `terminal()`; a disabled one otherwise.
    The step lines are printed either way (above the bar when there is one)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not (enabled and terminal()))


@dataclass
class SampleRow:
    """One sampled completion of an RL step, as the --log_completions_steps table shows it."""

    prompt: str
    completion: str
    reward: float
    label: Any = None

    def record(self, step: int) -> dict[str, Any]:
        label = self.label if self.label is None or isinstance(self.label, (str, int, float, bool)) else str(self.label)
        return {"step": int(step), "prompt": self.prompt, "completion": self.completion,
                "reward": float(self.reward), "label": label}


class NullLogger:
    def start(self, step: int) -> None:
        pass

    def log(self, step: int, metrics: dict[str, Any], console: bool = True, total: int | None = None) -> None:
        pass

    def log_completions(self, step: int, rows: list[SampleRow]) -> None:
        pass

    def truncate(self, keep_through: int) -> None:
        pass

    def close(self) -> None:
        pass

    def model_card(self, model_dir: str, **kw: Any) -> None:
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
                 plot_keys: tuple[str, ...] | None = None) -> None:
        """`plot_keys`: the plot's panels (names in rlhfkit.trainers.plot.PANELS; None: every panel with data)."""
        os.makedirs(run_dir, exist_ok=True)
        logs.ensure_setup()  # the console lines go through rlhfkit.logs
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a")
        self.plot_keys = plot_keys
        self._clock: tuple[float, int] | None = None  # (time, step) of the last training line
        self._tb = None
        if tensorboard_dir:
            require("tensorboard", "--use_tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
            log.info(f"TensorBoard: {tensorboard_dir}")
        self._wandb = None
        if wandb is not None:
            self._wandb = _init_wandb(wandb, wandb_config(config or {}))

    def start(self, step: int) -> None:
        """The loop starts (or resumes) at `step`: the first training line's time per step counts from here."""
        self._clock = (time.monotonic(), int(step))

    def log(self, step: int, metrics: dict[str, Any], console: bool = True, total: int | None = None) -> None:
        """One record and its lines: the training line, whose time per step is the mean since the previous
        training line (or `start`), and an evaluation line when the record has eval metrics. Both always go
        to the run's train.log; `console=False` keeps the training line off the console."""
        rec = metrics_record(step, metrics)
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        mean = None
        if any(k.startswith(TRAIN) for k in rec):
            now = time.monotonic()
            if self._clock is not None and step > self._clock[1]:
                mean = (now - self._clock[0]) / (step - self._clock[1])
            self._clock = (now, int(step))
        for line in console_lines(rec, total, seconds_per_step=mean):
            _write(line, console=console or line.startswith("[eval "))
        scalars = {k: v for k, v in rec.items() if k != "step" and _is_number(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def log_completions(self, step: int, rows: list[SampleRow]) -> None:
        """A table of sampled completions: rows of completions.jsonl, TensorBoard text, a wandb table, and
        its first rows on the console."""
        if not rows:
            return
        with open(self.completions_path, "a") as f:
            f.writelines(json.dumps(r.record(step), default=str) + "\n" for r in rows)
        for line in sample_lines(step, rows):
            _write(line)
        if self._tb is not None:
            self._tb.add_text("completions", sample_markdown(rows), int(step))
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "completion", "reward", "label"],
                                data=[list(r.record(step).values()) for r in rows])
            self._wandb.log({"completions": table}, step=int(step))

    @property
    def completions_path(self) -> str:
        return os.path.join(self.run_dir, "completions.jsonl")

    def truncate(self, keep_through: int) -> None:
        """Keep only the records of steps <= `keep_through` (a resume; -1 drops them all), in metrics.jsonl
        and completions.jsonl."""
        self._f.close()
        _truncate_jsonl(self.path, keep_through)
        if os.path.exists(self.completions_path):
            _truncate_jsonl(self.completions_path, keep_through)
        self._f = open(self.path, "a")

    def model_card(self, model_dir: str, **kw: Any) -> None:
        """README.md for a model saved during the run (rlhfkit.trainers.model_card), from this run's files."""
        from rlhfkit.trainers.model_card import write_model_card

        self._f.flush()
        write_model_card(model_dir, run_dir=self.run_dir, **kw)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        try:
            from rlhfkit.trainers.plot import plot_metrics

            plot_metrics(self.path, os.path.join(self.run_dir, "metrics.png"), self.plot_keys)
        except Exception as e:  # a plot must never lose a finished run
            log.warning(f"warning: could not write metrics.png: {e}")


def tensorboard_run_dir(root: str, run_name: str | None, run_dir: str) -> str:
    """`root`/<run name>, so that each training run is one TensorBoard run (as OpenRLHF does): the run
    name is --wandb_run_name, else the run directory's name and the start time (a suffix -2, -3, ...
    when that folder exists already). A name is never a path out of `root`: one that is absolute or climbs
    out of it with '..' (or names `root` itself) is refused, naming the flag."""
    if run_name:
        rel = os.path.normpath(run_name)
        if os.path.isabs(run_name) or rel in (".", "..") or rel.startswith(".." + os.sep):
            raise UsageError(f"--wandb_run_name {run_name!r}: TensorBoard writes a run into --use_tensorboard "
                             f"{root}/<run name>, and this name leads out of that folder; give a name without a "
                             "leading '/' or '..'")
        return os.path.join(root, rel)
    base = f"{os.path.basename(os.path.normpath(os.path.abspath(run_dir)))}_{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = os.path.join(root, base), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{base}-{n}")
    return path


def _truncate_jsonl(path: str, keep_through: int) -> None:
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by the kill
                continue
            if isinstance(rec, dict) and int(rec.get("step", 0)) <= keep_through:
                kept.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(path, "".join(kept))


CONSOLE_SAMPLES = 3  # rows of a completions table shown on the console


PROMPT_CHARS = 80  # the end of a prompt shown on a sample line (a chat template's start is its system prompt)
COMPLETION_CHARS = 100  # a completion's start and end, its middle cut when longer


def _short(text: str, limit: int = 60) -> str:
    """repr(text), its end cut to `limit` characters."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit - 4] + "...'"


def _fit(text: str, limit: int, keep: Any) -> str:
    """repr(keep(text, k)) for the largest k that fits in `limit` characters (escapes count)."""
    k = limit
    while k > 0 and len(repr(keep(text, k))) > limit:
        k -= max(1, (len(repr(keep(text, k))) - limit) // 2)
    return repr(keep(text, max(k, 0)))


def _tail(text: str, limit: int = PROMPT_CHARS) -> str:
    """repr(text) when it fits in `limit` characters, else '...' and the repr of its end."""
    shown = repr(text)
    return shown if len(shown) <= limit else "..." + _fit(text, limit - 3, lambda t, k: t[len(t) - k:])


def _ends(text: str, limit: int = COMPLETION_CHARS) -> str:
    """repr(text) when it fits in `limit` characters, else its start and its end around ' ... '."""
    shown = repr(text)
    if len(shown) <= limit:
        return shown
    half = (limit - 5) // 2
    return (_fit(text, half, lambda t, k: t[:k]) + " ... "
            + _fit(text, limit - 5 - half, lambda t, k: t[len(t) - k:]))


def sample_lines(step: int, rows: list[SampleRow]) -> list[str]:
    """The console lines of a completions table: a header and its first CONSOLE_SAMPLES rows, each with the
    END of its prompt (where the question is: a chat template's prompt starts with the system prompt and
    ends with the assistant's header) and its completion (start and end)."""
    more = f" (first {CONSOLE_SAMPLES} of {len(rows)}; all in completions.jsonl)" if len(rows) > CONSOLE_SAMPLES else ""
    out = [f"[samples step {step}]{more}"]
    for r in rows[:CONSOLE_SAMPLES]:
        label = "" if r.label is None else f" label={_short(str(r.label), 24)}"
        out.append(f"  reward={_fmt(float(r.reward))}{label} {_tail(r.prompt)} -> {_ends(r.completion)}")
    return out


def sample_markdown(rows: list[SampleRow]) -> str:
    """A markdown table of the rows (TensorBoard renders text as markdown)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "\\n").replace("<", "&lt;")

    head = "| prompt | completion | reward | label |\n| --- | --- | --- | --- |\n"
    return head + "\n".join(f"| {cell(r.prompt)} | {cell(r.completion)} | {_fmt(float(r.reward))} | "
                            f"{cell('' if r.label is None else r.label)} |" for r in rows)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _write(line: str, console: bool = True) -> None:
    """One line to the run's log and (unless `console` is False) the console, above an active bar."""
    log.info(line, extra=None if console else {logs.FILE_ONLY: True})


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if v == 0 or 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def console_lines(rec: dict[str, Any], total: int | None = None, train: bool = True,
                  seconds_per_step: float | None = None) -> list[str]:
    """The console lines of one record: the training line (main metrics and the seconds per step:
    `seconds_per_step`, else the record's own step time) and the evaluation line (every eval metric);
    each only when the record has such metrics."""
    step = rec.get("step", 0)
    lines = []
    tr = {k[len(TRAIN):]: v for k, v in rec.items() if k.startswith(TRAIN)}
    if train and tr:
        shown = [k for k in CONSOLE_KEYS if k in tr] or [k for k in tr if _is_number(tr[k])][:6]
        body = " ".join(f"{k}={_fmt(tr[k])}" for k in shown)
        secs = seconds_per_step if seconds_per_step is not None else next(
            (rec[k] for k in SECONDS_KEYS if _is_number(rec.get(k))), None)
        where = f"{step}/{total}" if total else f"{step}"
        lines.append(f"[step {where}] {body}" + (f" ({secs:.3g} s/step)" if secs is not None else ""))
    ev = {k[len(EVAL):]: v for k, v in rec.items() if k.startswith(EVAL)}
    if ev:
        lines.append(f"[eval step {step}] " + " ".join(f"{k}={_fmt(v)}" for k, v in ev.items()))
    return lines


def wandb_config(config: dict[str, Any]) -> dict[str, Any]:
    """Flag values as wandb config: numbers, bools, strings and None as they are, lists of those as
    lists, anything else as its str()."""
    def typed(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [typed(x) for x in v]
        return str(v)

    return {k: typed(v) for k, v in config.items()}


def _init_wandb(s: WandbSettings, config: dict[str, Any]):
    wandb = require("wandb", "--use_wandb")
    if s.key and s.key not in ("True", "true", "1"):
        wandb.login(key=s.key)
    return wandb.init(project=s.project, entity=s.org, group=s.group, name=s.run_name, config=config,
                      reinit=True)


def resolve_eval_key(key: str, available: Iterable[str]) -> str | None:
    """The eval metric `key` names among `available` record names: "eval/pass1" itself, a bare
    "pass1", or OpenRLHF's flat "eval_pass1"; "" = the first `eval/*pass1`. None: no such metric."""
    names = list(available)
    if not key:
        return next((k for k in names if k.startswith(EVAL) and fnmatch.fnmatch(k, "*pass1")), None)
    for cand in (key, EVAL + key, EVAL + key.removeprefix("eval_"), EVAL + key.removeprefix("eval/")):
        if cand in names and cand.startswith(EVAL):
            return cand
    return None
