"""The test suite's support package: helpers and fixtures for every test module.

``cli`` runs the CLI as a user does and reads what it printed; ``fixtures`` holds per-test and
per-session storage and the cluster's checks; ``train``, ``infer``, ``hf`` and ``bench`` hold
what their tests share. ``tests/conftest.py`` registers the fixture modules as plugins.
"""
