"""benchmarks/training/sites.py: its configurations, ratios and table (no processes; the
harness itself runs in tests/mpi/test_sites.py where root allows)."""

from benchmarks.training.sites import add_ratios, configs, row, table


def test_site_configurations_make_each_site_one_super_learner():
    c = configs(3)
    assert c["bmuf-sites"][-2:] == ["--ranks-per-node", "3"]
    assert c["hadpsgd-sites"][-2:] == ["--super-learner-size", "3"]
    assert c["bmuf-hosts"][-2:] == ["--ranks-per-node", "1"]
    assert "--ranks-per-node" not in c["ssgd"]


def test_rows_ratios_and_table():
    def run(between: int, inside: int, counted: float, seconds: float) -> dict:
        return {"steps": 60, "seconds": seconds, "link_bytes_each_way": [between, inside],
                "counted": {"world_internode_bytes": counted, "world_control_bytes": 0.0},
                "last_line": ""}

    rows = [row("ssgd", [], run(1000, 2000, 3000.0, 30.0)),
            row("bmuf-sites", [], run(100, 2500, 90.0, 15.0))]
    add_ratios(rows)
    assert rows[1]["between_sites"] == 100 and rows[1]["inside_sites"] == 2500
    assert rows[1]["ssgd_over_between_sites"] == 10.0 and rows[1]["ssgd_over_seconds"] == 2.0
    assert rows[1]["counted_between_super_learners"] == 90.0
    text = table(rows)
    assert "bmuf-sites" in text and "10x" in text and "2.00x" in text
