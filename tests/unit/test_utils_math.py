"""rlhfkit.utils: extract_boxed_answer and grade_answer against tables worked out by hand.

Every EQUAL / UNEQUAL pair is checked with math-verify off (rlhfkit's own rules and sympy) and,
where math-verify is installed, on; LENIENT lists the pairs that only math-verify accepts.
"""

from __future__ import annotations

import os

import pytest

from rlhfkit.utils import extract_boxed_answer, grade_answer
from rlhfkit.utils.latex import normalize_answer, parse_number, split_structure
from rlhfkit.utils.math_utils import latex_to_sympy_text, math_verify_available, set_math_verify

BOXED = [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
    ("so $\\boxed{\\frac{1}{\\sqrt{2}}}$", "\\frac{1}{\\sqrt{2}}"),  # nested braces
    ("\\boxed{\\left(\\frac{a}{b}, {c}\\right)}", "\\left(\\frac{a}{b}, {c}\\right)"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literals
    ("\\boxed{x^{2^{3}}} done", "x^{2^{3}}"),
    ("$\\boxed 7$", "7"),
    ("\\fbox{12}", "12"),
    ("\\boxed{unclosed {", None),
    ("no box here", None),
    ("", None),
]

# (given, ground truth): mathematically equal
EQUAL = [
    ("42", "42"), ("42.0", "42"), ("042", "42"), ("-3", "-3.00"), ("1,000", "1000"), ("1,234,567.5", "1234567.5"),
    ("1{,}000", "1000"), ("1\\,000", "1000"), (".5", "0.5"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac12", "\\frac{1}{2}"), ("\\frac{2}{4}", "\\frac{1}{2}"), ("-\\frac{3}{4}", "\\frac{-3}{4}"),
    ("-0.75", "-\\frac34"), ("2\\frac{1}{4}", "9/4"), ("1.5\\times10^{3}", "1500"), ("50\\%", "50"),
    ("50\\%", "0.5"), ("50%", "\\frac{1}{2}"), ("\\$18.90", "18.9"), ("18.90 dollars", "18.9"),
    ("10\\text{ cm}", "10"), ("10 \\mbox{ meters}", "10"), ("5 square feet", "5"), ("90^\\circ", "90"),
    ("90^{\\circ}", "90"), ("30\\degree", "30"), ("\\$5\\text{ million}", "5000000"), ("x = 5", "5"),
    ("\\theta = \\frac{\\pi}{3}", "\\frac{\\pi}{3}"), ("\\text{Monday}", "monday"), ("\\text{(B)}", "B"),
    ("(C)", "C"), ("\\left( 1, 2 \\right)", "(1,2)"), ("(1, \\frac{1}{2})", "(1, 0.5)"),
    ("[-1, 3)", "\\left[ -1, 3 \\right)"), ("(-\\infty, 2]", "(-\\infty,2]"),
    ("(-\\infty,1)\\cup(2,\\infty)", "(2,\\infty)\\cup(-\\infty,1)"), ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}"),
    ("3, -2", "-2, 3"), ("x+1", "1+x"), ("2x+2", "2(x+1)"), ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt2}"), ("\\sqrt[3]{8}", "2"), ("\\frac{\\pi}{2}", "\\pi/2"),
    ("\\sin^2 x+\\cos^2 x", "1"), ("x^2-1", "(x-1)(x+1)"), ("e^{i\\pi}", "-1"), ("3+4i", "4i+3"),
    ("\\binom{5}{2}", "10"), ("y = 2x + 1", "2x + 1 = y"), ("2y = 4x + 2", "y = 2x + 1"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}"),
]

# (given, ground truth): not equal
UNEQUAL = [
    ("41", "42"), ("-42", "42"), ("4.2", "42"), ("1,000", "100"), ("\\frac{1}{3}", "0.33"), ("1/3", "0.333"),
    ("\\frac{2}{1}", "\\frac{1}{2}"), ("\\pi", "3.14"), ("\\sqrt{2}", "1.414"), ("10", "100"), ("50\\%", "5"),
    ("(1, 2)", "[1, 2]"), ("(1, 2]", "(1, 2)"), ("(2, 1)", "(1, 2)"), ("(1, 2, 3)", "(1, 2)"),
    ("\\{1, 2\\}", "\\{1, 2, 3\\}"), ("3, -2", "3, 2"), ("x+1", "x+2"), ("x^2", "x^3"), ("2x", "2y"),
    ("y = 2x + 1", "y = 2x + 2"), ("A", "B"), ("yes", "no"), ("\\frac{\\pi}{3}", "\\frac{\\pi}{6}"),
    ("(-\\infty, 2]", "(-\\infty, 2)"), ("e", "2.718"), ("\\sqrt{x}", "x"), ("10\\%", "0.1\\%"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}"),
    ("", "0"), ("0", ""), (None, "1"), ("1", None),
]

# math-verify rounds decimals to 6 places and reads a trailing m / s as a unit; rlhfkit's own rules do neither
LENIENT = [("1/3", "0.3333333"), ("\\frac{2}{3}", "0.666667"), ("2m", "2"), ("3s", "3")]


@pytest.fixture(params=["own", "math_verify"])
def mode(request):
    if request.param == "math_verify" and not math_verify_available():
        pytest.skip("math-verify is not installed (pip install 'rlhfkit[math]')")
    set_math_verify(request.param == "math_verify")
    yield request.param
    set_math_verify(True)


@pytest.mark.parametrize("text,want", BOXED)
def test_extract_boxed_answer(text, want):
    assert extract_boxed_answer(text) == want


@pytest.mark.parametrize("given,truth", EQUAL)
def test_equal_pairs(mode, given, truth):
    assert grade_answer(given, truth), f"{given!r} should equal {truth!r} ({mode})"
    assert grade_answer(truth, given), f"{truth!r} should equal {given!r} ({mode})"


@pytest.mark.parametrize("given,truth", UNEQUAL)
def test_unequal_pairs(mode, given, truth):
    assert not grade_answer(given, truth), f"{given!r} should not equal {truth!r} ({mode})"


@pytest.mark.parametrize("given,truth", LENIENT)
def test_leniencies_only_with_math_verify(mode, given, truth):
    assert grade_answer(given, truth) == (mode == "math_verify")


def test_normalisation_steps():
    assert normalize_answer("\\boxed{x = \\dfrac{1}{2}\\text{ cm}}") == "\\frac{1}{2}"
    assert normalize_answer("\\left[ 1, 2 \\right)") == "[1,2)"
    assert normalize_answer("\\pi r^2") == "\\pi r^2"  # the space that ends a command stays
    assert normalize_answer("The  End.") == "theend"  # words: spaces go, lower case
    assert parse_number("-\\frac{6}{4}") == parse_number("-1.5") == -1.5
    assert parse_number("1/0") is None and parse_number("x") is None
    s = split_structure("(1,2]")
    assert (s.kind, s.open, s.close, s.elems) == ("interval", "(", "]", ["1", "2"])
    assert split_structure("(1+2)") is None and split_structure("(1)(2)") is None


def test_model_text_is_never_evaluated(tmp_path):
    """Answers reach sympy only through a whitelisted grammar: code in an answer is not run."""
    marker = tmp_path / "pwned"
    attack = f"__import__('os').system('touch {marker}')"
    assert latex_to_sympy_text(attack) is None
    assert not grade_answer(attack, "0")
    assert not grade_answer(f"eval(\"open('{marker}', 'w')\")", "1")
    assert not os.path.exists(marker)
    for tower in ("9^{9^{9^{9}}}", "9^9^9", "2^{10000}", "100000!", "2^{(3!)!}"):  # refused before sympy
        assert latex_to_sympy_text(normalize_answer(tower)) is None, tower
        assert not grade_answer(tower, "1")


def test_grading_in_a_worker_thread(mode):
    """reward_func files run in worker threads, where math-verify's SIGALRM limits cannot work."""
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.update(eq=grade_answer("1/3", "0.3333333"),
                                                   half=grade_answer("\\frac{1}{2}", "0.5")))
    t.start()
    t.join(30)
    assert out == {"eq": mode == "math_verify", "half": True}


def test_openrlhf_import_paths():
    import rlhfkit.agents as agents
    import rlhfkit.utils as utils
    from rlhfkit.utils import agent as utils_agent
    from rlhfkit.utils import math_utils

    assert utils.grade_answer is math_utils.grade_answer
    assert utils.extract_boxed_answer is math_utils.extract_boxed_answer
    for name in ("AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor"):
        assert getattr(utils_agent, name) is getattr(agents, name)
