"""The endpoint benchmark charges a cell's CPU to the server processes that spent it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.server_process import CpuMeter, priorities

BUSY = "import time\nend = time.process_time() + float(__import__('sys').argv[1])\n" + (
    "while time.process_time() < end:\n    pass\ninput()\n"
)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_a_busy_server_process_is_charged_and_the_sleeping_client_is_not() -> None:
    # A "server": a session leader that burns 0.6 s of CPU during the cell, then waits.
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY, "0.6"], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        with CpuMeter(proc) as cpu:
            time.sleep(1.5)
        spent = {label.split()[-1]: s for label, s in cpu.server_s.items()}
        assert 0.4 <= spent[str(proc.pid)] <= 1.6
        assert cpu.client_s < 0.5  # this process only slept
        assert priorities(proc) == {}  # under 1 s of CPU in all: not listed as busy
    finally:
        proc.kill()
        proc.wait()


def test_no_server_measures_only_the_client() -> None:
    with CpuMeter(None) as cpu:
        sum(range(10_000))
    assert cpu.server_s == {}
    assert cpu.client_s >= 0
