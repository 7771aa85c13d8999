"""User-facing errors.

`UserError` is raised for anything the user can fix (a missing file, an unknown architecture,
an unsupported config field, a bad flag). The CLI prints its message as one line and exits 2;
the server maps it to a 4xx. Never let such a condition surface as a traceback.
"""


class UserError(Exception):
    """A problem with the user's input; the message is one line and names the file/field."""

    exit_code = 2


class StoreIntegrityError(UserError):
    """Stored expert bytes do not match their recorded checksum."""
