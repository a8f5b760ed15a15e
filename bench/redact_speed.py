"""The credential matcher's speed (rayacc/redact/): every console line and MLflow tag goes
through it, so it must take time linear in its input. Prints, for the hand-picked inputs and
the worst of the inputs generated from the module's own patterns and words
(tests/unit/package/test_redact_linear.py), ms per MB and the ratio of 2 MB's time to 1 MB's
(linear: about 2; quadratic: about 4); the realistic 105-character log line in µs; and the rate
of a 100 MB mixed log (mostly benign lines, some holding credentials) through
`RedactingStream`, written a line at a time as a program prints.

    .venv/bin/python bench/redact_speed.py
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayacc.redact import RedactingStream, contains_secret, redact

MB = 1 << 20


def inputs(size: int) -> dict[str, str]:
    return {
        "a.a.a.…://": "a." * (size // 2) + "://",
        "a://a://…": "a://" * (size // 4),
        "http://@@@…": "http://" + "@" * size,
        "?a=?a=…": "?a=" * (size // 3),
        "?token=x…": "?token=x" * (size // 8),
        "log lines with URIs": ("step 3 at http://u:p@h:5000/x?sig=abc done\n" * (size // 43)),
        "password=x password=x…": "password=x " * (size // 11),
        "-x_password…": "-x_password" * (size // 11),
        "--opt_opt_…": "--opt_" * (size // 6),
        "token: token: …": "token: " * (size // 7),
        "Bearer Bearer …": "Bearer " * (size // 7),
        "ghp_ghp_…": "ghp_" * (size // 4),
        "eyJ_eyJ_…": "eyJ_" * (size // 4),
        "AKIA…AKIA… ": ("AKIA" + "A" * 16 + " ") * (size // 21),
        "log lines with keys": ("step 3 token=abc api_key: 'k' --password p done\n" * (size // 49)),
    }


def seconds(fn, text: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn(text)
        best = min(best, time.process_time() - t0)
    return best


def generated(top: int = 8) -> dict[str, str]:
    from tests.unit.package import test_redact_linear as T

    timed = sorted(
        ((seconds(redact, text[: MB // 4], 1), name) for name, text in T.inputs().items()),
        reverse=True,
    )
    return {f"generated {name}": T.inputs()[name] for _, name in timed[:top]}


MIXED = [
    "step 120/4000 loss 2.3187 lr 3.00e-04 tokens/s 48213 elapsed 00:12:31",
    "INFO worker.py:1893 -- Started a local Ray instance. View the dashboard at 127.0.0.1:8265",
    "[rank1]: wrote shard_00_01 of checkpoint_step00000120 (9982 tokens, 14.2 MB)",
    "tokenizer_config.json special_tokens_map.json max_new_tokens=200 --key-path /etc/x",
    "tracking at http://alice:s3cret@mlflow:5000/#/experiments/1",
    "export AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "{'AccessKeyId': 'ASIAIOSFODNN7EXAMPLE', 'SessionToken': 'FwoGZXIvYXdzEBAaD'}",
]
"""Four benign lines to every three holding a credential (a log dense in them)."""


def stream_rate(total: int = 100 * MB) -> tuple[float, float]:
    """(MB/s of the mixed log, MB/s of its benign lines alone) through RedactingStream."""
    rates = []
    for lines in (MIXED, MIXED[:4]):
        text = [line + "\n" for line in lines]
        n = total // sum(len(t) for t in text)
        out = io.StringIO()
        stream = RedactingStream(out)
        t0 = time.process_time()
        for _ in range(n):
            for line in text:
                stream.write(line)
        stream.release()
        rates.append(total / MB / (time.process_time() - t0))
    return rates[0], rates[1]


def main() -> None:
    one = {**inputs(MB), **generated()}
    print(f"{'input':34} {'ms / 1 MB':>10} {'2 MB / 1 MB':>12}")
    worst = 0.0
    for name, text in one.items():
        a = seconds(lambda t: (redact(t), contains_secret(t)), text)
        b = seconds(lambda t: (redact(t), contains_secret(t)), text + text)
        worst = max(worst, a)
        print(f"{name[:34]:34} {1000 * a:10.1f} {b / a:12.2f}")
    print(f"worst ms per MB (redact and contains_secret): {1000 * worst:.1f}")
    line = "rank 0 wrote -shard_" + "_".join(f"{i:02d}" for i in range(24)) + " (9982 tokens)"
    t0 = time.process_time()
    for _ in range(10_000):
        redact(line)
    print(f"the 105-character log line: {(time.process_time() - t0) / 10_000 * 1e6:.1f} µs")
    mixed, benign = stream_rate()
    print(
        f"RedactingStream, 100 MB mixed log: {mixed:.1f} MB/s; its benign lines: {benign:.1f} MB/s"
    )


if __name__ == "__main__":
    main()
