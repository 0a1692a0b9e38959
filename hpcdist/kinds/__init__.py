"""Job kinds (node side; their light params modules are read on the login side too): the registry
(a kind's name -> its params model, site check and runner, each imported only when used), the
smoke job, and ``python``, the kind that runs your own code. A kind is what a job spec's
``kind:`` names; its parameters are the kind's params model (``params:``).
"""
