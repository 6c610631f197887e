"""rlhfkit.logs: one console handler (info to stdout, warnings to stderr, no colour codes off a terminal),
the run's log file (every level, early records included, no colour codes, transformers' records too),
third-party progress bars off unless --log_level debug, and user-code errors shown by the user's frames."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from rlhfkit import logs

RED = "\x1b[31mred\x1b[0m"


@pytest.fixture()
def fresh():
    logs.setup("info")
    yield
    logs.close_run_logs()
    logs.setup("info")


def test_console_levels_streams_and_colour_codes(fresh, capsys):
    log = logging.getLogger("rlhfkit.test")
    log.info("plain %s", RED)
    log.warning("careful")
    log.debug("hidden")
    out, err = capsys.readouterr()
    assert out == "plain red\n" and err == "careful\n"  # captured streams are no terminals: no codes
    logs.setup("debug")
    log.debug("shown")
    assert capsys.readouterr().out == "shown\n"


def test_run_log_has_every_level_early_records_and_transformers(fresh, tmp_path, capsys):
    from transformers.utils import logging as hf_logging

    log = logging.getLogger("rlhfkit.test")
    log.info("before the run directory was known")
    path = logs.add_run_log(str(tmp_path))
    log.debug("a detail %s", RED)
    logs.route_transformers()
    hf_logging.get_logger("transformers.modeling_utils").warning("load report %s", RED)
    try:
        raise KeyError("boom")
    except KeyError as e:
        log.debug("failed", exc_info=e)
    logs.close_run_logs()
    log.info("after the run")
    text = open(path).read()
    assert path == os.path.join(str(tmp_path), "train.log") and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].endswith("INFO rlhfkit.test: before the run directory was known")
    assert lines[1].endswith("DEBUG rlhfkit.test: a detail red")
    assert "INFO rlhfkit.logs: note: third-party warnings (transformers' load reports" in lines[2]  # the console's note
    assert lines[3].endswith("WARNING transformers.modeling_utils: load report red")
    assert "Traceback (most recent call last)" in text and "KeyError: 'boom'" in text
    assert "after the run" not in text
    assert "load report" not in capsys.readouterr().err  # a third-party warning: the log file only (no --verbose)


def import_file(path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WARNS = "import warnings\n\n\ndef old():\n    warnings.warn('{}', FutureWarning, stacklevel=2)\n"


def test_third_party_messages_only_with_verbose(fresh, tmp_path, capsys, monkeypatch):
    """transformers' warnings and warnings issued by other packages' code go to train.log only, with one note;
    --verbose shows them; errors, rlhfkit's own warnings and the user's show always."""
    import warnings

    from transformers.utils import logging as hf_logging

    from rlhfkit.data.templates import check_input_template

    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "fakepkg.py").write_text(WARNS.format("fakepkg.old is deprecated"))
    (tmp_path / "my_code.py").write_text(WARNS.format("my_code.old is deprecated"))
    fakepkg, my_code = import_file(tmp_path / "site-packages" / "fakepkg.py", "fakepkg"), \
        import_file(tmp_path / "my_code.py", "my_code")
    path = logs.add_run_log(str(tmp_path / "run"))
    logs.route_transformers()
    hf = hf_logging.get_logger("transformers.modeling_utils")

    def emit_all(tag: str) -> None:
        with warnings.catch_warnings():  # pytest records warnings: show them the way a run does
            warnings.simplefilter("always")
            monkeypatch.setattr(warnings, "showwarning", logs._showwarning)
            hf.warning(f"LlamaForSequenceClassification LOAD REPORT {tag}")
            fakepkg.old()  # issued by a package's code (the line it names, stacklevel 2, is this test's)
            my_code.old()  # the user's own file
            check_input_template("Q:\\n{}")  # rlhfkit's own warning
            hf.error(f"transformers broke {tag}")

    emit_all("quiet")
    out, err = capsys.readouterr()
    assert "LOAD REPORT" not in err and "fakepkg.old" not in err
    assert "my_code.old is deprecated" in err and "literal backslash-n" in err and "transformers broke quiet" in err
    assert out == (f"note: third-party warnings (transformers' load reports, other packages' FutureWarnings ...) go "
                   f"to {path} only; --verbose prints them here too\n")  # once
    logs.setup("info", new_run=False, verbose=True)
    emit_all("verbose")
    out, err = capsys.readouterr()
    assert "LOAD REPORT verbose" in err and "FutureWarning: fakepkg.old is deprecated" in err and out == ""
    logs.close_run_logs()
    text = open(path).read()
    for tag in ("quiet", "verbose"):
        assert f"WARNING transformers.modeling_utils: LlamaForSequenceClassification LOAD REPORT {tag}" in text
    assert text.count("WARNING py.warnings: ") == 6 and text.count("FutureWarning: fakepkg.old is deprecated") == 2


def test_a_new_run_log_closes_the_last_one(fresh, tmp_path):
    log = logging.getLogger("rlhfkit.test")
    first = logs.add_run_log(str(tmp_path / "sft"))
    log.info("sft line")
    second = logs.add_run_log(str(tmp_path / "rl"))  # one process, two runs (the quickstart)
    log.info("rl line")
    logs.close_run_logs()
    assert "rl line" not in open(first).read() and "sft line" in open(first).read()
    assert "sft line" not in open(second).read() and "rl line" in open(second).read()


def test_third_party_progress_bars_only_with_debug(fresh, monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    logs.setup("info")
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and not hf_logging.is_progress_bar_enabled()
    logs.setup("debug")
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and hf_logging.is_progress_bar_enabled()


def test_user_error_is_one_line_and_the_users_frames(tmp_path, monkeypatch):
    user = tmp_path / "my_reward.py"
    user.write_text("def helper(x):\n    return 1 / x\n\n\ndef reward_func(q):\n    return [helper(v) for v in q]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import my_reward
    finally:
        sys.path.remove(str(tmp_path))

    def framework_call():  # a frame of this test file, which stands for the framework here
        try:
            my_reward.reward_func([0])
        except ZeroDivisionError as e:
            raise RuntimeError("my_reward.py: reward_func raised ZeroDivisionError: division by zero") from e

    with pytest.raises(RuntimeError) as info:
        framework_call()
    monkeypatch.setattr(logs, "_LIBRARY_DIRS", logs._LIBRARY_DIRS + (os.path.dirname(__file__),))
    lines = logs.user_error_lines("train_ppo", info.value)
    assert lines[0] == "train_ppo: error: my_reward.py: reward_func raised ZeroDivisionError: division by zero"
    frames = [(a, b) for a, b in zip(lines[1::2], lines[2::2]) if "<listcomp>" not in a]  # Python < 3.12 has one
    assert frames == [(f'  File "{user}", line 6, in reward_func', "    return [helper(v) for v in q]"),
                      (f'  File "{user}", line 2, in helper', "    return 1 / x")]
    assert len(lines) % 2 == 1
