"""The one exception type a user sees: bad input, reported as a single line with exit code 2."""


class UserError(Exception):
    """Something about the user's input (profile, data, checkpoint, flags) is wrong.

    Entry points print ``error: <message>`` and exit with code 2; nothing already written is touched.
    """
