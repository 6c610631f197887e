"""tests/helpers.py's run_cli and run_shell: a command run in the test's process gives what `python -m` gives
(exit status, stdout, stderr, the output of the processes it starts) and leaves the process as it found it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import run_cli, run_shell

# a command module of this test's own: what it does is chosen by its first argument
COMMAND = '''
import logging, os, signal, subprocess, sys, warnings
import torch

def main(argv):
    what = argv[0]
    if what == "echo":
        print("out:", *argv[1:], flush=True)
        print("err:", sys.stdin.read().strip(), file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)
        return ["ignored"]
    if what == "exit":
        raise SystemExit(int(argv[1]) if argv[1].isdigit() else argv[1])
    if what == "raise":
        raise KeyError("boom")
    if what == "leak":
        os.environ["RK_LEAKED"] = "1"
        os.chdir(argv[1])
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(2)
        torch.manual_seed(1234)
        signal.signal(signal.SIGTERM, lambda *a: None)
        warnings.simplefilter("error")
        logging.getLogger("rlhfkit").addHandler(logging.NullHandler())
        sys.path.insert(0, "/leaked")
        print(sys.argv[0].endswith("rk_test_command.py"), sys.argv[1:])
'''


@pytest.fixture
def command(tmp_path, monkeypatch) -> str:
    (tmp_path / "rk_test_command.py").write_text(COMMAND)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "rk_test_command"


def test_output_and_exit_status_as_a_process_gives_them(command):
    r = run_cli(command, ["echo", "a", 1], stdin="typed\n")
    assert (r.returncode, r.stdout, r.stderr) == (0, "out: a 1\nchild out\n", "err: typed\nchild err\n")
    merged = run_cli(command, ["echo", "b"], merge_stderr=True)
    assert (merged.stdout, merged.stderr) == ("out: b\nerr: \nchild out\nchild err\n", "")  # in the order written
    assert run_cli(command, ["exit", "3"]).returncode == 3
    assert run_cli(command, ["exit", "0"]).returncode == 0
    r = run_cli(command, ["exit", "a message"])
    assert (r.returncode, r.stderr) == (1, "a message\n")
    r = run_cli(command, ["raise"])
    assert r.returncode == 1 and r.stderr.startswith("Traceback") and r.stderr.endswith("KeyError: 'boom'\n")


def test_a_python_file_runs_as_main(tmp_path):
    (tmp_path / "helper_mod.py").write_text("X = 5\n")
    (tmp_path / "prog.py").write_text("import sys\nfrom helper_mod import X\nprint(__name__, X, sys.argv)\n"
                                      "sys.exit(4)\n")
    r = run_cli("prog.py", ["a"], cwd=str(tmp_path))
    assert (r.returncode, r.stdout) == (4, "__main__ 5 ['prog.py', 'a']\n"), r.stderr


def test_what_a_run_changes_ends_with_it(command, tmp_path):
    before = (dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path), signal.getsignal(signal.SIGTERM),
              list(warnings.filters), torch.get_default_dtype(), torch.get_num_threads(), torch.get_rng_state())
    r = run_cli(command, ["leak", str(tmp_path)])
    assert r.returncode == 0 and r.stdout == f"True ['leak', '{tmp_path}']\n", r.stderr
    after = (dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path), signal.getsignal(signal.SIGTERM),
             list(warnings.filters), torch.get_default_dtype(), torch.get_num_threads(), torch.get_rng_state())
    assert after[:-1] == before[:-1] and torch.equal(after[-1], before[-1])
    assert not any(isinstance(h, __import__("logging").NullHandler)
                   for h in __import__("logging").getLogger("rlhfkit").handlers)


def test_each_run_has_one_console_handler_as_a_fresh_interpreter(tiny_model_dir, tmp_path):
    """A second run in this process prints its lines once (the first run's console handler is not its own)."""
    argv = ["addition", "--out", str(tmp_path), "--num_prompts", "4", "--num_eval", "2", "--num_train", "4"]
    first, second = (run_cli("rlhfkit.cli.make_data", argv) for _ in range(2))
    assert first.returncode == second.returncode == 0
    assert first.stdout == second.stdout and first.stdout.count("prompts.jsonl") == 1, first.stdout


def test_a_scripts_rlhfkit_commands_run_here_and_others_as_processes(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text(textwrap.dedent("""\
        set -u
        echo start
        python -m rlhfkit.examples | head -1 | grep -c reward_func.py
        printf 'x\\n' | rlhfkit --version
        python3 -m rlhfkit.cli.make_data nonsense --out d 2> err.txt || echo "status $?"
        grep -c "unknown KIND" err.txt
        python -c 'import os, sys; print("a process", os.getpid() != int(sys.argv[1]))' "$TEST_PID"
        rlhfkit make_data addition --out data --num_prompts 4 --num_eval 2 --num_train 4 > made.txt
        ls data
        exit 7
        """))
    r = run_shell(["bash", str(script)], str(tmp_path), dict(os.environ, TEST_PID=str(os.getpid())), 120)
    assert r.returncode == 7, r.stderr
    assert r.stdout.splitlines() == ["start", "1", "rlhfkit " + __import__("rlhfkit").__version__, "status 2", "1",
                                     "a process True", "eval.jsonl", "prompts.jsonl", "train.jsonl"], r.stderr
    assert "wrote" in (tmp_path / "made.txt").read_text()


def test_a_script_past_its_time_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_shell(["bash", "-c", "sleep 30"], str(tmp_path), dict(os.environ), 1)
