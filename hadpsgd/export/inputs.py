"""What the export bakes in around the BLSTM: the feature normalisation and the priors.

``hadpsgd.forward`` reads raw features: an HDF5 file is normalised with its own ``norm/``
statistics, a Kaldi table with the training file's (``--norm auto``). The exported graph
takes raw features too, so ``--norm auto`` bakes in the training file's statistics: the
file the checkpoint's configuration names, or, for a run on the synthetic default set, that
set's training file (the one training read; made again, identically, if the cache lost it).
``--norm FILE`` takes them from another feature file or an ``.npz``; ``--norm none`` bakes in
nothing (the graph then takes normalised features). The priors follow forward's
``--priors`` (:func:`hadpsgd.forward.__main__.resolve_priors`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hadpsgd.data import FeatureFile, FeatureFileError, PriorsError, default_dataset
from hadpsgd.data.kaldi import load_norm
from hadpsgd.data.pipeline import read_record
from hadpsgd.data.synth import SynthSpec
from hadpsgd.export.graph import Scores
from hadpsgd.forward import ForwardError, LoadedModel
from hadpsgd.forward.__main__ import check_prior_scale, resolve_priors
from hadpsgd.forward.model import check_priors

Stats = tuple[np.ndarray, np.ndarray] | None


def training_file(loaded: LoadedModel) -> tuple[Path, str]:
    """The run's training file and how it is named in messages.

    Raises:
        ForwardError: If the configuration's training file is not here.
    """
    if loaded.train_file is not None:
        path = Path(loaded.train_file)
        if not path.is_file():
            raise ForwardError(f"--norm auto: the training file {path} that the checkpoint's "
                               "config names is not here, so the normalisation the model "
                               "expects is unknown; pass --norm TRAIN.h5 (or an .npz with mean "
                               "and std), or --norm none to export a graph that takes "
                               "normalised features")
        return path, f"the training file's, {path}"
    utts = int(loaded.config.get("data", {}).get("synthetic_utts", SynthSpec.train_utts))
    path = default_dataset(spec=SynthSpec(train_utts=utts))[0]
    return path, f"the synthetic training set's, {path}"


def cmvn_note(path: Path) -> str:
    """What the graph leaves to the user of the import that made ``path``, as a clause.

    A Kaldi import records its per-speaker or per-utterance CMVN in the file
    (:mod:`hadpsgd.data.pipeline`); the graph holds only the global statistics, so the
    features it is given must have had that CMVN already.
    """
    try:
        record = read_record(path)
    except (ValueError, OSError) as err:
        raise ForwardError(f"--norm: {err}") from None
    if record is None or record.cmvn is None:
        return ""
    return (f"; the training import applied {record.cmvn.describe()} before these statistics, "
            "which is not in the graph: give it features with that CMVN applied")


def _file_stats(path: Path, flag: str) -> Stats:
    try:
        ff = FeatureFile(path)
    except FeatureFileError as err:
        raise ForwardError(f"--norm {flag}: {err}; pass a feature file with norm/, an .npz "
                           "with mean and std, or --norm none") from None
    if ff.norm_mean is None or ff.norm_std is None:
        return None
    return ff.norm_mean, ff.norm_std


def resolve_norm(spec: str, loaded: LoadedModel) -> tuple[Stats, str]:
    """The statistics ``--norm`` names, and one line saying which.

    Raises:
        ForwardError: For a file that is not there or holds none, or of another dimension.
    """
    if spec == "none":
        return None, "none (--norm none): the graph takes normalised features"
    note = ""
    if spec == "auto":
        path, named = training_file(loaded)
        stats, note = _file_stats(path, "auto"), cmvn_note(path)
        if stats is None:
            return None, f"none ({path} has no norm/): the graph takes features as stored{note}"
    else:
        try:  # the loader the Kaldi import's --norm-from uses: a feature file or an .npz
            stats = load_norm(spec)
        except (OSError, KeyError, ValueError) as err:
            raise ForwardError(f"--norm {spec}: {err}; pass the training file (its norm/), an "
                               ".npz with arrays 'mean' and 'std', or --norm none") from None
        named = f"from {spec}" if spec.endswith(".npz") else f"{spec}'s"
        note = "" if spec.endswith(".npz") else cmvn_note(Path(spec))
    mean, std = stats
    if mean.shape != (loaded.input_dim,) or std.shape != (loaded.input_dim,):
        raise ForwardError(f"--norm: the statistics have dimension {mean.shape[0]} but the "
                           f"model reads {loaded.input_dim}-dim features; pass the statistics "
                           "of its training set")
    return stats, (f"{named} (baked in: the graph takes raw features, as hadpsgd.forward "
                   f"does){note}")


def resolve(norm: str, priors: str, loaded: LoadedModel,
            prior_scale: float = 1.0) -> tuple[Scores, str, str]:
    """The :class:`Scores` of ``--norm``, ``--priors`` and ``--prior-scale``, and a line on each.

    Raises:
        ForwardError: For either flag, naming it and the fix.
    """
    stats, norm_line = resolve_norm(norm, loaded)
    try:
        found, priors_line = resolve_priors(priors, loaded)
    except (PriorsError, FileNotFoundError, ValueError) as err:
        raise ForwardError(f"--priors {priors}: {err}") from None
    check_priors(loaded, found)
    priors_line += check_prior_scale(prior_scale, found)
    mean, std = stats if stats is not None else (None, None)
    return Scores(mean, std, found, prior_scale), norm_line, priors_line
