"""Run by tests/trainer/test_hf_integration.py under torchrun (2 gloo ranks): one SGD step of
SGDJobTrainer on one global batch of 32, split 16+16 and 24+8, each with Trainer's token-normalised
loss (average_tokens_across_devices) and without it (the session's DDP hook weighs the ranks), and
24+8 without the hook's weights (the control: DDP's plain average); rank 0 prints each case's
parameters after the step (sum and sum of squares of each tensor) as one line of JSON."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from sgdjob_trainer.adapt.split import Split
from sgdjob_trainer.integrations.hf import SGDJobTrainer


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (64, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def one_step(sizes: dict[int, int], average_tokens: bool, out: str, weigh: bool = True) -> list[float]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=16, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to="none", disable_tqdm=True,
        use_cpu=True, average_tokens_across_devices=average_tokens, ddp_find_unused_parameters=False,
        save_strategy="no", seed=0,
    )  # fmt: skip
    trainer = SGDJobTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
    loader = trainer.get_train_dataloader().loader
    split = Split.of(dist.get_world_size(), 16, sizes)
    trainer.sgdjob.split = split
    loader.resplit(split)  # as a control command applied at a step boundary does, from the first batch
    if not weigh:  # the control case: the hook keeps weight 1, DDP's plain average of unequal batches
        loader._on_batch = lambda size, weight: None
    trainer.train()
    params = [p.detach().double() for p in trainer.model.parameters()]
    return [round(float(v), 6) for p in params for v in (p.sum(), p.square().sum())]


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for average_tokens in (True, False):
            for sizes in ({0: 16, 1: 16}, {0: 24, 1: 8}):
                key = f"{average_tokens}-{sizes[0]}+{sizes[1]}"
                results[key] = one_step(sizes, average_tokens, f"{out}/{key}")
        results["unweighted"] = one_step({0: 24, 1: 8}, False, f"{out}/unweighted", weigh=False)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
