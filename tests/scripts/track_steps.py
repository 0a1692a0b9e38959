"""A user script on ``hpcdist.init()`` that logs ``loss = 1 / step`` at steps 1..5 to the job's
trackers (``ctx.track``) and its result, then closes: the run is then FINISHED, with the result file
as its artifact."""

import hpcdist

ctx = hpcdist.init()
for step in range(1, 6):
    ctx.track(step, loss=1 / step)
ctx.results.attrs["final_loss"] = 1 / 5
ctx.close()
