"""Two sites of two emulated hosts (benchmarks/_common/sites.py): super-learners as sites.

``--ranks-per-node`` of a site's ranks makes every super-learner one site: its learners
average each step over the site's own (fast) network, and BMUF's block syncs are all that
crosses the slow link between the sites. Needs root, iproute2 and Open MPI; skipped
elsewhere with the reason.
"""

import json
import os
import subprocess
import sys

import pytest

from benchmarks._common.netns import available
from benchmarks._common.sites import Sites
from tests._mpi import ROOT, ranks_python

pytestmark = pytest.mark.mpi
OK, WHY = available()


@pytest.mark.skipif(not OK, reason=f"emulated sites: {WHY}")
def test_bmuf_between_two_sites_sends_only_its_block_syncs_between_them(tiny_data, tmp_path):
    env = {**ranks_python(), "HADPSGD_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_osc": "^ucx"}
    out = tmp_path / "run"
    with Sites(sites=2, hosts_per_site=2, rate="100mbit") as sites:
        before = sites.link_bytes()
        argv = [sys.executable, "-m", "hadpsgd.run", "--algo", "bmuf", "--ranks-per-node", "2",
                "--train", str(tiny_data[0]), "--heldout", str(tiny_data[1]), "--preset",
                "tiny", "--max-steps", "16", "--batch-size", "8", "--out-dir", str(out),
                "--no-progress"]
        try:
            res = subprocess.run(sites.mpirun(4, argv), capture_output=True, text=True,
                                 timeout=240, env={**os.environ, **env}, cwd=ROOT)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"the sites' job did not finish in 240 s\n{err.stdout}\n{err.stderr}")
        after = sites.link_bytes()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "4 learners on 2 emulated nodes [2, 2]" in res.stdout
    assert "each node spans 2 hosts: a site" in res.stdout
    between, inside = (a - b for a, b in zip(after, before, strict=True))
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"bytes"' in line][-1]
    # All that the run counts as crossing between super-learners crossed between the sites
    # (the link also carries TCP/IP, MPI's control, the start's broadcast and evaluations).
    assert between >= record["world_internode_bytes"] > 0
    # Every step's gradient mean stays inside a site: at tau 8 the site's own network
    # carries several times what the slow link does (10.6 MB against 1.0 MB, measured).
    assert inside > 3 * between
