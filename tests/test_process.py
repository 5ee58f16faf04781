"""``fastdit.process``: torchrun's variables read without collectives, device choice, and the process group's scope."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from fastdit.errors import FieldError
from fastdit.process import (
    OWNER,
    choose_device,
    is_main_process,
    join_process_group,
    launched_by_torchrun,
    local_rank,
    max_across_processes,
    process_count,
    process_group_scope,
    process_rank,
    synchronize,
)


def test_counts_and_ranks_from_the_environment() -> None:
    assert process_count({}) == 1 and process_rank({}) == 0
    assert process_count({"WORLD_SIZE": "4"}) == 4 and process_count({"WORLD_SIZE": "0"}) == 1
    assert process_rank({"RANK": "3"}) == 3 and process_rank({"RANK": " "}) == 0
    assert launched_by_torchrun({"WORLD_SIZE": "2", "RANK": "0"})
    assert not launched_by_torchrun({"WORLD_SIZE": "2"})
    assert local_rank({"LOCAL_RANK": "1"}) == 1 and local_rank({}) is None and local_rank({"LOCAL_RANK": "x"}) is None


@pytest.mark.parametrize(
    ("environ", "main"), [({}, True), ({"RANK": "0"}, True), ({"RANK": ""}, True), ({"RANK": "2"}, False)]
)
def test_is_main_process(environ: dict[str, str], main: bool) -> None:
    assert is_main_process(environ) is main


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK"])
def test_a_variable_that_is_not_an_integer_names_itself(name: str) -> None:
    read = process_count if name == "WORLD_SIZE" else process_rank
    with pytest.raises(FieldError) as caught:
        read({name: "two"})
    assert (caught.value.owner, caught.value.field, caught.value.value) == (OWNER, f"env:{name}", "two")
    assert caught.value.requirement == "must be an integer"


def test_choose_device() -> None:
    assert choose_device("cpu") == torch.device("cpu")
    assert choose_device(torch.device("cpu"), {"LOCAL_RANK": "1"}) == torch.device("cpu")
    assert choose_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(FieldError) as caught:
        choose_device("warp")
    assert (caught.value.field, caught.value.value) == ("device", "warp")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda() -> None:
    with pytest.raises(FieldError, match="CUDA is not available"):
        choose_device("cuda")


@pytest.mark.gpu
def test_cuda_takes_the_local_rank() -> None:
    assert choose_device("cuda", {"LOCAL_RANK": "0"}) == torch.device("cuda", 0)
    assert choose_device("cuda:0", {"LOCAL_RANK": "1"}) == torch.device("cuda", 0)  # an explicit index wins


def test_without_a_process_group_the_collectives_are_local(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    synchronize("cpu", barrier=True)
    assert max_across_processes(2.5, "cpu") == 2.5
    assert not join_process_group("cpu")  # not launched by torchrun
    with process_group_scope():
        pass
    assert not dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_group_joined_inside_the_scope_ends_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with process_group_scope():
        assert join_process_group("cpu")
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert not join_process_group("cpu")  # one group: a second call joins nothing
        synchronize("cpu", barrier=True)
        assert max_across_processes(1.5, "cpu") == 1.5
    assert not dist.is_initialized()
