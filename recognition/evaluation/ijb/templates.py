"""IJB template pooling: image features into one unit feature per template.

A media's (a video's frames, or one still) image features are averaged, a template's media
features summed and L2-normalised, as in the protocol. A template with no readable image (or
none listed at all) has no feature, a zero row: its pairs and searches score
:data:`NO_FEATURE_SCORE`, below every threshold.
"""

from __future__ import annotations

import numpy as np

from recognition.evaluation.ijb.protocol import IJBProtocol

NO_FEATURE_SCORE = -1.0
"""The score of a pair whose template has no feature: the lowest cosine, never accepted."""


def template_features(
    features: np.ndarray,
    readable: np.ndarray,
    protocol: IJBProtocol,
    score_weight: bool = False,
    more_templates: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pool image features into templates: (template ids (T,) sorted, unit features (T, D)).

    Per face_tid_mid row: its image's feature, times the detector score with
    ``score_weight``. A media's rows (same template and media id) are averaged, a
    template's media summed and L2-normalised. Rows of unreadable images are left out; a
    template left with no row, or whose pooled feature is zero, gets a zero feature.
    Templates are every id of face_tid_mid, of the pairs and of ``more_templates`` (the
    1:N lists).
    """
    features = np.asarray(features, np.float32)
    rows = np.flatnonzero(readable[protocol.face_image])  # face rows with a feature
    image = protocol.face_image[rows]
    row_features = features[image].astype(np.float64)  # (R, D)
    if score_weight:
        row_features *= protocol.detector_scores[image, None]

    listed = [protocol.face_template, protocol.pairs.ravel()]
    if more_templates is not None:
        listed.append(np.asarray(more_templates, np.int64).ravel())
    template_ids = np.unique(np.concatenate(listed))
    # Media: one group per (template, media) pair, averaged.
    keys = np.stack([protocol.face_template[rows], protocol.face_media[rows]], axis=1)
    media_keys, media_of_row = np.unique(keys, axis=0, return_inverse=True)
    media_of_row = media_of_row.ravel()
    num_media = len(media_keys)
    media_sums = np.zeros((num_media, features.shape[1]))
    _add_rows(media_sums, media_of_row, row_features)
    media_counts = np.bincount(media_of_row, minlength=num_media)
    media_means = media_sums / np.maximum(media_counts, 1)[:, None]
    # Templates: the sum of their media.
    template_of_media = np.searchsorted(template_ids, media_keys[:, 0])
    pooled = np.zeros((len(template_ids), features.shape[1]))
    _add_rows(pooled, template_of_media, media_means)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    unit = np.divide(pooled, norms, out=np.zeros_like(pooled), where=norms > 0)
    return template_ids, unit.astype(np.float32)


def _add_rows(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """out[index[k]] += values[k] for every k (a sort and reduceat: np.add.at is slow)."""
    if len(index) == 0:
        return
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    starts = np.flatnonzero(np.r_[True, sorted_index[1:] != sorted_index[:-1]])
    out[sorted_index[starts]] += np.add.reduceat(values[order], starts, axis=0)
