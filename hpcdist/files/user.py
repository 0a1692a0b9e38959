"""Who runs this process, as storage paths name them (standard library only: a rank's task
runner checks its files' owners without loading the config models)."""

from __future__ import annotations

import os


def current_user() -> str:
    """This process's user name (its uid's, as the password database says; the uid if none): the
    name of its folder in a shared storage root. Never ``$USER``, which a shell may leave as it was."""
    import pwd

    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
