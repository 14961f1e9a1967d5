"""An elastic training script for tests/dist/test_elastic.py, with failures to order.

``python _elastic_train.py OUT [--die WID@WHEN:HOW ...]``: a linear model on fixed synthetic
data, 96 samples an epoch in global batches of 12 (each of the ``hvd.size()`` workers takes
``12 // size``), DistributedOptimizer (SGD with momentum), ElasticSampler, a commit every 2
steps. Because a step always covers the same 12 samples, whatever the world size, the final
weights of any run equal those of one process alone (float rounding aside).

``--die w1@5:kill``: worker w1 SIGKILLs itself before step 5; ``killpg``: its whole process
group (with a child it started); ``raise``: an exception; ``capacity``: writes OUT/died (the
discovery script then offers one slot fewer for a while), waits 1.5 s, then SIGKILL.
``WHEN`` may be ``reset``: in the first reset callback (a failure while the world re-forms).

``--say``: each worker prints ``<wid> rank <R> step <N>`` at each commit.

Each worker writes OUT/<wid>.json at the end: pid, steps run in this process, resets, the
world sizes it saw, the weights. Rank 0 writes the last committed step and the world size to
OUT/progress.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hora.torch as hvd
import torch

GLOBAL_BATCH = 12
SAMPLES = 96
EPOCHS = 2
COMMIT_EVERY = 2


def dataset() -> torch.utils.data.TensorDataset:
    """The fixed synthetic regression data (the same in every process)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=gen)
    y = x @ torch.randn(8, 2, generator=gen) + 0.1 * torch.randn(SAMPLES, 2, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its (plain) optimizer, seeded alike everywhere."""
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference() -> list[list[float]]:
    """The weights of one process training without failures: no launcher, no hvd.init()."""
    data, (model, opt) = dataset(), model_and_optimizer()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)  # a world of one
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    return [v.flatten().tolist() for v in model.state_dict().values()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--die", action="append", default=[])
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--wait-size", type=int, default=0,
                   help="commits wait (<= 60 s) once for the world to grow to this size")
    p.add_argument("--say", action="store_true", help="print each commit")
    args = p.parse_args()
    torch.set_num_threads(1)
    wid = os.environ.get("HORA_ELASTIC_WORKER", "solo")
    plans = {when: how for w, _, rest in (d.partition("@") for d in args.die) if w == wid
             for when, _, how in [rest.partition(":")]}  # fmt: skip

    hvd.init()
    data, (model, opt) = dataset(), model_and_optimizer()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    record = {"wid": wid, "pid": os.getpid(), "steps_run": 0, "resets": 0, "sizes": [hvd.size()]}

    def die(when: str) -> None:
        how = plans.pop(when, None)
        if how is None:
            return
        if how == "raise":
            raise RuntimeError(f"injected failure of {wid} at {when}")
        if how == "capacity":
            (args.out / "died").write_text(wid)
            time.sleep(1.5)
        if how == "killpg":
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_reset() -> None:
        record["resets"] += 1
        record["sizes"].append(hvd.size())
        die("reset")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // hvd.size(),
                                                 sampler=sampler)  # fmt: skip
            for xb, yb in loader:
                die(str(state.step))
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                sampler.record_batch(0, len(xb))
                state.step += 1
                record["steps_run"] += 1
                if state.step % COMMIT_EVERY == 0:
                    commit(state)
                time.sleep(args.sleep)
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            commit(state)

    def commit(state: hvd.elastic.TorchState) -> None:
        if args.say:
            print(f"{wid} rank {hvd.rank()} step {state.step}", flush=True)
        if hvd.rank() == 0:
            (args.out / "progress.tmp").write_text(f"{state.step} {hvd.size()}")
            os.replace(args.out / "progress.tmp", args.out / "progress")
        state.commit()
        deadline = time.monotonic() + 60
        while hvd.size() < args.wait_size and not record.get("grown"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the world did not grow back to {args.wait_size}")
            time.sleep(0.1)
            record["grown"] = True  # the next world, after this interrupt, is the grown one
            state.check_host_updates()  # HostsUpdatedInterrupt once the new worker is in
            record.pop("grown")

    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    state.register_reset_callbacks([on_reset])
    train(state)
    weights = [v.flatten().tolist() for v in model.state_dict().values()]
    record.update(step=state.step, weights=weights)
    (args.out / f"{wid}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
