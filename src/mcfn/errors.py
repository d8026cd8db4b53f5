"""The exceptions a user sees, each reported as a single ``error:`` line: bad input (exit code 2) and a
training run that had to stop (exit code 3)."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """Something about the user's input (profile, data, checkpoint, flags) is wrong.

    Entry points print ``error: <message>`` and exit with code 2; nothing already written is touched.
    """


class RunAborted(Exception):
    """Training cannot go on (for example, the loss stayed non-finite); the last good state is checkpointed.

    ``train.run`` prints ``error: <message>`` and exits with code 3.
    """


def exit_code(body: Callable[[], object]) -> int:
    """Run an entry point's body: 0 when it returns, else the exit code of its error, printed as one line."""
    try:
        body()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0
