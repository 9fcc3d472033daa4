"""Running the ``ucformat`` app in-process, and what a user error must look like."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner, Result
from ucformat_cli.main import app


def invoke(*args: object) -> Result:
    """Run ``ucformat ARGS...`` in-process; stdout and stderr are kept apart."""
    return CliRunner().invoke(app, [str(arg) for arg in args])


def assert_user_error(result: Result, *fragments: str) -> str:
    """Exit code 2, nothing on stdout, one ``error:`` line on stderr holding ``fragments``."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


#: Runs the app with the arguments in ``sys.argv[2:]``, then prints (as the last line on
#: stderr) which of the modules named in ``sys.argv[1]`` (comma-separated) got imported.
_WATCH_IMPORTS = """
import json, sys
from ucformat_cli.main import app
watched, args = sys.argv[1].split(","), sys.argv[2:]
try:
    app(args, prog_name="ucformat")
except SystemExit as exit:
    if exit.code not in (0, None):
        raise
print(json.dumps(sorted(m for m in watched if m in sys.modules)), file=sys.stderr)
"""


def heavy_imports(*args: object, watch: tuple[str, ...]) -> tuple[str, list[str]]:
    """Run ``ucformat ARGS...`` in a fresh interpreter: its stdout, and which of the ``watch``
    modules it imported."""
    command = [sys.executable, "-c", _WATCH_IMPORTS, ",".join(watch), *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    imported: list[str] = json.loads(done.stderr.splitlines()[-1])
    return done.stdout, imported
