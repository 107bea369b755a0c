"""The base class every training algorithm derives from, and the name registry behind ``--algo``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from hadpsgd.algorithms.gradsync import DEFAULT_GRAD_BUCKET_MB, GradSync
from hadpsgd.cli import ConfigError, flag
from hadpsgd.comm import FlatBuffer, Topology, cudnn_weight_groups
from hadpsgd.comm.overlap import Scope


@dataclass
class AlgoOptions:
    """Base of an algorithm's command-line options (a dataclass beside the algorithm).

    Field names are the flags (``sync_period`` -> ``--sync-period``), field docstrings their
    help, ``__post_init__`` their validation (raising :class:`hadpsgd.cli.ConfigError` that
    names the flag). The run configuration and the sweep tool read them from the registry.
    """

    def check_choices(self) -> None:
        """Refuse a field outside the ``choices`` its metadata declares, naming the flag.

        The generated CLI already restricts such flags; this catches ``--config`` files and
        direct construction. Call it from ``__post_init__``.

        Raises:
            ConfigError: For the first such field.
        """
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ConfigError(f"{flag(f.name)} must be one of {', '.join(choices)}, got "
                                  f"{value!r}")

    def algorithm_kwargs(self) -> dict[str, Any]:
        """The constructor keywords these options stand for (default: the fields as they are)."""
        return dataclasses.asdict(self)

    def ranks_per_node(self) -> int | None:
        """Learners per super-learner this algorithm asks for (None: the nodes as they are)."""
        return None

    # One line for --help: the defaults recipe() sets (empty if none). A comment, not a
    # docstring, so that the generated CLI does not take it for an option.
    recipe_help: ClassVar[str] = ""

    @classmethod
    def recipe(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults this algorithm gives to options the user did not set.

        Args:
            given: The options set on the command line (flag names with ``_``).

        Returns:
            Option name -> value, only for options absent from ``given``; shared options
            (``optimizer``, ``beta1``) as well as the algorithm's own.
        """
        return {}


@dataclass(frozen=True)
class AlgoSpec:
    """A registry entry: what ``--algo NAME`` builds and which options it reads."""

    name: str
    description: str
    """One line for ``--help`` and the docs."""
    cls: type[Algorithm]
    options: type[AlgoOptions]


_REGISTRY: dict[str, AlgoSpec] = {}
A = TypeVar("A", bound="type[Algorithm]")


def register(name: str, description: str | None = None) -> Callable[[A], A]:
    """Class decorator that makes an algorithm available as ``build(name, ...)`` / ``--algo``.

    The entry carries the class's ``Options`` dataclass and a one-line description (default:
    the first line of the class docstring).
    """

    def deco(cls: A) -> A:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"algorithm name {name!r} is already registered")
        line = description or (cls.__doc__ or name).strip().split("\n")[0]
        _REGISTRY[name] = AlgoSpec(name, line, cls, cls.Options)
        cls.name = name
        return cls

    return deco


def names() -> list[str]:
    """Registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def specs() -> list[AlgoSpec]:
    """Every registry entry, sorted by name."""
    return [_REGISTRY[n] for n in names()]


def spec(name: str) -> AlgoSpec:
    """The registry entry of ``name``.

    Raises:
        ValueError: If ``name`` is unknown; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; registered: {', '.join(names())}"
        ) from None


def get(name: str) -> type[Algorithm]:
    """The class registered under ``name`` (see :func:`spec`)."""
    return spec(name).cls


def build(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology,
          **options: Any) -> Algorithm:
    """Construct the algorithm registered under ``name`` (see :func:`get`)."""
    return get(name)(model, optimizer, topo, **options)


class Algorithm:
    """Wraps a model and a ``torch.optim`` optimizer and keeps the replicas in agreement.

    Subclasses implement :meth:`step`; the constructor broadcasts rank 0's parameters so
    every replica starts identical, and puts the gradients into one flat buffer per dtype.

    Args:
        model: The local replica.
        optimizer: An ordinary optimizer over ``model``'s parameters.
        topo: The communication topology from :func:`hadpsgd.comm.init`.
        max_grad_norm: Clip the (synchronised) gradient to this global L2 norm; 0 disables.
        overlap: Reduce gradient buckets during backward (see :class:`GradSync`): True or
            ``on``, False or ``off``, or ``auto`` (on when the model is on a GPU).
        grad_bucket_mb: Gradient bucket size in MiB.
    """

    name: str = "base"
    Options: type[AlgoOptions] = AlgoOptions
    """This algorithm's command-line options (none beyond the shared ones by default)."""
    divergence_hint: str = ""
    """This algorithm's advice when its run diverges (a sentence, or empty)."""

    @classmethod
    def options_of(cls, algo_cfg: Any) -> AlgoOptions:
        """This algorithm's options, picked from a run configuration's ``algo`` section."""
        return cls.Options(**{f.name: getattr(algo_cfg, f.name)
                              for f in dataclasses.fields(cls.Options)})

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 topo: Topology, max_grad_norm: float = 0.0, overlap: bool | str = "auto",
                 grad_bucket_mb: float = DEFAULT_GRAD_BUCKET_MB) -> None:
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables), got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        self.model = model
        self.optimizer = optimizer
        self.topo = topo
        self.steps = 0
        """Steps taken by this learner (including skipped non-finite ones)."""
        self.skipped_steps = 0
        """Steps whose synchronised gradient was not finite, so no update was applied."""
        self.local_nonfinite = False
        """Whether this learner's own gradient (before any reduction) was non-finite in the
        last step: it names the origin of a NaN that the reduction spreads to its peers."""
        self.last_loss = float("nan")
        """The loss given to the last :meth:`step`, as a float (NaN if none was)."""
        self._closed = False
        params = [p for p in model.parameters() if p.requires_grad]
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(params) if id(p) not in owned]
        if missing:
            raise ValueError(
                f"{type(self).__name__}: {len(missing)} trainable parameters of the model are "
                "not in the optimizer; build the optimizer from model.parameters()"
            )
        # On CUDA each LSTM's weights get a storage of their own inside the flat buffer, the
        # layout cuDNN runs in place (else it copies every weight at every forward).
        groups = cudnn_weight_groups(model) if params and params[0].is_cuda else []
        self.params = FlatBuffer(params, kind="data", own_storage=groups)
        self.gradsync = GradSync(params, topo, self.grad_scope, bucket_mb=grad_bucket_mb,
                                 overlap=overlap)
        self.grads = self.gradsync.flat
        self._check = None
        for buf in self.params.buffers.values():
            topo.broadcast_(buf, root=0)

    asynchronous = False
    """Whether learners step at their own pace (ADPSGD): the training loop then gives them a
    shared work-conserving data pool and keeps every global collective off the step path."""

    separate_eval_model = False
    """Whether :meth:`evaluation_parameters` differs from the local replica (BMUF), so that a
    checkpoint must store both."""

    def step(self, loss: torch.Tensor | None = None) -> None:
        """Apply this step's gradients: the template every algorithm follows.

        Reduce the gradients as the algorithm says (:meth:`reduce_grads`: the buckets that
        backward already handed to the comm layer, then the rest), read in one host
        synchronisation whether they are finite (this learner's own, which names the origin
        of a NaN, and the reduced one) and their norm, apply the update
        (:meth:`apply_update`, a no-op on every learner that shares a non-finite gradient),
        count the step, then the algorithm's own work between steps (:meth:`after_step`:
        block sync, gossip).

        Args:
            loss: The step's loss; given, it is read in the same synchronisation and left
                in :attr:`last_loss` (so the training loop needs no second one).
        """
        self.reduce_grads()
        self._check = self.gradsync.check(norm=self.max_grad_norm > 0, loss=loss)
        self.local_nonfinite = not self._check.local_finite
        self.last_loss = self._check.loss
        self.apply_update()
        self.steps += 1
        self.after_step()

    def grad_scope(self) -> Scope:
        """Over which learners this step's gradients are averaged: ``world``, ``node`` or None.

        Asked once per step, when its first gradient bucket is reduced (during backward when
        the reduction overlaps it), so it must not change between backward and :meth:`step`.
        """
        return "world"

    def reduce_grads(self) -> None:
        """Finish averaging the gradient buffers over :meth:`grad_scope`'s learners."""
        self.gradsync.finish()

    def apply_update(self) -> None:
        """Take the (clipped) optimizer step unless the reduced gradient is non-finite."""
        self.apply_grads()

    def after_step(self) -> None:  # noqa: B027 - SSGD has nothing to do between steps
        """The algorithm's work after a counted step (block sync, gossip); none by default."""

    def apply_grads(self) -> bool:
        """Clip and take the optimizer step, unless the (synchronised) gradient is non-finite.

        Every learner that applies the same reduced gradient reaches the same verdict, so
        they skip the step together without another message; the step still counts, which
        keeps periodic collectives (BMUF's block sync, the loop's control points) aligned.

        Returns:
            Whether the update was applied.
        """
        check = self._check if self._check is not None else self.gradsync.check(
            norm=self.max_grad_norm > 0)
        self._check = None
        if not check.finite:
            self.skipped_steps += 1
            return False
        self.clip_grads_(check.norm)
        self.optimizer.step()
        return True

    def clip_grads_(self, norm: float) -> None:
        """Scale the gradients down to ``max_grad_norm`` if their global norm exceeds it.

        The norm comes with the step's one synchronisation (:meth:`GradSync.check`), taken
        after the reduction so that every replica scales identically.
        """
        if self.max_grad_norm > 0 and norm > self.max_grad_norm:
            for buf in self.grads.buffers.values():
                buf.mul_(self.max_grad_norm / (norm + 1e-6))

    def zero_grad(self) -> None:
        """Zero all gradients (in the flat buffer, keeping the views)."""
        self.gradsync.zero_()

    def sync(self) -> None:  # noqa: B027 - a no-op is right for always-synchronous algorithms
        """Force agreement of the replicas now (before evaluation and checkpoints)."""

    def finish(self) -> None:
        """End of training (before the final evaluation and checkpoint): by default a sync.

        BMUF closes its last, partial block here, which it never does mid-run.
        """
        self.sync()

    @contextlib.contextmanager
    def evaluation_parameters(self) -> Iterator[nn.Module]:
        """Context in which ``self.model`` holds the parameters to evaluate and deploy.

        For SSGD that is the local replica. Algorithms that keep a separate global model
        (BMUF's theta_n) swap it in here and restore the local parameters on exit.
        """
        yield self.model

    def update_batch(self, per_learner: int) -> int:
        """Sub-sequences behind one optimizer update: what the LR recipe scales with.

        All learners' batches for synchronous SGD and (h-adpsgd paper, section 3) for ADPSGD;
        BMUF overrides it with its super-learner's batch.
        """
        return per_learner * self.topo.size

    def restart_from_model(self) -> None:  # noqa: B027 - stateless algorithms need nothing
        """Re-derive the algorithm's own state from the current parameters.

        Called after weights were loaded from a checkpoint of another algorithm or world
        size (``--allow-resume-change``), when the algorithm's saved state does not apply.
        """

    def metrics(self) -> dict[str, float]:
        """Algorithm-specific figures for the training log (empty by default)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the algorithm's counters and the optimizer state."""
        return {"name": self.name, "steps": self.steps, "skipped_steps": self.skipped_steps,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: If the state was saved by another algorithm.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint was written by algorithm {state.get('name')!r}, not {self.name!r}; "
                f"resume with --algo {state.get('name')}"
            )
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.optimizer.load_state_dict(state["optimizer"])

    def node_state(self) -> dict[str, Any] | None:
        """What differs between super-learners and must be saved per node, or None.

        A checkpoint holds rank 0's :meth:`state_dict` and the model's parameters; an
        algorithm whose super-learners part ways between agreements (BMUF mid-block) returns
        here what each node needs to resume exactly. Called on every rank, with the same
        None-or-not answer everywhere.
        """
        return None

    def load_node_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - no node state
        """Restore this node's part of :meth:`node_state` (after :meth:`load_state_dict`)."""

    def close(self) -> None:
        """Finish in-flight communication on every rank; idempotent."""
        self._closed = True
        self.gradsync.close()

    def __enter__(self) -> Algorithm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # On an error the peers may be gone: closing would wait for them (up to the deadline)
        # and bury the real error under a timeout. The caller aborts the job instead.
        if exc_type is None:
            self.close()
