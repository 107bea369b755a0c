import torch
from torch import nn

from hadpsgd.comm import FlatBuffer
from hadpsgd.launch import Launcher, launch_env, mpirun_command


def test_flat_grad_buffer_views_and_reattach():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    flat = FlatBuffer(model.parameters(), kind="grad")
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    buf = flat.buffers[torch.float32]
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(buf, expected)  # backward accumulated straight into the buffer
    # zero_grad(set_to_none=True) detaches; gather_grads must bring gradients back.
    for p in model.parameters():
        p.grad = None
    model(torch.randn(5, 3)).sum().backward()
    flat.gather_grads()
    assert torch.equal(buf, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    pairs = zip(model.parameters(), flat.views, strict=True)
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in pairs)


def test_flat_data_buffer_backs_parameters():
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatBuffer(model.parameters(), kind="data")
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    flat.buffers[torch.float32].add_(1.0)
    assert torch.equal(model.bias, before[1] + 1.0)


def test_mpirun_command_and_env():
    cmd = mpirun_command(4, ["--algo", "ssgd"], launcher=Launcher("/x/mpirun", "openmpi"),
                         python="/v/python")
    assert cmd[:3] == ["/x/mpirun", "-np", "4"] and "--oversubscribe" in cmd
    assert cmd[-5:] == ["/v/python", "-m", "hadpsgd.run", "--algo", "ssgd"]
    cmd = mpirun_command(2, [], launcher=Launcher("/x/mpiexec", "mpich"), python="p")
    assert "--oversubscribe" not in cmd
    env = launch_env({"OMP_NUM_THREADS": "3"}, nprocs=4)
    assert env["OMP_NUM_THREADS"] == "3"  # the user's choice wins
