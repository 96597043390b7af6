"""Two source trees' model-only step side by side on one GPU: eager and compiled, in one call.

    python -m benchmarks.compare_commits f2782d6 HEAD            # with git: exports both
    python -m benchmarks.compare_commits --tree .bisect/f2782d6 --tree .   # trees at hand
    python -m benchmarks.compare_commits f2782d6 HEAD --modes compiled --rounds 2 --json c.json
    python -m benchmarks.compare_commits --tree .bisect/f2782d6 --tree . \
        --tree .@train.compile_scope=blocks       # a tree again, with overrides of its own
    python -m benchmarks.compare_commits f2782d6 HEAD --device cpu --steps 2 --warmup 1 --set \
        model.backbone=iresnet18 model.width=0.125 train.batch_size=8 data.image_size=32 \
        data.channels_last=false train.compile_backend=aot_eager   # a try of the script on a CPU

What the GPU check's `model only` rows measure (benchmarks/gpu_throughput.py: IResNet-50,
112 px, batch 256, O1 bf16, channels-last, 512 classes, 20 timed steps after 5), each tree
measured by its own code (`benchmarks.train_throughput.measure_model` of that tree) in a
process of its own, with an empty Inductor cache of its own (a compile from cold, as on a
fresh machine), the trees alternating (A B, then B A in the next round) so that the
machine's drift falls on both. Each measurement also records the host's speed (a tiny CPU
operation's cost, as gpu_check's machine line does), the compiler's counters (graph breaks,
graphs, recompilations) and the kernel head.kernel=auto chose, so a difference can be told
apart: the code's, the compiler's, or the host's. It prints one table (images/s, ms per
step, first steps, and each tree's ratio to the first tree's) and with --json writes every
measurement.

Commits need git (each is exported with `git archive` into a temporary folder). On a
machine without the repository's .git (a GPU loan gets the working tree only), export them
beforehand into the tree, where they travel with it, and pass the folders:

    git archive f2782d6 --prefix=.bisect/f2782d6/ | tar -x     # in the repository root
    python -m benchmarks.compare_commits --tree .bisect/f2782d6 --tree .

Time: about 10 s per eager measurement and 50-80 s per compiled one on an H200 (the
compile); two trees, both modes, one round: about 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# The GPU check's model-only rows (benchmarks/gpu_throughput.py, throughput_plan, not smoke).
CONFIG = "ms1m_arcface"
OVERRIDES = ("model.backbone=iresnet50", "train.batch_size=256", "data.image_size=112",
             "data.channels_last=true", "precision.level=O1", "precision.dtype=bf16",
             "eval.targets=[]", "eval.at_end=false")  # fmt: skip
CLASSES, STEPS, WARMUP = 512, 20, 5

# Run in a tree, by that tree's code: one measurement, printed as the last line (JSON).
CHILD = """
import json, logging, statistics, sys, time
import torch
compiled, device = sys.argv[1] == "compiled", sys.argv[2]
classes, steps, warmup = map(int, sys.argv[3:6])
overrides = sys.argv[6:]
from benchmarks.train_throughput import measure_model
from recognition.config import load_config
chosen = []
class Choice(logging.Handler):
    def emit(self, record):
        if "head.kernel=auto" in record.getMessage():
            chosen.append(record.getMessage())
logging.getLogger("recognition").addHandler(Choice())
logging.getLogger("recognition").setLevel(logging.INFO)
x, rounds = torch.zeros(4), []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(2000):
        torch.add(x, 1.0)
    rounds.append((time.perf_counter() - start) / 2000 * 1e6)
cfg = load_config("{config}", [*overrides, f"train.device={{device}}",
                               f"train.compile={{str(compiled).lower()}}"])
result = measure_model(cfg, torch.device(device), classes, steps, warmup)
from torch._dynamo.utils import counters
result.update(
    host_dispatch_us=statistics.median(rounds),
    graph_breaks=sum(counters["graph_break"].values()),
    unique_graphs=counters["stats"]["unique_graphs"],
    recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
    head_choice=chosen[0] if chosen else None,
)
print(json.dumps(result, default=str))
"""


def export(commit: str, into: Path) -> Path:
    """`commit` of this repository as a folder under `into` (git archive)."""
    folder = into / commit.replace("/", "_")
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=REPO_ROOT, capture_output=True,
                             check=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def parse_tree(spec: str) -> tuple[Path, list[str]]:
    """A --tree argument, `PATH` or `PATH@KEY=VALUE,KEY=VALUE`: the folder and the overrides
    that this tree's measurements add after the others (a setting the other trees lack)."""
    path, _, extra = spec.partition("@")
    overrides = [item for item in extra.split(",") if item]
    if any("=" not in item for item in overrides):
        raise ValueError(f"--tree {spec}: the overrides after @ are KEY=VALUE, comma-separated")
    return Path(path), overrides


def measure(tree: Path, mode: str, args: argparse.Namespace, scratch: Path,
            extra: list[str] = ()) -> dict[str, Any]:  # fmt: skip
    """One measurement of `tree`'s step in `mode` (eager, compiled) in a fresh process, with
    the overrides `extra` after the check's and --set's."""
    cache = Path(tempfile.mkdtemp(prefix="inductor_", dir=scratch))  # a cold compile
    env = dict(os.environ, PYTHONPATH=str(tree), TORCHINDUCTOR_CACHE_DIR=str(cache))
    command = [sys.executable, "-c", CHILD.format(config=CONFIG), mode, args.device,
               str(CLASSES), str(args.steps), str(args.warmup),
               *OVERRIDES, *args.set, *extra]  # fmt: skip
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary_rows(runs: list[dict[str, Any]], names: list[str], modes: list[str]) -> list[list]:
    """Per tree and mode the medians over the rounds, and the ratio to the first tree."""
    rows, first = [], {}
    for mode in modes:
        for name in names:
            mine = [r for r in runs if r["tree"] == name and r["mode"] == mode and "error" not in r]
            if not mine:
                errors = [r["error"] for r in runs if r["tree"] == name and r["mode"] == mode]
                rows.append([name, mode, "-", "-", "-", "-", "-", errors[0] if errors else ""])
                continue
            rate = statistics.median(r["images_per_s"] for r in mine)
            first.setdefault(mode, rate)
            rows.append([
                name, mode, f"{rate:,.0f}", f"x{rate / first[mode]:.3f}",
                f"{statistics.median(r['step_ms'] for r in mine):.1f}",
                f"{statistics.median(r['warmup_s'] for r in mine):.1f}",
                f"{statistics.median(r['host_dispatch_us'] for r in mine):.2f}",
                f"breaks {mine[0]['graph_breaks']}, graphs {mine[0]['unique_graphs']}, "
                f"recompiles {mine[0]['recompiles']}; {mine[0]['head_choice'] or ''}",
            ])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs="*", help="commits of this repository (needs git)")
    parser.add_argument("--tree", action="append", default=[],
                        help="a source tree: PATH, or PATH@KEY=VALUE,... with its own "
                        "overrides")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"],
                        default=["eager", "compiled"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overrides after the GPU check's (a CPU try: a tiny model)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if len(args.commits) + len(args.tree) < 2:
        parser.error("give two commits or trees (or more) to compare")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compare_commits_") as scratch_name:
        scratch = Path(scratch_name)
        trees = {c: (export(c, scratch / "trees"), []) for c in args.commits}
        for spec in args.tree:
            try:
                path, extra = parse_tree(spec)
            except ValueError as exc:
                parser.error(str(exc))
            trees[spec] = (path.resolve(), extra)
        names = list(trees)
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                for mode in args.modes:
                    path, extra = trees[name]
                    result = measure(path, mode, args, scratch, extra)
                    runs.append({"tree": name, "mode": mode, "round": round_index, **result})
                    print(json.dumps(runs[-1], default=str), file=sys.stderr, flush=True)
    header = ["tree", "mode", "images/s", "x first", "ms/step", "first steps s", "host us",
              "compiler; head"]  # fmt: skip
    table = [header, *summary_rows(runs, names, args.modes)]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print(
            "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
