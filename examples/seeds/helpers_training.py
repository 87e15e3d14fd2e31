# ---- not in the seed: imports and a logger ----
import logging
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from distributed import (
    barrier,
    broadcast_tensor,
    cleanup,
    gather_tensor,
    get_device,
    get_rank,
    init_distributed,
    is_main_process,
    reduce_tensor,
)

logger = logging.getLogger("seed")  # the seed's logger: its messages, one a line, on stdout
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.setLevel(logging.INFO)


# ---- seed: 4.3 场景1: 模型参数同步 ----
def sync_model_parameters():
    # 确保所有GPU的模型参数完全一致
    for param in model.parameters():
        # 将主进程的参数广播到所有进程
        broadcast_tensor(param.data, src=0)


# ---- seed: 4.3 场景2: 随机种子同步 ----
def sync_random_seed():
    if is_main_process():
        # 主进程生成随机种子
        seed = torch.randint(0, 1000000, (1,), device=get_device())
    else:
        # 其他进程准备接收
        seed = torch.zeros(1, dtype=torch.long, device=get_device())  # changed: the seed's torch.zeros(1, device=get_device()) is float32 and rank 0's randint seed int64; a broadcast needs one dtype on every rank
    
    # 广播种子到所有进程
    seed = broadcast_tensor(seed, src=0)
    
    # 所有进程使用相同种子
    torch.manual_seed(seed.item())
    logger.info(f"All processes using seed: {seed.item()}")


# ---- seed: 4.3 场景3: 动态配置更新 ----
def update_learning_rate_dynamically():
    if is_main_process():
        # 主进程根据某些条件决定新的学习率
        if should_decay_lr():
            new_lr = current_lr * 0.1
        else:
            new_lr = current_lr
        
        lr_tensor = torch.tensor(new_lr, device=get_device())
    else:
        # 其他进程准备接收
        lr_tensor = torch.zeros(1, device=get_device())
    
    # 广播新学习率
    lr_tensor = broadcast_tensor(lr_tensor, src=0)
    
    # 所有进程更新优化器
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr_tensor.item()


# ---- seed: 4.3 场景4: 早停信号广播 ----
def check_early_stopping():
    if is_main_process():
        # 主进程检查是否应该早停
        should_stop = check_convergence() or check_time_limit()
        stop_signal = torch.tensor(1.0 if should_stop else 0.0, device=get_device())
    else:
        stop_signal = torch.zeros(1, device=get_device())
    
    # 广播停止信号
    stop_signal = broadcast_tensor(stop_signal, src=0)
    
    return stop_signal.item() > 0.5


# ---- seed: 5.3 场景1: 确保检查点保存完成 ----
def save_checkpoint_safely():
    if is_main_process():
        # 主进程保存模型
        torch.save(model.state_dict(), "checkpoint.pt")
        logger.info("Checkpoint saved")
    
    # 等待主进程完成保存
    barrier()
    
    # 现在所有进程都知道检查点已保存完成
    logger.info("All processes: checkpoint save confirmed")


# ---- seed: 5.3 场景3: 验证阶段同步 ----
def training_loop():
    for epoch in range(num_epochs):
        # 训练阶段
        model.train()
        for batch in train_dataloader:
            train_step(batch)
        
        # 确保所有进程完成训练
        barrier()
        
        # 验证阶段
        if epoch % eval_interval == 0:
            model.eval()
            eval_loss = evaluate()
            
            if is_main_process():
                logger.info(f"Epoch {epoch}, Eval loss: {eval_loss}")
        
        # 确保验证完成后再开始下一个epoch
        barrier()


# ---- seed: 6.1 完整的训练循环示例 ----
def distributed_training_step(model, batch, optimizer):
    # 1. 前向传播（每个GPU处理不同数据）
    outputs = model(batch)
    loss = outputs.loss
    
    # 2. 反向传播
    loss.backward()
    
    # 3. 梯度同步（如果不使用DDP）
    if not using_ddp:
        for param in model.parameters():
            if param.grad is not None:
                param.grad = reduce_tensor(param.grad, op="mean")
    
    # 4. 参数更新
    optimizer.step()
    optimizer.zero_grad()
    
    # 5. 损失值同步用于监控
    avg_loss = reduce_tensor(loss.detach(), op="mean")
    
    return avg_loss

def distributed_evaluation(model, dataloader):
    model.eval()
    all_losses = []
    all_predictions = []
    all_labels = []
    
    with torch.no_grad():
        for batch in dataloader:
            outputs = model(batch)
            loss = outputs.loss
            predictions = outputs.logits.argmax(dim=-1)
            labels = batch['labels']
            
            # 收集所有GPU的结果到主进程
            gathered_losses = gather_tensor(loss, dst=0)
            gathered_preds = gather_tensor(predictions, dst=0)
            gathered_labels = gather_tensor(labels, dst=0)
            
            if is_main_process():
                all_losses.extend([l.item() for l in gathered_losses])
                for preds, labs in zip(gathered_preds, gathered_labels):
                    all_predictions.extend(preds.cpu().numpy())
                    all_labels.extend(labs.cpu().numpy())
    
    if is_main_process():
        avg_loss = sum(all_losses) / len(all_losses)
        accuracy = compute_accuracy(all_predictions, all_labels)
        
        # 将结果广播给所有进程
        result_tensor = torch.tensor([avg_loss, accuracy], device=get_device())
    else:
        result_tensor = torch.zeros(2, device=get_device())
    
    result_tensor = broadcast_tensor(result_tensor, src=0)
    avg_loss, accuracy = result_tensor[0].item(), result_tensor[1].item()
    
    return avg_loss, accuracy


# ---- not in the seed: the names its functions use, and a run ----
using_ddp = False
num_epochs = 3
eval_interval = 1
current_lr = 0.5


class Model(torch.nn.Module):
    """model(batch) returns outputs with .loss and .logits, as the seed's model does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 2)

    def forward(self, batch):
        logits = self.linear(batch["inputs"])
        return SimpleNamespace(loss=F.cross_entropy(logits, batch["labels"]), logits=logits)


def make_batches(seed):
    """4 batches of 16 samples (8 features, label: the sign of their sum) on get_device()."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(4):
        inputs = torch.randn(16, 8, generator=generator)
        labels = (inputs.sum(dim=1) > 0).long()
        batches.append({"inputs": inputs.to(get_device()), "labels": labels.to(get_device())})
    return batches


def compute_accuracy(predictions, labels):
    return sum(int(p == t) for p, t in zip(predictions, labels, strict=True)) / len(labels)


def should_decay_lr():
    return True


def check_convergence():
    return False


def check_time_limit():
    return False


def train_step(batch):
    distributed_training_step(model, batch, optimizer)


def evaluate():
    eval_loss, accuracy = distributed_evaluation(model, eval_dataloader)
    return eval_loss


if __name__ == "__main__":
    init_distributed()  # torchrun: 4 ranks; plain python: one process
    torch.manual_seed(get_rank())  # every rank its own initial weights, until they are synced
    model = Model().to(get_device())
    optimizer = torch.optim.SGD(model.parameters(), lr=current_lr)
    train_dataloader = make_batches(seed=get_rank())  # every rank its own shard
    eval_dataloader = make_batches(seed=100 + get_rank())

    sync_model_parameters()
    sync_random_seed()
    training_loop()
    update_learning_rate_dynamically()
    logger.info(f"Rank {get_rank()}: learning rate {optimizer.param_groups[0]['lr']}")
    logger.info(f"Rank {get_rank()}: early stop: {check_early_stopping()}")
    save_checkpoint_safely()
    cleanup()
