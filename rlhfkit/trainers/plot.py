"""The run's plot (run_dir/metrics.png): a grid of panels read from metrics.jsonl.

    plot_metrics("run/metrics.jsonl", "run/metrics.png", panels=("reward", "eval_accuracy", "kl"))

A panel (PANELS) draws metric base names from both namespaces: `train/<name>` as a faint raw line
under a smoothed one (a centred Gaussian-weighted moving average, sigma = 1/30 of the points: a
trend shows where it happens, with no lag, and a spike as a bump; none below 8 points, nor for the
learning rate), `eval/<name>` as
marked points joined by a dashed line (orange when the panel draws one name, else the colour of
that name's training line). Panels without data are
left out, so one panel list serves runs that log different metrics; None: every panel with data.
Tick labels carry as many digits as it takes to tell them apart (`tick_digits`).
The grid has at most 4 columns (3 for 5 or 6 panels); a panel is about 3.6 x 2.6 inches at 100 dpi.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Sequence

from rlhfkit.trainers.metric_names import EVAL, TRAIN, read_metrics


@dataclass(frozen=True)
class Panel:
    title: str
    names: tuple[str, ...]  # metric base names (fnmatch patterns), drawn from train/ and eval/
    smooth: bool = True


PANELS: dict[str, Panel] = {
    "reward": Panel("reward", ("reward",)),
    "eval_accuracy": Panel("eval accuracy (pass@k)", ("pass*",)),
    "loss": Panel("loss", ("loss",)),
    "acc": Panel("accuracy", ("acc",)),
    "margin": Panel("reward margin (chosen - rejected)", ("margin",)),
    "rewards": Panel("chosen / rejected reward", ("chosen_reward", "rejected_reward")),
    "signed_reward": Panel("signed reward", ("signed_reward",)),
    "kl": Panel("KL to the reference", ("kl",)),
    "kd": Panel("distillation / NLL loss", ("kd_loss", "nll_loss")),
    "response_length": Panel("response length (tokens)", ("response_length",)),
    "entropy": Panel("entropy", ("entropy",)),
    "losses": Panel("policy / value loss", ("policy_loss", "value_loss")),
    "grad_norm": Panel("grad norm", ("grad_norm", "critic_grad_norm")),
    "lr": Panel("learning rate", ("lr", "actor_lr"), smooth=False),
}
RL_PANELS = ("reward", "eval_accuracy", "kl", "response_length", "entropy", "losses", "grad_norm", "lr")
OFFLINE_PANELS = ("loss", "acc", "margin", "rewards", "grad_norm", "lr")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def gaussian_smooth(values: Sequence[float], sigma: float) -> list[float]:
    """Point i -> sum_j w_ij x_j / sum_j w_ij with w_ij = exp(-(i - j)^2 / (2 sigma^2)) over |i - j| <= ceil(3 sigma)
    (points, not steps; at the ends the weights of the points that exist). sigma 0: the values."""
    if sigma <= 0:
        return list(values)
    r, n = math.ceil(3 * sigma), len(values)
    w = [math.exp(-0.5 * (d / sigma) ** 2) for d in range(r + 1)]
    out = []
    for i in range(n):
        js = range(max(0, i - r), min(n, i + r + 1))
        out.append(sum(w[abs(i - j)] * values[j] for j in js) / sum(w[abs(i - j)] for j in js))
    return out


def smoothing_sigma(n: int) -> float:
    """The smoothing of n points: none below 8, else sigma = n / 30 points (at least 1)."""
    return 0.0 if n < 8 else max(1.0, n / 30)


def tick_digits(ticks: Sequence[float], least: int = 3) -> int:
    """The fewest significant digits (at least `least`) that give every tick its own label: a curve that
    moves in its fifth digit (an entropy of 3.1701 .. 3.1709) gets ticks 3.1702, 3.1704, ..."""
    for d in range(least, 16):
        if len({f"{t:.{d}g}" for t in ticks}) == len(ticks):
            return d
    return 16


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def panel_keys(panel: Panel, keys: Sequence[str]) -> list[str]:
    """The record names `panel` draws among `keys`: train ones first, in the panel's order."""
    out = []
    for prefix in (TRAIN, EVAL):
        for pat in panel.names:
            out += sorted(k for k in keys if k.startswith(prefix) and fnmatch.fnmatch(k[len(prefix):], pat)
                          and k not in out)
    return out


def panels_with_data(rows: list[dict[str, Any]], panels: Sequence[str] | None = None
                     ) -> list[tuple[Panel, list[str]]]:
    """(panel, the record names it draws) for each of `panels` (None: all of PANELS) that has data."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "step"))
    chosen = [(PANELS[p], panel_keys(PANELS[p], keys)) for p in (panels or PANELS)]
    return [(p, [k for k in ks if _series(rows, k)[0]]) for p, ks in chosen if any(_series(rows, k)[0] for k in ks)]


def plot_metrics(jsonl_path: str, png_path: str, panels: Sequence[str] | None = None) -> str | None:
    """Draw the panels (names in PANELS) that have data into `png_path`; None when none has."""
    rows = read_metrics(jsonl_path)
    chosen = panels_with_data(rows, panels)
    if not chosen:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(chosen) if len(chosen) <= 4 else 3 if len(chosen) <= 6 else 4
    nrows = -(-len(chosen) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 2.6 * nrows), squeeze=False)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    for ax, (panel, ks) in zip(axes.flat, chosen):
        _draw(ax, panel, ks, rows)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _label(key: str, keys: list[str]) -> str:
    """"train" / "eval" when the panel draws one name; else the name, "(eval)" marking eval ones."""
    base = key.split("/", 1)[1]
    if len({k.split("/", 1)[1] for k in keys}) == 1:
        return key.split("/", 1)[0]
    return base + (" (eval)" if key.startswith(EVAL) else "")


def _digits_formatter() -> Any:
    """A y-axis tick formatter with `tick_digits` of the axis's ticks, found once per set of ticks (matplotlib
    hands a formatter the tick locations before it asks for their labels)."""
    from matplotlib.ticker import Formatter

    class Digits(Formatter):
        digits = 3

        def set_locs(self, locs: list[float]) -> None:
            super().set_locs(locs)
            self.digits = tick_digits(locs)

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:.{self.digits}g}"

    return Digits()


def _draw(ax: Any, panel: Panel, keys: list[str], rows: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    present = [k for k in keys if _series(rows, k)[0]]
    bases = list(dict.fromkeys(k.split("/", 1)[1] for k in present))
    for key in present:
        xs, ys = _series(rows, key)
        base = key.split("/", 1)[1]
        color = COLORS[1] if len(bases) == 1 and key.startswith(EVAL) else COLORS[bases.index(base) % len(COLORS)]
        label = _label(key, present) if len(present) > 1 else None
        if key.startswith(EVAL):
            ax.plot(xs, ys, linestyle="--", marker="o", markersize=4, linewidth=1, color=color,
                    label=label or "eval")
            continue
        sigma = smoothing_sigma(len(xs)) if panel.smooth else 0.0
        if sigma > 0:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, gaussian_smooth(ys, sigma), color=color, linewidth=1.6, label=label)
        else:
            ax.plot(xs, ys, color=color, linewidth=1.4, marker="." if len(xs) < 30 else None, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(_digits_formatter())
    values = [v for k in present for v in _series(rows, k)[1]]
    if values and max(values) == min(values):  # a constant (e.g. the learning rate): centred, no offset ticks
        v = values[0]
        ax.set_ylim(v - (abs(v) or 1.0), v + (abs(v) or 1.0))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if len(present) > 1 or any(k.startswith(EVAL) for k in present):
        ax.legend(fontsize=7, frameon=False)
