"""The lines Ray relays to the driver (`(raylet) …`, a worker's output) carry no escape codes
where the console is a file or a pipe: Ray's own printer, given a raylet's line, after the
driver's set-up (`env.plain_ray_lines`, called before every `ray.init`)."""

from __future__ import annotations

import io


def _relayed(monkeypatch) -> str:
    from ray._private import worker

    monkeypatch.setattr(worker, "_worker_logs_enabled", True)
    out = io.StringIO()
    data = {"pid": "raylet", "ip": "10.0.0.1", "localhost": "10.0.0.2", "lines": ["a worker died"]}
    worker.print_worker_logs(data, out)
    return out.getvalue()


def test_a_raylet_line_in_a_pipe_is_plain_text(monkeypatch):
    from rayacc.env import plain_ray_lines

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    assert "\x1b[" in _relayed(monkeypatch)  # Ray's own way, whatever the console
    plain_ray_lines()  # pytest's console is not a terminal
    line = _relayed(monkeypatch)
    assert "\x1b[" not in line and line.startswith("(raylet, ip=10.0.0.1) a worker died"), line


def test_a_users_own_choice_of_ray_colours_stands(monkeypatch):
    from rayacc.env import plain_ray_lines

    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    plain_ray_lines()
    assert "\x1b[" in _relayed(monkeypatch)
