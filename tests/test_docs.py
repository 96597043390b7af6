"""The README and docs/ cannot rot: the README fits on a screen, keeps the quick start CI
runs and links every page; every local link, repository path and module named resolves; and
every `train.py` / `evaluate.py` command line they print parses.

A command line is one in a fenced code block, or an inline code span that starts a command
(`python train.py ...`, `torchrun ... train.py ...`, `python evaluate.py ...`). For train.py
each `key=value` override must name a real config key (the dataclasses of
`recognition.config`, walked by field), `--config NAME` a file under configs/, and every
other flag one that train.py's own parser knows; for evaluate.py every flag one that its
parser knows. Lines in code blocks are also parsed by those parsers, so a flag given no value
or a value of the wrong type fails too. Placeholders (`CKPT`, `path/to/...`, `$VAR`) are
taken as values, never as keys or flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import shlex
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest

import evaluate
import train
from recognition.config import ExperimentConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECTION = re.compile(r"\s\d*(>>?|<)(&\d+|\s*[^\s;&|]+)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # CKPT, NAME_OR_PATH, X
PYTHONS = ("python", "python3", "python3.11", "python3.12")
SCRIPTS = ("train.py", "evaluate.py")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The page without its fenced code blocks (a `# comment` in one is not a heading)."""
    return FENCE.sub("", text)


# ----------------------------------------------------------------------------- the pages


def test_readme_fits_on_a_screen_and_links_every_page():
    text = README.read_text()
    num_lines = len(text.splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines"
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall(prose(text))}
    unlinked = [page_id(page) for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not unlinked, f"README.md links no {unlinked}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=page_id)
def test_every_page_says_what_it_holds_and_links_back(page: Path):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), f"{page_id(page)}: starts with its title"
    assert lines[1] == "" and lines[2], f"{page_id(page)}: a summary follows the title"
    targets = LINK.findall(prose(page.read_text()))
    assert "../README.md" in targets, f"{page_id(page)} does not link back to the README"


QUICK_START = (
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt"
    " && python train.py && python evaluate.py",
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt"
    " && python -m pytest",
)


def test_the_quick_start_is_what_ci_runs():
    """The README's two quick-start commands, each on a line of its own, and CI's
    `.ci/run` installing and testing as the second one says."""
    lines = README.read_text().splitlines()
    for command in QUICK_START:
        assert command in lines, f"README.md lost its quick start: {command}"
    ci = (ROOT / ".ci" / "run").read_text()
    install, _, test = QUICK_START[1].rpartition(" && ")
    assert install in ci and f"\n{test}\n" in ci, ".ci/run no longer runs the quick start"


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(heading) for heading in HEADING.findall(prose(path.read_text()))}


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_local_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page_id(page)}: {broken}"


REPO_PATH = re.compile(r"^(recognition|benchmarks|tests|configs|\.ci)/[^<>*]*$")
MODULE = re.compile(r"^(recognition|benchmarks)(\.[A-Za-z_]\w*)+$")


def naming_error(name: str) -> str | None:
    """Why `name` (a repository path, or a dotted module or a module's name) names nothing
    in the repository; None when it names something."""
    if REPO_PATH.match(name):
        return None if (ROOT / name).exists() else "no such file or folder"
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        for source in (Path(*parts[:end]).with_suffix(".py"), Path(*parts[:end], "__init__.py")):
            if (ROOT / source).is_file():
                rest = parts[end:]
                if not rest:
                    return None
                defined = rf"^(def |class )?{rest[0]}\b|^from .* import .*\b{rest[0]}\b"
                found = len(rest) == 1 and re.search(defined, (ROOT / source).read_text(), re.M)
                return None if found else f"{source} defines no {'.'.join(rest)}"
    return "no such module"


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_named_files_and_modules_exist(page: Path):
    """Every repository path (`recognition/heads/tiles.py`) and dotted module name
    (`recognition.optim.fused_is_sound`) the page names in code exists; what runs create
    (`data/synthetic/`, `runs/`) and placeholders (`gpu-<device>.json`) are not checked."""
    wrong = []
    for span in INLINE_CODE.findall(prose(page.read_text())):
        for word in span.split():
            name = word.strip("(),;:")
            if REPO_PATH.match(name) or MODULE.match(name):
                if (error := naming_error(name)) is not None:
                    wrong.append(f"{name}: {error}")
    assert not wrong, f"{page_id(page)}: {wrong}"


# ---------------------------------------------------------------------- the command lines


def captured_parser(call: Callable[[], object]) -> argparse.ArgumentParser:
    """The parser that `call` builds, as it builds it, taken when it starts parsing (which
    then does not happen): train.py's is made inside its main()."""

    class Captured(Exception):
        pass

    def capture(parser: argparse.ArgumentParser, *args, **kwargs):
        raise Captured(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            call()
        except Captured as captured:
            return captured.args[0]
    raise AssertionError(f"{call} parsed no arguments")


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {
        "train.py": captured_parser(lambda: train.main([])),
        "evaluate.py": captured_parser(lambda: evaluate.parse_args([])),
    }


def logical_lines(block: str) -> Iterator[str]:
    """The block's lines with their continuations (`\\` at the end) joined."""
    pending = ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line (split at `&&`, `||`, `;`, `|`), as words, without
    comments, redirections (`> log`, `2>&1`) and leading `VAR=value` assignments."""
    line = REDIRECTION.sub(" ", line)
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote: not a shell line
        return
    command: list[str] = []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|"):
            if command:
                yield command
            command = []
        elif command or not ASSIGNMENT.match(word):
            command.append(word)


def script_arguments(command: list[str]) -> tuple[str, list[str]] | None:
    """(script, its arguments) when `command` runs train.py or evaluate.py; else None."""
    for i, word in enumerate(command):
        if word not in SCRIPTS:
            continue
        launched = i > 0 and command[i - 1] in PYTHONS
        torchrun = word == "train.py" and "torchrun" in command[:i]
        if launched or torchrun:
            return word, command[i + 1 :]
    return None


def command_lines(text: str) -> Iterator[tuple[str, bool]]:
    """(command line, whether it is in a code block) for every line of the page that may run
    train.py or evaluate.py."""
    for block in FENCE.findall(text):
        for line in logical_lines(block):
            yield line, True
    for span in INLINE_CODE.findall(prose(text)):
        if span.split(" ", 1)[0] in (*PYTHONS, "torchrun"):
            yield span.replace("[", " ").replace("]", " "), False


def config_key_error(key: str) -> str | None:
    """Why `key` (dotted) is not a config key, or None when it is one."""
    section: type | None = ExperimentConfig
    walked = []
    for name in key.split("."):
        if section is None:
            return f"{'.'.join(walked)} has no keys under it"
        fields = {field.name for field in dataclasses.fields(section)}
        if name not in fields:
            return f"{'.'.join([*walked, name])}: not a config key"
        section = dataclass_of(typing.get_type_hints(section)[name])
        walked.append(name)
    return None


def dataclass_of(hint: object) -> type | None:
    """The dataclass a field's type names (also inside `X | None`), or None."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [dataclass_of(arg) for arg in typing.get_args(hint)]
        return next((arg for arg in found if arg is not None), None)
    return None


def config_error(value: str) -> str | None:
    """Why `--config value` names no config, or None (also for a placeholder)."""
    if PLACEHOLDER.match(value) or value.startswith(("path/to/", "runs/", "$")):
        return None  # a name to fill in, or a run directory's config.yaml the run writes
    if "/" in value or value.endswith((".yaml", ".yml")):
        return None if (ROOT / value).is_file() else f"--config {value}: no such file"
    return None if (ROOT / "configs" / f"{value}.yaml").is_file() else f"no configs/{value}.yaml"


def argument_errors(
    script: str, arguments: list[str], parser: argparse.ArgumentParser, *, parse: bool
) -> list[str]:
    """What is wrong with `script arguments`: unknown flags, config keys, configs; with
    `parse`, also what the script's own parser refuses."""
    errors = []
    known = parser._option_string_actions  # every --flag, without abbreviations
    words = [word for word in arguments if word != "..."]
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word.startswith("-"):
            flag, has_value, value = word.partition("=")
            if flag not in known:
                errors.append(f"{flag}: {script} has no such flag")
                continue
            if not has_value:
                values = flag_values(known[flag].nargs, words[i:])
                value = words[i] if values else ""
                i += values
            if flag == "--config" and (error := config_error(value)) is not None:
                errors.append(error)
        elif script == "train.py" and "=" in word:
            if (error := config_key_error(word.split("=", 1)[0])) is not None:
                errors.append(error)
        elif script == "train.py" and parse:
            errors.append(f"{word!r}: train.py takes key=value overrides only")
    if parse and not errors:
        errors += parser_errors(script, parser, [SHELL_VAR.sub(r"\1", word) for word in words])
    return errors


def flag_values(nargs: int | str | None, rest: list[str]) -> int:
    """How many of the words after a flag are its values."""
    if nargs is None:  # one value, which is not another flag
        return 1 if rest and not rest[0].startswith("--") else 0
    if isinstance(nargs, int):
        return min(nargs, len(rest))
    count = 0  # "?", "*", "+": the words up to the next flag
    while count < len(rest) and not rest[count].startswith("-"):
        count += 1
        if nargs == "?":
            break
    return count


def parser_errors(script: str, parser: argparse.ArgumentParser, arguments: list[str]) -> list[str]:
    """What the script's parser says of `arguments`, parsed as the script parses them
    (argparse prints its error and exits)."""
    parse = parser.parse_intermixed_args if script == "train.py" else parser.parse_args
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse(arguments)
    except SystemExit:
        return [stderr.getvalue().strip().splitlines()[-1]]
    return []


def command_line_errors(text: str, parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Every error of the train.py and evaluate.py command lines that `text` prints."""
    errors = []
    for line, in_block in command_lines(text):
        for command in commands(line):
            found = script_arguments(command)
            if found is None:
                continue
            script, arguments = found
            for error in argument_errors(script, arguments, parsers[script], parse=in_block):
                errors.append(f"{line.strip()!r}: {error}")
    return errors


@pytest.mark.parametrize("page", pages(), ids=page_id)
def test_command_lines_parse(page: Path, parsers: dict[str, argparse.ArgumentParser]):
    errors = command_line_errors(page.read_text(), parsers)
    assert not errors, "\n".join(errors)


def test_the_pages_show_command_lines(parsers: dict[str, argparse.ArgumentParser]):
    """The parser above finds the command lines it is meant to check."""
    found = [
        script_arguments(command)
        for page in pages()
        for line, _ in command_lines(page.read_text())
        for command in commands(line)
    ]
    scripts = [script for script, _ in filter(None, found)]
    assert scripts.count("train.py") >= 20 and scripts.count("evaluate.py") >= 10, scripts


BROKEN = [
    "python train.py optim.lrr=0.1",
    "python train.py data.synthetic.nope=1",
    "python train.py head.margin.m=0.5",
    "python train.py --config no_such_config",
    "python train.py --config configs/no_such_config.yaml",
    "python train.py --plan --gpu 8",
    "python train.py --plan --gpus eight",
    "python train.py head.margin",
    "torchrun --standalone --nproc_per_node 8 train.py \\\n    trian.batch_size=64",
    "python3.11 -m venv .venv && python evaluate.py --checkpont x.pt",
    "python evaluate.py --checkpoint x.pt --ijb-name ijbd",
    "OMP_NUM_THREADS=1 python evaluate.py --bin  # no file given",
]


@pytest.mark.parametrize("line", BROKEN)
def test_a_broken_command_line_is_found(line: str, parsers: dict[str, argparse.ArgumentParser]):
    page = f"Text.\n\n```bash\n{line}\n```\n"
    assert command_line_errors(page, parsers), line


def test_placeholders_shell_syntax_and_real_keys_pass(parsers: dict[str, argparse.ArgumentParser]):
    page = """
```bash
python train.py --config ms1m_arcface data.root=$DATA output_dir="${RUNS}/x" 2>&1 | tee log
torchrun --nnodes "$N" --nproc_per_node 8 train.py --config=default \\
    eval.targets=[] data.synthetic.enabled=false train.resume=auto  # a comment
python evaluate.py --checkpoint CKPT --bin a.bin --bin b.bin --reid && echo done
python train.py --config path/to/exp.yaml model.pipeline_split=[layer2.0,layer3.0]
```
Inline: `python train.py --config X --plan --gpus W --gpu-memory G [--classes N]` and
`python evaluate.py --checkpoint CKPT --ijb ROOT --ijb-name ijbc [--ijb-mode 11|1n]`.
"""
    assert command_line_errors(page, parsers) == []


def test_lfw_photos_are_cropped_in_every_command_that_evaluates_them():
    # LFW's originals are 250x250 with the face in the middle: verified uncropped, the
    # background dominates the input and the numbers mean little.
    uncropped = [
        f"{page_id(page)}: {line.strip()}"
        for page in pages()
        for line in page.read_text().splitlines()
        if "evaluate.py" in line and "--images lfw" in line and "--crop" not in line
    ]
    assert not uncropped, uncropped
