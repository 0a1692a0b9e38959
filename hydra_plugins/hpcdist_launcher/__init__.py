"""``hydra/launcher=hpcdist``: Hydra's multirun sweeps as hpcdist jobs (``pip install hpcdist[hydra]``).

Hydra finds this package by scanning the ``hydra_plugins`` namespace package (which has no
``__init__.py``, so that every installed plugin shares it). ``config`` registers the launcher's
settings in Hydra's ConfigStore; ``launcher`` is the plugin class, kept thin: the submit side is
``hpcdist.login.hydra_sweep``. Both import only Hydra here, so discovery stays fast for every
Hydra app on the machine.
"""
