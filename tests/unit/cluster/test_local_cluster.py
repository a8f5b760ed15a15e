"""cluster/local.sh signals only the processes it started: a recorded pid that another process
holds now (the node died, the machine rebooted) is left alone and its record dropped."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def start_time(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(") ", 1)[1].split()[19]


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def local_sh(state: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAYACC_LOCAL_DIR=str(state), RAYACC_LOCAL_PORT="28379")
    return subprocess.run(
        ["bash", str(ROOT / "cluster" / "local.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def test_a_reused_pid_is_never_signalled_and_stale_records_are_dropped(tmp_path):
    state = tmp_path / "state with spaces"
    state.mkdir()
    unrelated = subprocess.Popen(["sleep", "300"])
    try:
        # records that name the unrelated process's pid: a bare pid (as written before records
        # held start times), another start time, another boot
        (state / "worker1.pid").write_text(f"{unrelated.pid}\n")
        (state / "worker4.pid").write_text(f"{unrelated.pid} 1 {boot_id()}\n")
        (state / "head.pid").write_text(f"{unrelated.pid} {start_time(unrelated.pid)} old-boot\n")
        (state / "env").write_text("export RAY_ADDRESS=http://127.0.0.1:1\n")
        out = local_sh(state, "remove", "1")
        assert out.returncode == 0 and "already gone" in out.stdout, out.stdout + out.stderr
        out = local_sh(state, "down")
        assert out.returncode == 0 and "stopped 0 process(es)" in out.stdout, out.stdout
        time.sleep(0.3)
        assert alive(unrelated), "local.sh signalled a process it did not start"

        (state / "worker2.pid").write_text(f"{unrelated.pid} 1 {boot_id()}\n")
        (state / "env").write_text("export RAY_ADDRESS=http://127.0.0.1:1\n")
        assert local_sh(state, "prune").returncode == 0
        assert not list(state.glob("*.pid")) and not (state / "env").exists()
        assert alive(unrelated)

        # the record of a process it did start (same pid, start time and boot) is stopped
        (state / "worker3.pid").write_text(
            f"{unrelated.pid} {start_time(unrelated.pid)} {boot_id()}\n"
        )
        out = local_sh(state, "down")
        assert "stopped 1 process(es)" in out.stdout, out.stdout + out.stderr
        unrelated.wait(timeout=10)
    finally:
        if alive(unrelated):
            unrelated.kill()


def test_every_signal_of_down_and_remove_re_checks_the_process_start_time(tmp_path):
    """A process that ends after `down`'s TERM may hand its pid to another before the KILL
    pass: each signal goes only to a pid whose start time is still the one seen first."""
    unrelated = subprocess.Popen(["sleep", "300"])
    lib = f"source {ROOT / 'cluster' / 'local.sh'}"
    try:
        right = f"{unrelated.pid}:{start_time(unrelated.pid)}"
        wrong = f"{unrelated.pid}:1"
        out = subprocess.run(["bash", "-c", f"{lib}; signal_same KILL {wrong}"], timeout=30)
        assert out.returncode == 0
        time.sleep(0.3)
        assert alive(unrelated), "signalled a pid whose start time is another's"
        out = subprocess.run(
            ["bash", "-c", f"{lib}; with_start {unrelated.pid} 999999999"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.stdout.split() == [right], "a pid that runs, with its start; none for the gone"
        subprocess.run(["bash", "-c", f"{lib}; signal_same KILL {right}"], timeout=30)
        unrelated.wait(timeout=10)
    finally:
        if alive(unrelated):
            unrelated.kill()


def test_down_kills_a_recorded_process_that_ignores_term(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 300 & wait"])
    try:
        time.sleep(0.3)
        (state / "head.pid").write_text(f"{stubborn.pid} {start_time(stubborn.pid)} {boot_id()}\n")
        out = local_sh(state, "down")
        assert out.returncode == 0 and "stopped" in out.stdout, out.stdout + out.stderr
        stubborn.wait(timeout=20)
    finally:
        if alive(stubborn):
            stubborn.kill()


JOIN = r"""
source "$ROOT/cluster/local.sh"
set +e
mkdir -p "$STATE"
starts=0
start_worker() {  # a node start that gives up (exits) $FAILS times, then one that joins
  starts=$((starts + 1))
  if [ "$FAILS" = never ]; then start_bg "worker$1" sleep 30
  elif [ "$starts" -le "$FAILS" ]; then start_bg "worker$1" bash -c 'exit 1'
  else start_bg "worker$1" bash -c 'touch "$0"; exec sleep 30' "$STATE/joined"
  fi
}
node_joined() { [ -f "$STATE/joined" ]; }
start_worker 1
join_worker 1 $((SECONDS + 3))
echo "rc=$? starts=$starts"
kill "$(cut -d' ' -f1 "$STATE/worker1.pid")" 2>/dev/null
"""


@pytest.mark.parametrize(
    ("fails", "rc", "starts", "says"),
    [
        ("0", 0, 1, None),
        # Ray's own start of a node gave up after 30 s on a loaded machine: started again
        ("1", 0, 2, "worker node 1's ray start exited before it joined"),
        ("2", 0, 3, "worker1.exited2.log"),
        ("3", 1, 3, "worker node 1's ray start exited 3 times"),
        # alive but never joining: the deadline, not a restart
        ("never", 1, 1, "worker node 1 not ready by the deadline"),
    ],
)
def test_a_worker_node_whose_start_exits_is_started_again_twice_at_most(
    tmp_path, fails, rc, starts, says
):
    state = tmp_path / "state"
    out = subprocess.run(
        ["bash", "-c", JOIN],
        capture_output=True,
        text=True,
        env=dict(os.environ, ROOT=str(ROOT), RAYACC_LOCAL_DIR=str(state), FAILS=fails),
        timeout=60,
    )
    assert f"rc={rc} starts={starts}" in out.stdout, out.stdout + out.stderr
    if says is None:
        assert "exited" not in out.stderr, out.stderr
    else:
        assert says in out.stderr, out.stderr
