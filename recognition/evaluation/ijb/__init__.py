"""IJB-B / IJB-C template evaluation: 1:1 verification and 1:N identification.

The protocol: each image of the release is aligned on its five landmarks
(:mod:`recognition.data.alignment`) and embedded as model(image) + model(mirror),
optionally times its detector score; a media's (a video's frames, or one still) image
features are averaged, a template's media features summed and L2-normalised. 1:1 scores a
pair by the cosine of its two templates (TAR at FAR 1e-6 ... 1e-1, AUC, the ROC); 1:N
searches every probe template in each of the two galleries (CMC, TPIR at FPIR). One features
file serves both modes.

An image that cannot be decoded is left out and counted; a template with no readable image
(or none listed at all) has no feature and scores -1, below every threshold. Both counts are
in the results and the log.

One concern a module, each importing only those above it in this list:

    protocol         the 1:1 meta files (face_tid_mid, template pairs, 5 landmarks), checked
    search_protocol  the 1:N lists (two galleries, the mixed probes), cross-checked
    features         image features (aligned, embedded) and their cache file
    templates        pooling image features into unit template features
    release          both modes' start: options, and a release's pooled templates
    verification     1:1: pair scores, ROC, AUC, TAR@FAR; evaluate_ijb
    search           1:N: the tiled gallery search, CMC, TPIR@FPIR; evaluate_ijb_search
    report           the console tables, JSON and ROC plot of both modes

The names below are those ``recognition.evaluation.ijb`` has always offered (and
``IJBOptions``); the 1:N ones are in ``search_protocol``, ``search`` and ``report``.
"""

from recognition.evaluation.ijb.features import (
    AlignedFaces,
    cached_features,
    image_features,
    load_features,
    model_digest,
    protocol_features,
    save_features,
)
from recognition.evaluation.ijb.protocol import (
    IJB_NAMES,
    IJBProtocol,
    load_protocol,
    meta_files,
    numbered_lines,
    read_faces,
    read_landmarks,
    read_pairs,
)
from recognition.evaluation.ijb.release import IJBOptions, default_threads
from recognition.evaluation.ijb.report import format_ijb_table, report_ijb
from recognition.evaluation.ijb.templates import NO_FEATURE_SCORE, template_features
from recognition.evaluation.ijb.verification import (
    ROC_POINTS,
    evaluate_ijb,
    roc_metrics,
    score_pairs,
)
from recognition.evaluation.verification import far_key

__all__ = [
    "IJB_NAMES",
    "NO_FEATURE_SCORE",
    "ROC_POINTS",
    "AlignedFaces",
    "IJBOptions",
    "IJBProtocol",
    "cached_features",
    "default_threads",
    "evaluate_ijb",
    "far_key",
    "format_ijb_table",
    "image_features",
    "load_features",
    "load_protocol",
    "meta_files",
    "model_digest",
    "numbered_lines",
    "protocol_features",
    "read_faces",
    "read_landmarks",
    "read_pairs",
    "report_ijb",
    "roc_metrics",
    "save_features",
    "score_pairs",
    "template_features",
]
