"""ShardedMarginSoftmax on W gloo processes against a single-process float64 reference.

One spawned group per world size (1 to 4) runs every case: spawning is the slow part. Each
rank builds the same full problem from one seed (class matrix, global batch), takes its
shard and its block of the batch, and checks what the head computed against a reference
written here independently: the full cosine matrix, psi from acos, F.cross_entropy in
float64. Mismatches are collected, not raised, so that the ranks stay in step through the
collectives; each rank writes its list to a JSON file that the test reads.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_head import MARGIN_CASES
from test_reid_losses import check_label_smoothing, check_triplet

from recognition import distributed
from recognition.heads import ShardedMarginSoftmax, shard_range
from recognition.heads.margins import CosFace

NUM_CLASSES = 23  # 23 % W != 0 for W = 2, 3, 4: uneven shards
EMBEDDING_SIZE = 8
LOCAL_BATCH = 3


# ---- reference ---------------------------------------------------------------------------


def reference(embeddings, weight, labels, scale, psi, columns=None):
    """Loss, d loss / d embeddings, d loss / d weight and accuracy, float64, full matrix.

    `columns` (sorted global class ids) restricts the softmax to those classes (partial FC).
    """
    embeddings = embeddings.detach().double().requires_grad_(True)
    weight = weight.detach().double().requires_grad_(True)
    norm_weight = F.normalize(weight, dim=1)
    if columns is not None:
        norm_weight = norm_weight[columns]
        labels = torch.searchsorted(columns, labels)
    cos = F.normalize(embeddings, dim=1) @ norm_weight.T  # (N, C)
    theta = torch.acos(cos.gather(1, labels[:, None]).squeeze(1))
    logits = cos.scatter(1, labels[:, None], psi(theta)[:, None]) * scale
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    accuracy = (logits.argmax(dim=1) == labels).double().mean()
    return loss.detach(), embeddings.grad, weight.grad, accuracy


def full_problem(world_size, scenario, dtype, seed):
    """The same (weight (C, D), embeddings (N, D), labels (N,)) on every rank."""
    generator = torch.Generator().manual_seed(seed)
    num_rows = LOCAL_BATCH * world_size
    weight = torch.randn(NUM_CLASSES, EMBEDDING_SIZE, generator=generator, dtype=torch.float64)
    embeddings = torch.randn(num_rows, EMBEDDING_SIZE, generator=generator, dtype=torch.float64)
    if scenario == "random":
        labels = torch.randint(0, NUM_CLASSES, (num_rows,), generator=generator)
        labels[1] = labels[num_rows - 1]  # a duplicate label across ranks' blocks
    elif scenario == "one_shard":  # every label in the last rank's shard, with duplicates
        start, count = shard_range(NUM_CLASSES, world_size, world_size - 1)
        labels = start + torch.randint(0, count, (num_rows,), generator=generator)
        labels[0] = labels[-1]
    elif scenario == "rank_owns_none":  # no label in rank 1's shard (rank 0's when W = 1)
        start, count = shard_range(NUM_CLASSES, world_size, min(1, world_size - 1))
        others = [c for c in range(NUM_CLASSES) if not start <= c < start + count]
        others = others or list(range(NUM_CLASSES))
        picks = torch.randint(0, len(others), (num_rows,), generator=generator)
        labels = torch.tensor(others)[picks]
    else:
        raise ValueError(scenario)
    return weight.to(dtype), embeddings.to(dtype), labels


# ---- worker ------------------------------------------------------------------------------


class Checker:
    """Collects mismatches instead of raising, so every rank runs every collective."""

    def __init__(self):
        self.failures: list[str] = []

    def close(self, name, actual, expected, rel):
        actual, expected = actual.detach().double(), expected.detach().double()
        if actual.shape != expected.shape:
            self.failures.append(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            return
        tolerance = rel * max(expected.abs().max().item(), 1e-30)
        error = (actual - expected).abs().max().item()
        if not error <= tolerance:
            self.failures.append(f"{name}: max error {error:.3g} > {tolerance:.3g}")

    def true(self, name, condition):
        if not condition:
            self.failures.append(name)


def gather_rows(local, world_size):
    """Concatenate every rank's (n_r, ...) tensor in rank order (n_r may differ by one)."""
    count = torch.tensor([local.shape[0]])
    counts = distributed.all_gather_tensor(count).tolist()
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = distributed.all_gather_tensor(padded).view(world_size, max(counts), -1)
    return torch.cat([gathered[r, : counts[r]] for r in range(world_size)])


def run_head(head, weight, embeddings, labels, rank, world_size):
    """Loss, gradient of the full weight and of the global embeddings (convention undone)."""
    with torch.no_grad():
        head.weight.copy_(weight[head.class_start : head.class_start + head.num_local])
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    local_embeddings = embeddings[rows].clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = head(local_embeddings, labels[rows])
    loss.backward()
    grad_weight = gather_rows(head.weight.grad, world_size)
    # The head hands each rank W x d loss / d(its embeddings) (for DDP's average).
    grad_embeddings = distributed.all_gather_tensor(local_embeddings.grad) / world_size
    return loss.detach(), grad_weight, grad_embeddings


def check_exact_cases(check, rank, world_size):
    scenarios = ["random", "one_shard", "rank_owns_none"]
    for dtype, rel, chunks in [
        (torch.float64, 1e-10, [None, 1, 3]),
        (torch.float32, 1e-5, [None, 3]),
    ]:
        for scenario_index, scenario in enumerate(scenarios):
            weight, embeddings, labels = full_problem(world_size, scenario, dtype, scenario_index)
            for margin_id, make_margin, scale, psi in MARGIN_CASES:
                ref_loss, ref_grad_e, ref_grad_w, ref_accuracy = reference(
                    embeddings, weight, labels, scale, psi
                )
                for chunk_size in chunks:
                    name = f"W={world_size} {dtype} {scenario} {margin_id} chunk={chunk_size}"
                    head = ShardedMarginSoftmax(
                        NUM_CLASSES, EMBEDDING_SIZE, make_margin(), chunk_size=chunk_size
                    ).to(dtype)
                    check.true(
                        f"{name}: shard", head.num_local == head.weight.shape[0]
                        and (head.class_start, head.num_local)
                        == shard_range(NUM_CLASSES, world_size, rank),
                    )  # fmt: skip
                    loss, grad_w, grad_e = run_head(
                        head, weight, embeddings, labels, rank, world_size
                    )
                    check.true(f"{name}: loss dtype {loss.dtype}", loss.dtype == dtype)
                    check.close(f"{name}: loss", loss, ref_loss, rel)
                    check.close(f"{name}: grad weight", grad_w, ref_grad_w, rel)
                    check.close(f"{name}: grad embeddings", grad_e, ref_grad_e, rel)
                    check.close(f"{name}: accuracy", head.last_accuracy, ref_accuracy, 1e-12)
                    # The same loss on every rank.
                    losses = distributed.all_gather_tensor(loss.reshape(1))
                    check.close(
                        f"{name}: loss across ranks", losses, loss.expand(world_size), 1e-13
                    )


def check_backbone_under_ddp(check, rank, world_size):
    # A linear "backbone" under DDP: after DDP's average, its gradient must be that of the
    # single-process model on the whole global batch.
    generator = torch.Generator().manual_seed(42)
    inputs = torch.randn(LOCAL_BATCH * world_size, 5, generator=generator, dtype=torch.float64)
    backbone_weight = torch.randn(EMBEDDING_SIZE, 5, generator=generator, dtype=torch.float64)
    weight, _, labels = full_problem(world_size, "random", torch.float64, seed=7)
    backbone = torch.nn.Linear(5, EMBEDDING_SIZE, bias=False).double()
    with torch.no_grad():
        backbone.weight.copy_(backbone_weight)
    # One DDP wrapper for every case: building one costs about a second.
    model = torch.nn.parallel.DistributedDataParallel(backbone)
    for chunk_size in (None, 2):
        name = f"W={world_size} DDP backbone chunk={chunk_size}"
        backbone.zero_grad(set_to_none=True)
        head = ShardedMarginSoftmax(
            NUM_CLASSES, EMBEDDING_SIZE, CosFace(s=16.0), chunk_size=chunk_size
        ).double()
        with torch.no_grad():
            head.weight.copy_(weight[head.class_start : head.class_start + head.num_local])
        rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        head(model(inputs[rows]), labels[rows]).backward()

        reference_backbone = backbone_weight.clone().requires_grad_(True)
        embeddings = inputs @ reference_backbone.T
        cos = F.normalize(embeddings, dim=1) @ F.normalize(weight, dim=1).T
        logits = 16.0 * (cos - 0.4 * F.one_hot(labels, NUM_CLASSES).double())
        F.cross_entropy(logits, labels).backward()
        check.close(name, backbone.weight.grad, reference_backbone.grad, 1e-10)


def check_partial_fc(check, rank, world_size):
    for margin_id, make_margin, scale, psi in MARGIN_CASES[:2]:
        for chunk_size in (None, 2):
            name = f"W={world_size} partial FC {margin_id} chunk={chunk_size}"
            weight, embeddings, labels = full_problem(world_size, "random", torch.float64, 11)
            head = ShardedMarginSoftmax(
                NUM_CLASSES, EMBEDDING_SIZE, make_margin(), sample_rate=0.3,
                chunk_size=chunk_size, seed=5,
            ).double()  # fmt: skip
            loss, grad_w, grad_e = run_head(head, weight, embeddings, labels, rank, world_size)
            local_index = head.sampled_index
            owned = labels[
                (labels >= head.class_start) & (labels < head.class_start + head.num_local)
            ]
            expected_count = max(owned.unique().numel(), head.num_sample)
            check.true(f"{name}: count", local_index.numel() == expected_count)
            columns = gather_rows((head.class_start + local_index)[:, None], world_size)[:, 0]
            check.true(f"{name}: positives kept", bool(torch.isin(labels, columns).all()))
            check.true(f"{name}: some classes left out", columns.numel() < NUM_CLASSES)
            ref_loss, ref_grad_e, ref_grad_w, _ = reference(
                embeddings, weight, labels, scale, psi, columns=columns
            )
            check.close(f"{name}: loss", loss, ref_loss, 1e-10)
            check.close(f"{name}: grad weight", grad_w, ref_grad_w, 1e-10)
            check.close(f"{name}: grad embeddings", grad_e, ref_grad_e, 1e-10)
            # The full-softmax loss differs: the test can tell the two apart.
            full_loss = reference(embeddings, weight, labels, scale, psi)[0]
            check.true(f"{name}: differs from full", abs(full_loss - ref_loss) > 1e-6)


def check_bad_inputs_raise_on_every_rank(check, rank, world_size):
    head = ShardedMarginSoftmax(NUM_CLASSES, EMBEDDING_SIZE, CosFace())
    cases = [
        # (name, local batch size, bad label on rank 0, expected text in the message)
        ("bad label on rank 0", LOCAL_BATCH, True, "label 99" if rank == 0 else "rank(s) [0]"),
        ("uneven batches", LOCAL_BATCH + rank, False, "same batch size"),
    ]
    for name, batch, bad_label, expected in cases:
        if world_size == 1 and not bad_label:
            continue
        labels = torch.zeros(batch, dtype=torch.int64)
        if bad_label and rank == 0:
            labels[0] = 99
        try:
            head(torch.randn(batch, EMBEDDING_SIZE), labels)
            check.true(f"W={world_size} {name}: no error", False)
        except ValueError as error:
            check.true(f"W={world_size} {name}: message {error}", expected in str(error))


def worker(rank, world_size, rendezvous, out_dir, checks):
    torch.set_num_threads(1)
    check = Checker()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        for run_check in checks:
            run_check(check, rank, world_size)
    except Exception:  # report, so the test shows the traceback rather than a bare exit code
        check.failures.append(traceback.format_exc())
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(check.failures))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # Skip the interpreter's teardown: with torch 2.14 + gloo it intermittently aborts
        # ("terminate called without an active exception") while destroying gloo's threads,
        # after every result has been written. The results files carry the verdict.
        os._exit(0)


def assert_checks_pass_on_ranks(world_size, tmp_path, checks):
    """Run each of `checks` (check, rank, world size) on `world_size` gloo ranks.

    Each call rendezvouses in a file of its own: the ranks leave with os._exit, so a file
    store's file outlives them, and a second group on the same file could read the first's
    addresses (a test calling this twice in one folder failed so, now and then: "Connection
    refused" from gloo's full mesh)."""
    folder = Path(tempfile.mkdtemp(prefix=f"w{world_size}-", dir=tmp_path))
    mp.spawn(
        worker,
        args=(world_size, str(folder / "rendezvous"), str(folder), checks),
        nprocs=world_size,
        join=True,
    )
    failures = []
    for rank in range(world_size):
        failures += [
            f"rank {rank}: {f}" for f in json.loads((folder / f"rank{rank}.json").read_text())
        ]
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures)"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_head_matches_single_process_reference(world_size, tmp_path):
    assert_checks_pass_on_ranks(
        world_size,
        tmp_path,
        (
            check_exact_cases,
            check_backbone_under_ddp,
            check_partial_fc,
            check_bad_inputs_raise_on_every_rank,
            check_label_smoothing,
            check_triplet,
        ),
    )
