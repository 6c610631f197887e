"""The API trainers' common part: config -> the command's namespace -> the command's `run()`.

    trainer = SFTTrainer(model, args=SFTConfig(...), train_dataset=rows)
    trainer.train()
      config.to_args(parser)           the namespace `python -m rlhfkit.cli.train_sft ...` would parse
      + inputs                         --pretrain (a directory, or where a loaded model came from),
                                       --dataset / ... as in-memory rows (rlhfkit.api.inputs)
      + given                          a loaded model, tokenizer and reference as objects
                                       (rlhfkit.models.given): trained in place, never written to disk
      -> rlhfkit.cli.<command>.run()   the very function the CLI's main() calls
      -> history                       result.state.history: one dict per logged step, as in metrics.jsonl
    trainer.save_model(path)           the trained model (and tokenizer) in Hugging Face format

Errors are raised as they are (the CLI turns the same ones into one line and exit code 1). A run stopped
by Ctrl-C (SIGINT) or SIGTERM raises rlhfkit.trainers.stop.RunStopped, whose message names the checkpoint
and how to resume in Python: the same config with `load_checkpoint=True` (not the command line's flag).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from rlhfkit import logs
from rlhfkit.api.config import FlagConfig, command_parser
from rlhfkit.api.inputs import data_source, model_input, tokenizer_input
from rlhfkit.config.flag_parser import set_as_given
from rlhfkit.models.given import GivenModels
from rlhfkit.trainers.stop import RunStopped


def _stop_line(e: RunStopped) -> str:
    """The stop message without the command-line resume hint the CLI wrapper appends (the RunStopped it
    re-raised is the context of `e`)."""
    ctx = e.__context__
    if isinstance(ctx, RunStopped) and ctx.saved == e.saved:
        return str(ctx)
    return str(e).split("; resume with:", 1)[0]


class BaseTrainer:
    """Subclasses set `config_class` (whose COMMAND names the CLI module) and `_inputs()`."""

    config_class: type[FlagConfig] = FlagConfig

    def __init__(self, model: Any, args: FlagConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, tokenizer: Any = None) -> None:
        if args is None:
            args = self.config_class()
        if not isinstance(args, FlagConfig):
            raise TypeError(f"{type(self).__name__}: args must be a {self.config_class.__name__}, "
                            f"got {type(args).__name__}")
        if model is None:
            raise ValueError(f"{type(self).__name__}: model is required (a model directory or a loaded model)")
        if train_dataset is None:
            raise ValueError(f"{type(self).__name__}: train_dataset is required")
        if processing_class is not None and tokenizer is not None and processing_class is not tokenizer:
            raise ValueError(f"{type(self).__name__}: give processing_class or tokenizer, not both")
        self.args = args
        self.model_init = model
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.result: Any = None
        self.history: list[dict[str, Any]] = []
        self._pretrain, self._module = model_input(model)
        self._tokenizer = tokenizer_input(self.processing_class, model)

    # ------------------------------------------------------------------ inputs and running

    def _inputs(self) -> dict[str, Any]:
        """dest -> value of the input flags (model directory or origin, datasets)."""
        return {"pretrain": self._pretrain,
                "dataset": data_source(self.train_dataset, "train_dataset"),
                "eval_dataset": data_source(self.eval_dataset, "eval_dataset")}

    def _given(self) -> GivenModels:
        """The model and tokenizer objects the run takes (rlhfkit.models.given)."""
        return GivenModels(policy=self._module, tokenizer=self._tokenizer)

    def _run(self, ns: Any, parser: Any) -> Any:
        return importlib.import_module(f"rlhfkit.cli.{self.args.COMMAND}").run(ns, given=self._given())

    def build_args(self) -> Any:
        """The namespace the command's parser gives for the config, with the input flags set as given (what
        run_config.json records as parsed), and the parser; the run resolves it (the RL commands: a read-only
        copy, rlhfkit.rl_run.resolve)."""
        parser = command_parser(self.args.COMMAND)
        ns = self.args.to_args(parser)
        for dest, value in self._inputs().items():
            set_as_given(ns, dest, value)
        return ns, parser

    def train(self) -> list[dict[str, Any]]:
        """Train; returns the metrics history (one dict per logged step: the records of metrics.jsonl)."""
        try:
            ns, parser = self.build_args()
            logs.route_transformers()
            self.result = self._run(ns, parser)
        except RunStopped as e:
            if not e.saved:
                raise
            raise RunStopped(e.signum, f"{_stop_line(e)}; resume with: the same trainer and data, "
                                       f"{type(self.args).__name__}(..., load_checkpoint=True), then train()",
                             e.saved) from None
        finally:
            logs.close_run_logs()
        self.history = self.result.state.history
        self._name_after_save_path()
        return self.history

    def _name_after_save_path(self) -> None:
        """The trained model now lives in save_path (train() saved it there): its `name_or_path` says so,
        so a trainer it is passed to next names it as its base model (model cards)."""
        model = self.backend.unwrap()
        if os.path.isdir(self.args.save_path) and hasattr(model, "name_or_path"):
            model.name_or_path = self.args.save_path
            if getattr(model, "config", None) is not None:
                model.config.name_or_path = self.args.save_path

    # ------------------------------------------------------------------ results

    def _require_result(self) -> Any:
        if self.result is None:
            raise RuntimeError(f"{type(self).__name__}: call train() first")
        return self.result

    @property
    def backend(self) -> Any:
        return self._require_result().backend

    @property
    def model(self) -> Any:
        """The trained model (a transformers model; a peft model under lora_rank > 0). Before
        train(): what was passed in."""
        return self.model_init if self.result is None else self.backend.unwrap()

    @property
    def tokenizer(self) -> Any:
        return self._require_result().tokenizer

    def save_model(self, output_dir: str | None = None) -> str:
        """Save the trained model and its tokenizer in Hugging Face format (default: args.save_path,
        where train() has saved it already). Returns the directory."""
        path = output_dir or self.args.save_path
        self.backend.save_hf(path, self.tokenizer)
        return path
