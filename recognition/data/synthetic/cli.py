"""The command line that generates a synthetic data set alone
(`python -m recognition.data.synthetic --out DIR`, one `--<field>` per spec field)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from recognition.config.reference import field_docs, one_line
from recognition.config.synthetic import SyntheticSpec
from recognition.data.synthetic.generation import ensure_synthetic_dataset

# The --help description: the first line of the package's docstring.
DESCRIPTION = (
    "A built-in synthetic face data set, generated on first use, for the default run and tests."
)


PROG = "python -m recognition.data.synthetic"


def main(argv: list[str] | None = None) -> None:
    """Command line: generate a synthetic data set (`python -m recognition.data.synthetic`)."""
    args, spec = parse_spec_arguments(argv, prog=PROG, description=DESCRIPTION)
    start = time.perf_counter()
    ensure_synthetic_dataset(args.out, spec, num_workers=args.workers)
    print(f"ready in {time.perf_counter() - start:.1f} s: {args.out}")


def parse_spec_arguments(
    argv: list[str] | None, *, prog: str, description: str
) -> tuple[argparse.Namespace, SyntheticSpec]:
    """--out DIR, --workers N and one --<field> per SyntheticSpec field (its help the
    field's doc) for the command `prog` (its usage line) described by `description`; returns
    the arguments and the spec."""
    defaults = SyntheticSpec()
    docs = field_docs(SyntheticSpec)
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, required=True, help="directory to generate into")
    for field in dataclasses.fields(SyntheticSpec):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=int,
            metavar="N",
            default=getattr(defaults, field.name),
            help=f"{one_line(docs[field.name])} (default: %(default)s)",
        )
    parser.add_argument(
        "--workers", type=int, metavar="N", help="worker processes (default: a CPU each, at most 8)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = SyntheticSpec(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticSpec)}
    )
    return args, spec
