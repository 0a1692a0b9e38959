"""The login side: what runs on the machine a user submits from, before a job is queued and after.

It owns the plan (`plan`: a spec and a site made into what is submitted), the rendered script
(`render`), the submission and the job's life in the queue (`submit`, `lifecycle`, `watch`,
`jobhandle`, `jobindex`, `joblogs`), the Python `Executor` (and submitit's `LocalExecutor` and
`SlurmExecutor` over it, `submitit_executors`), and what a submit decides about
the nodes (`exclusions`: the bad nodes every submit excludes; `node_failure_wait`: a job requeued after
a node died runs again without it). Nothing on the nodes imports it: the rank side lives in
`hpcdist.runtime` and the job packages, and both sides share `config`, `scheduler`, `store`,
`launchers`, `console`, `errors`, `polling` and `progress`. The commands over it are
`hpcdist.cli`.
"""
