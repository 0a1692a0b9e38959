"""The login side: what runs on the machine a user submits from, before a job is queued and after.

It owns the plan (`plan`: a spec and a site made into what is submitted), the rendered script
(`render`), the submission and the job's life in the queue (`submit`, `lifecycle`, `watch`,
`jobhandle`, `jobindex`, `joblogs`), the Python `Executor`, and the login-side views of the
nodes (`nodes`, `exclusions`, `nodefail`, `stacks`). Nothing on the nodes imports it: the rank
side lives in `hpcdist.runtime` and the job packages, and both sides share `config`, `scheduler`,
`store`, `launchers`, `console`, `errors`, `polling` and `progress`.
"""
