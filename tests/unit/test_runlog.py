"""``RUN_DIR/train.log``: rank 0's console teed into the run directory, line by line."""

from __future__ import annotations

import sys
from pathlib import Path

from hadpsgd.assembly.runlog import LOG_FILE, ConsoleLog


def test_lines_reach_the_file_as_printed_and_the_streams_come_back(tmp_path: Path,
                                                                   capsys) -> None:
    out, err = sys.stdout, sys.stderr
    log = ConsoleLog()
    log.install()
    try:
        print("[hadpsgd] made the run directory")  # before it stands: kept in memory
        path = log.attach(tmp_path, "start")
        assert path == tmp_path / LOG_FILE
        print("[hadpsgd] epoch 0 step 10: loss 2.1", flush=True)
        sys.stdout.write("partial ")  # a line written in pieces is one line
        # Flushed per line: readable while the run goes on, not only at the end.
        assert path.read_text().splitlines()[-1] == "[hadpsgd] epoch 0 step 10: loss 2.1"
        sys.stdout.write("line\n")
        # A progress bar redrawn in place (carriage returns, a cursor escape): its last frame.
        sys.stderr.write("\repoch 0:  10%|#  | 1/10")
        sys.stderr.write("\repoch 0: 100%|###| 10/10\x1b[A\n")
        print("hadpsgd: error: something", file=sys.stderr)
    finally:
        log.close()
    assert sys.stdout is out and sys.stderr is err
    lines = path.read_text().splitlines()
    assert lines[0].startswith("===== ") and " start: hadpsgd.run" in lines[0]
    assert lines[1:] == ["[hadpsgd] made the run directory",
                         "[hadpsgd] epoch 0 step 10: loss 2.1", "partial line",
                         "epoch 0: 100%|###| 10/10", "hadpsgd: error: something"]
    seen = capsys.readouterr()  # the console still got everything
    assert "made the run directory" in seen.out and "something" in seen.err


def test_a_resume_appends_after_a_separator_naming_it(tmp_path: Path) -> None:
    for what in ("start", "resume (--resume auto)"):
        log = ConsoleLog()
        log.install()
        try:
            log.attach(tmp_path, what)
            print(f"[hadpsgd] {what} line")
        finally:
            log.close()
    lines = (tmp_path / LOG_FILE).read_text().splitlines()
    assert len(lines) == 4 and lines[1] == "[hadpsgd] start line"
    assert lines[2].startswith("===== ") and " resume (--resume auto): " in lines[2]
    assert lines[3] == "[hadpsgd] resume (--resume auto) line"


def test_a_start_that_never_attaches_writes_nothing(tmp_path: Path) -> None:
    log = ConsoleLog()
    log.install()
    try:
        print("hadpsgd: error: --out-dir already holds a run")  # refused before the directory
    finally:
        log.close()
    assert not (tmp_path / LOG_FILE).exists() and log.path is None
