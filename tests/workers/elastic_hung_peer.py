"""An elastic job in which a member fails while a process it left behind holds the job's connections open, as a hung
peer on another host would: in the first round, at step 10, the last rank starts a child in a session of its own
(shoalrun cannot end it; it writes its pid to the file named by the first argument) that inherits every socket, and
one in its own process group (pid to the second argument), then exits 1 while the others are in the step's
collective. Prints one JSON line per worker at the end."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import shoal.torch as hvd
from shoal.core import session

torch.set_num_threads(1)
hvd.init()
first_world = hvd.size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
restores = 0
committed_restore = state.restore


def counting_restore() -> None:
    global restores
    restores += 1
    committed_restore()


state.restore = counting_restore  # type: ignore[method-assign]


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    while state.step < 40:
        if state.step == 10 and hvd.size() == first_world and hvd.rank() == first_world - 1:
            for session, path in (("own", sys.argv[1]), ("worker's", sys.argv[2])):
                if os.fork() == 0:
                    if session == "own":
                        os.setsid()
                    with open(path, "w") as out:
                        out.write(str(os.getpid()))
                    time.sleep(300)
                    os._exit(0)
            time.sleep(0.5)  # the others are waiting in step 10's allreduce by now
            os._exit(1)
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        state.step += 1
        state.commit()


train(state)
caller_cycles = session.session().engine.caller_cycles  # an elastic worker's calls leave every cycle to the engine
print(
    json.dumps(
        {"rank": hvd.rank(), "size": hvd.size(), "restores": restores, "step": state.step, "caller_cycles": caller_cycles}
    ),
    flush=True,
)
