"""The public API without processes: options in the caller's words, state, samplers, fp16."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import hadpsgd
from hadpsgd.algorithms import ADPSGDOptions, BMUFOptions
from hadpsgd.api import OptionError, ShardSampler
from hadpsgd.api.options import check_layout
from hadpsgd.api.samplers import make_sampler
from tests._mpi import ROOT
from tests.fakes import OneLearner


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _dist(algo: str = "ssgd", seed: int = 0, **kw) -> hadpsgd.Distributed:
    net = _model(seed)
    return hadpsgd.Distributed(net, torch.optim.Adam(net.parameters(), lr=0.01), algo,
                               topology=OneLearner(), **kw)


DATA = torch.Generator().manual_seed(1)
X, Y = torch.randn(40, 5, generator=DATA), torch.randint(0, 3, (40,), generator=DATA)


def _train(dist: hadpsgd.Distributed, sampler: ShardSampler, steps: int) -> None:
    """A user's loop over epochs, from the sampler's epoch on, until ``steps`` in all."""
    epoch = sampler.epoch
    while dist.steps < steps:
        sampler.set_epoch(epoch)
        for idx in sampler:
            with dist.autocast():
                loss = nn.functional.cross_entropy(dist.model(X[idx]).float(), Y[idx])
            dist.zero_grad()
            dist.scale(loss).backward()
            dist.step(loss)
            if dist.steps == steps:
                return
        epoch += 1


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


# ---------------------------------------------------------------------- the package
def test_import_hadpsgd_stays_light_and_names_the_api():
    # The decoder's tools import hadpsgd without torch; the API's names load on first use.
    code = ("import sys, hadpsgd; assert 'torch' not in sys.modules; "
            "[getattr(hadpsgd, n) for n in hadpsgd.__all__]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "True"
    assert set(hadpsgd.__all__) <= set(dir(hadpsgd))
    assert hadpsgd.Distributed.__module__ == "hadpsgd.api.distributed"
    assert hadpsgd.StepResult is hadpsgd.algorithms.StepResult
    with pytest.raises(AttributeError):
        hadpsgd.no_such_name  # noqa: B018


# ---------------------------------------------------------------------- options
@pytest.mark.parametrize(("kw", "option", "says"), [
    ({"algo": "dpsgd"}, "algo", "registered: adpsgd, bmuf, ssgd"),
    ({"algo": "bmuf", "sync_period": 0}, "sync_period", "sync_period must be > 0"),
    ({"algo": "bmuf", "sync_period": "8"}, "sync_period", "must be None or int"),
    ({"algo": "bmuf", "nesterov": 1}, "nesterov", "must be bool"),
    ({"algo": "bmuf", "block_momentum": 1.0}, "block_momentum", "block_momentum must be in"),
    ({"algo": "bmuf", "fragments": 5, "sync_period": 4}, "fragments", "more than sync_period"),
    ({"algo": "bmuf", "adam_moments": "mean"}, "adam_moments", "adam_moments must be one of"),
    ({"algo": "bmuf", "worker_lr": "all"}, "worker_lr", "worker_lr must be one of"),
    ({"algo": "adpsgd", "max_staleness": -1}, "max_staleness", "max_staleness must be >= 0"),
    ({"algo": "adpsgd", "wire": "fp8"}, "wire", "wire must be one of fp32, bf16, int8"),
    ({"algo": "ssgd", "sync_period": 8}, "sync_period",
     "ssgd has no option sync_period (an option of bmuf)."),
    ({"algo": "bmuf", "sync_perod": 8}, "sync_perod",
     "bmuf has no option sync_perod; did you mean sync_period?"),
    ({"algo": "bmuf", "precison": "bf16"}, "precison", "did you mean precision?"),
    ({"algo": "adpsgd", "wire": "sign", "topk_fraction": 0.1}, "topk_fraction",
     "topk_fraction is read by wire topk or wire signtopk only, not by wire sign"),
    ({"algo": "adpsgd", "wire": "int8", "gossip_step": 0.5}, "gossip_step",
     "gossip_step is read by wire sign or wire topk or wire signtopk only, not by wire "
     "int8"),
    ({"algo": "bmuf", "topk_fraction": 0.1}, "topk_fraction", "not by wire fp32"),
    ({"precision": "fp8"}, "precision", "precision must be one of fp32, bf16, fp16"),
    ({"grad_wire": "int8"}, "grad_wire", "grad_wire must be one of"),
    ({"overlap": 1}, "overlap", "overlap must be"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm", "max_grad_norm must be"),
    ({"grad_bucket_mb": 0}, "grad_bucket_mb", "grad_bucket_mb must be"),
])
def test_a_bad_option_is_refused_naming_the_keyword(kw, option, says):
    with pytest.raises(OptionError) as err:
        _dist(**kw)
    assert err.value.option == option
    assert says in str(err.value)
    assert "--" not in str(err.value)  # the keyword the caller wrote, not the CLI's flag
    assert isinstance(err.value, ValueError)


def test_options_reach_the_algorithm_as_its_own_dataclass():
    dist = _dist("bmuf", sync_period=3, block_lr=1, max_grad_norm=2)
    assert dist.options.sync_period == 3 and dist.options.block_lr == 1
    assert dist.algorithm.max_grad_norm == 2.0 and dist.algo == "bmuf"
    dist.close()
    dist.close()  # idempotent


def test_options_may_come_built_as_the_cli_builds_them():
    dist = _dist("bmuf", options=BMUFOptions(sync_period=5))
    assert dist.options.sync_period == 5
    with pytest.raises(OptionError, match="BMUFOptions for bmuf") as err:
        _dist("bmuf", options=ADPSGDOptions())
    assert err.value.option == "options"
    with pytest.raises(OptionError, match="not both"):
        _dist("bmuf", options=BMUFOptions(), sync_period=3)


def test_super_learners_must_be_what_the_options_ask_for():
    opts = ADPSGDOptions(super_learner_size=1)
    check_layout(opts, SimpleNamespace(node_sizes=[1, 1, 1], size=3))
    check_layout(ADPSGDOptions(super_learner_size=2), SimpleNamespace(node_sizes=[2, 2, 1],
                                                                      size=5))
    with pytest.raises(OptionError, match=r"hadpsgd.init\(ranks_per_node=1\)") as err:
        check_layout(opts, SimpleNamespace(node_sizes=[2, 2], size=4))
    assert err.value.option == "super_learner_size"


def test_a_model_elsewhere_or_outside_the_optimizer_is_refused():
    net = _model().to("meta")
    with pytest.raises(ValueError, match="model.to"):
        hadpsgd.Distributed(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            topology=OneLearner())
    net = _model()
    with pytest.raises(OptionError, match=r"2 trainable parameters of the model are not in "
                                          r"the optimizer \(2.weight, 2.bias\)") as err:
        hadpsgd.Distributed(net, torch.optim.SGD(net[0].parameters(), lr=0.1),
                            topology=OneLearner())
    assert err.value.option == "optimizer"  # said once, exit 2, as every option error


class _RankZeroIsZeros(OneLearner):
    """One learner whose broadcasts bring rank 0's values: zeros, unlike any rank's own."""

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return tensor.zero_()


@pytest.mark.parametrize("algo", ["ssgd", "bmuf"])
def test_frozen_parameters_start_as_rank_zeros_too(algo):
    """A frozen layer (a fixed random projection, seeded by rank) is broadcast as the rest."""
    net = _model(seed=3)
    net[0].requires_grad_(False)
    hadpsgd.Distributed(net, torch.optim.SGD(net[2].parameters(), lr=0.1), algo,
                        topology=_RankZeroIsZeros())
    assert not net[0].weight.any() and not net[0].bias.any()
    assert not net[2].weight.any()


# ---------------------------------------------------------------------- state
@pytest.mark.parametrize(("algo", "kw"), [("ssgd", {}), ("bmuf", {"sync_period": 3}),
                                          ("ssgd", {"precision": "fp16"})])
def test_state_round_trip_is_exact(algo, kw):
    k = 7  # 10 steps per epoch of 4: mid-epoch, and mid-block for tau 3
    straight = _dist(algo, **kw)
    _train(straight, straight.sampler(40, 4, seed=2), 2 * k)

    first = _dist(algo, **kw)
    _train(first, first.sampler(40, 4, seed=2), k)
    buf = io.BytesIO()
    torch.save({"user": 1, "hadpsgd": first.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["hadpsgd"]
    assert state["sampler"] == {"epoch": 0, "step": k}

    resumed = _dist(algo, seed=5, **kw)  # other weights: the load restores them
    resumed.load_state_dict(state)  # before the sampler is made: it is kept for it
    sampler = resumed.sampler(40, 4, seed=2)
    assert (sampler.epoch, resumed.steps) == (0, k)
    _train(resumed, sampler, 2 * k)
    assert torch.equal(_flat(resumed.model), _flat(straight.model))
    with resumed.evaluation_model() as a, straight.evaluation_model() as b:
        assert torch.equal(_flat(a), _flat(b))
    assert resumed.metrics()["steps"] == 2 * k
    if kw.get("precision") == "fp16":
        assert resumed.loss_scale == straight.loss_scale == 2.0**16


def test_a_state_of_another_algorithm_or_layout_is_refused():
    state = _dist("bmuf").state_dict()
    with pytest.raises(ValueError, match="algo='bmuf'"):
        _dist("ssgd").load_state_dict(state)
    state["layout"]["size"] = 4
    with pytest.raises(ValueError, match="saved by 4 learners"):
        _dist("bmuf").load_state_dict(state)
    with pytest.raises(ValueError, match="not a hadpsgd.Distributed state"):
        _dist("bmuf").load_state_dict({"model": {}})


def test_a_state_saved_with_other_options_is_refused_unless_not_strict():
    state = _dist("bmuf", sync_period=3).state_dict()
    assert state["options"]["sync_period"] == 3
    with pytest.raises(ValueError, match=r"other bmuf options: sync_period=5 \(the state has "
                                         r"3\).*strict=False"):
        _dist("bmuf", sync_period=5).load_state_dict(state)
    _dist("bmuf", sync_period=5).load_state_dict(state, strict=False)
    _dist("bmuf", sync_period=3).load_state_dict(state)
    del state["options"]  # saved before options were recorded: not compared
    _dist("bmuf", sync_period=5).load_state_dict(state)


# ---------------------------------------------------------------------- a step
def test_fp16_scales_the_loss_and_halves_on_overflow():
    dist = _dist(precision="fp16")
    assert dist.loss_scale == 2.0**16
    loss = nn.functional.cross_entropy(dist.model(X[:4]), Y[:4])
    assert torch.equal(dist.scale(loss), loss * 2.0**16)
    (dist.scale(loss) * 2.0**200).backward()  # an overflow the scale has to search past
    result = dist.step(loss)
    assert result.skipped and result.overflow and not result.finite
    assert dist.loss_scale == 2.0**15 and dist.metrics()["overflow_steps"] == 1
    fp32 = _dist()
    assert fp32.loss_scale == 1.0 and fp32.scale(loss) is loss


def test_bmuf_evaluates_its_global_model_and_gives_the_local_one_back():
    dist = _dist("bmuf", sync_period=4)
    _train(dist, dist.sampler(40, 4, seed=0), 5)  # one step into the second block
    local = _flat(dist.model)
    with dist.evaluation_model() as model:
        assert not torch.equal(_flat(model), local)
    assert torch.equal(_flat(dist.model), local)
    dist.finish()  # the partial block joins the global model
    with dist.evaluation_model() as model:
        assert torch.equal(_flat(model), _flat(dist.model))


# ---------------------------------------------------------------------- samplers
def test_shard_sampler_resumes_once_at_the_saved_step():
    sampler = ShardSampler(40, 4, rank=0, world_size=1, seed=0)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.load_state_dict({"epoch": 3, "step": 6})
    sampler.set_epoch(3)
    assert list(sampler) == full[6:]
    sampler.set_epoch(3)  # a later epoch start begins at its first step again
    assert list(sampler) == full
    for _ in range(len(sampler)):
        sampler.stepped()
    assert sampler.state_dict() == {"epoch": 4, "step": 0}


@pytest.mark.parametrize(("args", "says"), [((0, 4, 0), "num_samples"), ((40, 0, 0), "batch_size"),
                                            ((40, 4, -1), "seed"), ((3, 4, 0), "global batch")])
def test_a_sampler_that_cannot_work_is_refused(args, says):
    with pytest.raises(ValueError, match=says):
        make_sampler(OneLearner(), False, *args)


def test_state_dict_is_sharded_by_default_and_a_huge_gather_is_refused(monkeypatch):
    """Issue 44: ``state_dict()`` keeps each node's own part (as the CLI's checkpoints); a
    gather of node parts past the limit is refused before any message, naming the sharded
    call (the > 2 GiB gather crashed)."""
    import inspect

    from hadpsgd.api import state as st

    assert inspect.signature(hadpsgd.Distributed.state_dict).parameters["gather"].default \
        is False
    part = {"theta": torch.zeros(1000), "moments": [torch.zeros(500)]}
    st._gatherable(part)  # 6 kB: fine
    monkeypatch.setattr(st, "GATHER_LIMIT", 5000)
    with pytest.raises(ValueError, match=r"too large to gather.*state_dict\(\) \(sharded"):
        st._gatherable(part)


@pytest.mark.parametrize("moments", ["corrected", "local"])
def test_bmuf_resumes_exactly_in_another_flat_order(monkeypatch, moments):
    """Issue 44: BMUF's flat state (theta, theta_init, Delta, the moments' start) follows the
    flat buffer's order, which is cuDNN's on CUDA and the module's on CPU. A state written in
    one order and loaded in another (here: the buffer reversed, as a CUDA checkpoint resumed
    on CPU) must continue exactly as the run that wrote it, mid-block."""
    import hadpsgd.algorithms.base as base

    kw = dict(sync_period=3, adam_moments=moments, block_momentum=0.5, nesterov=True)
    k = 7  # mid-epoch and mid-block
    straight = _dist("bmuf", **kw)
    _train(straight, straight.sampler(40, 4, seed=2), 2 * k)
    first = _dist("bmuf", **kw)
    _train(first, first.sampler(40, 4, seed=2), k)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)

    real = base.FlatBuffer
    monkeypatch.setattr(base, "FlatBuffer", lambda params, kind, own_storage: real(
        list(reversed(params)), kind=kind, own_storage=own_storage))
    again = _dist("bmuf", seed=9, **kw)  # other weights: the load must restore them
    assert again.algorithm.flat_layout() != first.algorithm.flat_layout()
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    _train(again, again.sampler(40, 4, seed=2), 2 * k)
    want, got = straight.model.state_dict(), again.model.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)
    with straight.evaluation_model() as a, again.evaluation_model() as b:
        want, got = a.state_dict(), b.state_dict()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)


def test_a_bmuf_state_of_another_model_or_packed_by_position_is_refused():
    from hadpsgd.algorithms.bmuf.relayout import moves, relayout_state

    a = [["w", "torch.float32", 0, 4], ["b", "torch.float32", 4, 2]]
    b = [["b", "torch.float32", 0, 2], ["w", "torch.float32", 2, 4]]
    assert moves(a, b) == {"torch.float32": [(4, 0, 2), (0, 2, 4)]}
    with pytest.raises(ValueError, match="another model.*w"):
        moves(a, [["w", "torch.float32", 0, 5], ["b", "torch.float32", 5, 2]])
    with pytest.raises(ValueError, match="packed by position"):
        relayout_state({"pending": {0: {}}}, a, b)


def test_a_warning_under_the_api_names_the_scripts_knobs_not_the_runs_flags():
    import warnings

    from hadpsgd.api.options import api_words
    from hadpsgd.cli import install_warning_format

    said = ("bmuf with a single super-learner is synchronous SGD; set --ranks-per-node 1 for "
            "one worker per rank or --ranks-per-node K for workers of K ranks. Leave "
            "--sync-period out, or --sync-period 4 with --bmuf-overlap; --epochs 3")
    assert api_words(said) == (
        "bmuf with a single super-learner is synchronous SGD; set hadpsgd.init("
        "ranks_per_node=1) (or HADPSGD_RANKS_PER_NODE=1) for one worker per rank or "
        "hadpsgd.init(ranks_per_node=K) (or HADPSGD_RANKS_PER_NODE=K) for workers of K ranks. "
        "Leave sync_period out, or sync_period=4 with block_overlap; --epochs 3")
    before = warnings.formatwarning
    try:
        install_warning_format(api_words)
        line = warnings.formatwarning("set --ranks-per-node 1", RuntimeWarning,
                                      "/x/hadpsgd/algorithms/bmuf/algorithm.py", 124)
        install_warning_format()  # the run's own: its flags stay
        run = warnings.formatwarning("set --ranks-per-node 1", RuntimeWarning,
                                     "/x/hadpsgd/algorithms/bmuf/algorithm.py", 124)
    finally:
        warnings.formatwarning = before
    assert line == ("[hadpsgd] warning: set hadpsgd.init(ranks_per_node=1) "
                    "(or HADPSGD_RANKS_PER_NODE=1)\n")
    assert run == "[hadpsgd] warning: set --ranks-per-node 1\n"
