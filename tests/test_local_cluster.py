"""cluster/local.sh signals only the processes it started: a recorded pid that another process
holds now (the node died, the machine rebooted) is left alone and its record dropped."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
