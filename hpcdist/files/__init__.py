"""Files that are never half-written and never read from where someone else could have written
them: the ground the store, the site config and the login node's records stand on. Both sides
use it (standard library only).

- ``atomic``: temporary name in the same directory, fsync, ``os.replace``, directory fsync;
- ``trust``: what may be run, imported or unpickled (the owner and mode of a file and every
  folder above it, links included);
- ``roots``: a site's storage roots as this user may use them, each user's own folder in a shared
  root, and the one line for one she cannot read, write or make (the root, its owner and mode,
  the key to set), or for a PermissionError met there;
- ``user``: who runs this process, as storage paths name them.
"""
