"""sgdjob_trainer.integrations.hf: the settings it refuses, and, on 2 real torchrun ranks (gloo), that a
rebalanced split of one global batch moves the model exactly as the equal split does, whether Trainer
normalises the loss by the world's token count (the hook's weight set to 1) or not (the session's DDP
hook weighs each rank's mean gradient by its share), and without the hook's weights it would not.
Skipped only without the `hf` extra."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e .[hf]")
pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install -e .[hf]")

from sgdjob_trainer.integrations.hf import refuse_unsupported
from tests.trainer.two_ranks import results_of

SCRIPT = Path(__file__).with_name("hf_weighting_script.py")


def _args(**changes: object) -> SimpleNamespace:
    base = {"gradient_accumulation_steps": 1, "deepspeed": None, "fsdp": "", "n_gpu": 1, "auto_find_batch_size": False}
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
        ({"deepspeed": "ds.json"}, "deepspeed"),
        ({"fsdp": "full_shard"}, "fsdp"),
        ({"n_gpu": 2}, "n_gpu=2"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
    ],
)
def test_a_setting_the_integration_cannot_follow_is_refused_by_name(changes: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"TrainingArguments.{named}"):
        refuse_unsupported(_args(**changes))
    refuse_unsupported(_args())


@pytest.mark.multiproc
def test_an_unequal_split_moves_the_model_as_the_equal_split_does(tmp_path: Path) -> None:
    results = results_of(SCRIPT, tmp_path)
    for average_tokens in ("True", "False"):
        equal, unequal = results[f"{average_tokens}-16+16"], results[f"{average_tokens}-24+8"]
        assert unequal == pytest.approx(equal, rel=1e-5, abs=1e-5), (average_tokens, equal, unequal)
    # The control: without the weights, DDP's plain average of the unequal batches moves it elsewhere.
    assert results["unweighted"] != pytest.approx(results["False-16+16"], rel=1e-5, abs=1e-5)
