# NOT ONE OF SUBMITIT'S OWN TESTS. Written for this harness (benchmarks/submitit_parity/run.sh),
# and copied by run.sh into submitit/test_hpcdist_helpers.py of both test trees. Everything else the
# harness runs is submitit 1.5.4's own test code.
#
# Both tests take the `executor` fixture of submitit/conftest.py: in the hpcdist tree (patched
# conftest) that is `hpcdist.Executor(folder=tmp_path)`; in the baseline tree (submitit's own
# conftest) it is `LocalExecutor(tmp_path)`, so the same file also runs against plain submitit.
#
# test_monitor_jobs_real_jobs: submitit's test_monitor_jobs (submitit/test_helpers.py) runs
# `helpers.monitor_jobs` on two fake jobs whose state a fake watcher makes up; this one gives it two
# real jobs, one that returns and one that raises, and asserts what that test asserts: every job is
# done, and the set of jobs whose `state.upper() == "FAILED"` is exactly the failing one.
# (submitit's test writes `all(j for j in jobs if j.done())`, which is always true; "all done" is
# asserted here as `all(j.done() for j in jobs)`, which is what it means.)
#
# test_result_raises_submitit_errors: `job.result()` of a job that raised raises
# submitit.core.utils.FailedJobError, and of a cancelled job raises
# submitit.core.utils.UncompletedJobError (FailedJobError is a subclass of it; either is accepted).

import time

import pytest
import submitit
import submitit.core.utils
import submitit.helpers


def test_monitor_jobs_real_jobs(executor) -> None:
    # local functions, as in test_local.py: cloudpickle sends them by value
    def _returns() -> int:
        return 12

    def _raises() -> None:
        raise RuntimeError("Failed on purpose")

    ok = executor.submit(_returns)
    failing = executor.submit(_raises)
    jobs = [failing, ok]
    submitit.helpers.monitor_jobs(jobs, 0.1, test_mode=True)
    assert all(j.done() for j in jobs)
    assert set(j for j in jobs if j.state.upper() == "FAILED") == {failing}


def test_result_raises_submitit_errors(executor) -> None:
    def _raises() -> None:
        raise RuntimeError("Failed on purpose")

    failing = executor.submit(_raises)
    with pytest.raises(submitit.core.utils.FailedJobError, match="Failed on purpose"):
        failing.result()

    sleeping = executor.submit(time.sleep, 60)
    sleeping.cancel()
    start = time.time()
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        sleeping.result()
    assert time.time() - start < 50, "result() waited for the job to end: the cancel did not stop it"
