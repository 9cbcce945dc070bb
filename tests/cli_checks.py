"""How a command that refused its input must look to the user (imported by the fault tests)."""
from __future__ import annotations


def fails(res, *needles: str, codes: tuple[int, ...] = (1,)) -> str:
    """The CliRunner result `res` failed the way a user should see it: an exit code in `codes` (1: our
    error; 2: click's usage error), click's exit rather than an escaped error, no traceback, and one
    `Error:` line holding every needle. Returns that line."""
    assert res.exit_code in codes, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    (line,) = [x for x in res.output.splitlines() if x.startswith("Error:")]
    for needle in needles:
        assert needle in line, line
    return line
