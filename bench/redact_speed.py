"""The credential matcher's speed (rayacc/redact.py) on 1 MB of adversarial text: every console
line and MLflow tag goes through it, so it must take time linear in its input. Prints ms per MB
for each input and the ratio of 2 MB's time to 1 MB's (linear: about 2; quadratic: about 4).

    .venv/bin/python bench/redact_speed.py
"""

from __future__ import annotations

import time

from rayacc.redact import contains_secret, redact

MB = 1 << 20


def inputs(size: int) -> dict[str, str]:
    return {
        "a.a.a.…://": "a." * (size // 2) + "://",
        "a://a://…": "a://" * (size // 4),
        "a://@a://@…": "a://@" * (size // 5),
        "http://@@@…": "http://" + "@" * size,
        "????…": "?" * size,
        "?a=?a=…": "?a=" * (size // 3),
        "?token=x…": "?token=x" * (size // 8),
        "log lines with URIs": ("step 3 at http://u:p@h:5000/x?sig=abc done\n" * (size // 43)),
        "password=x password=x…": "password=x " * (size // 11),
        "token: token: …": "token: " * (size // 7),
        "--token --token …": "--token " * (size // 8),
        "a-a-a-…-token": "a-" * (size // 2) + "token",
        "a.a.a.…token:": "a." * (size // 2) + "token:",
        "Bearer Bearer …": "Bearer " * (size // 7),
        "ghp_ghp_…": "ghp_" * (size // 4),
        "AKIA…AKIA… ": ("AKIA" + "A" * 16 + " ") * (size // 21),
        "log lines with keys": ("step 3 token=abc api_key: 'k' --password p done\n" * (size // 49)),
    }


def seconds(text: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        redact(text)
        contains_secret(text)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    one, two = inputs(MB), inputs(2 * MB)
    worst = 0.0
    print(f"{'input':24} {'ms / 1 MB':>10} {'2 MB / 1 MB':>12}")
    for name in one:
        a, b = seconds(one[name]), seconds(two[name])
        worst = max(worst, a)
        print(f"{name:24} {1000 * a:10.1f} {b / a:12.2f}")
    print(f"worst ms per MB: {1000 * worst:.1f}")


if __name__ == "__main__":
    main()
