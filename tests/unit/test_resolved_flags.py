"""`rlhfkit.config.flag_parser.derive`: a copy of a parsed namespace that `set_explicitly`, `parsed_values` and
`set_as_given` answer for as they do for the parsed one."""

from __future__ import annotations

import argparse

from rlhfkit.config.flag_parser import FlagParser, derive, parsed_values, set_as_given, set_explicitly


def test_derive_registers_the_parsed_entry_for_the_copy():
    p = FlagParser("x")
    p.add_argument("--a", type=int, default=1)
    p.add_argument("--b", type=int, default=2)
    p.add_argument("--c", type=float, nargs=2, default=[0.5, 0.5])
    ns = p.parse(["--a", "5"], notes=False)
    new = derive(ns, argparse.Namespace)
    assert new is not ns and vars(new) == vars(ns)
    assert set_explicitly(new, "a") and not set_explicitly(new, "b")
    new.b = 7
    new.c.append(1.0)  # a list value is the copy's own
    assert parsed_values(new) == parsed_values(ns) == {"a": 5, "b": 2, "c": [0.5, 0.5], "config": None,
                                                       "log_level": "info", "verbose": False}
    assert (ns.b, ns.c) == (2, [0.5, 0.5])
    set_as_given(new, "b", 9)  # given on the copy: recorded for the copy only
    assert parsed_values(new)["b"] == 9 and parsed_values(ns)["b"] == 2
    plain = derive(argparse.Namespace(a=1), argparse.Namespace)  # not from parse: nothing known
    assert parsed_values(plain) is None and set_explicitly(plain, "a")
