"""Train the quickstart MNIST model (784-1024-512-256-10) on several processes.

``--mode data-parallel`` or ``--mode pipeline``.

Launch one process per GPU (or per CPU process with gloo) with torchrun::

    torchrun --standalone --nproc_per_node=2 examples/distributed_mnist.py --mode data-parallel
    torchrun --standalone --nproc_per_node=2 examples/distributed_mnist.py --mode pipeline

Both give the model that single-process ``DADTrainer.fit`` gives for the same global batch
(see docs/distributed.md). Only rank 0 prints and writes ``--save``.

With ``--checkpoint-dir`` (a folder every rank sees) each rank writes its shard every
``--checkpoint-every`` steps and at the end, and a restarted run resumes from the newest
complete checkpoint. To survive a killed worker, let torchrun restart the group::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        examples/distributed_mnist.py --mode data-parallel --checkpoint-dir runs/mnist
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import torch_dad as td
from torch_dad import data
from torch_dad.training import DataParallelTrainer, Pipeline


class DADClassifier(td.DADModel):
    def __init__(self, in_features: int = 784, num_classes: int = 10) -> None:
        super().__init__()
        self.layer1 = td.DADLinear(in_features, 1024, num_classes=num_classes)
        self.layer2 = td.DADLinear(1024, 512, num_classes=num_classes)
        self.layer3 = td.DADLinear(512, 256, num_classes=num_classes)
        self.classifier = torch.nn.Linear(256, num_classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["data-parallel", "pipeline"], required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch (rows per optimizer step)")
    parser.add_argument("--limit", type=int, default=0, help="use only the first N training images")
    parser.add_argument("--synthetic", action="store_true", help="a synthetic 784-feature task instead of MNIST")
    parser.add_argument("--save", default="", help="checkpoint path (written by rank 0)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="folder shared by every rank: checkpoint there and resume from the newest complete one")
    parser.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL collectives (and all_gather_object) use the current device
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    if args.synthetic:
        (xtr, ytr), (xte, yte) = data.synthetic(num_train=6000, num_test=1000, num_features=784, num_classes=10)
    else:
        (xtr, ytr), (xte, yte) = data.mnist()
    if args.limit:
        xtr, ytr = xtr[: args.limit], ytr[: args.limit]
    torch.manual_seed(0)  # the same model on every rank (rank 0's weights are copied anyway)
    model = DADClassifier()

    checkpoints = {}
    if args.checkpoint_dir:
        checkpoints = dict(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=True)
    if args.mode == "data-parallel":
        trainer = DataParallelTrainer(model, device=device, lr=1e-3)
        history = trainer.fit((xtr.to(device), ytr.to(device)), epochs=args.epochs, batch_size=args.batch_size,
                              eval=(xte.to(device), yte.to(device)), **checkpoints)
        trainer.solve_head()  # from every rank's input sample, Gram statistics summed over ranks
        accuracy = trainer.evaluate((xte.to(device), yte.to(device)))["accuracy"]
        if args.save:
            trainer.save(args.save)
    else:
        trainer = td.DADTrainer(model, device=device, lr=1e-3)
        pipe = Pipeline(trainer)  # stage = rank; layers balanced by cost
        first = pipe.is_first
        history = pipe.fit((xtr.to(device), ytr.to(device)) if first else None, epochs=args.epochs,
                           batch_size=args.batch_size, eval=(xte.to(device), yte.to(device)) if first else None,
                           **checkpoints)
        pipe.solve_head()  # on the last stage
        metrics = pipe.evaluate((xte.to(device), yte.to(device)) if first else None)
        accuracy = metrics["accuracy"] if metrics is not None else float("nan")
        if args.save:
            pipe.save(args.save)
    if rank == 0:
        for record in history:
            print({k: round(v, 4) for k, v in record.items()})
        print(f"{args.mode}: test accuracy after solve_head() {accuracy:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
