"""A user's own training script, tuned with tunekit.prepare (run under torchrun by the tests).

    torchrun --standalone --nproc-per-node 2 prepare_script.py WORKLOAD CONFIG STEPS OUT

It draws the same batches a tunekit job does (seeded per step and rank), so
the two can be compared step by step.
"""

import sys

import torch
import torch.distributed as dist

import tunekit
from tunekit.runtime.data import batch_seed

spec, config, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
workload = tunekit.load_workload(spec)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(workload.seed)
model = workload.model()
optimizer = workload.optimizer(model.parameters(), workload.lr)
example = workload.make_batch(2, torch.Generator().manual_seed(0))
model, optimizer, step = tunekit.prepare(
    model, optimizer, workload.loss, config, batch_size=workload.batch_size, example=example
)
losses = []
for s in range(steps):
    inputs, targets = workload.make_batch(
        step.batch_size, torch.Generator().manual_seed(batch_seed(workload.seed, s, rank))
    )
    losses.append(step(inputs, targets))
strategy = step.session.grad_sync.name
step.close()
if rank == 0:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(
        {"losses": losses, "params": params, "strategy": strategy, "batch": step.batch_size}, out
    )
dist.destroy_process_group()
