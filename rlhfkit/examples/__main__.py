"""`python -m rlhfkit.examples [--copy DIR]`: print the shipped example files' paths, or copy them."""

from __future__ import annotations

import argparse

from rlhfkit.examples import FILES, copy_to, path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rlhfkit.examples", description=__doc__)
    p.add_argument("--copy", metavar="DIR", default=None, help="copy the example files into DIR")
    args = p.parse_args(argv)
    if args.copy:
        for dst in copy_to(args.copy):
            print(dst)
        return
    for name, what in FILES.items():
        print(f"{path(name)}\t{what}")


if __name__ == "__main__":
    main()
