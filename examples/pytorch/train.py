"""A data-parallel training job for gpuctl, in plain PyTorch.

Run as one process per gpuctl task: gpuctl sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, so `init_process_group("env://")` needs no
wrapper; or under `torchrun`, which reads gpuctl's PET_* variables (one
torchrun per task, each a node of the attempt). It trains a small model on a
synthetic regression problem with DistributedDataParallel (gloo on CPU,
nccl when the task has a GPU), saves a checkpoint every few steps to
$GPUCTL_CHECKPOINT_DIR (the same path in every attempt: --checkpoint-dir)
from rank 0 and resumes from it, so a gang restarted by gpuctl (a retry, a requeue after
a GPU fault, an elastic gang grown to more ranks) goes on where it stopped,
whatever its new world size. On SIGTERM (gpuctl stopping it) it saves and
exits 0.

Each rank prints one line at the end:
  rank R of W: step S loss L weights-sum X
and writes it to $OUT/rank-R when OUT is set. All ranks of an attempt hold
the same weights (DDP keeps them in step), so X is the same on every rank.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("STEPS", "60"))
SAVE_EVERY = 10

stop = False


def on_term(signum, frame):
    global stop
    stop = True


def main():
    signal.signal(signal.SIGTERM, on_term)
    use_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_gpu else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    ckpt_dir = os.environ.get("GPUCTL_CHECKPOINT_DIR")
    ckpt = os.path.join(ckpt_dir, "model.pt") if ckpt_dir else None
    # Rank 0 reads the checkpoint (the directory is its task user's); DDP
    # gives its weights to the other ranks, and the step is broadcast.
    if ckpt and rank == 0 and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    at = torch.tensor([step], device=device)
    dist.broadcast(at, src=0)
    step = int(at.item())
    if step > 0:
        print(f"rank {rank}: resumed at step {step} with world size {world}", flush=True)
    ddp = DDP(model)
    # The same synthetic problem on every rank; each takes its own shard.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=gen)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1
    xs, ys = x[rank::world].to(device), y[rank::world].to(device)
    loss = torch.tensor(0.0)
    while step < STEPS and not stop:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        loss.backward()
        opt.step()
        step += 1
        if ckpt and rank == 0 and step % SAVE_EVERY == 0:
            save(ckpt, model, opt, step)
    if ckpt and rank == 0:
        save(ckpt, model, opt, step)
    total = sum(p.detach().sum().item() for p in model.parameters())
    line = f"rank {rank} of {world}: step {step} loss {loss.item():.4f} weights-sum {total:.6f}"
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"rank-{rank}"), "w") as f:
            f.write(line + "\n")
    dist.destroy_process_group()
    return 0


def save(path, model, opt, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
