"""User-facing errors.

`UserError` is raised for anything the user can fix (a missing file, an unknown architecture,
an unsupported config field, a bad flag). The CLI prints its message as one line and exits 2;
the server maps it to a 4xx. Never let such a condition surface as a traceback.
"""


class UserError(Exception):
    """A problem with the user's input; the message is one line and names the file/field."""

    exit_code = 2


class StoreError(UserError):
    """The expert store failed while serving (a record's checksum, an I/O error).

    The server answers the request that hit it with a 503 naming the record, not a 500: the
    fault is in the files or the disk, not in the request. A checksum mismatch also turns
    /health unhealthy (503) until a restart: the files under the server are damaged.
    """


class StoreIntegrityError(StoreError):
    """Stored expert bytes do not match their recorded checksum."""
