"""Worker: the compressed cross-node mean (``comm.CompressedMean``) under real mpirun.

Every learner of node i holds the same tensor x_i (a super-learner). For every wire, with the
whole tensor per learner and (with several learners per node) split across the node:

- the result is bit-identical on every rank; fp32 equals the mean summed in node order;
  bf16 / int8 / int4 lie within two roundings of the true mean (the worker's, then the
  server's); sign is dense with one magnitude a chunk; topk is sparse (the rest waits in the
  residuals);
- bytes_sent is the two-stage (all-to-all + allgather) count, and fp32 / int8 >= 3.5
  (int4 >= 7, topk >= 90 on these short shards); bytes_received equals it;
- error feedback telescopes, by its definition: out_k = s_k - e_s,k with
  s_k = mean_i(x_i,k + e_w,i,k-1 - e_w,i,k) + e_s,k-1, so summed over K rounds:
  sum out_k + mean_i(e_w,i,K) + e_s,K = sum mean_i(x_i,k);
- a restored state_dict continues bit for bit; a NaN comes out non-finite and the next
  finite round is finite again; a background thread may run it beside the main thread's
  collectives.
Prints ``OK rank r`` or the failures.
"""

import hashlib
import sys
import threading

import torch

from hadpsgd import comm
from hadpsgd.comm.compressed import MEAN_BUCKET_ELEMS

topo = comm.init(device="cpu", preload=False)  # no optimizer steps here
r, nodes, per_node = topo.rank, topo.num_nodes, topo.local_size
failures: list[str] = []
N = 5003  # not a multiple of anything: padded shards, a partial int8 chunk
BUCKET = 2048  # three buckets


def check(name: str, ok: bool) -> None:
    if not ok:
        failures.append(name)


def data(node: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Node ``node``'s tensor of round ``k`` (the same on its learners)."""
    g = torch.Generator().manual_seed(1000 * k + node)
    x = torch.randn(N, generator=g, dtype=torch.float64) * (1 + node)
    x[:1024] *= 1e-3  # a chunk of its own scale
    return x.to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def same_everywhere(t: torch.Tensor, group: range | list[int] | None = None) -> bool:
    every = topo.allgather_object(digest(t))
    return len({every[k] for k in (group if group is not None else range(topo.size))}) == 1


def server_residual(states: list[dict], slices: int) -> torch.Tensor:
    """The nodes' server residuals in the tensor's layout (buckets of N*slices shards)."""
    out = torch.zeros(N, dtype=torch.float64)
    offset = 0
    for lo in range(0, N, BUCKET):
        hi = min(lo + BUCKET, N)
        shard = -(-(hi - lo) // (nodes * slices))
        for s in range(slices):
            for i in range(nodes):
                a = lo + (s * nodes + i) * shard
                b = min(a + shard, hi)
                part = states[i]["server"][offset + s * shard:offset + (s + 1) * shard]
                if a < b:
                    out[a:b] = part[:b - a]
        offset += slices * shard
    return out


def compressed_mean(dtype: torch.dtype, wire: str, split: bool,
                    bucket: int = MEAN_BUCKET_ELEMS) -> comm.CompressedMean:
    """A mean on private duplicates of the topology's communicators, with its own watchdog
    (collective: every rank makes it), as a background thread needs."""
    topo.require_equal_nodes("a compressed cross-node mean")
    watchdog = comm.Watchdog(topo.comm.Dup(), topo.timeout, topo.thread_multiple)
    return comm.CompressedMean(topo.inter.Dup(), watchdog, topo.inter_ranks, N, dtype, "cpu",
                               wire, intra=topo.intra.Dup() if split else None,
                               node_ranks=topo.node_ranks if split else None,
                               bucket_elems=bucket)


def mean(k: int, dtype: torch.dtype) -> torch.Tensor:
    ref = data(0, k, dtype).clone()
    for i in range(1, nodes):
        ref += data(i, k, dtype)
    return ref / nodes


bytes_of: dict[tuple[str, bool], int] = {}
for split in ([False, True] if per_node > 1 else [False]):
    slices = per_node if split else 1
    for wire in comm.WIRES:
        tag = f"{wire} split={split}"
        cm = compressed_mean(torch.float32, wire, split, BUCKET)
        t = data(topo.node, 0, torch.float32)
        cm.mean_(t)
        check(f"identical {tag}", same_everywhere(t))
        want = mean(0, torch.float32)
        xs = torch.stack([data(i, 0, torch.float32) for i in range(nodes)])
        if wire == "fp32":
            check(f"fp32 exact {tag}", torch.equal(t, want))
        elif wire == "bf16":
            # the worker's rounding of each x_i, then the server's of their mean s
            bound = 2.0**-8 * 1.01 * (xs.abs().mean(0) + want.abs())
            check(f"bf16 bound {tag}", bool(((t - want).abs() <= bound).all()))
        elif wire in ("int8", "int4"):
            # half a scale (absmax / 127, / 7) for the worker's rounding, and for the server's
            levels = 127 if wire == "int8" else 7
            bound = 2.01 * float(xs.abs().max()) / (2 * levels)
            check(f"{wire} bound {tag}", float((t - want).abs().max()) <= bound)
            check(f"{wire} rounds {tag}", float((t - want).abs().max()) > 0)
        elif wire == "sign":
            # every value sent, as plus or minus its chunk's scale: dense, few magnitudes
            check(f"sign dense {tag}", float((t != 0).float().mean()) > 0.99)
            check(f"sign levels {tag}", t.abs().unique().numel() < N // 256)
        else:
            # top-k sends a few values a chunk: most of the mean is still in the residuals
            # (the telescoping below accounts for it); what was sent is finite and sparse.
            check(f"topk sparse {tag}", 0 < int((t != 0).sum()) < N // 8)
        bytes_of[wire, split] = cm.bytes_sent
        sent, received = cm.bytes_sent, cm.bytes_received
        check(f"bytes {tag}", cm.bytes_sent > 0 if nodes > 1 else cm.bytes_sent == 0)
    if nodes > 1:
        for wire, least in (("int8", 3.5), ("int4", 7.0), ("sign", 25.0), ("topk", 90.0),
                            ("signtopk", 90.0)):
            # top-k on shards shorter than a chunk: k = round(shard / 64), a scale per shard
            ratio = bytes_of["fp32", split] / bytes_of[wire, split]
            check(f"fp32/{wire} bytes {ratio:.2f} split={split}", ratio >= least)
        # Every byte sent is received by someone: the two stages are symmetric per rank.
        check(f"received split={split}", received == sent)
        # a ring allreduce's share: 2 (N - 1) / N of the tensor per node, per learner unsplit
        ring = 2 * (nodes - 1) / nodes * N * 4 / slices
        check(f"fp32 bytes split={split}", ring <= bytes_of["fp32", split] <= ring * 1.01)

    # Error feedback over K rounds, in float64 (the rounding of the arithmetic is negligible).
    for wire in ("bf16", "int8", "int4", "sign", "topk", "signtopk"):
        tag = f"{wire} split={split}"
        cm = compressed_mean(torch.float64, wire, split, BUCKET)
        out_sum = torch.zeros(N, dtype=torch.float64)
        mean_sum = torch.zeros(N, dtype=torch.float64)
        for k in range(4):
            out_sum += cm.mean_(data(topo.node, k, torch.float64))
            mean_sum += mean(k, torch.float64)
        state = cm.state_dict()
        check(f"state identical in the node {tag}",
              same_everywhere(torch.cat([state["worker"], state["server"]]), topo.node_ranks))
        every = topo.allgather_object(state)
        leaders = [every[i * per_node] for i in range(nodes)]  # node i: consecutive ranks
        worker_mean = sum(s["worker"] for s in leaders) / nodes
        total = out_sum + worker_mean + server_residual(leaders, slices)
        check(f"telescopes {tag}", float((total - mean_sum).abs().max()) < 1e-9)
        # Exact resume: a fresh one with the saved state continues bit for bit.
        again = compressed_mean(torch.float64, wire, split, BUCKET)
        again.load_state_dict(state)
        a, b = data(topo.node, 9, torch.float64), data(topo.node, 9, torch.float64)
        check(f"resume {tag}", torch.equal(cm.mean_(a), again.mean_(b)))
        # A NaN anywhere comes out non-finite, and the next finite round is finite again.
        bad = data(topo.node, 10, torch.float64)
        if topo.node == 0:
            bad[7] = float("nan")
        cm.mean_(bad)
        check(f"nan out {tag}", not bool(torch.isfinite(bad[7])))
        check(f"recovers {tag}", bool(torch.isfinite(cm.mean_(data(topo.node, 11,
                                                                     torch.float64))).all()))
        try:
            again.load_state_dict({**state, "wire": "fp32"})
            check(f"bad state refused {tag}", False)
        except ValueError:
            pass

# In a background thread, beside the main thread's own collectives (MPI_THREAD_MULTIPLE).
if topo.thread_multiple:
    cm = compressed_mean(torch.float32, "int8", split=False)
    results: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: results.extend(
        cm.mean_(data(topo.node, k, torch.float32)) for k in range(3)))
    worker.start()
    for _ in range(20):
        s = topo.allreduce_(torch.ones(3), op="sum")
        topo.intra_allreduce_(torch.ones(3), op="sum")
    worker.join()
    check("main thread sums", torch.equal(s, torch.full((3,), float(topo.size))))
    check("background results", len(results) == 3 and same_everywhere(results[-1]))

topo.barrier()
topo.close()
if failures:
    print(f"FAIL rank {r}: {failures}", flush=True)
    sys.exit(1)
print(f"OK rank {r} nodes={nodes}x{per_node} bytes={bytes_of}", flush=True)
