"""``hadpsgd.env``: every ``HADPSGD_*`` variable's default, a good value and a bad one."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hadpsgd import env, faults
from hadpsgd.env import EnvError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable of the table leaks in from the shell that runs the tests."""
    for name in env.NAMES:
        monkeypatch.delenv(name, raising=False)


# (variable, reader, default, good value, what it parses to, bad values)
CASES: list[tuple[str, Callable[[], Any], Any, str, Any, list[str]]] = [
    ("HADPSGD_TIMEOUT", env.timeout, 300.0, "4.5", 4.5, ["abc", "0", "-1", "nan", "1e12"]),
    ("HADPSGD_START_TIMEOUT", lambda: env.start_timeout()[0], 300.0, "120", 120.0,
     ["abc", "0", "-1", "nan", "1e12"]),
    ("HADPSGD_RANKS_PER_NODE", env.ranks_per_node, None, "2", 2, ["two", "1.5", "0", "-3"]),
    ("HADPSGD_INTRA_BACKEND", env.intra_backend, "auto", "gloo", "gloo", ["MPI", "ucx"]),
    ("HADPSGD_BUCKET_MB", env.bucket_mb, 64.0, "0.0001", 0.0001, ["big", "0", "-2"]),
    ("HADPSGD_PIPELINE_MB", env.pipeline_mb, 0.0, "4", 4.0, ["big", "-1", "nan", "inf"]),
    ("HADPSGD_CUDA_AWARE", env.cuda_aware, None, "0", False, ["yes", "2", "true"]),
    ("HADPSGD_HOST_LINK", env.host_link, True, "0", False, ["maybe", "2"]),
    ("HADPSGD_SHARE_GPU", env.share_gpu, 0, "2", 2, ["two", "-1", "1.5"]),
    ("HADPSGD_CACHE", env.cache_dir, Path.home() / ".cache" / "hadpsgd", "/tmp/hadpsgd-c",
     Path("/tmp/hadpsgd-c"), ["<a file>"]),
    ("HADPSGD_DEBUG", env.debug, False, "1", True, ["maybe", "2"]),
    ("HADPSGD_FAULT", env.fault_spec, "", " kind=nan,rank=1 ", "kind=nan,rank=1", []),
    ("HADPSGD_TRACE_CHUNKS", env.trace_chunks_dir, None, "/tmp/hadpsgd-t",
     Path("/tmp/hadpsgd-t"), ["<a file>"]),
    ("HADPSGD_EMULATE_STEP", lambda: env.emulated_step_s(0), 0.0, "ms=40", 0.04,
     ["40", "ms=x", "ms=-1"]),
    ("HADPSGD_STDOUT_TTY", env.stdout_tty, None, "0", False, ["yes", "2"]),
    ("HADPSGD_FT_DETECTOR", env.ft_detector, False, "1", True, ["maybe", "2"]),
    ("HADPSGD_FROZEN_S", env.frozen_s, 5.0, "0", 0.0, ["soon", "-1", "nan", "inf"]),
]
IDS = [c[0] for c in CASES]


def _bad(value: str, tmp_path: Path) -> str:
    """The bad value, with ``<a file>`` made into a real file (a directory variable's bad case)."""
    if value == "<a file>":
        path = tmp_path / "a-file"
        path.write_text("not a directory")
        return str(path)
    return value


def test_every_variable_has_a_case() -> None:
    assert sorted(IDS) == sorted(env.NAMES)


@pytest.mark.parametrize(("name", "read", "default", "good", "parsed", "bads"), CASES, ids=IDS)
def test_unset_and_blank_give_the_default(monkeypatch: pytest.MonkeyPatch, name: str,
                                          read: Callable[[], Any], default: Any, good: str,
                                          parsed: Any, bads: list[str]) -> None:
    assert read() == default
    monkeypatch.setenv(name, "  ")  # `VAR= cmd` in a shell means "the default"
    assert read() == default


@pytest.mark.parametrize(("name", "read", "default", "good", "parsed", "bads"), CASES, ids=IDS)
def test_good_value_parses(monkeypatch: pytest.MonkeyPatch, name: str, read: Callable[[], Any],
                           default: Any, good: str, parsed: Any, bads: list[str]) -> None:
    monkeypatch.setenv(name, good)
    assert read() == parsed


@pytest.mark.parametrize(("name", "read", "default", "good", "parsed", "bads"),
                         [c for c in CASES if c[5]], ids=[c[0] for c in CASES if c[5]])
def test_bad_value_names_variable_value_and_fix(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path, name: str,
                                                read: Callable[[], Any], default: Any,
                                                good: str, parsed: Any,
                                                bads: list[str]) -> None:
    for bad in bads:
        value = _bad(bad, tmp_path)
        monkeypatch.setenv(name, value)
        with pytest.raises(EnvError) as info:
            read()
        msg = str(info.value)
        assert f"{name}={value!r}" in msg, msg
        assert "set it" in msg or "set 1" in msg or "choose one of" in msg, msg
        # ...and check(), the entry points' start-up check, finds it too
        with pytest.raises(EnvError, match=name):
            env.check()


def test_env_error_is_a_value_error() -> None:
    # Callers that treat ValueError as the user's mistake (the runner's USER_ERRORS) keep doing so.
    assert issubclass(EnvError, ValueError)


def test_other_spellings_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HADPSGD_TIMEOUT", "inf")  # no deadline, as before
    assert env.timeout() == float("inf")
    monkeypatch.setenv("HADPSGD_TIMEOUT", "2592000")  # the longest finite one: 30 days
    assert env.timeout() == env.MAX_TIMEOUT_S
    for word, on in [("TRUE", True), ("yes", True), ("On", True), ("0", False), ("off", False)]:
        monkeypatch.setenv("HADPSGD_DEBUG", word)
        assert env.debug() is on
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "1")
    assert env.cuda_aware() is True
    monkeypatch.setenv("HADPSGD_CACHE", "~/somewhere")
    assert env.cache_dir() == Path.home() / "somewhere"


def test_check_passes_when_all_good(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, _, _, good, _, _ in CASES:
        monkeypatch.setenv(name, good)
    monkeypatch.setenv("HADPSGD_TRACE_CHUNKS", str(tmp_path))  # an existing directory is fine
    env.check()


def test_fault_spec_is_parsed_by_faults_with_env_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_PLAN", None)
    monkeypatch.setenv("HADPSGD_FAULT", "kind=hang,rank=1,step=5")
    assert faults.plan() == [faults.Fault("hang", 1, 5)]
    for bad, part in [("kind=boom", "kind='boom'"), ("kind=kill,step=five", "step='five'"),
                      ("kind=kill,color=red", "color"), ("oops", "'oops'"),
                      ("kind=kill,at=nowhere", "at='nowhere'")]:
        with pytest.raises(EnvError) as info:
            faults.parse(bad)
        assert "HADPSGD_FAULT" in str(info.value) and part in str(info.value), info.value


def test_a_poisoned_loss_takes_the_ranks_next_steps_from_its_step_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ADPSGD's pool a rank may never take step 5 itself (another super-learner took
    it): the overflow then takes its next steps, count of them, once per process."""
    monkeypatch.setattr(faults, "_PLAN", None)
    monkeypatch.setenv("HADPSGD_FAULT", "kind=overflow,rank=1,step=5,count=2")
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    got = {step: faults.hit("step", 1, step) for step in (2, 4, 6, 8, 9, 10)}
    assert got == {2: None, 4: None, 6: "overflow", 8: "overflow", 9: None, 10: None}
    assert faults.hit("step", 0, 7) is None  # another rank


def test_comm_readers_delegate(monkeypatch: pytest.MonkeyPatch) -> None:
    from hadpsgd.comm import timeout_from_env as from_package
    from hadpsgd.comm.deadline import timeout_from_env
    from hadpsgd.comm.mpi import cuda_support

    assert from_package is timeout_from_env and timeout_from_env() == 300.0
    monkeypatch.setenv("HADPSGD_TIMEOUT", "7")
    assert timeout_from_env() == 7.0
    monkeypatch.setenv("HADPSGD_TIMEOUT", "abc")
    with pytest.raises(EnvError, match="HADPSGD_TIMEOUT='abc' is not a number"):
        timeout_from_env()
    monkeypatch.setenv("HADPSGD_CUDA_AWARE", "yes")  # once silently ignored
    with pytest.raises(EnvError, match="HADPSGD_CUDA_AWARE='yes'"):
        cuda_support()


def test_comm_init_helpers_read_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # `hadpsgd.comm.init` the attribute is the function; the module is only in sys.modules.
    comm_init = importlib.import_module("hadpsgd.comm.init")

    monkeypatch.setenv("HADPSGD_INTRA_BACKEND", "gloo")
    monkeypatch.setenv("HADPSGD_RANKS_PER_NODE", "3")
    assert comm_init._backend_name("auto") == "gloo"
    assert comm_init._backend_name("mpi") == "mpi"  # the flag wins over the variable
    assert comm_init._resolve_ranks_per_node(None) == 3
    assert comm_init._resolve_ranks_per_node(2) == 2
    monkeypatch.setenv("HADPSGD_RANKS_PER_NODE", "x")
    with pytest.raises(EnvError, match="is not an integer; set it to the number of consecutive"):
        comm_init._resolve_ranks_per_node(None)


def test_synth_cache_reads_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hadpsgd.data import synth

    monkeypatch.setenv("HADPSGD_CACHE", str(tmp_path / "c"))
    assert synth._default_cache() == tmp_path / "c"


def test_env_module_imports_nothing_from_the_package() -> None:
    tree = ast.parse((ROOT / "hadpsgd" / "env" / "__init__.py").read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.split(".")[0] == "hadpsgd"], modules


def test_tables_list_the_same_variables() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text()
    section = usage.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    in_readme = {v for row in rows for v in re.findall(r"`(HADPSGD_[A-Z_]+)`", row.split("|")[1])}
    in_readme -= {"HADPSGD_VENV", "HADPSGD_MPI"}  # read by scripts/*.sh, not by the package
    in_docstring = set(re.findall(r"^(HADPSGD_[A-Z_]+) ", env.__doc__ or "", re.MULTILINE))
    assert in_readme == set(env.NAMES) == in_docstring


@pytest.mark.parametrize(("name", "value"), [("HADPSGD_TIMEOUT", "abc"),
                                             ("HADPSGD_TIMEOUT", "1e12"),  # was OverflowError
                                             ("HADPSGD_DEBUG", "maybe")])
def test_bad_variable_ends_the_run_cleanly(tmp_path: Path, name: str, value: str) -> None:
    # One rank without mpirun is a singleton MPI job. A launcher's task count (tests run
    # inside a Slurm step) would make comm.init refuse it as a broken launch first, and the
    # shell's HADPSGD_* variables would mix in.
    from hadpsgd.comm.placement import _LAUNCHER_SIZES

    sizes = {var for var, _, _ in _LAUNCHER_SIZES}
    base = {k: v for k, v in os.environ.items() if not k.startswith("HADPSGD_") and k not in sizes}
    res = subprocess.run([sys.executable, "-m", "hadpsgd.run", "--preset", "tiny", "--epochs",
                          "1", "--out-dir", str(tmp_path / "out")],
                         env={**base, "HADPSGD_CACHE": str(tmp_path / "cache"), name: value},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert f"{name}={value!r}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_usable_cpus_follow_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    """Issue 44: threads are sized by the cores the job was given (affinity, cgroup quota),
    not the machine's count: 4 of 128 cores bound, or a container's --cpus 2.5."""
    import os

    from hadpsgd.env.cpus import cgroup_quota, usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert usable_cpus(tmp_path) == 4  # no cgroup file: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None and usable_cpus(tmp_path) == 4
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_quota(tmp_path) == 2.5 and usable_cpus(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1  # half a core: still one thread
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == 3  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(tmp_path) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert usable_cpus(tmp_path) == 4  # unreadable: no limit known
