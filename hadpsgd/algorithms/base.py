"""The base class every training algorithm derives from: the step template and its verdict."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hadpsgd.algorithms.buffers import ModelBuffers
from hadpsgd.algorithms.gradsync import (
    DEFAULT_GRAD_BUCKET_MB,
    GradCheck,
    GradSync,
    internode_share,
)
from hadpsgd.algorithms.options import AlgoOptions
from hadpsgd.algorithms.scaler import LossScaler
from hadpsgd.comm import FlatBuffer, World, cudnn_weight_groups
from hadpsgd.comm.overlap import GradScope
from hadpsgd.precision import check_precision


def params_missing_from(model: nn.Module, optimizer: Any) -> list[str]:
    """The names of ``model``'s trainable parameters that ``optimizer`` does not update."""
    owned = {id(p) for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    return [name for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in owned]


def broadcast_frozen(model: nn.Module, topo: World, root: int = 0) -> None:
    """Give every learner ``root``'s parameters that do not require a gradient.

    A frozen layer or a fixed random projection is in no flat buffer (nothing trains it), so
    the flat buffers' broadcast misses it, and each rank would keep what its own seed drew:
    replicas that differ for the whole run. One message per device and dtype.

    Args:
        model: The local replica.
        topo: The communication topology.
        root: The rank whose values every learner takes.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            groups.setdefault((p.device, p.dtype), []).append(p.data)
    for tensors in groups.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        topo.broadcast_(flat, root=root)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def missing_params_message(missing: list[str]) -> str:
    """What to say of :func:`params_missing_from`'s names: how many, the first few, the fix."""
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                       else "")
    return (f"{len(missing)} trainable parameters of the model are not in the optimizer "
            f"({shown}): build the optimizer from model.parameters()")


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`Algorithm.step` found and did: the verdict the training loop reads."""

    loss: float
    """The loss given to the step, as a float (NaN if none was given)."""
    finite: bool
    """Whether the reduced gradient was finite (every learner that shares it agrees)."""
    local_finite: bool
    """Whether this learner's own gradient was finite before any reduction: a False here
    names the origin of a NaN that the reduction spread to its peers."""
    norm: float
    """The reduced gradient's global L2 norm (NaN unless clipping asked for it)."""
    skipped: bool
    """Whether no update was applied (the reduced gradient was not finite)."""
    overflow: bool = False
    """fp16: the skip was the loss scale's search (the gradient overflowed at the scale, which
    was halved on every learner that shares the step), not non-finite data."""


class Algorithm:
    """Wraps a model and a ``torch.optim`` optimizer and keeps the replicas in agreement.

    Subclasses implement :meth:`step`; the constructor broadcasts rank 0's parameters (the
    frozen ones too) and buffers so every replica starts identical, and puts the gradients into
    one flat buffer per dtype. The model's buffers (BatchNorm's running statistics) live in one
    memory per device (:class:`~hadpsgd.algorithms.buffers.ModelBuffers`), kept in agreement as
    each algorithm says unless the options' ``sync_buffers`` is False: by default (SSGD) every
    learner takes rank 0's after each step, as DDP's ``broadcast_buffers``.

    Args:
        model: The local replica.
        optimizer: An ordinary optimizer over ``model``'s parameters.
        topo: The communication topology from :func:`hadpsgd.comm.init`.
        options: This algorithm's :attr:`Options`, built and validated (by the run
            configuration); or leave it out and give them as keywords (``option_values``).
        max_grad_norm: Clip the (synchronised) gradient to this global L2 norm; 0 disables.
        overlap: Reduce gradient buckets during backward (see :class:`GradSync`): True or
            ``on``, False or ``off``, or ``auto`` (on when the model is on a GPU).
        grad_bucket_mb: Gradient bucket size in MiB.
        precision: ``fp32``, ``bf16`` or ``fp16`` (:mod:`hadpsgd.precision`): fp16 keeps a
            dynamic loss scale (:attr:`scaler`), which the training loop multiplies the loss
            by before backward and :meth:`apply_update` divides out.
        grad_wire: What a gradient bucket is on the wire when it is averaged: ``fp32`` or
            ``bf16`` (half the bytes; summed in fp32 where MPI carries it).
        option_values: The options by name (``sync_period=8``), when ``options`` is not given.

    Raises:
        TypeError: For a keyword that is no option of this algorithm.
        hadpsgd.cli.ConfigError: For an option out of range, naming its flag.
    """

    name: str = "base"
    Options: type[AlgoOptions] = AlgoOptions
    """This algorithm's command-line options (none beyond the shared ones by default)."""
    divergence_hint: str = ""
    """This algorithm's advice when its run diverges (a sentence, or empty)."""

    needs_equal_nodes = False
    """Whether the super-learners must be of equal size (BMUF's block average)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: World, *,
                 options: AlgoOptions | None = None, max_grad_norm: float = 0.0,
                 overlap: bool | str = "auto", grad_bucket_mb: float = DEFAULT_GRAD_BUCKET_MB,
                 precision: str = "fp32", grad_wire: str = "fp32",
                 **option_values: Any) -> None:
        # Every rank raises alike, before the first collective, so nobody is left waiting.
        self.options = self.Options.resolve(options, option_values)
        """This algorithm's validated options (built once, here or by the configuration)."""
        if self.needs_equal_nodes:
            topo.require_equal_nodes(self.name)
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables), got {max_grad_norm}")
        check_precision(precision)
        self.precision = precision
        self.scaler = LossScaler() if precision == "fp16" else None
        """fp16's dynamic loss scale (None otherwise): the same on every learner that shares
        a step's gradient, since each decides it from the same reduced gradient."""
        self.max_grad_norm = max_grad_norm
        self.model = model
        self.optimizer = optimizer
        self.topo = topo
        self.steps = 0
        """Steps taken by this learner (including skipped non-finite ones)."""
        self.skipped_steps = 0
        """Steps whose synchronised gradient was not finite, so no update was applied."""
        self._closed = False
        params = [p for p in model.parameters() if p.requires_grad]
        missing = params_missing_from(model, optimizer)
        if missing:
            raise ValueError(f"{type(self).__name__}: {missing_params_message(missing)}")
        # On CUDA each LSTM's weights get a storage of their own inside the flat buffer, the
        # layout cuDNN runs in place (else it copies every weight at every forward).
        groups = cudnn_weight_groups(model) if params and params[0].is_cuda else []
        self.params = FlatBuffer(params, kind="data", own_storage=groups)
        self.gradsync = GradSync(params, topo, self.grad_scope, bucket_mb=grad_bucket_mb,
                                 overlap=overlap, wire=grad_wire, world=self.reduces_world())
        self.grads = self.gradsync.flat
        for buf in self.params.buffers.values():
            topo.broadcast_(buf, root=0)
        broadcast_frozen(model, topo)
        self.buffers = ModelBuffers(model, topo)
        """The model's buffers in one memory per device (none: every agreement is free)."""
        self.buffers.broadcast()  # the replicas start from rank 0's buffers too, as DDP's
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                          if isinstance(t, torch.Tensor))
        self.startup_bytes = (topo.num_nodes - 1) * model_bytes if topo.num_nodes > 1 else 0
        """The start's broadcast of rank 0's model (parameters, frozen ones, buffers) to the
        other nodes, every rank's together: each other node receives it at least once. A
        fixed cost, not in :meth:`internode_bytes` (what training sends, growing with the
        steps): the run's last line says it apart (issue 57)."""
        wanted = bool(getattr(self.options, "sync_buffers", True))  # an Options without it
        self.syncs_buffers = bool(self.buffers) and wanted
        """Whether the buffers are kept in agreement (the model has some, and the option)."""

    def flat_layout(self) -> list[list[Any]]:
        """Where each parameter lies in the flat buffer: ``[name, dtype, offset, numel]`` each.

        In the buffer's order, named as the model's state dict names it (the stacked LSTM's
        names in either ``--lstm-layout``). The order is the device's (cuDNN's layout on
        CUDA, the module's on CPU), which is why states of flat tensors record it (BMUF:
        ``bmuf/relayout.py``).
        """
        names = {id(p): n for n, p in self.model.state_dict(keep_vars=True).items()}
        return [[names.get(id(p), f"#{i}"), str(p.dtype), off, p.numel()]
                for i, (p, off) in enumerate(self.param_offsets())]

    def param_offsets(self) -> list[tuple[nn.Parameter, int]]:
        """Each parameter with its offset in its dtype's flat buffer, in the buffer's order."""
        out: list[tuple[nn.Parameter, int]] = []
        offsets: dict[torch.dtype, int] = {}
        for p in self.params.params:
            off = offsets.get(p.dtype, 0)
            out.append((p, off))
            offsets[p.dtype] = off + p.numel()
        return out

    asynchronous = False
    """Whether learners step at their own pace (ADPSGD): the training loop then gives them a
    shared work-conserving data pool and keeps every global collective off the step path."""

    separate_eval_model = False
    """Whether :meth:`evaluation_parameters` differs from the local replica (BMUF), so that a
    checkpoint must store both."""

    def step(self, loss: torch.Tensor | None = None) -> StepResult:
        """Apply this step's gradients: the template every algorithm follows.

        Reduce the gradients as the algorithm says (:meth:`reduce_grads`: the buckets that
        backward already handed to the comm layer, then the rest), read in one host
        synchronisation whether they are finite (this learner's own, which names the origin
        of a NaN, and the reduced one) and their norm, apply the update
        (:meth:`apply_update`, a no-op on every learner that shares a non-finite gradient),
        count the step, then the algorithm's own work between steps (:meth:`after_step`:
        block sync, gossip).

        Args:
            loss: The step's loss; given, it is read in the same synchronisation (so the
                training loop needs no second one).

        Returns:
            The step's verdict: its loss, the finiteness of this learner's and of the reduced
            gradient, the norm, and whether the update was skipped.
        """
        self.reduce_grads()
        check = self.gradsync.check(norm=self.max_grad_norm > 0, loss=loss)
        applied = self.apply_update(check)
        # The scale follows the shared verdict: every learner of the group moves it alike.
        overflow = self.scaler.update(check.finite) if self.scaler is not None else False
        self.steps += 1
        self.after_step()
        return StepResult(loss=check.loss, finite=check.finite, local_finite=check.local_finite,
                          norm=check.norm, skipped=not applied, overflow=overflow)

    @property
    def loss_scale(self) -> float:
        """What the training loop multiplies the loss by before backward (1 but for fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def reduces_world(self) -> bool:
        """Whether :meth:`grad_scope` can be ``world`` in this run (asked once, at start).

        Only a world-scope mean takes the pipelined hierarchical route, which duplicates the
        inter-node communicator (``HADPSGD_PIPELINE_MB``); an algorithm whose gradients never
        leave the node says False and builds none. Decided by the options alone: the same
        on every rank.
        """
        return True

    def grad_scope(self) -> GradScope:
        """Over which learners this step's gradients are averaged: ``world``, ``node`` or None.

        Asked once per step, when its first gradient bucket is reduced (during backward when
        the reduction overlaps it), so it must not change between backward and :meth:`step`.
        """
        return "world"

    def reduce_grads(self) -> None:
        """Finish averaging the gradient buffers over :meth:`grad_scope`'s learners."""
        self.gradsync.finish()

    def after_step(self) -> None:
        """The algorithm's work after a counted step (block sync, gossip).

        By default (every learner applies the world's gradient: SSGD) the buffers become rank
        0's, as DDP's ``broadcast_buffers`` makes them before each forward: one message of
        every buffer, and nothing for a model without buffers.
        """
        if self.syncs_buffers:
            self.buffers.broadcast()

    def apply_update(self, check: GradCheck) -> bool:
        """Clip and take the optimizer step, unless the (synchronised) gradient is non-finite.

        Every learner that applies the same reduced gradient reaches the same verdict, so
        they skip the step together without another message; the step still counts, which
        keeps periodic collectives (BMUF's block sync, the loop's control points) aligned.

        Args:
            check: The step's finiteness and norm (:meth:`GradSync.check`).

        Returns:
            Whether the update was applied.
        """
        if not check.finite:
            self.skipped_steps += 1
            return False
        self.clip_grads_(check.norm)
        self.optimizer.step()
        return True

    def clip_grads_(self, norm: float) -> None:
        """Unscale (fp16) and clip the gradients to ``max_grad_norm``, in one pass.

        The norm comes with the step's one synchronisation (:meth:`GradSync.check`), taken
        after the reduction (of the scaled gradients, under fp16) so that every replica
        scales identically.
        """
        factor = 1.0
        if self.scaler is not None:
            factor = 1.0 / self.scaler.scale
            norm = norm * factor
        if self.max_grad_norm > 0 and norm > self.max_grad_norm:
            factor *= self.max_grad_norm / (norm + 1e-6)
        if factor != 1.0:
            for buf in self.grads.buffers.values():
                buf.mul_(factor)

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

    def finish_changes_state(self) -> bool:
        """Whether :meth:`finish` would change what training goes on from.

        BMUF's closing sync ends a partial block, which an uninterrupted longer run never
        does: the trainer then checkpoints the state before it for a resume that extends
        the run (``--epochs``, ``--max-steps``), and the finished model for deployment.
        """
        return False

    def steps_not_deployed(self) -> int:
        """Local steps up to now that :meth:`evaluation_parameters` has not taken in yet.

        0 where the deployable model is the replica (SSGD, ADPSGD); BMUF's global model
        lags by the block in flight (and, overlapped, by the block whose mean is in flight).
        A run carried over from the deployable model alone (a failure's survivors, a resume
        at another world size) goes on from the data position that many steps back, so
        that no chunk's progress is lost.
        """
        return 0

    def carry_bytes(self, old: Algorithm) -> None:
        """Add ``old``'s byte counters to this one's (a run rebuilt after a failure).

        The counters say what crossed the links over the whole run; the rebuilt
        algorithm's start at 0. Algorithms add their own exchanges' counters.
        """
        self.gradsync.wire_bytes += old.gradsync.wire_bytes
        self.gradsync.internode_bytes += old.gradsync.internode_bytes
        self.startup_bytes += old.startup_bytes  # and the rebuilt run broadcast again

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

    def defaults_note(self) -> str:
        """What the run's size chose among the algorithm's defaults (``""``: nothing).

        Said once at start: BMUF's block and, on a sparse wire, where the rounding goes
        depend on the number of workers, known only once the algorithm is built.
        """
        return ""

    def evaluation_note(self) -> str:
        """What the held-out line should say about the model it scores (``""``: nothing).

        BMUF says when its global model is still the initial one (no block sync yet), which
        a long block makes look like a run that does not learn.
        """
        return ""

    def metrics(self) -> dict[str, float]:
        """Figures for the training log: the gradients' wire bytes, fp16's loss scale.

        Algorithms add their own to these (``{**super().metrics(), ...}``). ``wire_bytes``,
        the bytes of the algorithm's own exchanges across nodes, is here the gradients'
        (SSGD's every step), so every algorithm logs it under one name; BMUF's block syncs
        and ADPSGD's gossip replace it with theirs.
        """
        sent, received = self.internode_bytes()
        figures = {"grad_wire_bytes": float(self.gradsync.wire_bytes),
                   "wire_bytes": float(self.gradsync.internode_bytes),
                   "internode_bytes": float(sent), "internode_bytes_received": float(received)}
        if self.scaler is not None:
            figures["loss_scale"] = self.scaler.scale
            figures["overflow_steps"] = float(self.scaler.overflow_steps)
        return figures

    def internode_bytes(self) -> tuple[int, int]:
        """Bytes this rank sent to and received from other nodes so far: ``(sent, received)``.

        Here the gradients' share of the hierarchical allreduce (SSGD's every step, BMUF's
        warm-up); algorithms add their own exchanges (BMUF's block syncs, ADPSGD's gossip).
        """
        grads = self.gradsync.internode_bytes
        return grads, grads  # a ring receives what it sends

    def control_bytes(self) -> int:
        """Bytes of the algorithm's own control traffic this rank carried across nodes so far.

        Beside :meth:`internode_bytes`' payloads: what decides who exchanges with whom
        (ADPSGD's pairing board). None here.
        """
        return 0

    def ssgd_fp32_bytes(self, steps: int) -> int:
        """What this rank would have sent between nodes in ``steps`` steps of SSGD in fp32.

        The reference of ``--wire``'s savings: every parameter's gradient, 4 bytes a value,
        through the hierarchical allreduce, every step.
        """
        values = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return steps * internode_share(4 * values, self.topo)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the algorithm's counters and the optimizer state."""
        state = {"name": self.name, "steps": self.steps, "skipped_steps": self.skipped_steps,
                 "optimizer": self.optimizer.state_dict(),
                 "grad_wire_bytes": self.gradsync.wire_bytes,
                 "internode_grad_bytes": self.gradsync.internode_bytes}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

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
        self.gradsync.wire_bytes = int(state.get("grad_wire_bytes", 0))
        self.gradsync.internode_bytes = int(state.get("internode_grad_bytes", 0))
        if self.scaler is not None and "loss_scale" in state:
            # A run resumed in fp16 from a bf16/fp32 checkpoint starts the scale afresh.
            self.scaler.load_state_dict(state["loss_scale"])

    def node_state(self) -> dict[str, Any] | None:
        """What differs between super-learners and must be saved per node, or None.

        A checkpoint holds rank 0's :meth:`state_dict` and the model's parameters; an
        algorithm whose super-learners part ways between agreements (BMUF mid-block) returns
        here what each node needs to resume exactly. Called on every rank, with the same
        None-or-not answer everywhere.

        By default that is fp16's loss scale where there are several super-learners: those
        that share no gradient (BMUF, H-ADPSGD) decide their scales apart.
        """
        if self.scaler is None or self.topo.num_nodes == 1:
            return None
        return {"loss_scale": self.scaler.state_dict()}

    def load_node_state(self, state: dict[str, Any]) -> None:
        """Restore this node's part of :meth:`node_state` (after :meth:`load_state_dict`)."""
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])

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
