"""One section of ``config.json`` per owner, and the runs saved before the split (issue 58).

``TrainConfig`` held the loop's options with those of checkpoints, failures and precision;
each has its section now (``checkpoint``, ``failure``, ``precision``). A run saved before
holds them in ``train``: resuming it, giving its ``config.json`` to ``--config``, decoding
its checkpoints and launching its resume must read them as before. The old files here are
written by hand, as that version wrote them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hadpsgd.assembly.resume_config import differences, flatten
from hadpsgd.cli import to_dict
from hadpsgd.config import FORMER_SECTION, RunConfig, parse_config
from hadpsgd.config_file import SECTIONS

MOVED = {"checkpoint": {"checkpoint_every", "resume", "overwrite", "allow_resume_change",
                        "keep_checkpoints", "keep_best"},
         "failure": {"on_failure", "min_learners", "control_every", "max_nonfinite",
                     "max_loss_ratio"},
         "precision": {"precision", "tf32"}}


def _old_form(saved: dict) -> dict:
    """``saved`` as a run of the version before the split wrote it: all in ``train``."""
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for section in MOVED:
        old["train"].update(old.pop(section))
    return old


def test_each_owner_has_its_section_and_every_option_one():
    saved = to_dict(parse_config([]))
    for section, names in MOVED.items():
        assert set(saved[section]) == names
        assert not names & set(saved["train"])
    assert set(saved["train"]) == {"algo", "epochs", "batch_size", "seed", "max_steps",
                                   "log_every", "out_dir", "tensorboard", "progress",
                                   "cuda_graph"}
    assert set(FORMER_SECTION) == set().union(*MOVED.values())
    assert set(FORMER_SECTION.values()) == {"train"}
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    assert sorted(sections) == sorted(SECTIONS)


def test_a_run_saved_before_the_split_is_read_as_it_was():
    cfg = parse_config(["--precision", "bf16", "--on-failure", "continue", "--keep-best", "3",
                        "--max-loss-ratio", "7", "--algo", "bmuf"])
    new = to_dict(cfg)
    old = _old_form(new)
    assert "precision" not in old and old["train"]["precision"] == "bf16"
    assert flatten(old) == flatten(new)


def test_a_resume_of_an_old_run_refuses_what_differs_from_its_train_section():
    old = _old_form(to_dict(parse_config(["--precision", "bf16"])))
    values, refused = differences(parse_config(["--precision", "fp32", "--keep-best", "5"]), old)
    assert [r.split()[0] for r in refused] == ["--precision"]
    assert "(the run has bf16)" in refused[0]
    assert values["keep_best"] == 5  # may change on a resume, as before


@pytest.mark.parametrize("form", ["new", "old"])
def test_config_file_of_either_form(tmp_path, form):
    saved = to_dict(parse_config(["--precision", "bf16", "--min-learners", "2",
                                  "--checkpoint-every", "7"]))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved if form == "new" else _old_form(saved)))
    cfg = parse_config(["--config", str(path)])
    assert (cfg.precision.precision, cfg.failure.min_learners, cfg.checkpoint.checkpoint_every) \
        == ("bf16", 2.0, 7)


def test_a_moved_option_in_a_third_section_is_still_refused(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optim": {"precision": "bf16"}}))
    with pytest.raises(SystemExit):
        parse_config(["--config", str(path)])
    assert "move it to precision.precision" in capsys.readouterr().err


@pytest.mark.parametrize("section", ["precision", "train"])
def test_decoding_reads_the_precision_of_either_form(section):
    from hadpsgd.forward.model import LoadedModel

    def loaded(config: dict) -> LoadedModel:
        return LoadedModel(model=None, checkpoint=None, run_dir=None,  # type: ignore[arg-type]
                           config=config, weights="model")

    assert loaded({section: {"precision": "bf16"}}).precision == "bf16"
    assert loaded({}).precision == "fp32"


@pytest.mark.parametrize("section", ["failure", "train"])
def test_the_launcher_reads_on_failure_of_either_form(tmp_path, section):
    from hadpsgd.launch.mpirun import continues_on_failure

    (tmp_path / "config.json").write_text(json.dumps({section: {"on_failure": "continue"}}))
    assert continues_on_failure(["--resume", "auto", "--out-dir", str(tmp_path)])


def test_the_bucket_size_of_the_environment_is_honoured(monkeypatch, capsys):
    """``HADPSGD_BUCKET_MB`` was read by the API only: the command's --bucket-mb default of
    64 always won over it."""
    monkeypatch.setenv("HADPSGD_BUCKET_MB", "0.5")
    assert parse_config([]).comm.bucket_mb == 0.5
    assert parse_config(["--bucket-mb", "8"]).comm.bucket_mb == 8.0
    assert to_dict(parse_config([]))["comm"]["bucket_mb"] == 0.5  # the size used, saved
    monkeypatch.setenv("HADPSGD_BUCKET_MB", "big")
    with pytest.raises(SystemExit):
        parse_config([])
    err = capsys.readouterr().err
    assert "HADPSGD_BUCKET_MB" in err and "--bucket-mb" in err
    monkeypatch.delenv("HADPSGD_BUCKET_MB")
    assert parse_config([]).comm.bucket_mb == 64.0


def test_the_super_learner_size_is_one_setting_under_two_flags(capsys):
    """ADPSGD's ``--super-learner-size`` sets the node size as ``--ranks-per-node`` does; the
    latter was silently dropped where both were given."""
    cfg = parse_config(["--algo", "adpsgd", "--super-learner-size", "2", "--ranks-per-node", "2"])
    assert cfg.algo_options().ranks_per_node() == 2
    with pytest.raises(SystemExit):
        parse_config(["--algo", "adpsgd", "--super-learner-size", "2", "--ranks-per-node", "4"])
    err = capsys.readouterr().err
    assert "--super-learner-size 2 and --ranks-per-node 4" in err and "give one" in err


def test_the_rebuilt_runs_configuration_leaves_the_callers_alone():
    """A recovery rebuilds the run from a copy that continues it (``--resume auto``); the
    split moved ``resume`` to a section the shallow copy shared with the caller's."""
    from hadpsgd.assembly.elastic import _continuing

    cfg = parse_config(["--out-dir", "r", "--overwrite"])
    cont = _continuing(cfg)
    assert (cont.checkpoint.resume, cont.checkpoint.overwrite) == ("auto", False)
    assert (cfg.checkpoint.resume, cfg.checkpoint.overwrite) == (None, True)
    assert cont.train.out_dir == "r"


def test_precision_is_a_section_and_an_option_in_a_config_file(tmp_path):
    """``{"precision": "bf16"}`` (a flat file) and ``{"precision": {"precision": "bf16"}}``
    (the section) both name the option; an old file's ``train.precision`` too."""
    for body in ({"precision": "bf16"}, {"precision": {"precision": "bf16", "tf32": True}},
                 {"train": {"precision": "bf16"}}):
        path = tmp_path / "c.json"
        path.write_text(json.dumps(body))
        assert parse_config(["--config", str(path)]).precision.precision == "bf16"
