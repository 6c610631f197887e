"""Answer strings of math problems: ``\\boxed{}`` extraction and LaTeX normalisation.

Used by ``math_utils.grade_answer``; every function is pure string work (no sympy).

    extract_boxed_answer("... so \\boxed{\\frac{1}{2}}.")  -> "\\frac{1}{2}"
    normalize_answer("x = \\dfrac{1}{2}\\text{ cm}")       -> "\\frac{1}{2}"
    parse_number("1,000") -> Fraction(1000); parse_number("\\frac{3}{4}") -> Fraction(3, 4)
    split_structure("(1, 2]") -> Structure("interval", "(", "]", ["1", "2"])

Braces are matched with LaTeX escapes in mind: ``\\{`` and ``\\}`` are literal braces (set
notation) and do not open or close a group, so ``\\boxed{\\{1, 2\\}}`` gives ``\\{1, 2\\}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

BOXED_COMMANDS = ("\\boxed", "\\fbox")
TEXT_COMMANDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "operatorname")
# single letters (m, s, g) are left out: "2m" is more often 2 times m than two metres
UNIT_WORDS = (
    "units?", "square", "sq", "cubic", "degrees?", "radians?", "cm", "centimeters?", "mm", "millimeters?",
    "km", "kilometers?", "meters?", "metres?", "inch(?:es)?", "feet", "foot", "ft", "yards?", "miles?",
    "mph", "seconds?", "sec", "minutes?", "min", "hours?", "hrs?", "days?", "weeks?", "months?", "years?",
    "dollars?", "cents?", "pounds?", "lbs?", "ounces?", "oz", "grams?", "kg", "kilograms?", "liters?",
    "litres?", "ml", "gallons?", "people", "students?", "ways", "points?",
)
_UNIT_TAIL = re.compile(r"(?<=[\d}).\s])\s*(?:" + "|".join(UNIT_WORDS) + r")(?:\^\{?[23]\}?|\u00b2|\u00b3)?\.?\s*$")
_SCALE_WORDS = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"


# ----------------------------------------------------------------------------- braces and \boxed


def matching_brace(s: str, open_idx: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (``\\{``, ``\\}`` are literals); None if unbalanced."""
    depth, i = 0, open_idx
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``) of ``text``, command included."""
    idx = max(text.rfind(cmd) for cmd in BOXED_COMMANDS)
    if idx < 0:
        return None
    cmd = next(c for c in BOXED_COMMANDS if text.startswith(c, idx))
    rest = idx + len(cmd)
    j = rest
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        end = matching_brace(text, j)
        return None if end is None else text[idx:end + 1]
    m = re.match(r"\s+([^\s$]+)", text[rest:])  # "\boxed 5$"
    return f"{cmd} {m.group(1)}" if m and j > rest else None


def remove_boxed(s: str) -> str | None:
    """``\\boxed{X}`` / ``\\fbox{X}`` / ``\\boxed X`` -> ``X``; None when ``s`` is not one of these."""
    for cmd in BOXED_COMMANDS:
        if not s.startswith(cmd):
            continue
        body = s[len(cmd):]
        stripped = body.lstrip(" ")
        if stripped.startswith("{") and matching_brace(stripped, 0) == len(stripped) - 1:
            return stripped[1:-1]
        if body.startswith(" ") and stripped:
            return stripped
    return None


def extract_boxed_answer(solution: str) -> str | None:
    """The content of the last ``\\boxed{}`` (or ``\\fbox{}``) of ``solution``, nested braces
    kept; None when there is none or its braces do not close (OpenRLHF's ``extract_boxed_answer``)."""
    if not isinstance(solution, str):
        return None
    boxed = last_boxed_only_string(solution)
    return None if boxed is None else remove_boxed(boxed)


# ----------------------------------------------------------------------------- normalisation


def _unwrap_commands(s: str, names: tuple[str, ...], keep: bool = True) -> str:
    """``\\name{X}`` -> ``X`` (or removed when ``keep`` is False), brace-matched, for every name."""
    pattern = re.compile(r"\\(" + "|".join(names) + r")\s*\{")
    while True:
        m = pattern.search(s)
        if m is None:
            return s
        end = matching_brace(s, m.end() - 1)
        if end is None:
            return s
        inner = s[m.end():end] if keep else ""
        s = s[:m.start()] + inner + s[end + 1:]


def _drop_trailing_text(s: str) -> str:
    """``5\\text{ cm}`` -> ``5``: a text group at the end of an answer that has something before it is
    a unit; ``\\text{ million}`` and friends scale the number instead."""
    m = re.search(r"\\(?:" + "|".join(TEXT_COMMANDS) + r")\s*\{([^{}]*)\}\s*$", s)
    if m is None or not s[:m.start()].strip():
        return s
    word = m.group(1).strip().lower()
    head = s[:m.start()].rstrip()
    if word in _SCALE_WORDS:
        return f"{head}\\times10^{{{_SCALE_WORDS[word]}}}"
    return head


def _squeeze_spaces(s: str) -> str:
    """Remove whitespace, except one space that ends a command before a letter (``\\pi r``)."""
    out = []
    for m in re.finditer(r"\\[A-Za-z]+|\\.|\s+|[^\\\s]+", s):
        tok = m.group(0)
        if tok.isspace():
            prev = out[-1] if out else ""
            nxt = s[m.end():m.end() + 1]
            if re.fullmatch(r"\\[A-Za-z]+", prev) and nxt.isalpha():
                out.append(" ")
            continue
        out.append(tok)
    return "".join(out)


def _fix_shorthand(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{x}`` -> ``\\frac{1}{x}``, ``\\sqrt2`` -> ``\\sqrt{2}``."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*([0-9A-Za-z])\s*(?=\{)", r"\\frac{\1}", s)
    s = re.sub(r"\\frac(\{[^{}]*\})\s*([0-9A-Za-z])", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)


_REPLACE = [
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"), ("{,}", ","), ("\\!", ""),
    ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\quad", " "), ("\\qquad", " "), ("~", " "),
    ("\\displaystyle", ""), ("\\$", ""), ("$", ""), ("\\%", "%"), ("\u2212", "-"), ("\\infinity", "\\infty"),
    ("\\le ", "\\leq "), ("\\ge ", "\\geq "), ("\\emptyset", "\\varnothing"),
]
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\u00b0|\\degree")
_DELIMS = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|big|Big|bigg|Bigg)(?![A-Za-z])\s*\.?")
_SIMPLE_LHS = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*=(?!=)")


def normalize_answer(answer: str, strip_lhs: bool = True) -> str:
    """A canonical form of an answer string for comparison (no arithmetic happens here).

    Removes: math delimiters (``$``, ``\\(``), ``\\left``/``\\right``, spacing commands, degree
    signs, ``\\$``, a trailing unit (``\\text{ cm}`` or a unit word after a number), a simple
    left-hand side (``x =``; unless ``strip_lhs`` is False), thousands commas of a single number,
    a trailing period, outer braces.
    Rewrites: ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, ``\\text{X}`` -> X,
    ``(A)`` -> ``A``, plain words to lower case. ``%`` is kept (``parse_number`` reads it).
    """
    s = str(answer).strip()
    while True:
        inner = remove_boxed(s)
        if inner is None:
            break
        s = inner.strip()
    s = s.replace("\n", " ")
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s).strip()
    s = re.sub(r"(?<!\\)\\ ", " ", s)  # a control space, not the end of a "\\\\" row break
    for old, new in _REPLACE:
        s = s.replace(old, new)
    s = _DELIMS.sub("", s)
    s = _DEGREES.sub("", s)
    s = _drop_trailing_text(s.strip())
    s = _unwrap_commands(s, TEXT_COMMANDS)
    s = s.strip().rstrip(".").strip()
    for _ in range(3):  # "5 square feet"
        s2 = _UNIT_TAIL.sub("", s).strip()
        if s2 == s or not s2:
            break
        s = s2
    if strip_lhs and s.count("=") == 1 and _SIMPLE_LHS.match(s) and s.split("=", 1)[1].strip():
        s = s.split("=", 1)[1]
    s = _squeeze_spaces(s.strip())
    s = _fix_shorthand(s)
    while s.startswith("{") and matching_brace(s, 0) == len(s) - 1:
        s = s[1:-1]
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?", s):
        s = s.replace(",", "")
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    m = re.fullmatch(r"\(([A-Za-z])\)", s)
    if m:
        s = m.group(1)
    if re.fullmatch(r"[A-Za-z]{2,}(?:[A-Za-z' -]*)", s):
        s = s.lower()
    return s.rstrip(".")


# ----------------------------------------------------------------------------- numbers


def _fraction(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(s: str) -> Fraction | None:
    """An exact rational for a normalised number: ``-12``, ``0.25``, ``.5``, ``1/3``, ``\\frac{3}{4}``,
    ``-\\frac{3}{4}``, ``\\frac{-3}{4}``, mixed ``2\\frac{1}{4}`` (= 9/4), ``1.5\\times10^{3}``,
    ``2e-3``; None for anything else. A trailing ``%`` is dropped (50% -> 50; see ``percent_value``)."""
    s = s.replace(" ", "").rstrip("%")
    sign = -1 if s.startswith("-") else 1
    body = s[1:] if s[:1] in "+-" else s
    if re.fullmatch(NUMBER, body):
        return sign * Fraction(body)
    if re.fullmatch(NUMBER + r"[eE][+-]?\d{1,3}", body):
        return sign * Fraction(body)
    m = re.fullmatch(rf"(-?{NUMBER})/(-?{NUMBER})", body) or \
        re.fullmatch(rf"\\frac\{{(-?{NUMBER})\}}\{{(-?{NUMBER})\}}", body)
    if m:
        num, den = Fraction(m.group(1)), Fraction(m.group(2))
        return None if den == 0 else sign * num / den
    m = re.fullmatch(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}", body)
    if m and int(m.group(3)) != 0:
        return sign * (int(m.group(1)) + Fraction(int(m.group(2)), int(m.group(3))))
    m = re.fullmatch(rf"({NUMBER})(?:\\times|\\cdot|\*)10\^\{{?([+-]?\d{{1,3}})\}}?", body)
    if m:
        return sign * Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
    return None


def percent_value(s: str) -> Fraction | None:
    """``50%`` -> 1/2 (the percentage as a fraction); None when ``s`` is not a number with ``%``."""
    if not s.endswith("%"):
        return None
    n = parse_number(s)
    return None if n is None else n / 100


# ----------------------------------------------------------------------------- tuples, intervals, sets


@dataclass
class Structure:
    """A compound answer: ``kind`` is tuple, interval, set, list, union or matrix; ``elems`` are
    element strings (for a matrix, one ``Structure("list", ...)`` per row)."""

    kind: str
    open: str
    close: str
    elems: list


def split_top_level(s: str, sep: str) -> list[str]:
    """Split on ``sep`` outside (), [], {} and ``\\{ \\}`` groups."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _encloses(s: str, open_len: int, close_len: int) -> bool:
    """True when the opening bracket of ``s`` is closed only by its last bracket."""
    depth = 0
    for i in range(len(s) - close_len):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and i >= open_len - 1:
                return False
    return True


_MATRIX = re.compile(r"^\\begin\{([pbBvV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}$", re.S)


def split_structure(s: str) -> Structure | None:
    """The compound shape of a normalised answer, or None for a single value."""
    m = _MATRIX.match(s)
    if m:
        rows = [r for r in (x.strip() for x in m.group(2).split("\\\\")) if r]
        return Structure("matrix", "[", "]", [Structure("list", "", "", [c.strip() for c in r.split("&")])
                                               for r in rows])
    union = split_top_level(s, "\\cup")
    if len(union) > 1:
        return Structure("union", "", "", union)
    if s.startswith("\\{") and s.endswith("\\}") and _encloses(s.replace("\\{", "{").replace("\\}", "}"), 1, 1):
        return Structure("set", "{", "}", split_top_level(s[2:-2], ","))
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and _encloses(s, 1, 1):
        elems = split_top_level(s[1:-1], ",")
        if len(elems) > 1:
            kind = "tuple" if (s[0], s[-1]) in (("(", ")"), ("[", "]")) else "interval"
            return Structure(kind, s[0], s[-1], elems)
    elems = split_top_level(s, ",")
    if len(elems) > 1 and all(elems):
        return Structure("list", "", "", elems)
    return None
