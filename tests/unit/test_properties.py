"""Property-based tests (hypothesis) of what a user or a damaged file can hand the readers.

Each reader either accepts its input or refuses it with its own error type (which the entry
points turn into exit 2 with the file named); no input may escape as another exception.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hadpsgd.train.checkpoint import MANIFEST_FILE, CheckpointError, read_manifest
from hadpsgd.train.metrics import read_metrics

FEW = settings(max_examples=60, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _manifests() -> st.SearchStrategy:
    """Arbitrary JSON, and manifests that are almost right (one field wrong)."""
    entry = st.fixed_dictionaries({"bytes": st.integers() | st.text(max_size=3) | st.none(),
                                   "sha256": st.text(max_size=4) | st.integers()})
    files = st.dictionaries(st.sampled_from(["state.pt", "node-00000.pt", "../x", "", "a/b"]),
                            entry | _json, max_size=3)
    near = st.fixed_dictionaries({"format": st.sampled_from(["hadpsgd-checkpoint/1", "x"]),
                                  "files": files | _json})
    return _json | near


@FEW
@given(manifest=_manifests())
def test_any_manifest_is_read_or_refused_as_a_checkpoint_error(tmp_path, manifest):
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    try:
        got = read_manifest(tmp_path)
    except CheckpointError as err:
        assert str(tmp_path) in str(err)
        return
    # Accepted: it vouches for state.pt with a size and a checksum, and names no other path.
    assert got["files"]["state.pt"]["sha256"] is not None
    assert all("/" not in name and name not in ("", ".", "..") for name in got["files"])


@FEW
@given(lines=st.lists(st.text(max_size=30).filter(lambda t: "\n" not in t), max_size=6),
       torn=st.booleans())
def test_metrics_are_read_or_refused_by_line(tmp_path, lines, torn):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + ("" if torn else "\n"))
    try:
        records = read_metrics(path)
    except ValueError as err:
        assert "line" in str(err)
        return
    assert isinstance(records, list)


_FLOAT_FLAGS = ["--lr", "--momentum", "--weight-decay", "--max-grad-norm", "--max-loss-ratio",
                "--bucket-mb", "--anneal", "--beta1", "--beta2"]


@FEW
@given(name=st.sampled_from(_FLOAT_FLAGS),
       value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(["1e400",
                                                                            "-1e400", "nan"]))
def test_a_float_flag_is_finite_and_in_range_or_refused_naming_it(capsys, name, value):
    from hadpsgd.config import parse_config

    text = value if isinstance(value, str) else repr(value)
    try:
        cfg = parse_config([name, text])
    except SystemExit as exc:
        assert exc.code == 2 and name in capsys.readouterr().err
        return
    field = name.lstrip("-").replace("-", "_")
    for section in (cfg.optim, cfg.train, cfg.failure, cfg.comm):
        if hasattr(section, field):
            assert math.isfinite(getattr(section, field))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_json_numbers_python_reads_that_are_no_numbers_are_refused(tmp_path, capsys, text):
    from hadpsgd.config import parse_config

    path = tmp_path / "c.json"
    path.write_text(f'{{"optim": {{"momentum": {text}}}}}')
    with pytest.raises(SystemExit) as exc:
        parse_config(["--config", str(path)])
    assert exc.value.code == 2 and "momentum" in capsys.readouterr().err


# ----------------------------------------------------------------- the feature-file reader
# Strings and bytes without NUL: HDF5 cannot store one inside a string attribute (h5py
# refuses to write it), so no file a user has can hold it.
_ATTR_VALUES = (st.integers(-2, 10**12) | st.floats() | st.text(max_size=6).filter(
    lambda t: "\0" not in t) | st.binary(max_size=3).filter(lambda b: b"\0" not in b)
                | st.lists(st.integers(0, 9), min_size=2, max_size=3))
_ARRAYS = st.sampled_from(["float32", "float16", "int64", "uint8", "S3"]).flatmap(
    lambda dtype: st.sampled_from([(0,), (3,), (7,), (3, 3), (2, 2, 2)]).map(
        lambda shape: (dtype, shape)))


def _feature_file(path) -> None:
    import numpy as np

    from hadpsgd.data import write_features

    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((n, 3)).astype(np.float32) for n in (4, 2, 5)]
    write_features(path, feats, [rng.integers(0, 4, len(f)) for f in feats],
                   ["a", "b", "c"], 4, norm_mean=np.zeros(3, np.float32),
                   norm_std=np.ones(3, np.float32))


@FEW
@given(attr=st.sampled_from(["format_version", "num_classes", "feat_dim", "validated",
                             "silence_classes", "pipeline"]) | st.none(),
       value=_ATTR_VALUES,
       dataset=st.sampled_from(["feats", "labels", "offsets", "utt_ids", "norm/mean",
                                "norm/std"]) | st.none(),
       array=_ARRAYS, delete=st.booleans())
def test_any_edit_of_a_feature_file_is_read_or_refused_as_a_feature_file_error(
        tmp_path_factory, attr, value, dataset, array, delete):
    """An attribute set to anything, a dataset deleted or replaced by an array of another
    type or shape: the file opens and reads, or FeatureFileError names it."""
    import h5py
    import numpy as np

    from hadpsgd.data import FeatureFile, FeatureFileError

    path = tmp_path_factory.mktemp("h5") / "f.h5"
    _feature_file(path)
    with h5py.File(path, "r+") as h5:
        if attr is not None:
            h5.attrs[attr] = np.array(value) if isinstance(value, list) else value
        if dataset is not None:
            del h5[dataset]
            if not delete:
                dtype, shape = array
                h5.create_dataset(dataset, data=np.ones(shape, dtype=dtype))
    for verify in (False, True):
        try:
            ff = FeatureFile(path, verify=verify)
            ff.read(0, min(ff.num_frames, 3))
            assert len(ff.utt_ids) == ff.num_utts
        except FeatureFileError as err:
            assert str(path) in str(err)
