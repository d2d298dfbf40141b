#!/usr/bin/env python
"""A real DistributedDataParallel training loop on shardstream data, resumable mid-epoch.

Run with torchrun (NCCL on GPUs, gloo on CPU)::

    torchrun --nproc_per_node=2 tools/train_ddp.py --data /data/shards --epochs 2 \\
        --batch-size 32 --workers 2 --image-size 64 --checkpoint ckpt.pt
    # preempted? the same command with --resume continues at the next batch:
    torchrun --nproc_per_node=2 tools/train_ddp.py --data /data/shards --epochs 2 \\
        --batch-size 32 --workers 2 --image-size 64 --checkpoint ckpt.pt --resume

What it exercises:

* `shardstream.StreamingDataset` with ``shuffle=True`` and a fused random-resized-crop
  decode, split exactly over the ranks (every rank gets the same number of batches, so
  DDP cannot hang on an uneven last step);
* `shardstream.DataLoader` with ``device=`` (side-stream prefetch on CUDA) and
  ``transform_on_device=Normalize(field=0)``: uint8 over the bus, floats on the device;
* a small CNN (defined inline, no torchvision) in `DistributedDataParallel`, SGD;
* checkpoints (model, optimizer, ``loader.state_dict()``, epoch, step) written by rank 0
  every ``--checkpoint-every`` steps and at the end, atomically; ``--resume`` loads one on
  every rank and continues mid-epoch through ``loader.load_state_dict``;
* per-rank throughput at the end of each epoch (images/s, ``loader.stats.wait_fraction``);
* ``--log-keys FILE``: every rank appends one JSON line per step,
  ``{"rank", "epoch", "step", "keys"}``, so a test can check which samples each rank saw;
* ``--decode-on-device``: the workers ship JPEG bytes with the crop they drew, and
  `DecodeOnDevice` decodes on the device (nvJPEG on CUDA; on the CPU without it, with
  the same pixels as decoding in the workers);
* ``--steps N``: stop once the global step count reaches N (counted across resumes, like
  a ``max_steps``), e.g. to simulate a preemption in a test;
* preemption (README's recipe): SIGTERM only sets a flag; after each step the ranks agree on
  it (one all-reduce of MAX), so they all stop after the same step, rank 0 checkpoints,
  and the job exits 0 for its scheduler to requeue it with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from shardstream import DataLoader, DecodeOnDevice, DeferDecode, Normalize, RandomResizedCropJPEG, StreamingDataset


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU stages (stride 2 after the first), global average pool, linear head."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        chans = [3, width, width * 2, width * 4, width * 8]
        layers: list[nn.Module] = []
        for i in range(4):
            layers += [
                nn.Conv2d(chans[i], chans[i + 1], 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                nn.BatchNorm2d(chans[i + 1]),
                nn.ReLU(inplace=True),
            ]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(chans[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="packed dataset (folder or fsspec URL with manifest.msgpack)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="stop once the global step count reaches N (counted across resumes)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=None, help="default: the manifest's class count")
    p.add_argument("--width", type=int, default=32, help="channels of the first conv layer (doubles per stage)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="data order and augmentation seed")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (written by rank 0)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--log-keys", default=None, help="append per-rank JSON lines {rank, epoch, step, keys}")
    p.add_argument("--quiet", action="store_true", help="no per-step loss lines")
    p.add_argument("--decode-on-device", action="store_true",
                   help="decode JPEGs on the device (nvJPEG where available) instead of in the workers")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep after each step (lets a test preempt a tiny epoch mid-way)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    return args


def setup() -> tuple[int, int, torch.device]:
    """Initialise the process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    if "RANK" not in os.environ:  # plain `python tools/train_ddp.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), device


def say(message: str) -> None:
    """One write per line, so lines of several ranks sharing a terminal do not interleave."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def log_keys(path: str, record: dict[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write, so lines of several ranks never interleave."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write atomically: a crash mid-save leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Set here, acted on after a step (README: saving inside the handler could catch the
    # model mid-update). Before the loader's workers start: they ignore the job's SIGTERM
    # while this process lives (shardstream.DataLoader), and end with it.
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: preempted.set())
    rank, world_size, device = setup()
    torch.manual_seed(args.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)

    crop = RandomResizedCropJPEG(args.image_size)
    # --decode-on-device: workers ship JPEG bytes and the crop they drew; nvJPEG decodes on
    # the GPU (on a machine without it, the same crop is decoded on the CPU).
    dataset = StreamingDataset(args.data, shuffle=True, seed=args.seed,
                               decode=DeferDecode(crop) if args.decode_on_device else crop,
                               fields=("jpg;png;webp", "cls", "__key__"))  # pack keeps each image's format
    num_classes = args.num_classes
    if num_classes is None:
        manifest = dataset.resolve().manifest
        if manifest is None or not manifest.classes:
            raise SystemExit("the dataset has no class list in its manifest: pass --num-classes")
        num_classes = len(manifest.classes)
    on_device = [DecodeOnDevice(device), Normalize(field=0)] if args.decode_on_device else [Normalize(field=0)]
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, device=device,
                        transform_on_device=on_device)

    model = SmallCNN(num_classes, args.width).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=5e-5)

    start_epoch, step = 0, 0
    if args.resume and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = int(ckpt["step"])
        if ckpt["epoch_done"]:
            start_epoch = int(ckpt["epoch"]) + 1
        else:
            start_epoch = int(ckpt["epoch"])
            loader.load_state_dict(ckpt["loader"])  # sets the epoch and where in it we are
        if rank == 0:
            say(f"resumed from {args.checkpoint}: epoch {start_epoch}, step {step}"
                f"{'' if ckpt['epoch_done'] else ', mid-epoch'}")
    elif args.resume and rank == 0:
        say(f"no checkpoint at {args.checkpoint}: starting afresh")

    def checkpoint(epoch: int, epoch_done: bool) -> None:
        if args.checkpoint and rank == 0:
            save_checkpoint(args.checkpoint, {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),
                "epoch": epoch,
                "epoch_done": epoch_done,
                "step": step,
                "world_size": world_size,
            })

    stopped = args.steps is not None and step >= args.steps
    preempted_stop = False
    epoch = start_epoch
    while epoch < args.epochs and not stopped:
        if epoch != loader.dataset.epoch:
            loader.set_epoch(epoch)  # (the resumed epoch is already set, with its position)
        ddp.train()
        batches_left = len(loader)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        seen = 0
        for images, labels, keys in loader:
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            seen += 1
            loss_sum += loss.detach()
            if args.log_keys:
                log_keys(args.log_keys, {"rank": rank, "epoch": epoch, "step": step, "keys": list(keys)})
            if not args.quiet and rank == 0 and (step % 20 == 0 or seen == 1):
                say(f"epoch {epoch} step {step}: loss {loss.item():.4f}")
            if args.checkpoint and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpoint(epoch, epoch_done=False)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.steps is not None and step >= args.steps:
                stopped = True
                break
            # Every rank stops after the same step: one that saw no signal yet would go on into
            # the next step's all-reduce alone, and hang there.
            signalled = torch.tensor([float(preempted.is_set())], device=device)
            dist.all_reduce(signalled, op=dist.ReduceOp.MAX)
            if signalled.item():
                stopped = preempted_stop = True
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        s = loader.stats
        say(f"[rank {rank}/{world_size}] epoch {epoch}: {s.batches}/{batches_left} batches, {s.samples} images "
            f"in {wall:.2f} s = {s.samples / wall if wall else 0:,.0f} images/s; data wait {s.wait_s:.2f} s "
            f"(wait_fraction {s.wait_fraction:.3f}); mean loss {(loss_sum / max(seen, 1)).item():.4f}"
            + ((" (stopped by SIGTERM)" if preempted_stop else " (stopped by --steps)") if stopped else ""))
        # Stopped on the epoch's last batch counts as done: the resumed job starts the next epoch.
        checkpoint(epoch, epoch_done=seen == batches_left)
        epoch += 1

    if rank == 0:
        # A fingerprint of the final weights: an interrupted-and-resumed job must end on the same one.
        checksum = sum(float(p.detach().double().sum()) for p in model.state_dict().values() if p.is_floating_point())
        say(f"finished at step {step}; weights checksum {checksum!r}")
    dist.barrier()  # the checkpoint is complete before any rank exits
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
