"""One measurement of training frames/s: plain PyTorch, hadpsgd SSGD, or torch DDP.

Run by ``benchmarks/train_throughput.py`` (:mod:`benchmarks.training.throughput`); prints one
JSON line (rank 0 for the MPI cases). ``plain`` is one process without communication; ``ssgd``
and ``ddp`` run on every rank of the MPI job. DDP's process group is bootstrapped over MPI (a
FileStore whose path rank 0 broadcasts), so no ``MASTER_ADDR``/``RANK`` environment is
needed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks._common.launch import file_store, remove_store
from benchmarks._common.timing import device_sync, seconds_per_step, training_step
from hadpsgd.models import build_model
from hadpsgd.models.presets import LSTM_LAYOUTS, per_layer_lstm


@dataclass
class DDPWorld:
    """The MPI job seen from torch.distributed: this rank, its device and the group's backend.

    Attributes:
        comm: The MPI world communicator.
        mpi: The ``mpi4py.MPI`` module.
        device: This rank's device.
        backend: ``gloo`` or ``nccl``.
        store_path: The FileStore's file (rank 0 removes it at the end).
        notes: Why the backend is not the one the device would suggest.
    """

    comm: Any
    mpi: Any
    device: torch.device
    backend: str
    store_path: str
    notes: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        """Rank in the world."""
        return int(self.comm.Get_rank())

    @property
    def size(self) -> int:
        """Number of ranks."""
        return int(self.comm.Get_size())


def ddp_world(device: str) -> DDPWorld:
    """Start torch.distributed's default group over the ranks of the MPI job.

    The device follows hadpsgd's rule (a rank's GPU is its rank on the physical host). The
    backend is gloo on CPU and NCCL on CUDA, unless NCCL cannot run there (no NCCL in this
    torch, or ranks sharing a GPU, which NCCL refuses): then gloo on the CUDA tensors, with
    a note. Every rank takes the same decision.
    """
    import torch.distributed as dist

    from hadpsgd.comm.deadline import timeout_from_env
    from hadpsgd.comm.mpi import mpi
    from hadpsgd.comm.placement import device_label, resolve_device

    MPI = mpi()  # noqa: N806 - conventional name of the module
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    host = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    dev = resolve_device(device, host.Get_rank(), host.Get_size())
    host.Free()
    backend, notes = "gloo", []
    if dev.type == "cuda":
        from hadpsgd.comm.nccl import nccl_available

        torch.cuda.set_device(dev)
        ok, why = nccl_available()
        labels = world.allgather(device_label(dev))
        if ok and len(set(labels)) < len(labels):
            ok, why = False, "ranks share a GPU and NCCL needs one GPU per rank"
        reasons = sorted({r for r in world.allgather("" if ok else why) if r})
        if reasons:
            notes.append(f"DDP runs over gloo on the CUDA tensors: NCCL is off "
                         f"({'; '.join(reasons)})")
        else:
            backend = "nccl"
    store, path = file_store(world, tempfile.gettempdir(), "bench-ddp")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_from_env()))
    return DDPWorld(world, MPI, dev, backend, path, notes)


def main() -> None:
    """Parse the options, build the model and data, time the steps, print the JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["plain", "ssgd", "ssgd-overlap", "ssgd-serial", "ddp"],
                   required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-len", type=int, default=21)
    p.add_argument("--feat-dim", type=int, default=260)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--lstm-layout", choices=list(LSTM_LAYOUTS), default="auto",
                   help="the BLSTM's LSTM stack, as hadpsgd.run's --lstm-layout (auto: "
                        "per-layer on CUDA, stacked on CPU)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="as hadpsgd.run's --precision (autocast forward, fp32 loss)")
    p.add_argument("--grad-wire", choices=["fp32", "bf16"], default="fp32",
                   help="as hadpsgd.run's --grad-wire (ssgd modes only)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of this process (default: as launched)")
    a = p.parse_args()

    rank, size = 0, 1
    info: dict[str, Any] = {"backend": None, "notes": []}
    topo = ddp = algo = None
    if a.mode.startswith("ssgd"):
        from hadpsgd import comm

        topo = comm.init(device=a.device)
        rank, size, device = topo.rank, topo.size, topo.device
        grads = torch.empty(0, dtype=torch.float32, device=device)
        route = topo.route(grads)
        info.update(backend=route.intra, route=route._asdict(), cuda_aware=topo.cuda_aware,
                    notes=list(topo.notes))
    elif a.mode == "ddp":
        ddp = ddp_world(a.device)
        rank, size, device = ddp.rank, ddp.size, ddp.device
        info.update(backend=ddp.backend, notes=ddp.notes)
    else:
        from hadpsgd.comm.placement import resolve_device

        device = resolve_device(a.device, 0, 1)
    if a.threads is not None:
        # After comm.init, which sets its own share only when OMP_NUM_THREADS is unset.
        torch.set_num_threads(a.threads)

    torch.manual_seed(0)
    per_layer = per_layer_lstm(a.lstm_layout, device)
    info["lstm_layout"] = "per-layer" if per_layer else "stacked"
    model: nn.Module = build_model(a.preset, a.feat_dim, a.classes,
                                   per_layer=per_layer).to(device)
    if ddp is not None:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if topo is not None:
        from hadpsgd.algorithms import SSGD

        # ssgd: as hadpsgd.run runs it (--overlap auto); the others force the setting.
        overlap = {"ssgd": "auto", "ssgd-overlap": "on", "ssgd-serial": "off"}[a.mode]
        algo = SSGD(model, opt, topo, overlap=overlap, precision=a.precision,
                    grad_wire=a.grad_wire)
        info["overlap"] = algo.gradsync.overlapped
        info["grad_wire"] = a.grad_wire
    x = torch.randn(a.batch, a.chunk_len, a.feat_dim, device=device)
    y = torch.randint(0, a.classes, (a.batch, a.chunk_len), device=device)

    # DDP reduces the gradients in the step's backward pass, overlapped with it.
    step = training_step(model, opt, x, y, a.classes, algo, a.precision)
    sec = seconds_per_step(step, a.steps, warmup=a.warmup, sync=device_sync(device))
    # The slowest rank sets the pace of a synchronous job.
    if algo is not None:
        sec = max(algo.topo.allgather_object(sec))
        info["grad_wire_bytes_per_step"] = algo.gradsync.wire_bytes / (a.steps + a.warmup)
        algo.close()
    elif ddp is not None:
        import torch.distributed as dist

        sec = float(ddp.comm.allreduce(sec, op=ddp.mpi.MAX))
        # The DDP module's reducer holds the process group: drop it first, or gloo's threads
        # may be torn down at interpreter exit while still running (std::terminate, abort).
        del step, model, opt
        gc.collect()
        dist.destroy_process_group()
        ddp.comm.Barrier()
        if rank == 0:
            remove_store(ddp.store_path)
    if rank == 0:
        print(json.dumps({"mode": a.mode, "preset": a.preset, "ranks": size,
                          "device": device.type, "batch_per_rank": a.batch,
                          "precision": a.precision,
                          "sec_per_step": sec, "threads_per_rank": torch.get_num_threads(),
                          "frames_per_s": a.batch * a.chunk_len * size / sec, **info}),
              flush=True)


if __name__ == "__main__":
    main()
