"""Math answer checking for reward functions: ``grade_answer`` and ``extract_boxed_answer``.

The names and call signatures are OpenRLHF's (``openrlhf.utils``), so a ``reward_func`` file that
imports them works once its import line reads ``from rlhfkit.utils import ...``::

    pred = extract_boxed_answer(response)          # last \\boxed{...}, nested braces kept; or None
    grade_answer(pred, label) -> bool              # given answer first, ground truth second

``grade_answer(given, truth)`` decides in this order (the first rule that applies answers):

    1. either is None / truth empty                         -> False
    2. normalised strings equal (``latex.normalize_answer``) -> True
    3. both are numbers (ints, decimals, thousands commas, a/b, \\frac, mixed numbers, x10^k):
       exact rational equality; a percentage also equals its fraction (50% = 50 = 0.5)
    4. either is a tuple / interval / set / list / union / matrix: same kind and brackets, same
       length, elements equal by these rules (in order; sets and bare lists in any order)
    5. sympy: both sides parse as expressions (or equations) and their difference simplifies
       to 0 (equations: equal up to a nonzero factor), or agrees at random points to 1e-9
    6. math-verify, where installed (``pip install 'rlhfkit[math]'``): its ``verify`` on the raw
       strings, which also accepts decimals rounded to 6 places (1/3 = 0.333333) and reads a
       trailing single-letter unit (2m = 2), which rules 2-5 do not

Rule 5 never calls ``eval`` on raw text: the LaTeX is rewritten into a whitelisted grammar
(digits, operators, single-letter symbols and known function names) before sympy parses it, and
long or exponent-heavy expressions are refused. Everything is deterministic except the random
points of rule 5, which use a fixed seed.
"""

from __future__ import annotations

import random
import re
import threading

from rlhfkit.utils.latex import (Structure, extract_boxed_answer, last_boxed_only_string, matching_brace,
                                 normalize_answer, parse_number, percent_value, remove_boxed, split_structure)

MAX_EXPR_CHARS = 300
FUNCTIONS = {"sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
             "log", "exp", "Abs", "binomial", "factorial"}
GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "nu", "rho", "sigma", "tau",
         "phi", "psi", "omega", "varphi", "vartheta", "varepsilon"}
CONSTANTS = {"pi", "oo"}
_COMMANDS = {
    "\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/", "\\ln": " log ",
    "\\log": " log ", "\\exp": " exp ", "\\arcsin": " asin ", "\\arccos": " acos ", "\\arctan": " atan ",
    **{f"\\{f}": f" {f} " for f in ("sin", "cos", "tan", "cot", "sec", "csc", "sinh", "cosh", "tanh")},
    **{f"\\{g}": f" {g} " for g in GREEK},
}
_use_math_verify = True


# ----------------------------------------------------------------------------- LaTeX -> sympy


def _replace_group_command(s: str, name: str, fmt) -> str | None:
    """Rewrite ``\\name{A}{B}`` (``fmt`` gets the groups); None when a group does not close."""
    while True:
        i = s.find(name + "{")
        if i < 0:
            return s
        groups, j = [], i + len(name)
        for _ in range(fmt.__code__.co_argcount):
            while j < len(s) and s[j] == " ":
                j += 1
            if j >= len(s) or s[j] != "{":
                return None
            end = matching_brace(s, j)
            if end is None:
                return None
            groups.append(s[j + 1:end])
            j = end + 1
        s = s[:i] + fmt(*groups) + s[j:]


def _too_costly(s: str) -> bool:
    """Power towers (``9**9**9``, ``9**(9**9)``), exponents or factorials of 4+ digits, more than
    4 powers: sympy would not finish evaluating them."""
    if s.count("**") > 4 or re.search(r"\*\*\s*\(?\s*\d{4,}|\d{4,}\s*!|\*\*\s*[\w.]+\s*\*\*", s):
        return True
    for m in re.finditer(r"\*\*\s*\(", s):
        depth, j = 0, m.end() - 1
        while j < len(s):
            depth += {"(": 1, ")": -1}.get(s[j], 0)
            if depth == 0:
                break
            j += 1
        if "**" in s[m.end():j] or "!" in s[m.end():j]:
            return True
    return False


def latex_to_sympy_text(s: str) -> str | None:
    """A normalised answer -> text in the safe grammar parsed by ``to_sympy``; None when it has
    LaTeX this converter does not know (``\\le``, ``\\sum``, ...)."""
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\sqrt\[([^\[\]]+)\]\{", r"\\nthroot{\1}{", s)
    for name, fmt in (("\\frac", lambda a, b: f"(({a})/({b}))"), ("\\binom", lambda a, b: f"binomial({a},{b})"),
                      ("\\nthroot", lambda n, a: f"(({a})**(1/({n})))"), ("\\sqrt", lambda a: f"sqrt({a})")):
        s = _replace_group_command(s, name, fmt)
        if s is None:
            return None
    for cmd in sorted(_COMMANDS, key=len, reverse=True):
        s = re.sub(re.escape(cmd) + r"(?![A-Za-z])", lambda _m, c=cmd: _COMMANDS[c], s)
    if "\\" in s or ("_" in s and not re.search(r"[A-Za-z]_\{?\w+\}?", s)):
        return None
    s = re.sub(r"([A-Za-z])_\{?([A-Za-z0-9]+)\}?", r"\1_\2", s)
    s = s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")").replace("^", "**")
    if not re.fullmatch(r"[0-9A-Za-z_+\-*/().,=! ]*", s) or len(s) > MAX_EXPR_CHARS:
        return None
    if _too_costly(s):
        return None
    out = []
    for tok in re.split(r"([A-Za-z][A-Za-z0-9_]*)", s):
        if not tok or not tok[0].isalpha() or tok in FUNCTIONS or tok in GREEK or tok in CONSTANTS \
                or re.fullmatch(r"[A-Za-z]_[A-Za-z0-9]+", tok):
            out.append(tok)
        else:  # "xy" -> x*y, "x2" -> x*2: implicit products of single-letter symbols
            out.append("*".join(re.findall(r"[A-Za-z]|\d+", tok)))
    return "".join(out)


def to_sympy(text: str):
    """Parse ``latex_to_sympy_text`` output; None on any failure. Single letters are symbols,
    except ``e`` (Euler's number) and ``i`` (the imaginary unit)."""
    import sympy
    from sympy.parsing.sympy_parser import (implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    names = set(re.findall(r"[A-Za-z][A-Za-z0-9_]*", text))
    local = {n: sympy.Symbol(n) for n in names if n not in FUNCTIONS and n not in CONSTANTS}
    local.update({"e": sympy.E, "i": sympy.I, "pi": sympy.pi, "oo": sympy.oo, "Abs": sympy.Abs,
                  "binomial": sympy.binomial, "factorial": sympy.factorial})
    for f in FUNCTIONS - {"Abs", "binomial", "factorial"}:
        local[f] = getattr(sympy, f)
    glob = {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
            "factorial": sympy.factorial, "__builtins__": {}}
    try:
        return parse_expr(text, local_dict=local, global_dict=glob,
                          transformations=standard_transformations + (implicit_multiplication_application,))
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression we can compare"
        return None


def _numerically_zero(expr, symbols) -> bool:
    """``expr`` is ~0 at 5 random points (seeded), with every point finite."""
    rng = random.Random(0)
    for _ in range(5):
        point = {s: rng.uniform(0.5, 2.5) for s in symbols}
        try:
            v = complex(expr.evalf(30, subs=point))
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            return False
        if v != v or abs(v) > 1e-9:
            return False
    return True


def _expr_equal(a, b) -> bool:
    import sympy

    try:
        diff = a - b
        if diff == 0 or sympy.simplify(diff) == 0:
            return True
        return bool(diff.free_symbols) and _numerically_zero(diff, sorted(diff.free_symbols, key=str))
    except Exception:  # noqa: BLE001 - sympy raises many kinds of errors on odd input
        return False


def sympy_equal(given: str, truth: str) -> bool:
    """Rule 5 on two normalised answers (expressions, or equations ``lhs = rhs``)."""
    import sympy

    if given.count("=") != truth.count("=") or given.count("=") > 1:
        return False
    texts = [latex_to_sympy_text(x) for x in (given, truth)]
    if None in texts:
        return False
    if "=" in given:
        sides = [[to_sympy(p) for p in t.split("=")] for t in texts]
        if any(x is None for pair in sides for x in pair):
            return False
        da, db = sides[0][0] - sides[0][1], sides[1][0] - sides[1][1]
        try:
            ratio = sympy.simplify(da / db)
        except Exception:  # noqa: BLE001
            return False
        return ratio.is_number and ratio != 0 and ratio.is_finite is True
    a, b = to_sympy(texts[0]), to_sympy(texts[1])
    return a is not None and b is not None and _expr_equal(a, b)


# ----------------------------------------------------------------------------- math-verify


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def set_math_verify(enabled: bool) -> None:
    """Turn rule 6 on (the default, where math-verify is installed) or off."""
    global _use_math_verify
    _use_math_verify = bool(enabled)


def math_verify_equal(given: str, truth: str) -> bool:
    """math-verify's ``verify(parse(truth), parse(given))`` on ``$...$``-wrapped strings. Its time
    limits use SIGALRM, which works only in the main thread: elsewhere (reward functions run in
    worker threads) they are off."""
    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None

    def wrap(x: str) -> str:
        return x if "$" in x or "\\boxed" in x else f"${x}$"

    try:
        gold = parse(wrap(truth), parsing_timeout=limit)
        pred = parse(wrap(given), parsing_timeout=limit)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - a failure to parse is "not equal"
        return False


# ----------------------------------------------------------------------------- grading


def _numbers_equal(a: str, b: str) -> bool | None:
    """Rule 3: None when either is not a number."""
    na, nb = parse_number(a), parse_number(b)
    if na is None or nb is None:
        return None
    if na == nb:
        return True
    pa, pb = percent_value(a), percent_value(b)
    if (pa is None) == (pb is None):  # both percentages or neither: 10% != 0.1%
        return False
    return pa == nb if pa is not None else pb == na


def _match_unordered(xs: list, ys: list) -> bool:
    left = list(ys)
    for x in xs:
        hit = next((k for k, y in enumerate(left) if _equal(x, y)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def _structures_equal(sa: Structure | None, sb: Structure | None) -> bool:
    if sa is None or sb is None or sa.kind != sb.kind or (sa.open, sa.close) != (sb.open, sb.close):
        return False
    if len(sa.elems) != len(sb.elems):
        return False
    if sa.kind == "matrix":
        return all(_structures_equal(ra, rb) for ra, rb in zip(sa.elems, sb.elems))
    if sa.kind in ("set", "list", "union"):
        return _match_unordered(sa.elems, sb.elems)
    return all(_equal(x, y) for x, y in zip(sa.elems, sb.elems))


def _equal(given: str, truth: str) -> bool:
    """Rules 2-5 on (possibly not yet normalised) answer strings."""
    a, b = normalize_answer(given), normalize_answer(truth)
    if not b or not a:
        return False
    if a == b:
        return True
    num = _numbers_equal(a, b)
    if num is not None:
        return num
    sa, sb = split_structure(a), split_structure(b)
    if sa is not None or sb is not None:
        return _structures_equal(sa, sb)
    if sympy_equal(a.rstrip("%"), b.rstrip("%")):
        return True
    if "=" in given and "=" in truth:  # "y = 2x + 1" vs "2x + 1 = y": compare as equations
        return sympy_equal(normalize_answer(given, strip_lhs=False), normalize_answer(truth, strip_lhs=False))
    return False


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """True when ``given_answer`` (already extracted, e.g. by ``extract_boxed_answer``) is
    mathematically equal to ``ground_truth``; the rules are in the module docstring."""
    if given_answer is None or ground_truth is None:
        return False
    given, truth = str(given_answer), str(ground_truth)
    if not truth.strip() or not given.strip():
        return False
    if _equal(given, truth):
        return True
    if any(_too_costly(x.replace("^", "**").replace("{", "(").replace("}", ")")) for x in (given, truth)):
        return False  # math-verify has no time limit in worker threads: keep towers away from it
    return _use_math_verify and math_verify_available() and math_verify_equal(given, truth)


__all__ = ["extract_boxed_answer", "grade_answer", "last_boxed_only_string", "remove_boxed", "normalize_answer",
           "parse_number", "sympy_equal", "math_verify_equal", "math_verify_available", "set_math_verify"]
