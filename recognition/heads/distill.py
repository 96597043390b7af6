"""Feature distillation (train.teacher): the student's embedding pulled towards the
teacher's, in direction only.

    loss = mean over the batch of 1 - cos(P s_i, t_i)

s_i the student's embedding (D_s), t_i the teacher's (D_t), P a learned bias-free Linear
(D_s -> D_t) when the sizes differ, else the identity. Why this loss (docs/distillation.md
has the measurements):

- verification compares embeddings by their cosine only, and the margin head trains the
  student on its normalised embedding: a loss on the directions asks the student for
  exactly what is used of the teacher, and leaves the norm (which the head ignores) free;
  an L2 loss on raw embeddings would also ask for the teacher's norms, which say more
  about its BatchNorm than about faces;
- it is per sample: its value for an image does not depend on the rest of the batch, so
  the teacher's targets can be computed once per image and cached (a relational loss on
  the batch's similarity matrix would need no projection, but pairs only the few samples
  a batch holds, which at a million identities share almost no identity);
- logit distillation (KL between the two heads' softmaxes) needs the teacher's classifier
  over the same classes: a backbone file has none, and the head is sharded over ranks.

P starts as a random orthogonal map scaled to keep lengths, so the first steps already
compare directions that mean something; it trains with the student (replicated over ranks
like the backbone) and is saved in the checkpoint, not in the exported backbone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeatureDistillation(nn.Module):
    """The distillation loss with its projection (see the module docstring).

    `project(student)` maps (B, D_s) embeddings into the teacher's space (B, D_t);
    `forward(projected, teacher)` is the loss, a 0-dim float32 tensor (float64 for float64
    inputs).
    """

    def __init__(self, student_dim: int, teacher_dim: int) -> None:
        super().__init__()
        self.student_dim = student_dim
        self.teacher_dim = teacher_dim
        self.projection: nn.Linear | None = None
        if student_dim != teacher_dim:
            self.projection = nn.Linear(student_dim, teacher_dim, bias=False)
            nn.init.orthogonal_(self.projection.weight)

    def project(self, student: torch.Tensor) -> torch.Tensor:
        """The student's embeddings (B, D_s) in the teacher's space (B, D_t)."""
        return student if self.projection is None else self.projection(student)

    def forward(self, projected: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        wide = torch.float64 if projected.dtype == torch.float64 else torch.float32
        # The cosine in float32 at least: half embeddings of norm ~20 square to ~400 per
        # component sum, and a half cosine rounds 1 - cos to zero for close directions.
        cosine = F.cosine_similarity(projected.to(wide), teacher.to(wide), dim=1, eps=1e-6)
        return (1.0 - cosine).mean()
