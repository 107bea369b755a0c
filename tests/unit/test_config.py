import argparse
import json

import pytest

from hadpsgd.cli import (
    add_arguments,
    field_docs,
    from_dict,
    from_namespace,
    option_name,
    to_dict,
)
from hadpsgd.config import (
    CheckpointConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    FailureConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from hadpsgd.run import parse_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p, RunConfig)
    return p


def test_every_field_has_a_docstring_and_a_flag():
    import dataclasses

    help_text = _parser().format_help()
    for cls in (DataConfig, OptimConfig, TrainConfig, CheckpointConfig, FailureConfig,
                PrecisionConfig, CommConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert "--" + f.name.replace("_", "-") in help_text


def test_cli_round_trip_and_defaults():
    cfg = parse_config(["--lr", "0.3", "--batch-size", "8", "--no-progress", "--preset", "tiny"])
    assert cfg.optim.lr == 0.3 and cfg.train.batch_size == 8 and cfg.train.progress is False
    assert cfg.model.preset == "tiny"
    assert cfg.train.epochs == TrainConfig().epochs  # untouched options keep their default
    again = from_dict(RunConfig, json.loads(json.dumps(to_dict(cfg))))
    assert again == cfg


def test_unknown_algo_lists_registered(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--algo", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "ssgd" in err


@pytest.mark.parametrize(
    ("kwargs", "cls", "needle"),
    [
        ({"lr": -1.0}, OptimConfig, "--lr"),
        ({"beta1": 1.0}, OptimConfig, "--beta1"),
        ({"anneal": 0.0}, OptimConfig, "--anneal"),
        ({"batch_size": 0}, TrainConfig, "--batch-size"),
        ({"max_loss_ratio": 0.5}, FailureConfig, "--max-loss-ratio"),
        ({"optimizer": "lamb"}, OptimConfig, "--optimizer"),
        ({"checkpoint": CheckpointConfig(resume="auto")}, RunConfig, "--out-dir"),
        ({"precision": "fp8"}, PrecisionConfig, "--precision"),
        ({"resume": "auto", "overwrite": True}, CheckpointConfig, "--overwrite"),
        ({"train": "a.h5"}, DataConfig, "--heldout"),
        ({"chunk_len": 0}, DataConfig, "--chunk-len"),
        ({"ranks_per_node": 0}, CommConfig, "--ranks-per-node"),
    ],
)
def test_validation_names_the_option(kwargs, cls, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        cls(**kwargs)


def test_bad_value_exits_with_message(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--warmup-epochs", "-2"])
    assert "--warmup-epochs must be >= 0" in capsys.readouterr().err
    ns = _parser().parse_args([])
    assert from_namespace(RunConfig, ns) == RunConfig()


def test_algorithm_options_come_from_the_registry():
    import dataclasses

    from hadpsgd import algorithms
    from hadpsgd.config import AlgoConfig

    gathered = {f.name for f in dataclasses.fields(AlgoConfig)}
    declared = set()
    for spec in algorithms.specs():
        assert spec.description and spec.cls.name == spec.name
        assert issubclass(spec.options, algorithms.AlgoOptions)
        own = {f.name: option_name(f) for f in dataclasses.fields(spec.options)}
        declared |= set(own.values())
        for name, doc in field_docs(spec.options).items():  # documented where declared
            assert doc and field_docs(AlgoConfig)[own[name]] == doc
    assert gathered == declared
    help_text = _parser().format_help()
    assert "--algo bmuf:" in help_text and "--algo adpsgd:" in help_text


def test_option_of_another_algorithm_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--algo", "ssgd", "--sync-period", "4"])
    err = capsys.readouterr().err
    assert "--algo ssgd does not read --sync-period (an option of --algo bmuf)" in err
    with pytest.raises(SystemExit):  # super-learners are ADPSGD's option, not BMUF's
        parse_config(["--algo", "bmuf", "--super-learner-size", "2"])
    assert "--super-learner-size (an option of --algo adpsgd)" in capsys.readouterr().err
    cfg = parse_config(["--algo", "adpsgd", "--super-learner-size", "2"])
    from hadpsgd.algorithms import ADPSGD

    assert isinstance(cfg.algo_options(), ADPSGD.Options)
    assert cfg.algo_options().ranks_per_node() == 2


def test_a_resume_checks_options_against_the_algorithm_of_the_run_it_resumes(tmp_path,
                                                                            monkeypatch):
    """Issue 55 item 8a: --resume auto --wire int4 on a BMUF run said "--algo ssgd does not
    read --wire", checked against the default --algo before the run's configuration."""
    from hadpsgd.assembly import resume_config

    saved = to_dict(parse_config(["--algo", "bmuf"]))
    monkeypatch.setattr(resume_config, "resume_checkpoint", lambda cfg: tmp_path)
    monkeypatch.setattr(resume_config, "saved_config", lambda path: saved)
    resume = ["--resume", "auto", "--out-dir", str(tmp_path)]
    cfg = parse_config([*resume, "--wire", "int4", "--allow-resume-change", "wire"])
    resolved, _ = resume_config.resumed_config(cfg)
    assert resolved.train.algo == "bmuf" and resolved.algo_options().wire == "int4"
    with pytest.raises(ConfigError, match="differ from it: --sync-period 3 \\(the run has None"):
        resume_config.resumed_config(parse_config([*resume, "--sync-period", "3"]))
    with pytest.raises(ConfigError, match=f"the run resumed from {tmp_path} is --algo bmuf, "
                                          "which does not read --gossip-step"):
        resume_config.resumed_config(parse_config([*resume, "--gossip-step", "0.5"]))
    # No checkpoint yet: a fresh start of the default --algo, which reads no --wire.
    monkeypatch.setattr(resume_config, "resume_checkpoint", lambda cfg: None)
    with pytest.raises(ConfigError, match="--algo ssgd does not read --wire"):
        resume_config.resumed_config(parse_config([*resume, "--wire", "int4"]))


def test_an_option_the_chosen_wire_does_not_read_is_refused(tmp_path, capsys, monkeypatch):
    """Issue 55 item 8f: --topk-fraction with --wire sign, --gossip-step with a wire that is
    not CHOCO's, were silently ignored."""
    for argv, says in [
            (["--algo", "adpsgd", "--wire", "sign", "--topk-fraction", "0.1"],
             "--topk-fraction is read by --wire topk or --wire signtopk only, not by --wire "
             "sign; drop it or choose --wire topk or --wire signtopk"),
            (["--algo", "adpsgd", "--wire", "int4", "--gossip-step", "0.5"],
             "--gossip-step is read by --wire sign or --wire topk or --wire signtopk only, "
             "not by --wire int4"),
            (["--algo", "bmuf", "--topk-fraction", "0.1"], "not by --wire fp32")]:
        with pytest.raises(SystemExit):
            parse_config(argv)
        assert says in capsys.readouterr().err
    assert parse_config(["--algo", "adpsgd", "--wire", "sign", "--gossip-step", "0.5"])
    assert parse_config(["--algo", "bmuf", "--wire", "topk", "--topk-fraction", "0.1"])
    # A run's config.json holds every option: given as --config, its idle ones are no error.
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(to_dict(parse_config(["--algo", "adpsgd"]))))
    assert parse_config(["--config", str(saved)]).algo_options().wire == "fp32"
    # A resume: against the run's wire, also where the change is allowed.
    from hadpsgd.assembly import resume_config

    monkeypatch.setattr(resume_config, "resume_checkpoint", lambda cfg: tmp_path)
    monkeypatch.setattr(resume_config, "saved_config",
                        lambda path: to_dict(parse_config(["--algo", "bmuf"])))
    with pytest.raises(ConfigError,
                       match="--topk-fraction is read by --wire topk or --wire signtopk only"):
        resume_config.resumed_config(parse_config(
            ["--resume", "auto", "--out-dir", str(tmp_path), "--topk-fraction", "0.1",
             "--allow-resume-change", "topk-fraction"]))


def test_abbreviated_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--batch", "8"])
    assert "--batch" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--lr", "--momentum", "--weight-decay", "--max-grad-norm",
                                  "--max-loss-ratio", "--bucket-mb", "--block-lr"])
@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_every_float_flag_refuses_nan_and_infinity_by_name(capsys, flag, value):
    from hadpsgd.config import parse_config

    with pytest.raises(SystemExit) as exc:
        parse_config(["--algo", "bmuf", flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}: must be a finite number" in err, err


def test_nonfinite_values_built_directly_are_refused_by_name():
    from hadpsgd.algorithms.bmuf import BMUFOptions
    from hadpsgd.cli import ConfigError
    from hadpsgd.config import OptimConfig

    with pytest.raises(ConfigError, match="--momentum must be a finite number"):
        OptimConfig(momentum=float("nan"))
    with pytest.raises(ConfigError, match="--block-lr must be a finite number"):
        BMUFOptions(block_lr=float("inf"))


@pytest.mark.parametrize("rank, printed", [("0", True), ("3", False)])
def test_a_bad_flag_is_printed_by_the_launch_rank_0_only(rank, printed, monkeypatch, capsys):
    """Under mpirun every rank refuses the same command line: one copy, not one per rank."""
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    # Rank 3 waits for rank 0 to say it (a launch ends that wait); none here, so no wait.
    monkeypatch.setattr("hadpsgd.cli.RANK_ZERO_GRACE_S", 0.0)
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--lr", "nan"])
    assert exit_.value.code == 2
    assert ("--lr" in capsys.readouterr().err) == printed
