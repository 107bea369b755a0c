"""A job across hosts (issue 60 item 1): host lists, mpirun's flags, the preflight's verdict.

The launch itself over two emulated hosts (real TCP between network namespaces) is
``tests/mpi/test_two_hosts.py``; here what needs no process: parsing and its errors, the
flags each MPI takes, and the messages the preflight gives for what its probes reported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hadpsgd.launch import Launcher, LauncherError
from hadpsgd.launch.__main__ import main, split_script
from hadpsgd.launch.hosts import (
    Host,
    check_network,
    check_nprocs,
    host_flags,
    parse_hosts,
    parse_ports,
    read_hostfile,
)
from hadpsgd.launch.preflight import judge, parse

OPENMPI = Launcher("/x/mpirun", "openmpi")
MPICH = Launcher("/x/mpiexec", "mpich")
TWO = [Host("a", 2), Host("b", 3)]


def test_host_lists_in_horovods_and_open_mpis_forms(tmp_path: Path) -> None:
    assert parse_hosts("a:2, b:3") == TWO
    assert parse_hosts("a,b:1") == [Host("a", 1), Host("b", 1)]
    file = tmp_path / "hosts"
    file.write_text("# the cluster\na slots=2\n\nb:3  # three GPUs\n")
    assert read_hostfile(file) == TWO
    assert check_nprocs(None, TWO) == 5 and check_nprocs(4, TWO) == 4


@pytest.mark.parametrize(("spec", "said"), [
    ("a:2,a:2", "names a twice"), ("a:0", "slots must be a whole number >= 1"),
    ("a:x", "got 'x'"), (",", "names no host"), ("a b:2", "is no host name")])
def test_a_bad_host_list_is_named(spec: str, said: str) -> None:
    with pytest.raises(LauncherError, match=said):
        parse_hosts(spec)


def test_a_bad_hostfile_line_is_named_with_its_number(tmp_path: Path) -> None:
    file = tmp_path / "hosts"
    file.write_text("a slots=2\nb cpus=4\n")
    with pytest.raises(LauncherError, match=r"line 2 \('b cpus=4'\).*'cpus=4'"):
        read_hostfile(file)
    with pytest.raises(LauncherError, match="cannot read it"):
        read_hostfile(tmp_path / "missing")


def test_more_ranks_than_slots_and_bad_networks_are_refused() -> None:
    with pytest.raises(LauncherError, match=r"-n 6 needs as many slots.*a 2, b 3"):
        check_nprocs(6, TWO)
    assert check_network("10.1.2.3/16") == "10.1.0.0/16" and check_network("eth0") == "eth0"
    with pytest.raises(LauncherError, match="as a name"):
        check_network("10.1.0.0/99")
    assert parse_ports("29500-29599") == (29500, 29599)
    for bad in ("29500", "80-90", "30000-29000"):
        with pytest.raises(LauncherError, match="LOW-HIGH"):
            parse_ports(bad)


def test_open_mpi_places_ranks_in_blocks_and_hands_the_environment_on() -> None:
    env = {"HADPSGD_TIMEOUT": "60", "PYTHONPATH": "/p", "HOME": "/root"}
    flags = host_flags(OPENMPI, TWO, env, iface="10.1.0.0/16", ports=(29500, 29599),
                       agent="/usr/bin/ssh -p 2222")
    line = " ".join(flags)
    assert "--host a:2,b:3 --map-by slot" in line  # consecutive ranks share a host
    assert "-x HADPSGD_TIMEOUT" in line and "-x PYTHONPATH" in line and "HOME" not in line
    assert "oob_tcp_if_include 10.1.0.0/16" in line and "btl_tcp_if_include 10.1.0.0/16" in line
    assert "btl_tcp_port_min_v4 29500 --mca btl_tcp_port_range_v4 100" in line
    assert "plm_ssh_agent /usr/bin/ssh -p 2222" in line
    one = " ".join(host_flags(OPENMPI, TWO, env, one_per_host=True))
    assert "--host a:1,b:1 --map-by ppr:1:node" in one


def test_mpich_takes_its_own_spelling() -> None:
    line = " ".join(host_flags(MPICH, TWO, {}, iface="eth0", ports=(29500, 29599)))
    assert line.startswith("-hosts a:2,b:3") and "-iface eth0" in line
    assert "MPIR_CVAR_CH3_PORT_RANGE 29500:29599" in line
    with pytest.raises(LauncherError, match="interface name"):
        host_flags(MPICH, TWO, {}, iface="10.0.0.0/8")
    with pytest.raises(LauncherError, match="neither"):
        host_flags(Launcher("/x/srun", "unknown"), TWO, {})


def test_dry_run_across_hosts_prints_the_check_and_the_job(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hadpsgd.launch.__main__.find_launcher", lambda: OPENMPI)
    assert split_script(["--hosts", "a:2", "--iface", "eth0", "--algo", "bmuf"])[1] is None
    assert main(["--hosts", "a:2,b:3", "--iface", "eth0", "--dry-run", "--", "--algo",
                 "bmuf"]) == 0
    check, job = capsys.readouterr().out.strip().splitlines()
    assert "-np 2 --host a:1,b:1" in check and "hadpsgd.comm.reach --deadline 20 a b" in check
    assert "-np 5 --host a:2,b:3 --map-by slot" in job and job.endswith("--algo bmuf")
    assert main(["--hosts", "a:2,b:3", "--no-preflight", "--dry-run", "-n", "4"]) == 0
    assert capsys.readouterr().out.count("\n") == 1


def test_network_flags_without_hosts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--iface", "eth0", "--dry-run"])
    assert ended.value.code == 2
    assert "--iface is for a job across hosts" in capsys.readouterr().err


def _report(named: str, missed: list[str], heard: dict[str, float] | None = None,
            torch: str = "2.13.0") -> str:
    import json

    body = {"rank": 0, "named": named, "host": named, "heard": heard or {}, "missed": missed,
            "seconds": 20.0, "versions": {"python": "3.11.7", "torch": torch,
                                          "hadpsgd": "0.1.0", "mpi": "Open MPI v5"}}
    return "noise\n[1,0]<stdout>: HADPSGD_REACH " + json.dumps(body) + "\n"


def test_the_preflight_names_the_pair_a_firewall_parts() -> None:
    out = _report("a", ["b"]) + _report("b", ["a"]) + _report("c", [], {"a": 0.1, "b": 0.2})
    with pytest.raises(LauncherError, match=r"between a and b over eth0.*--ports LOW-HIGH"):
        judge(parse(out), ["a", "b", "c"], 1, out, 21.0, "eth0")


def test_the_preflight_names_a_host_of_other_versions_and_passes_a_good_set() -> None:
    out = _report("a", [], {"b": 0.1}) + _report("b", [], {"a": 0.2}, torch="2.11.0")
    with pytest.raises(LauncherError, match=r"b runs torch 2.11.0 \(on a: 2.13.0\)"):
        judge(parse(out), ["a", "b"], 0, out, 3.0, None)
    good = _report("a", [], {"b": 0.1}) + _report("b", [], {"a": 0.25})
    found = judge(parse(good), ["a", "b"], 0, good, 3.0, "eth0")
    assert found.slowest == 0.25
    assert found.line("eth0").startswith("preflight: 2 hosts (a, b) hear each other over MPI")


def test_the_preflight_names_the_host_whose_daemon_did_not_start() -> None:
    out = "ORTE was unable to start\n  Local host:    a\n  Remote host:   c\n"
    with pytest.raises(LauncherError, match=r"no report from c: .*ssh HOST"):
        judge(parse(out), ["a", "c"], 1, out, 2.0, None)


def test_the_launcher_reads_the_line_the_probe_prints() -> None:
    # The launch layer imports no comm (docs/design.md's layers), so the report line's
    # start is written in both modules: held equal here.
    from hadpsgd.comm import reach
    from hadpsgd.launch import preflight

    assert preflight.PREFIX == reach.PREFIX
