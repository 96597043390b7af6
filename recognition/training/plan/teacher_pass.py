"""What train.teacher adds to a plan: the distillation's parts in the step, and the pass that
caches the teacher's embeddings before step 1.

- In the step (`planned_distillation`): the projection (its weights, masters, optimizer
  state and gradients, counted with the model's), and either the teacher's cached
  embeddings in the batch (B x D_t float16) or, when the teacher runs alongside, the
  teacher itself: its fp32 weights and its forward under no_grad, at its own input size.
- Before step 1, with a cache (`plan_teacher_pass`): the teacher's fp32 weights and one
  batch of its inputs through it under no_grad and the run's autocast; the student is not
  built yet then.

The teacher is built from its file's model config (`teacher_outline`: no weights read into
the plan, no SHA-256). An ONNX teacher runs in onnxruntime, outside torch's allocator: its
memory is not planned (the step is planned with its embeddings in the batch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recognition.config import ExperimentConfig
from recognition.data.teacher_table import cached_views
from recognition.heads.distill import FeatureDistillation
from recognition.precision import Precision
from recognition.tensor_memory import TensorMemory
from recognition.training.distill import Distillation
from recognition.training.teacher import TeacherFile, build_teacher, teacher_outline


def is_cached(cfg: ExperimentConfig) -> bool:
    """Whether the run caches its teacher's embeddings (train.teacher_cache, the views)."""
    return cfg.train.teacher_cache and cached_views(cfg.data) is not None


def planned_distillation(cfg: ExperimentConfig, outline: TeacherFile | None) -> Distillation | None:
    """The run's `Distillation` built on the ambient device and tensor mode from `outline`
    (`teacher_outline`, read before the fake tensors), the teacher (when it runs alongside
    and is not ONNX) without weights; None without train.teacher."""
    if outline is None:
        return None
    loss = FeatureDistillation(cfg.model.embedding_size, outline.embedding_size)
    teacher = None
    if not is_cached(cfg) and not outline.is_onnx:
        teacher = build_teacher(outline, torch.device("cpu"))
    return Distillation(loss, cfg.train.distill_weight, outline, teacher=teacher)


def fake_targets(cfg: ExperimentConfig, distill: Distillation | None) -> list[torch.Tensor]:
    """What the loader brings beyond the labels: the cached embeddings (B, D_t) float16 when
    the step does not run the teacher, else nothing."""
    if distill is None or distill.teacher is not None:
        return []
    dim = distill.teacher_file.embedding_size
    return [torch.empty(cfg.train.batch_size, dim, dtype=torch.float16)]


def plan_teacher_pass(cfg: ExperimentConfig, *, granularity: int) -> int:
    """Peak bytes of the pass that caches the teacher's embeddings (0 without one, or with
    an ONNX teacher)."""
    if cfg.train.teacher is None or not is_cached(cfg):
        return 0
    outline = teacher_outline(cfg.train.teacher)
    if outline.is_onnx:
        return 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    memory = TensorMemory(granularity=granularity)
    precision = Precision(cfg.precision.level, cfg.precision.dtype, torch.device("cpu"))
    with FakeTensorMode(), memory, torch.no_grad():
        teacher = build_teacher(outline, torch.device("cpu"))
        images = torch.empty(cfg.train.batch_size, 3, *outline.image_hw)
        with precision.autocast():
            embeddings = teacher(images)
        F.normalize(embeddings.float(), dim=1).half()
    return memory.peak
