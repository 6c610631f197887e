"""Logging for every command: rlhfkit's messages, and transformers', through one handler to the console
and, once a run directory is known, to the run's log file.

    log = logging.getLogger(__name__)             # in every module
    log.info("model saved to %s", path)           # stdout, as a plain line
    log.warning("...")                            # stderr
    log.debug("...")                              # the log file; the console with --log_level debug

    setup("info", verbose=False)  the console handler (FlagParser.parse calls it with --log_level and
                                  --verbose); ensure_setup() installs it only when missing (MetricsLogger)
    add_run_log(run_dir)          also everything, at every level, into <run_dir>/train.log, with times
                                  and levels; records from before it was known are written first
    close_run_logs()              at the end of a run (the CLIs' cli_main, the API's train())
    user_error_lines(exc)         a user-code failure as one line and the user's own frames

One handler (`ConsoleHandler`) writes records below WARNING to stdout and the rest to stderr, above a
progress bar when one is drawn; a stream that is no terminal, and the log file, never get terminal
colour codes. A record marked `extra={FILE_ONLY: True}` goes to the log file only.

Third-party messages go to the log file only, unless `--verbose` (or `--log_level debug`): transformers'
warnings (its load report of missing or unexpected weights, deprecations) and Python warnings issued by
other packages' code (FutureWarning, DeprecationWarning, UserWarning ...; a warning issued by rlhfkit's
code or the user's own files, a reward function say, is shown). The first one hidden prints one note
saying where they are. Errors (ERROR and up) always show. Third-party progress bars (transformers' weight
loading and saving, the Hugging Face hub, datasets) are off unless `--verbose` / `--log_level debug`: a
run shows rlhfkit's own bar on a terminal, and one line per logged step.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from typing import Any

ROOT = "rlhfkit"
LOG_FILE = "train.log"
FILE_ONLY = "rlhfkit_file_only"  # a record attribute (logging's `extra`): the run's log file only
THIRD_PARTY = "rlhfkit_third_party"  # set on py.warnings records: the warning was issued by another package
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
    pytest's capture and redirections see them), above an active tqdm bar. Not: records marked FILE_ONLY,
    and third-party records below ERROR unless --verbose (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, FILE_ONLY, False):
            return False
        if not _verbose and record.levelno < logging.ERROR and is_third_party(record):
            _note_hidden()
            return False
        return super().filter(record)

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
_debug = False  # --log_level debug: transformers' info messages too
_verbose = False  # --verbose or --log_level debug: third-party messages and progress bars on the console
_hidden_noted = False  # the note about hidden third-party messages was printed (once per run)
_early: _Early | None = None
_files: dict[str, logging.FileHandler] = {}


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(ROOT), logging.getLogger("transformers"), logging.getLogger("py.warnings")]


def setup(level: str = "info", new_run: bool = True, verbose: bool = False) -> None:
    """Install the console handler once (later calls change its level); INFO by default. Python
    warnings are logged too (`py.warnings`). `new_run`: a run starts (a command line was parsed), so the
    last run's log file is closed and the early records start anew. `verbose` (--verbose): third-party
    messages and progress bars on the console too (--log_level debug implies it)."""
    global _console, _early, _verbose, _debug, _hidden_noted
    lvl = getattr(logging, level.upper())
    if _console is None:
        _console = ConsoleHandler()
        _console.setFormatter(logging.Formatter("%(message)s"))
        _early = _Early()
        logging.captureWarnings(True)
        warnings.showwarning = _showwarning  # logging's, plus who issued the warning (THIRD_PARTY)
        for name in (ROOT, "py.warnings"):
            lg = logging.getLogger(name)
            lg.setLevel(logging.DEBUG)  # records still reach handlers a user put on the root logger
            lg.addHandler(_console)
            lg.addHandler(_early)
    if new_run:
        close_run_logs()
        if _early is not None:
            _early.records = []
        _hidden_noted = False
    _console.setLevel(lvl)
    _debug = lvl <= logging.DEBUG
    _verbose = bool(verbose) or _debug
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
    --log_level debug); the console shows them under --verbose only (ConsoleHandler.filter)."""
    if _console is None:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.set_verbosity(logging.INFO if _debug else logging.WARNING)
    hf = logging.getLogger("transformers")
    for h in [_console, _early, *_files.values()]:  # _early: a load report before the run log opens
        if h is not None and h not in hf.handlers:
            hf.addHandler(h)


def is_third_party(record: logging.LogRecord) -> bool:
    """A record of another package: a logger outside rlhfkit's (transformers'), or a Python warning issued
    by code that is neither rlhfkit's nor the user's."""
    if record.name == ROOT or record.name.startswith(ROOT + "."):
        return False
    if record.name == "py.warnings":
        return bool(getattr(record, THIRD_PARTY, True))
    return True


def _note_hidden() -> None:
    """Once per run: where the third-party messages kept off the console are."""
    global _hidden_noted
    if _hidden_noted or os.environ.get("RANK", "0") != "0":
        return
    _hidden_noted = True
    where = next(iter(_files), None) or f"the run's {LOG_FILE}"
    logging.getLogger(__name__).info(
        f"note: third-party warnings (transformers' load reports, other packages' FutureWarnings ...) go to {where} "
        "only; --verbose prints them here too")


def _warning_issuer() -> str:
    """The file of the code that issued the warning being shown: the first frame outside the warnings
    module and this one (whatever `stacklevel` the warning names)."""
    skip = {os.path.normcase(os.path.abspath(warnings.__file__)), os.path.normcase(os.path.abspath(__file__))}
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if os.path.normcase(os.path.abspath(name)) not in skip and not name.startswith("<frozen"):
            return name
        f = f.f_back
    return ""


def _showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
    """logging.captureWarnings' showwarning, with the record marked THIRD_PARTY when another package's
    code issued the warning."""
    if file is not None:  # a warning shown to a file of the caller's choice: as Python shows it
        original = getattr(logging, "_warnings_showwarning", None)
        if original is not None:
            original(message, category, filename, lineno, file, line)
        return
    issuer = _warning_issuer() or filename
    ours = issuer.startswith(_PACKAGE + os.sep) or _is_user_frame(issuer)
    text = warnings.formatwarning(message, category, filename, lineno, line)
    logging.getLogger("py.warnings").warning("%s", text, extra={THIRD_PARTY: not ours})


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
