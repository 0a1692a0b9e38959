"""The suite's fixtures come from one support package, registered here once for the session:
``tests/support/`` (``cli`` helpers; ``fixtures``, ``train``, ``hf``: fixtures and helpers)."""

pytest_plugins = ["tests.support.fixtures", "tests.support.train", "tests.support.hf"]
