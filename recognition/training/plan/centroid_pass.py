"""The memory of head.init=centroids's pass before step 1, for the run planner.

The pass (`recognition.training.finetune.centroids`) runs before the precision level casts
the model and before the optimizer exists: the fp32 backbone in eval mode, the fp32 shard of
class rows, one batch of images through the backbone under no_grad, and its float64
embeddings, per-class sums and pair moments (`recognition.training.finetune.separation`).
Planned like the step: built and run on fake tensors while `TensorMemory` counts what each
op would allocate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recognition.config import ExperimentConfig
from recognition.heads import shard_range
from recognition.models import backbone_from_config
from recognition.tensor_memory import TensorMemory


def plan_centroid_pass(
    cfg: ExperimentConfig, num_classes: int, world_size: int, rank: int, *, granularity: int
) -> int:
    """Peak bytes of rank `rank`'s centroid pass (0 unless head.init=centroids)."""
    if cfg.head.init != "centroids":
        return 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch, dim = cfg.train.batch_size, cfg.model.embedding_size
    _, num_local = shard_range(num_classes, world_size, rank)
    memory = TensorMemory(granularity=granularity)
    with FakeTensorMode(), memory, torch.no_grad():
        backbone = backbone_from_config(cfg.model, cfg.data.image_hw).eval()
        torch.empty(num_local, dim)  # the class rows, made with the head (fp32 here)
        images = torch.empty(batch, 3, *cfg.data.image_hw)
        embeddings = F.normalize(backbone(images).double(), dim=1)
        # At most one class per image: the batch's per-class sums.
        torch.zeros(batch, dim, dtype=torch.float64).index_add_(
            0, torch.zeros(batch, dtype=torch.int64), embeddings
        )
        # The pair moments (recognition.training.finetune.separation): G and the open class's M
        # (D x D float64 each, held through the pass), the batch's G term, Gram matrix and
        # its square (the sums above stand for the moments' own).
        moments = [torch.zeros(dim, dim, dtype=torch.float64) for _ in range(2)]
        moments.append(embeddings.T @ embeddings)
        gram = embeddings @ embeddings.T  # (B, B)
        squares = gram * gram
        del moments, gram, squares
    return memory.peak
