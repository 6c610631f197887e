"""Logging for every command: rlhfkit's messages, and transformers', through one handler to the console
and, once a run directory is known, to the run's log file.

    log = logging.getLogger(__name__)             # in every module
    log.info("model saved to %s", path)           # stdout, as a plain line
    log.warning("...")                            # stderr
    log.debug("...")                              # the log file; the console with --log_level debug

    setup("info")                 the console handler (FlagParser.parse calls it with --log_level);
                                  ensure_setup() installs it only when missing (MetricsLogger)
    add_run_log(run_dir)          also everything, at every level, into <run_dir>/train.log, with times
                                  and levels; records from before it was known are written first
    close_run_logs()              at the end of a run (the CLIs' cli_main, the API's train())
    user_error_lines(exc)         a user-code failure as one line and the user's own frames

One handler (`ConsoleHandler`) writes records below WARNING to stdout and the rest to stderr, above a
progress bar when one is drawn; a stream that is no terminal, and the log file, never get terminal
colour codes. Third-party progress bars (transformers' weight loading and saving, the Hugging Face hub,
datasets) are off unless `--log_level debug`: a run shows rlhfkit's own bar on a terminal, or one line
per logged step.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import Any

ROOT = "rlhfkit"
LOG_FILE = "train.log"
LEVELS = ("debug", "info", "warning", "error")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
EARLY_RECORDS = 2000  # kept for the run's log file until it is opened


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class ConsoleHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr (the streams of the moment, so that
    pytest's capture and redirections see them), above an active tqdm bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            text = self.format(record)
            if not _isatty(stream):
                text = strip_ansi(text)
            from tqdm import tqdm

            tqdm.write(text, file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never end a run
            self.handleError(record)


class _Early(logging.Handler):
    """Holds the first records until the run's log file opens (bounded)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not _files and len(self.records) < EARLY_RECORDS:  # an open run log has them already
            self.records.append(record)


class _FileFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return strip_ansi(super().format(record))


_console: ConsoleHandler | None = None
_verbose = False  # --log_level debug
_early: _Early | None = None
_files: dict[str, logging.FileHandler] = {}


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(ROOT), logging.getLogger("transformers"), logging.getLogger("py.warnings")]


def setup(level: str = "info", new_run: bool = True) -> None:
    """Install the console handler once (later calls change its level); INFO by default. Python
    warnings are logged too (`py.warnings`). `new_run`: a run starts (a command line was parsed), so the
    last run's log file is closed and the early records start anew."""
    global _console, _early, _verbose
    lvl = getattr(logging, level.upper())
    if _console is None:
        _console = ConsoleHandler()
        _console.setFormatter(logging.Formatter("%(message)s"))
        _early = _Early()
        logging.captureWarnings(True)
        for name in (ROOT, "py.warnings"):
            lg = logging.getLogger(name)
            lg.setLevel(logging.DEBUG)  # records still reach handlers a user put on the root logger
            lg.addHandler(_console)
            lg.addHandler(_early)
    if new_run:
        close_run_logs()
        if _early is not None:
            _early.records = []
    _console.setLevel(lvl)
    _verbose = lvl <= logging.DEBUG
    quiet_third_party(not _verbose)
    if "transformers" in sys.modules:
        route_transformers()


def ensure_setup() -> None:
    """`setup()` unless a console handler is installed already (code used without a command line)."""
    if _console is None:
        setup()


def quiet_third_party(quiet: bool) -> None:
    """Third-party progress bars off (`quiet`) or on. The environment variables reach libraries not
    imported yet; transformers, once imported, is told directly."""
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        if quiet:
            os.environ[var] = "1"
        elif os.environ.get(var) == "1":
            del os.environ[var]
    if "transformers" in sys.modules:
        import warnings

        from transformers.utils import logging as hf_logging

        with warnings.catch_warnings():  # the hub says when its variable, read at its import, still wins
            warnings.simplefilter("ignore")
            (hf_logging.disable_progress_bar if quiet else hf_logging.enable_progress_bar)()


def route_transformers() -> None:
    """transformers' own log records go through rlhfkit's handlers (warnings; info too under
    --log_level debug)."""
    if _console is None:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.set_verbosity(logging.INFO if _verbose else logging.WARNING)
    hf = logging.getLogger("transformers")
    for h in [_console, *_files.values()]:
        if h not in hf.handlers:
            hf.addHandler(h)


def add_run_log(run_dir: str) -> str:
    """Write every record from now on (and those kept since setup) to <run_dir>/train.log; a run log
    still open from an earlier run of this process (the quickstart's SFT, say) is closed first."""
    path = os.path.join(run_dir, LOG_FILE)
    if path in _files:
        return path
    close_run_logs()
    if _console is None:
        setup()
    os.makedirs(run_dir, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(_FileFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if _early is not None:
        for record in _early.records:
            handler.handle(record)
        _early.records = []
    _files[path] = handler
    for lg in _loggers():
        lg.addHandler(handler)
    if "transformers" in sys.modules:
        route_transformers()
    return path


def close_run_logs() -> None:
    """Close the run log files (a run has ended; the next one opens its own)."""
    for handler in _files.values():
        for lg in _loggers():
            lg.removeHandler(handler)
        handler.close()
    _files.clear()


# ----------------------------------------------------------------------------- user code errors

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY_DIRS = tuple({os.path.dirname(os.__file__), _PACKAGE, sys.prefix, sys.base_prefix, sys.exec_prefix})
_EXAMPLES = os.path.join(_PACKAGE, "examples")


def _is_user_frame(filename: str) -> bool:
    """A frame of the user's own code: not rlhfkit's (its shipped examples excepted), not the standard
    library's or an installed package's."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_EXAMPLES + os.sep):
        return True
    return not any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS if d) and "site-packages" not in path


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


class UserFramesText(Exception):
    """The user's frames of an exception raised in another process (a reward worker), as traceback text:
    the cause of the error that reports it, so that `user_frames` prints them as a thread's would be."""

    def __init__(self, frames: str) -> None:
        super().__init__(frames)
        self.frames = frames


def user_frames(exc: BaseException) -> list[str]:
    """The user's frames in `exc` and the exceptions it came from, as traceback lines (innermost last)."""
    lines: list[str] = []
    for e in reversed(_chain(exc)):
        if isinstance(e, UserFramesText):
            lines.append(e.frames)
            continue
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_user_frame(f.filename)]
        lines += traceback.format_list(frames)
    out = [line.rstrip() for chunk in lines for line in chunk.splitlines()]
    return [line for line in out if line.strip(" ^~")]  # without the column markers under a line


def user_error_lines(prog: str, exc: BaseException) -> list[str]:
    """`prog: error: <message>` and, under it, the user's own frames (when the error came from there)."""
    return [f"{prog}: error: {exc}", *user_frames(exc)]
