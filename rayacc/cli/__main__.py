"""`python -m rayacc.cli`: the `rayacc` command."""

from rayacc.cli import run

if __name__ == "__main__":
    run()
