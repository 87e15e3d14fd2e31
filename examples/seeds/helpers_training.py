"""Data-parallel training by hand with the seed's helpers: the same model on every
rank, each rank a different shard of the data, gradients averaged with reduce_tensor.

Seed: 003_c0b9def01b497aca.txt -- the scenes of sections 2.3 (gradient sync, loss
monitoring, metrics), 3.3 (evaluation, gradient norms), 4.3 (parameter sync, random
seed, learning rate, early stopping), 5.3 (checkpoint, training loop) and 6.1 (training
step, evaluation), put together into one run on a toy problem.  The helpers are the
seed's ``distributed.py``, shipped as ``chorus.utils``.  Left out: 6.2 (adaptive batch
size), which reads CUDA memory statistics.
Run:  python -m chorus.run --nproc-per-node=4 examples/seeds/helpers_training.py
      python examples/seeds/helpers_training.py     (not distributed: the same code, one process)

What to look for: every rank reports the same seed and the same evaluation; the
parameters stay identical on all ranks; the accuracy from summed counts equals the one
computed on rank 0; every rank reads back the checkpoint rank 0 saved.
"""

import logging
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

import chorus as dist  # torch: import torch.distributed as dist
from chorus.utils import (
    barrier,
    broadcast_tensor,
    gather_tensor,
    get_device,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    reduce_tensor,
)

logger = logging.getLogger("distributed")  # the seed's logger: messages to stdout
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.setLevel(logging.INFO)

SAMPLES, FEATURES, BATCH, EPOCHS, EVAL_INTERVAL = 256, 8, 16, 6, 2


# -- 4.3 keeping the ranks in step ------------------------------------------------------
def sync_model_parameters(model):
    """Scene 1: rank 0's parameters everywhere (each rank initialised its own)."""
    for param in model.parameters():
        broadcast_tensor(param.data, src=0)


def sync_random_seed():
    """Scene 2: rank 0 draws the seed, everybody uses it."""
    if is_main_process():
        seed = torch.randint(0, 1000000, (1,), device=get_device())
    else:
        # the seed writes torch.zeros(1) here, a float tensor: a broadcast needs the same
        # dtype on every rank, so receive into an integer tensor like randint's
        seed = torch.zeros(1, dtype=torch.long, device=get_device())
    seed = broadcast_tensor(seed, src=0)
    torch.manual_seed(seed.item())
    logger.info(f"All processes using seed: {seed.item()}")


def update_learning_rate_dynamically(optimizer, epoch):
    """Scene 3: rank 0 decides, everybody applies."""
    current_lr = optimizer.param_groups[0]["lr"]
    if is_main_process():
        new_lr = current_lr * 0.1 if epoch == EPOCHS // 2 else current_lr
        lr_tensor = torch.tensor([new_lr], device=get_device())
    else:
        lr_tensor = torch.zeros(1, device=get_device())
    lr_tensor = broadcast_tensor(lr_tensor, src=0)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr_tensor.item()


def check_early_stopping(eval_loss):
    """Scene 4: rank 0 decides whether to stop, everybody follows."""
    if is_main_process():
        should_stop = eval_loss < 0.05
        stop_signal = torch.tensor([1.0 if should_stop else 0.0], device=get_device())
    else:
        stop_signal = torch.zeros(1, device=get_device())
    stop_signal = broadcast_tensor(stop_signal, src=0)
    return stop_signal.item() > 0.5


# -- 3.3 / 6.1 training and evaluation ---------------------------------------------------
def debug_gradient_norms(model):
    """3.3 scene 3: every rank's local gradient norm, logged by rank 0."""
    local_grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    all_grad_norms = gather_tensor(local_grad_norm, dst=0)
    if is_main_process():
        for rank, norm in enumerate(all_grad_norms):
            logger.info(f"GPU {rank} gradient norm: {norm.item():.4f}")


def distributed_training_step(model, batch, optimizer, debug=False):
    """6.1: forward and backward on the local batch, average the gradients, step."""
    inputs, labels = batch
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    if debug:
        debug_gradient_norms(model)  # before the averaging: they differ per rank
    for param in model.parameters():  # what DDP would do for us
        if param.grad is not None:
            param.grad = reduce_tensor(param.grad, op="mean")
    optimizer.step()
    optimizer.zero_grad()
    return reduce_tensor(loss.detach(), op="mean")  # 2.3 scene 2: the global loss


def distributed_evaluation(model, batches):
    """6.1: gather losses, predictions and labels on rank 0, which computes the
    metrics and broadcasts them."""
    all_losses, all_predictions, all_labels = [], [], []
    with torch.no_grad():
        for inputs, labels in batches:
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels)
            predictions = logits.argmax(dim=-1)
            gathered_losses = gather_tensor(loss, dst=0)
            gathered_preds = gather_tensor(predictions, dst=0)
            gathered_labels = gather_tensor(labels, dst=0)
            if is_main_process():
                all_losses.extend([lo.item() for lo in gathered_losses])
                for preds, labs in zip(gathered_preds, gathered_labels, strict=True):
                    all_predictions.extend(preds.tolist())
                    all_labels.extend(labs.tolist())

    if is_main_process():
        avg_loss = sum(all_losses) / len(all_losses)
        accuracy = sum(p == t for p, t in zip(all_predictions, all_labels, strict=True)) / len(all_labels)
        result_tensor = torch.tensor([avg_loss, accuracy], device=get_device())
    else:
        result_tensor = torch.zeros(2, device=get_device())
    result_tensor = broadcast_tensor(result_tensor, src=0)
    return result_tensor[0].item(), result_tensor[1].item()


def global_accuracy(model, batches):
    """2.3 scene 3: sum the correct and total counts of all ranks."""
    correct, total = 0, 0
    with torch.no_grad():
        for inputs, labels in batches:
            correct += (model(inputs).argmax(dim=-1) == labels).sum().item()
            total += len(labels)
    global_correct = reduce_tensor(torch.tensor(correct, device=get_device()), op="sum")
    global_total = reduce_tensor(torch.tensor(total, device=get_device()), op="sum")
    return (global_correct / global_total).item()


# -- 5.3 checkpoint ------------------------------------------------------------------------
def save_checkpoint_safely(model):
    """Rank 0 saves; the barrier tells everybody the file is complete."""
    folder = [tempfile.mkdtemp(prefix="seed003-") if is_main_process() else None]
    if is_distributed():
        dist.broadcast_object_list(folder, src=0)  # where rank 0 saves
    path = os.path.join(folder[0], "checkpoint.pt")
    if is_main_process():
        torch.save(model.state_dict(), path)
        logger.info("Checkpoint saved")

    barrier()  # wait until rank 0 has saved

    state = torch.load(path)
    same = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    logger.info(f"Rank {get_rank()}: checkpoint save confirmed, matches my parameters: {same}")
    barrier()  # everybody has read it: rank 0 may delete it
    if is_main_process():
        shutil.rmtree(folder[0])


def make_data():
    """The same data set on every rank (same seed); each rank keeps its own shard."""
    inputs = torch.randn(SAMPLES, FEATURES)
    teacher = torch.randn(FEATURES)
    labels = (inputs @ teacher > 0).long()
    shard = slice(get_rank(), SAMPLES, get_world_size())
    inputs, labels = inputs[shard], labels[shard]
    return [(inputs[i:i + BATCH], labels[i:i + BATCH]) for i in range(0, len(labels), BATCH)]


def training_loop():
    """5.3 scene 3: train, barrier, evaluate now and then, barrier."""
    torch.manual_seed(get_rank())  # a different initialisation on every rank ...
    model = torch.nn.Linear(FEATURES, 2)
    sync_model_parameters(model)  # ... until rank 0's is broadcast
    sync_random_seed()
    batches = make_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    for epoch in range(EPOCHS):
        update_learning_rate_dynamically(optimizer, epoch)
        for step, batch in enumerate(batches):
            avg_loss = distributed_training_step(model, batch, optimizer, debug=(epoch, step) == (0, 0))
        if is_main_process():
            logger.info(f"Epoch {epoch}, global average loss: {avg_loss.item():.4f}")

        barrier()  # everybody finished the epoch's training

        if epoch % EVAL_INTERVAL == 0 or epoch == EPOCHS - 1:
            eval_loss, accuracy = distributed_evaluation(model, batches)
            logger.info(f"Rank {get_rank()}: epoch {epoch}, eval loss {eval_loss:.4f}, accuracy {accuracy:.4f}")
            if check_early_stopping(eval_loss):
                break

        barrier()  # evaluation finished before the next epoch starts

    logger.info(f"Rank {get_rank()}: accuracy from summed counts {global_accuracy(model, batches):.4f}")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = gather_tensor(flat, dst=0)
    if is_main_process():
        logger.info(f"parameters identical on all ranks: {all(torch.equal(g, flat) for g in gathered)}")
    save_checkpoint_safely(model)


if __name__ == "__main__":
    distributed = "RANK" in os.environ  # set by chorusrun / torchrun
    if distributed:
        dist.init_process_group("gloo")
    training_loop()
    if distributed:
        dist.destroy_process_group()
