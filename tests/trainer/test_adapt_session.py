"""The adaptation API's session in one process (a world of 1, no process group): a command applied at
a step boundary, a refused part in /status, checkpoints written and resumed through the script's own
save/load, the agreed stop; and its DDP hook, and what keeps a DDP model out of hierarchical, on a
one-process gloo group."""

from __future__ import annotations

import inspect
import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from sgdjob_trainer.adapt.comm import Comm
from sgdjob_trainer.adapt.hierarchy import obstacle
from sgdjob_trainer.adapt.session import Session
from sgdjob_trainer.adapt.settings import Settings, settings
from sgdjob_trainer.config import Adaptation, Checkpoint, TrainingConfig
from sgdjob_trainer.recovery import EXIT_STOPPED
from sgdjob_trainer.runtime import WorldInfo
from sgdjob_trainer.wire.control import ControlCommand
from sgdjob_trainer.wire.launch_contract import RunConfig

INFO = WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, group_rank=0, restart_count=0, node="n0")
DATA = TensorDataset(torch.arange(100, dtype=torch.float32).unsqueeze(1))


def _settings(tmp_path: Path | None = None, every: int = 1000) -> Settings:
    checkpoint = Checkpoint(dir=str(tmp_path), interval_steps=every) if tmp_path is not None else Checkpoint()
    training = TrainingConfig(
        command=["python", "t.py"], adaptation=Adaptation.API, batch_size=8, checkpoint=checkpoint
    )
    return settings(RunConfig(job_name="adapt-test", training=training), None, None)


class Script:
    """What a script keeps: a counter its save/load round-trip, and the samples it trained on."""

    def __init__(self) -> None:
        self.state = 0
        self.loaded: list[str] = []

    def save(self, path: str) -> None:
        torch.save({"state": self.state}, path)

    def load(self, path: str) -> None:
        self.state = int(torch.load(path)["state"])
        self.loaded.append(path)


@pytest.fixture
def sessions() -> Iterator[list[Session]]:
    made: list[Session] = []
    yield made
    for session in made:
        if session.server is not None:
            session.server.stop()


def _session(made: list[Session], chosen: Settings, script: Script | None = None, optimizer: bool = False) -> Session:
    """`optimizer`: attached to a one-rank DDP model with its optimizer (needs a process group)."""
    s = script or Script()
    model = DistributedDataParallel(nn.Linear(4, 1)) if optimizer else None
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if model is not None else None
    session = Session(INFO, chosen, Comm(None), save=s.save, load=s.load, optimizer=sgd, port=0)
    made.append(session)
    if model is not None:
        session.attach(model)
    return session


def _status(session: Session) -> dict[str, Any]:
    assert session.server is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{session.server.port}/status", timeout=5) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def _train(session: Session, loader: Any, steps: int, seen: list[int] | None = None) -> None:
    """`steps` steps of the example's loop, epochs included."""
    done = 0
    while done < steps:
        for (x,) in loader:
            if seen is not None:
                seen.extend(int(v) for v in x.squeeze(1))
            session.step(float(x.mean()))
            done += 1
            if done == steps:
                return


def test_a_command_lands_at_the_step_boundary_after_the_round_that_carried_it(sessions: list[Session]) -> None:
    session = _session(sessions, _settings())
    loader = session.loader(DATA, batch_size=8, shuffle=False)
    _train(session, loader, 2)
    assert session.inbox is not None
    session.inbox.offer(ControlCommand(epoch=1, batch_sizes={0: 20}, reason="rebalance"))
    _train(session, loader, 1)  # this step's round carries rank 0's offer ...
    assert session.applied_epoch == 0 and loader.batch_size == 8
    _train(session, loader, 1)  # ... and the next step boundary applies it
    assert session.applied_epoch == 1 and loader.batch_size == 20
    status = _status(session)
    assert (status["controlEpoch"], status["batchSize"], status["mode"]) == (1, 20, "sync")
    assert "controlError" not in status
    seen: list[int] = []
    _train(session, loader, 1, seen)
    assert seen == list(range(32, 52)), "the next global batch, 20 samples after the 4 x 8 taken"
    assert status["step"] == 4 and status["samples"] == 32 and status["computeSeconds"] > 0


def test_a_mode_switch_is_refused_in_status_counted_as_applied_and_not_taken_again(sessions: list[Session]) -> None:
    session = _session(sessions, _settings())
    loader = session.loader(DATA, batch_size=8, shuffle=False)
    assert session.inbox is not None
    command = ControlCommand(epoch=2, mode="hierarchical", groups=[[0]], batch_sizes={0: 12}, reason="try hier")
    assert session.inbox.offer(command)
    _train(session, loader, 2)
    status = _status(session)
    assert status["controlEpoch"] == 2 and status["mode"] == "sync" and status["batchSize"] == 12
    assert (
        "mode hierarchical refused" in status["controlError"] and "no DistributedDataParallel" in status["controlError"]
    )
    assert not session.inbox.offer(command), "a controller's re-send of the epoch changes nothing"
    assert status["asyncCapable"] is False, "the policy never proposes async to a script without a model"
    assert status["hierarchicalCapable"] is False, "nor hierarchical to one without a model to regroup"
    assert session.inbox.offer(ControlCommand(epoch=3, mode="async", reason="try async"))
    _train(session, loader, 2)
    status = _status(session)
    assert status["controlEpoch"] == 3 and status["mode"] == "sync"
    assert "mode async refused" in status["controlError"] and "DistributedDataParallel" in status["controlError"]


def test_checkpoints_go_through_the_scripts_save_and_a_new_life_resumes_mid_epoch(
    sessions: list[Session], tmp_path: Path
) -> None:
    first_script = Script()
    first = _session(sessions, _settings(tmp_path, every=4), first_script)
    loader = first.loader(DATA, batch_size=8, shuffle=True, seed=3)
    assert first.inbox is not None
    first.inbox.offer(ControlCommand(epoch=1, batch_sizes={0: 10}))
    seen: list[int] = []
    first_script.state = 41
    _train(first, loader, 9, seen)  # batches of 10 from the third on; checkpoints at steps 4 and 8
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000000004", "step-0000000008"]
    meta = json.loads((tmp_path / "step-0000000008" / "meta.json").read_text())
    assert meta["kind"] == "adaptation-api" and meta["session"]["batch_sizes"] == {"0": 10}

    again = Script()
    resumed = _session(sessions, _settings(tmp_path, every=4), again)
    assert again.state == 41 and again.loaded == [str(tmp_path / "step-0000000008" / "checkpoint.pt")]
    assert (resumed.step_count, resumed.applied_epoch) == (8, 1)
    more: list[int] = []
    _train(resumed, resumed.loader(DATA, batch_size=8, shuffle=True, seed=3), 1, more)
    assert more == seen[-10:], "the new life reads the batch the old one read after its checkpoint"
    status = _status(resumed)
    assert status["step"] == 9 and status["controlEpoch"] == 1 and status["batchSize"] == 10


def test_a_checkpoint_at_an_epochs_end_resumes_at_the_next_epoch(sessions: list[Session], tmp_path: Path) -> None:
    first = _session(sessions, _settings(tmp_path, every=12))
    _train(first, first.loader(DATA, batch_size=8, shuffle=False), 12)  # 12 x 8 of 100: 4 samples left over
    meta = json.loads((tmp_path / "step-0000000012" / "meta.json").read_text())
    assert meta["session"]["position"] == {"epoch": 1, "cursor": 0, "batch": 12}
    resumed = _session(sessions, _settings(tmp_path, every=12))
    loader = resumed.loader(DATA, batch_size=8, shuffle=False)
    seen: list[int] = []
    assert loader.epoch == 1 and len(loader) == 12
    _train(resumed, loader, 1, seen)
    assert seen == list(range(8))


def test_an_agreed_stop_writes_a_checkpoint_and_exits_143(sessions: list[Session], tmp_path: Path) -> None:
    session = _session(sessions, _settings(tmp_path / "ckpt"))
    loader = session.loader(DATA, batch_size=8, shuffle=False)
    _train(session, loader, 2)
    session.stopping.set()  # what SIGTERM does (request_stop), without its watchdog thread
    _train(session, loader, 1)  # the stop rides this step's round ...
    with pytest.raises(SystemExit) as stop:
        _train(session, loader, 1)  # ... and every rank stops at the next boundary
    assert stop.value.code == EXIT_STOPPED
    assert [p.name for p in (tmp_path / "ckpt").glob("step-*")] == ["step-0000000004"]
    assert session.telemetry.done and session.server is None


def test_settings_take_the_jobs_checkpoint_over_the_scripts_and_plain_torchrun_the_scripts() -> None:
    job = _settings(Path("/shared/ckpt"), every=50)
    assert job.managed and job.adapted and job.checkpoint_dir == Path("/shared/ckpt") and job.checkpoint_every == 50
    overridden = settings(RunConfig(training=job.training), "mine", 7)
    assert overridden.checkpoint_dir == Path("/shared/ckpt") and overridden.checkpoint_every == 50
    plain = settings(None, "mine", 7)
    assert not plain.managed and plain.checkpoint_dir == Path("mine") and plain.checkpoint_every == 7
    assert settings(None, None, None).checkpoint_dir is None


def test_the_ddp_hook_weighs_and_times_the_exchange(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Linear(4, 1)
        model = DistributedDataParallel(net)
        session = Session(INFO, _settings(), Comm(None), port=None)
        session.attach(model)
        assert session.exchange is not None and session.telemetry.gradient_bytes == 5 * 4
        x = torch.ones(2, 4)
        model(x).sum().backward()
        plain = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        net.zero_grad()
        session.exchange.weight = 0.5  # what the loader sets for a rank with half the mean batch
        session.telemetry.computing = True
        model(x).sum().backward()
        halved = [p.grad for p in net.parameters() if p.grad is not None]
        assert all(torch.allclose(h, 0.5 * g) for h, g in zip(halved, plain, strict=True))
        assert not session.telemetry.computing, "the last bucket's launch ends the rank's compute"
        waited = session.exchange.take_wait()
        assert 0 < waited < 5 and session.exchange.take_wait() == 0
        assert math.isnan(session.telemetry.initial_loss)
    finally:
        dist.destroy_process_group()


def test_hierarchical_is_refused_naming_what_would_tie_the_groups_together(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain = DistributedDataParallel(nn.Linear(4, 1))
        sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
        assert obstacle(plain, sgd) is None
        assert "adapt.start(optimizer=...) was not given" in (obstacle(plain, None) or "")
        normed = DistributedDataParallel(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)))
        assert "forward_sync_buffers=False" in (obstacle(normed, sgd) or "")
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters  # 2.13 has it
        no_sync: dict[str, Any] = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        quiet = DistributedDataParallel(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)), **no_sync)
        assert obstacle(quiet, sgd) is None
        unused = DistributedDataParallel(nn.Linear(4, 1), find_unused_parameters=True)
        assert "find_unused_parameters" in (obstacle(unused, sgd) or "")
        session = Session(INFO, _settings(), Comm(None), optimizer=sgd, port=None)
        assert session.telemetry.hierarchical_capable is False
        session.attach(plain)
        assert session.telemetry.hierarchical_capable is True
    finally:
        dist.destroy_process_group()


def test_a_stop_in_hierarchical_checkpoints_its_groups_and_the_next_life_resumes_in_it(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    made: list[Session] = []
    try:
        first = _session(made, _settings(tmp_path / "ckpt"), optimizer=True)
        loader = first.loader(DATA, batch_size=8, shuffle=False)
        assert first.inbox is not None and _status(first)["hierarchicalCapable"] is True
        first.inbox.offer(ControlCommand(epoch=1, mode="hierarchical", groups=[[0]], reason="test: hier"))
        _train(first, loader, 2)
        status = _status(first)
        assert (status["mode"], status["controlEpoch"], status.get("controlError")) == ("hierarchical", 1, None)
        first.stopping.set()
        with pytest.raises(SystemExit):
            _train(first, loader, 16)
        # The stop rode the round of the 4th step in hierarchical (averageEvery 4), which every rank
        # consumes staleness (2) rounds later: at its 12th, step 2 + 12. No round ran in between.
        meta = json.loads(next((tmp_path / "ckpt").glob("step-*/meta.json")).read_text())
        assert meta["session"]["groups"] == [[0]] and meta["step"] == 14

        resumed = _session(made, _settings(tmp_path / "ckpt"), optimizer=True)
        assert _status(resumed)["mode"] == "hierarchical" and resumed.applied_epoch == 1
        resumed.finish()
        assert resumed.telemetry.mode.value == "sync", "finishing merges every rank to one model: sync"
    finally:
        for session in made:
            if session.server is not None:
                session.server.stop()
        dist.destroy_process_group()
