"""Worker: the pipelined hierarchical mean is the mean, and trains as the serial route does.

Usage: pipeline.py (under HADPSGD_RANKS_PER_NODE, so that the world is hierarchical).
Checks on every rank:

1. Means of tensors of several sizes and dtypes (some not a multiple of the node size, so the
   shard form pads; tiny pieces, so each tensor is many pieces in flight at once) equal an
   independent reference, every rank's tensor gathered as objects and averaged in float64,
   and are bit-identical on every rank, to the serial route (``HADPSGD_PIPELINE_MB=0``) and
   to the pipeline without its progress tests between node phases.
2. Two SSGD replicas on the same batches, one through the pipeline and one through the
   serial route, end bit-identical after several steps, overlapped with backward or not.
On ``HADPSGD_TEST_DEVICE=cuda`` (tests/gpu) 1 and 2 run on device tensors: the device route
itself (a node's ranks on one GPU: page-locked copies; a GPU each: NCCL's phases).

3. (Run between 1 and 2, on CPU.) The device route's bookkeeping, with host tensors taken as device
   ones: mirrored through page-locked copies (ranks sharing a GPU), or the node's phases on
   a device backend (gloo standing in for NCCL) and only the shard copied for the link;
   the same bits as 1.
"""

import hashlib
import os
import sys

import torch

from hadpsgd import comm
from hadpsgd.algorithms import SSGD
from hadpsgd.comm.backends import GlooIntra
from hadpsgd.comm.pipeline import GradPipeline
from hadpsgd.models.blstm import BLSTM

os.environ["HADPSGD_PIPELINE_MB"] = "0.0001"  # ~100-byte pieces: many in flight at once
dev = torch.device(os.environ.get("HADPSGD_TEST_DEVICE", "cpu"))  # tests/gpu: cuda
topo = comm.init(device=dev.type)
dev = topo.device
failures: list[str] = []
pipe = topo.grad_pipeline()
if pipe is None:
    print(f"rank {topo.rank} FAIL: no pipeline in a hierarchical world", flush=True)
    sys.exit(1)

# 1. means against a reference computed without the comm layer's sums
gen = torch.Generator().manual_seed(11 + topo.rank)
tensors = [torch.randn(n, generator=gen, dtype=dtype).to(dev)
           for n, dtype in ((1, torch.float32), (7, torch.float64), (1001, torch.float32),
                            (4096, torch.float32), (333, torch.float64))]
originals = [t.clone() for t in tensors]
for t in tensors:
    pipe.mean_(t, topo.size)
pipe.drain()
if pipe.pieces < 20:
    failures.append(f"only {pipe.pieces} pieces went through the pipeline")
everyone = topo.allgather_object([t.cpu().numpy() for t in originals])
for i, t in enumerate(tensors):
    ref = torch.stack([torch.from_numpy(row[i]).double() for row in everyone]).mean(0)
    if not torch.allclose(t.double().cpu(), ref, rtol=1e-5, atol=1e-6):
        failures.append(f"tensor {i}: the pipelined mean is not the mean")
    serial = originals[i].clone()
    topo.allreduce_(serial, op="avg")
    if not torch.equal(serial, t):
        failures.append(f"tensor {i}: pipelined and serial means differ in their bits")
# The progress tests between node phases (issue 59 item 4) only move requests: the same bits
pipe.progress = False
untested = [t.clone() for t in originals]
for t in untested:
    pipe.mean_(t, topo.size)
pipe.drain()
pipe.progress = True
if any(not torch.equal(a, b) for a, b in zip(untested, tensors, strict=True)):
    failures.append("the pipelined means differ with and without the progress tests")
if not 0 <= pipe.early <= pipe.pieces:
    failures.append(f"{pipe.early} of {pipe.pieces} pieces counted as ended early")
digests = topo.allgather_object([hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
                                 for t in tensors])
if any(d != digests[0] for d in digests):
    failures.append("the pipelined means differ between ranks")
pipe.close()


# 3. the device route's bookkeeping on host tensors (issue 44 item 4; tests/gpu runs it on a
#    GPU): every tensor is taken as a device one. With no device backend (ranks that share a
#    GPU) each piece goes through a page-locked copy and comes back; with one (gloo standing
#    in for NCCL) the node's phases run on it and only the shard is copied for the link.
class DeviceRoute(GradPipeline):
    def _device(self, t: torch.Tensor) -> bool:
        return True


gloo = (GlooIntra(topo.intra, topo.watchdog, topo.node_ranks)
        if topo.local_size > 1 and dev.type == "cpu" else None)
for route, backend in ((("shared GPU", None), ("nccl", gloo)) if dev.type == "cpu" else ()):
    topo.reducer.device_intra = backend
    pipe = topo.grad_pipeline()
    pipe.__class__ = DeviceRoute
    piped = [t.clone() for t in originals]
    for t in piped:
        pipe.mean_(t, topo.size)
    pipe.drain()
    topo.reducer.device_intra = None
    for i, t in enumerate(piped):
        # Mirrored, the host route's bits (the serial route's too); on another node backend
        # the node's sum may add in another order: the mean, the same bits on every rank.
        same = (torch.equal(t, tensors[i]) if backend is None
                else torch.allclose(t, tensors[i], rtol=1e-5, atol=1e-6))
        if not same:
            failures.append(f"device route ({route}), tensor {i}: not the mean")
    sums = topo.allgather_object([hashlib.sha256(t.numpy().tobytes()).hexdigest()
                                  for t in piped])
    if any(d != sums[0] for d in sums):
        failures.append(f"device route ({route}): the means differ between ranks")
    if pipe.pieces < 20:
        failures.append(f"device route ({route}): only {pipe.pieces} pieces")
    pipe.close()
if gloo is not None:
    gloo.close()


# 2. training: pipeline against the serial route, with and without overlap
def learner(piece_mb: str, overlap: str) -> tuple[torch.nn.Module, SSGD]:
    os.environ["HADPSGD_PIPELINE_MB"] = piece_mb  # read when the algorithm is built
    torch.manual_seed(0)
    model = BLSTM(6, 5, hidden=8, layers=2, proj=4).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, SSGD(model, opt, topo, overlap=overlap, grad_bucket_mb=0.002)


def digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


for overlap in ("off", "on"):
    pairs = [learner("0.0005", overlap), learner("0", overlap)]
    if pairs[0][1].gradsync._pipe is None or pairs[1][1].gradsync._pipe is not None:
        failures.append("HADPSGD_PIPELINE_MB did not switch the pipeline")
    gen = torch.Generator().manual_seed(7 + topo.rank)
    for _ in range(4):
        x = torch.randn(3, 8, 6, generator=gen).to(dev)
        for model, algo in pairs:
            model(x).square().mean().backward()
            algo.step()
            algo.zero_grad()
    pieces = pairs[0][1].gradsync._pipe.pieces
    for _, algo in pairs:
        algo.close()
    if pieces < 8:
        failures.append(f"overlap {overlap}: only {pieces} pieces went through the pipeline")
    if digest(pairs[0][0]) != digest(pairs[1][0]):
        failures.append(f"overlap {overlap}: pipelined and serial training differ")
    if len(set(topo.allgather_object(digest(pairs[0][0])))) != 1:
        failures.append(f"overlap {overlap}: the replicas differ")

if failures:
    print(f"rank {topo.rank} FAIL: {failures}", flush=True)
    sys.exit(1)
print(f"rank {topo.rank} OK", flush=True)
