"""A distilled run's parts (train.teacher, docs/distillation.md): the loss and its
projection, where the teacher's embeddings come from, and what the step adds.

- `Distillation` holds them: the loss (`FeatureDistillation`, its projection trained with
  the student and saved in the checkpoint as the part "distill"), the weight, and either
  the cached table of the teacher's embeddings (`TeacherTable`: the loader brings each
  sample's row beside its image) or the teacher itself, run at every step on the step's
  images (resized to its input size where it differs).
- `Student` is what DistributedDataParallel wraps: the backbone and the projection, so the
  projection's gradients are averaged over ranks like the backbone's. It returns the
  embeddings (for the head) and their projection (for the distillation loss).
- `DistillTerm` is the step's extra loss: `recognition.training.step.train_step` calls it
  with the projected embeddings, the micro-batch's images and what the loader brought
  beyond the labels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recognition.data.teacher_table import TeacherTable
from recognition.heads.distill import FeatureDistillation
from recognition.precision import Precision
from recognition.training.teacher import TeacherFile, build_teacher

log = logging.getLogger(__name__)


class Student(nn.Module):
    """The backbone with the distillation's projection: images -> (embeddings (B, D_s),
    their projection into the teacher's space (B, D_t))."""

    def __init__(self, backbone: nn.Module, distill: FeatureDistillation) -> None:
        super().__init__()
        self.backbone = backbone
        self.distill = distill

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.backbone(images)
        return embeddings, self.distill.project(embeddings)


@dataclass
class Distillation:
    """A distilled run's parts (see the module docstring)."""

    loss: FeatureDistillation
    weight: float
    teacher_file: TeacherFile
    table: TeacherTable | None = None
    """The cached embeddings; None: the teacher runs alongside."""
    teacher: nn.Module | None = None
    """The teacher (eval mode, frozen) when it runs alongside; None with a table."""

    @property
    def trained(self) -> list[nn.Module]:
        """The modules the optimizer steps besides the backbone and the head."""
        return [self.loss] if any(True for _ in self.loss.parameters()) else []

    def student(self, backbone: nn.Module, precision: Precision) -> Student:
        """`backbone` with the projection, which `precision` prepares here (after the
        backbone and the head: its O2 masters come after theirs)."""
        if self.trained:
            precision.prepare(self.loss)
        return Student(backbone, self.loss)

    def step_term(self) -> DistillTerm:
        """The step's distillation term."""
        return DistillTerm(self.loss, self.weight, self.teacher, self.teacher_file.image_hw)


class DistillTerm:
    """The distillation's part of a step's loss: `term(projected, images, brought)` is the
    unweighted loss of the micro-batch (a 0-dim tensor); `weight` multiplies it.

    `brought` is what the loader gave beyond the labels: [the teacher's embeddings (B, D_t)]
    with a table, [] when the teacher runs here (on `images`, under the step's autocast,
    without gradients, resized to its input size with antialiasing where it differs).
    """

    def __init__(
        self,
        loss: FeatureDistillation,
        weight: float,
        teacher: nn.Module | None,
        teacher_hw: tuple[int, int],
    ) -> None:
        self.loss = loss
        self.weight = weight
        self.teacher = teacher
        self.teacher_hw = teacher_hw

    def targets(self, images: torch.Tensor, brought: list[torch.Tensor]) -> torch.Tensor:
        """The teacher's embeddings of the micro-batch (B, D_t)."""
        if brought:
            return brought[0]
        if self.teacher is None:
            raise RuntimeError("distillation: no teacher embeddings in the batch and no teacher")
        if tuple(images.shape[-2:]) != self.teacher_hw:
            images = F.interpolate(
                images.float(), size=self.teacher_hw, mode="bilinear", antialias=True
            )
        with torch.no_grad():
            return self.teacher(images)

    def __call__(
        self, projected: torch.Tensor, images: torch.Tensor, brought: list[torch.Tensor]
    ) -> torch.Tensor:
        return self.loss(projected, self.targets(images, brought))


def make_distillation(
    teacher_file: TeacherFile,
    student_dim: int,
    weight: float,
    table: TeacherTable | None,
    device: torch.device,
    memory_format: torch.memory_format = torch.preserve_format,
    *,
    seed: int = 0,
) -> Distillation:
    """The run's `Distillation`: with `table` (cached embeddings) no teacher is built; else
    the teacher is built on `device` (`build_teacher`), in the images' `memory_format`.

    The projection is drawn from `seed` on a generator of its own: the run's random streams
    are left as they are, so the student starts from the weights it has without a teacher.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = FeatureDistillation(student_dim, teacher_file.embedding_size)
    if device.type != "cpu":  # (Module.to cannot convert the planner's fake parameters)
        loss = loss.to(device)
    teacher = None
    if table is None:
        teacher = build_teacher(teacher_file, device)
        if memory_format == torch.channels_last and not teacher_file.is_onnx:
            teacher = teacher.to(memory_format=memory_format)
    return Distillation(loss, weight, teacher_file, table=table, teacher=teacher)
