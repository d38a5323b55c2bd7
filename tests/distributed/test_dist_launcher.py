"""The launcher itself: a hung job is killed in time, ranks and grandchildren included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(60)

HANG = """
import os, subprocess, sys, time
out = os.path.join(os.environ["HANG_DIR"], "pids" + os.environ["RANK"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(out + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid} {os.environ['MASTER_PORT']} {os.environ['CUDA_VISIBLE_DEVICES']!r}")
os.replace(out + ".tmp", out)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_timeout_kills_every_rank_and_grandchild(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    start = time.monotonic()
    run = run_ranks("hang", script=script, timeout=5, env={"HANG_DIR": str(tmp_path)})
    assert run.timed_out
    assert time.monotonic() - start < 30
    assert [r.returncode for r in run.ranks] == [None, None]
    assert "timed_out=True" in run.describe()
    pids = []
    for rank in range(2):
        pid_file = tmp_path / f"pids{rank}"
        assert pid_file.exists(), "rank did not start within the timeout"
        rank_pid, child_pid, port, cuda = pid_file.read_text().split()
        assert cuda == "''"
        pids += [int(rank_pid), int(child_pid)]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


BIND = """
import os, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
if os.environ["RANK"] == "0":
    s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))  # OSError: [Errno 98] Address already in use
open(os.path.join(os.environ["OUT_DIR"], "ports" + os.environ["RANK"]), "a").write(os.environ["MASTER_PORT"] + "\\n")
"""


def test_port_taken_is_retried_on_a_new_port(tmp_path, monkeypatch):
    import socket

    import _dist_launcher

    script = tmp_path / "bind.py"
    script.write_text(BIND)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    ports = iter([busy_port])
    real = _dist_launcher.free_port
    monkeypatch.setattr(_dist_launcher, "free_port", lambda: next(ports, None) or real())
    try:
        run = run_ranks("bind", script=script, timeout=20, env={"OUT_DIR": str(tmp_path)})
    finally:
        busy.close()
    assert [r.returncode for r in run.ranks] == [0, 0], run.describe()
    used = (tmp_path / "ports1").read_text().split()
    assert len(used) == 2 and used[0] == str(busy_port) and used[1] != str(busy_port)
