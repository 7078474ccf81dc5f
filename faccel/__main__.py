"""The command line: ``python -m faccel env [--json]``.

Exit status: 0 when the report found no problem, 1 when it found one (each
is printed with its fix), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (``sys.argv[1:]`` by default); return the exit status.

    The status is 1 when ``env`` reports a problem (what would make ``detect()``
    fail or the run misbehave), else 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m faccel",
        description="faccel's command line. Exit status: 0 when no problem was found, "
        "1 when the report lists a problem, 2 for a usage error.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser(
        "env",
        help="versions, devices, what detect() sees here and why, and problems found",
        description="Report what faccel sees in this environment; paste it into bug reports. "
        "Never starts a process group. Exits with status 1 when the report lists a problem.",
    )
    env.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    from faccel._env_report import collect_hardware, collect_versions, env_report, render_text, report_dict

    report = env_report(os.environ, versions=collect_versions(), hardware=collect_hardware())
    if args.json:
        json.dump(report_dict(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_text(report))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
