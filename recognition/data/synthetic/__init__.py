"""A built-in synthetic face data set, generated on first use, for the default run and tests.

Every identity is a procedural face drawn from a few dozen random shape parameters (face
outline, jaw, hairline and hair style, ears, eyes, brows, nose, mouth, beard, glasses and a
few distinctive marks). Every image of an identity re-draws that template under strong
nuisance variation: rotation, scale, translation, a yaw-like horizontal squeeze, a random
cluttered background, a lighting gradient, brightness / contrast / colour cast, blur,
noise and JPEG compression. The nuisances are strong enough that matching raw pixels does
poorly (`recognition.evaluation.synthetic_baseline`: about 67% on the default set's
pairs), while the identity lives in the shapes of the face, which a small CNN learns in two
minutes on two CPU cores (about 97% on the same pairs).

Layout written under `root` (the same layout as a real image-folder training set plus
LFW-style verification data, so that the rest of the code sees no difference):

    root/train/id_00000/0.jpg ...                    training identities (ImageFolder)
    root/val/person_0000/person_0000_0001.jpg ...    held-out identities (LFW layout)
    root/val/pairs.txt                               LFW View-2 pairs over the val identities
    root/.generating                                 written first, removed at the end
    root/.complete                                   written last: the SyntheticSpec as JSON

The output depends only on the spec (seed included): every identity and image draws from
its own `numpy.random.Generator` seeded by (seed, split, identity, image), so the files are
byte-identical whatever the number of worker processes.

Modules: `layout` (folders, names, markers), `drawing` (an identity's parameters and its
face template), `rendering` (one image under the nuisances), `pairs` (the verification
folds), `generation` (the data set on disk), `cli` (`python -m recognition.data.synthetic`).
The spec itself, `SyntheticSpec`, lives with the config that describes it
(`recognition.config.synthetic`) and is re-exported here.
"""

from recognition.config.synthetic import GENERATOR_VERSION, SyntheticSpec
from recognition.data.synthetic.cli import main, parse_spec_arguments
from recognition.data.synthetic.drawing import TEMPLATE_OVERSAMPLING, draw_face, face_landmarks
from recognition.data.synthetic.generation import (
    ensure_synthetic_dataset,
    generate_synthetic_dataset,
)
from recognition.data.synthetic.layout import (
    COMPLETE_MARKER,
    GENERATING_MARKER,
    PAIRS_FILE,
    TRAIN_DIR,
    VAL_DIR,
    train_identity_name,
    val_identity_name,
)
from recognition.data.synthetic.pairs import make_pairs, write_lfw_pairs

# A private helper that tests/test_synthetic.py checks against a reference convolution.
from recognition.data.synthetic.rendering import _blur_rows

__all__ = [
    "COMPLETE_MARKER",
    "GENERATING_MARKER",
    "GENERATOR_VERSION",
    "PAIRS_FILE",
    "TEMPLATE_OVERSAMPLING",
    "TRAIN_DIR",
    "VAL_DIR",
    "SyntheticSpec",
    "_blur_rows",
    "draw_face",
    "ensure_synthetic_dataset",
    "face_landmarks",
    "generate_synthetic_dataset",
    "main",
    "make_pairs",
    "parse_spec_arguments",
    "train_identity_name",
    "val_identity_name",
    "write_lfw_pairs",
]
