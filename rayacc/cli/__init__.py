"""The `rayacc` command. User mistakes exit 2 with a message that names the field or file and
the fix; no traceback. `parser` declares the command line; one module per command group
(`train`, `plan`, `sweep`, `runs`, `jobs`, `data`); `common` what they share."""

from __future__ import annotations

import logging
import os
import sys

from rayacc import env
from rayacc.cli.common import EXIT_USER_ERROR, _user_error_types
from rayacc.cli.parser import build_parser, parse_args
from rayacc.cli.sweep import REPORT_OUT

__all__ = ["EXIT_USER_ERROR", "REPORT_OUT", "build_parser", "main", "parse_args", "run"]


def main(argv: list[str] | None = None) -> int:
    from rayacc.observe.console import QuietRayStream
    from rayacc.redact import RedactingStream

    # the console's one boundary: every line, rayacc's or a library's (argparse's messages
    # about the command line too), loses its credentials; Ray's own records below ERROR stay
    # in Ray's log files unless RAYACC_VERBOSE=1
    from rayacc.redact.origins import register_environment

    # the environment's credentials are known before the first line is printed
    register_environment()
    streams = sys.stdout, sys.stderr
    console_stream = RedactingStream if env.verbose() else QuietRayStream
    out, err = console_stream(sys.stdout), console_stream(sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        from rayacc.driver.arguments import environment_problems

        # what the environment stands for, checked before the command line is read
        if problems := environment_problems(os.environ):
            for problem in problems:
                print(f"rayacc: {problem}", file=sys.stderr)
            return EXIT_USER_ERROR
        args = parse_args(argv)
        return args.func(args)
    except _user_error_types() as exc:
        print(f"rayacc: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("rayacc: interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback

        traceback.print_exc()  # through the boundary, so masked too
        return 1
    finally:
        # a line left unfinished is masked whole, then the streams are the process's again
        out.release()
        err.release()
        sys.stdout, sys.stderr = streams


def run() -> None:
    """The `rayacc` command: `main`, then a quick exit. Once the command is done, everything it
    wrote is closed; stopping the local Ray it started is all that is left to do. The
    interpreter's own teardown of torch, Ray and gRPC would add about 2 s on 2 cores, so the
    process ends without it."""
    code = main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
