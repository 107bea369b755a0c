"""The speechocean762 study driver (examples/speechocean/study.py) without the corpus.

The test subset it decodes, the summary it reads from a run's metrics, the resumable result
rows and the report's paired arithmetic, on made-up files. The training, forward and decode
commands it calls are the CLI's own, tested elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import statistics

import h5py
import numpy as np

from examples.speechocean import study
from hadpsgd.data.writer import FeatureWriter


def _test_set(build, utts: int = 9) -> list[str]:
    ids = [f"{spk:04d}{i:05d}" for spk in range(3) for i in range(utts // 3)]
    with FeatureWriter(build / "test.h5", 4, 6, silence_classes=[0]) as w:
        for k, u in enumerate(ids):
            n = 3 + k
            w.append(u, np.full((n, 4), k, np.float32), np.arange(n) % 6)
    (build / "test.text").write_text("".join(f"{u} WORD{k} ELSE\n" for k, u in enumerate(ids)))
    return ids


def test_the_test_subset_keeps_every_kth_utterance_with_its_frames_and_words(tmp_path):
    ids = _test_set(tmp_path)
    h5, text = study.test_subset(tmp_path, 4)
    with h5py.File(h5, "r") as f:
        kept = [u.decode() if isinstance(u, bytes) else str(u) for u in f["utt_ids"][:]]
        assert kept == ids[::4]
        offsets = f["offsets"][:]
        for j, k in enumerate(range(0, len(ids), 4)):
            feats = f["feats"][offsets[j]:offsets[j + 1]]
            assert feats.shape == (3 + k, 4) and np.all(feats == k)
        assert list(f.attrs["silence_classes"]) == [0]
    assert text.read_text().splitlines() == [f"{ids[k]} WORD{k} ELSE" for k in (0, 4, 8)]
    # Written once: a second call reuses the files.
    mtime = h5.stat().st_mtime_ns
    assert study.test_subset(tmp_path, 4) == (h5, text) and h5.stat().st_mtime_ns == mtime
    assert study.test_subset(tmp_path, 1) == (tmp_path / "test.h5", tmp_path / "test.text")


def test_train_summary_reads_the_loss_at_each_epochs_end_and_the_bytes(tmp_path):
    rows = [{"kind": "eval", "epoch": 0, "step": 0, "heldout_loss": 4.0},
            {"kind": "train", "epoch": 0, "step": 10, "frames_per_s": 100.0,
             "internode_bytes": 10.0},
            {"kind": "eval", "epoch": 0, "step": 20, "heldout_loss": 2.0},
            {"kind": "train", "epoch": 1, "step": 30, "frames_per_s": 300.0,
             "internode_bytes": 30.0},
            {"kind": "eval", "epoch": 1, "step": 40, "heldout_loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = study.train_summary(tmp_path)
    assert s == {"heldout_loss": [2.0, 1.5], "frames_per_s": 200.0, "internode_bytes": 30.0}
    # The run's closing count (a partial block's closing sync included) is its bytes.
    rows.append({"kind": "bytes", "step": 40, "rank0_internode_bytes": 36})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert study.train_summary(tmp_path)["internode_bytes"] == 36.0


def test_rows_resume_from_the_last_line_of_a_cell_and_the_report_pairs_by_seed(tmp_path):
    def row(config, seed, wer, status="ok"):
        return {"config": config, "workers": 4, "seed": seed, "status": status, "wer": wer,
                "heldout_loss": [2.0, 1.0], "internode_bytes": 2.0**20,
                "frames_per_s": 1000.0}

    lines = [row("ssgd", 0, 50.0), row("ssgd", 1, 60.0), row("bmuf", 0, 0.0, "train exit 1"),
             row("bmuf", 0, 53.0), row("bmuf", 1, 61.0)]
    lines[3]["test_frames"] = {"frame_acc": 0.52, "posterior_entropy": 1.5}
    lines[4]["test_frames"] = {"frame_acc": 0.50, "posterior_entropy": 1.3}
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = study.load_rows(tmp_path)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    table = study.report(rows)
    bmuf = next(line for line in table.splitlines() if line.startswith("| bmuf |"))
    # Paired differences 3 and 1: mean +2, standard error stdev([3, 1]) / sqrt(2) = 1.
    se = statistics.stdev([3.0, 1.0]) / 2**0.5
    assert f"+2.00 ± {se:.2f}" in bmuf and "57.00 ±" in bmuf and "53.0 / 61.0" in bmuf
    ssgd = next(line for line in table.splitlines() if line.startswith("| ssgd |"))
    assert "| — |" in ssgd and "| 1.0 |" in ssgd
    assert bmuf.endswith("| 51.00, 1.400 nats |") and ssgd.endswith("| — |")  # frames: means
    # A run that stopped itself (exit 4) is a result, said as such; a crash is not.
    rows += [row("adpsgd", 0, 0.0, study.DIVERGED), row("adpsgd", 1, 0.0, study.DIVERGED),
             row("hadpsgd", 0, 0.0, study.DIVERGED), row("hadpsgd", 1, 58.0),
             row("single", 0, 0.0, "train exit 1")]
    lines = study.report(rows).splitlines()
    assert "| adpsgd | 4 | diverged / diverged | — |" in "\n".join(lines)
    hadpsgd = next(line for line in lines if line.startswith("| hadpsgd |"))
    assert "| diverged / 58.0 | 58.00 (1 seed) |" in hadpsgd
    assert not any(line.startswith("| single |") for line in lines)


def test_an_unknown_configuration_or_a_missing_build_is_refused(tmp_path, capsys):
    assert study.main([str(tmp_path), str(tmp_path / "runs"), "--configs", "nope"]) == 2
    assert "unknown configuration(s) nope" in capsys.readouterr().err
    assert study.main([str(tmp_path), str(tmp_path / "runs")]) == 2
    assert "run examples/speechocean/build.py first" in capsys.readouterr().err


def test_a_cell_is_claimed_by_one_live_driver_and_a_dead_drivers_claim_is_taken(tmp_path):
    claim = tmp_path / "ssgd-w4-s0.claim"
    assert study._claim(claim) and claim.read_text() == str(os.getpid())
    assert not study._claim(claim)  # held by a live process (this one)
    claim.write_text("999999999")  # no such process
    assert study._claim(claim) and claim.read_text() == str(os.getpid())


def test_dev_picks_the_prior_and_acoustic_scale_pair_and_redecode_does_not_train(
        tmp_path, monkeypatch):
    # The commands are recorded, not run: a decode writes a dev WER that is lowest at prior
    # scale 0.5 and acoustic scale 0.2, so test must be forwarded at 0.5 and decoded at 0.2.
    commands: list[list[str]] = []
    wer = {("1", "0.15"): 60.0, ("1", "0.2"): 59.0, ("0.5", "0.15"): 58.5, ("0.5", "0.2"): 57.0}

    def fake_run(cmd, log, timeout):
        commands.append(cmd)
        if "hadpsgd.decode" in cmd:
            ll, out = cmd[cmd.index("hadpsgd.decode") + 1], cmd[cmd.index("--json") + 1]
            ps = ll.split(".ps")[1].rsplit(".ll", 1)[0] if ".ps" in ll else "1"
            scale = cmd[cmd.index("--acoustic-scale") + 1]
            score = {"wer": wer.get((ps, scale), 99.0), "ref_words": 10, "sentences": 2}
            with open(out, "w") as f:
                json.dump({"score": score}, f)
        return 0

    monkeypatch.setattr(study, "_run", fake_run)
    scored = []
    monkeypatch.setattr(study, "frame_stats", lambda *a: scored.append(a) or {"frame_acc": 0.5})
    build, runs = tmp_path / "build", tmp_path / "runs"
    build.mkdir()
    args = study.build_parser().parse_args([str(build), str(runs), "--scales", "0.15,0.2",
                                            "--prior-scales", "1,0.5"])
    run = runs / "ssgd-w4-s0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "epoch": 0,
                                                   "heldout_loss": 2.0}) + "\n")
    test = (build / "test-every4.h5", build / "test-every4.text")
    row = study.run_cell("ssgd", 4, 0, args, test)
    assert row["status"] == "ok" and (row["prior_scale"], row["scale"]) == (0.5, 0.2)
    assert row["dev_wer"] == {0.15: 58.5, 0.2: 57.0}
    assert row["dev_grid"] == {"1.0": {0.15: 60.0, 0.2: 59.0}, "0.5": {0.15: 58.5, 0.2: 57.0}}
    assert any("hadpsgd.launch" in c for c in commands)
    forward_test = [c for c in commands if "hadpsgd.forward" in c and str(test[0]) in c]
    assert len(forward_test) == 1 and forward_test[0][-1] == "0.5"
    decode_test = [c for c in commands if "hadpsgd.decode" in c and str(test[1]) in c]
    assert len(decode_test) == 1 and decode_test[0][decode_test[0].index(
        "--acoustic-scale") + 1] == "0.2"
    # The frames are scored from the test forward's own file, at its prior exponent.
    assert scored == [(run / "test.ll.h5", test[0], run / "priors.json", 0.5)]
    assert row["test_frames"] == {"frame_acc": 0.5}

    commands.clear()
    args.redecode = True
    assert study.run_cell("ssgd", 4, 0, args, test)["status"] == "not trained " \
        "(--redecode decodes trained runs only)"  # no checkpoints yet: nothing to decode
    (run / "checkpoints").mkdir()
    assert study.run_cell("ssgd", 4, 0, args, test)["scale"] == 0.2
    assert not any("hadpsgd.launch" in c for c in commands)


def test_a_grid_of_scales_that_cannot_decode_is_refused_before_any_training(tmp_path, capsys):
    for flags, named in ((["--prior-scales", "0.5,-1"], "--prior-scales 0.5,-1: give"),
                         (["--scales", "0.1,x"], "--scales 0.1,x: give")):
        assert study.main([str(tmp_path / "build"), str(tmp_path / "runs"), *flags]) == 2
        assert named in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


#: A signtopk config's suffix -> where its rounding goes and how much the model takes back.
_RESIDUAL_BY_SUFFIX = {"": ("model", 0.5), "-ef": ("delta", None), "-keep75": ("model", 0.75),
                       "-keep25": ("model", 0.25),
                       "-keep": ("model", 1.0), "-keep-single": ("model", 1.0)}


def test_every_signtopk_config_sends_the_share_block_and_residual_its_name_says():
    from hadpsgd.comm.signtopk import signtopk_shape
    from hadpsgd.config import parse_config

    named = {n: re.fullmatch(r"bmuf-signtopk(\d+)-tau(\d+)(-(?!rpn).*?)?(?:-rpn(\d+))?", n)
             for n in study.CONFIGS}
    named = {n: m for n, m in named.items() if m}
    # The curves past 1,000x (4 nodes, 4 nodes of 4) and the 16-node share screen are
    # among them.
    assert {"bmuf-signtopk56-tau8", "bmuf-signtopk28-tau8", "bmuf-signtopk22-tau8",
            "bmuf-signtopk18-tau8", "bmuf-signtopk48-tau16", "bmuf-signtopk18-tau8-ef",
            "bmuf-signtopk18-tau8-keep75", "bmuf-signtopk18-tau8-keep25",
            "bmuf-signtopk92-tau4-ef",
            "bmuf-signtopk184-tau4-ef", "bmuf-signtopk20-tau8-rpn4"} <= set(named)
    for name, m in named.items():
        config = parse_config(study.CONFIGS[name][1])
        bmuf = config.algo_options()
        assert signtopk_shape(4096, bmuf.topk_fraction)[2] == int(m[1]), name  # the k it says
        assert bmuf.sync_period == int(m[2]), name
        assert (bmuf.residual, bmuf.residual_keep) == _RESIDUAL_BY_SUFFIX[m[3] or ""], name
        assert config.comm.ranks_per_node == int(m[4] or 1), name  # the nodes it says
    topk = parse_config(study.CONFIGS["bmuf-topk"][1]).algo_options()
    assert (topk.wire, topk.topk_fraction, topk.sync_period) == ("topk", None, None)  # defaults
