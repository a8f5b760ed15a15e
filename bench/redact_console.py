"""The console masker's cost on a real run's output: each line of a console log (as `rayacc
train` printed it) written through `RedactingStream` as the CLI writes it, per whole log, for
this tree's `rayacc/redact/` and, with `--against REF`, the single module `rayacc/redact.py` of a
git ref from before it became a package (read with `git show`, loaded beside it) — alternating,
best of five.

    .venv/bin/rayacc train -c jobs/digits.yaml > /tmp/console.txt
    .venv/bin/python bench/redact_console.py /tmp/console.txt --against d6d0857
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def module_at(ref: str):
    source = subprocess.run(
        ["git", "show", f"{ref}:rayacc/redact.py"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "redact_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("redact_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_log(module, lines: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(repeats):
            stream = module.RedactingStream(io.StringIO())
            for line in lines:
                stream.write(line)
            stream.release()
        best = min(best, (time.process_time() - t0) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log", type=Path)
    parser.add_argument("--against", help="a git ref whose rayacc/redact.py to time beside")
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    import rayacc.redact as here

    lines = [line + "\n" for line in args.log.read_text().splitlines()]
    print(f"{args.log}: {len(lines)} lines, {sum(map(len, lines))} characters")
    now = per_log(here, lines, args.repeats)
    print(f"this tree: {now * 1e6:.0f} µs per log")
    if args.against:
        then = per_log(module_at(args.against), lines, args.repeats)
        print(f"{args.against}: {then * 1e6:.0f} µs per log (this tree / it: {now / then:.2f})")


if __name__ == "__main__":
    main()
