"""``--config FILE`` and ``--print-config``: a run's config.json given back reproduces it."""

from __future__ import annotations

import json

import pytest

from hadpsgd.cli import to_dict
from hadpsgd.config import parse_config


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_config_json_round_trips(tmp_path):
    cfg = parse_config(["--algo", "bmuf", "--sync-period", "4", "--lr", "0.01", "--epochs", "7",
                        "--preset", "tiny"])
    saved = {**to_dict(cfg), "world": {"size": 4}, "provenance": {"argv": ["x"]}}
    again = parse_config(["--config", _write(tmp_path, saved)])
    assert to_dict(again) == to_dict(cfg)


def test_command_line_wins_and_recipe_yields_to_the_file(tmp_path):
    path = _write(tmp_path, {"optim": {"optimizer": "sgd", "lr": 0.2}, "train": {"algo": "bmuf",
                                                                                 "epochs": 2}})
    cfg = parse_config(["--config", path, "--epochs", "3"])
    assert cfg.train.algo == "bmuf" and cfg.train.epochs == 3
    # the file chose SGD: the BMUF recipe's SGD defaults (its buffer kept) fill the rest
    assert (cfg.optim.optimizer, cfg.optim.lr, cfg.algo.adam_moments) == ("sgd", 0.2, "local")


def test_other_algorithms_options_in_the_file_are_dropped(tmp_path):
    saved = to_dict(parse_config(["--algo", "bmuf", "--sync-period", "4"]))
    cfg = parse_config(["--config", _write(tmp_path, saved), "--algo", "ssgd"])
    assert cfg.train.algo == "ssgd"  # no "--algo ssgd does not read --sync-period" error


@pytest.mark.parametrize(("data", "needle"), [
    ({"optim": {"lrr": 1}}, "optim.lrr is no option"),
    ({"colour": 1}, "unknown key 'colour'"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_file_names_the_key(tmp_path, capsys, data, needle):
    with pytest.raises(SystemExit) as err:
        parse_config(["--config", _write(tmp_path, data)])
    assert err.value.code == 2 and needle in capsys.readouterr().err


def test_missing_and_malformed_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--config", str(tmp_path / "nope.json")])
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(tmp_path / "bad.json")])
    assert "not a readable JSON file" in capsys.readouterr().err


def test_print_config_prints_the_resolved_json(capsys):
    with pytest.raises(SystemExit) as err:
        parse_config(["--algo", "bmuf", "--print-config"])
    assert err.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optim"]["optimizer"] == "sgd" and out["algo"]["bmuf_worker_lr"] == "global"
    assert out["train"]["algo"] == "bmuf" and out["optim"]["lr"] == 0.5


@pytest.mark.parametrize(("section", "body", "message"), [
    ("train", {"epochs": "four"}, 'train.epochs must be an integer, got "four"'),
    ("train", {"max_steps": 2.5}, "train.max_steps must be an integer, got 2.5"),
    ("train", {"tensorboard": "yes"}, 'train.tensorboard must be true or false, got "yes"'),
    ("optim", {"lr": "0.1"}, 'optim.lr must be a number, got "0.1"'),
    ("train", {"epochs": None}, "train.epochs must not be null"),
])
def test_a_value_of_the_wrong_type_is_named(tmp_path, capsys, section, body, message):
    from hadpsgd.config import parse_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({section: body}))
    with pytest.raises(SystemExit) as exc:
        parse_config(["--config", str(path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_whole_numbers_are_valid_floats_and_null_is_valid_where_optional(tmp_path):
    from hadpsgd.config import parse_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optim": {"lr": 1}, "train": {"resume": None}}))
    cfg = parse_config(["--config", str(path)])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.checkpoint.resume is None


@pytest.mark.parametrize("text", ['{"optim": {"lr": NaN}}', '{"optim": {"lr": 1e400}}',
                                  '{"momentum": Infinity}', '{"block_lr": NaN}'])
def test_nonfinite_numbers_in_a_config_file_are_refused_by_name(tmp_path, capsys, text):
    """Python's json reads NaN, Infinity and 1e400 (as inf): each is refused, naming it."""
    from hadpsgd.config import parse_config

    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        parse_config(["--algo", "bmuf", "--config", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "finite" in err, err
