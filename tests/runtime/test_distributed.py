"""Process-group facts: the backend a multi-process run joins, and device choice."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from ernie5.runtime.distributed import (
    Dist,
    check_device,
    init_dist,
    parse_device,
    pick_device,
    process_group_backend,
)


def test_a_gpu_run_has_a_backend_for_cpu_tensors_too():
    """With CUDA the group is NCCL for CUDA tensors and gloo for CPU ones: the trainer all-reduces CPU
    tensors (expert loads, the gradient norm's sum), which NCCL alone rejects."""
    gpu = BackendConfig(Backend(process_group_backend(cuda=True))).get_device_backend_map()
    assert gpu == {"cuda": "nccl", "cpu": "gloo"}
    cpu = BackendConfig(Backend(process_group_backend(cuda=False))).get_device_backend_map()
    assert cpu["cpu"] == "gloo"


def test_one_process_joins_no_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_dist() == Dist(0, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error_and_auto_is_the_cpu():
    assert pick_device("auto") == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda'.*no CUDA GPU"):
        pick_device("cuda")


@pytest.mark.parametrize(
    ("name", "parsed"),
    [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)), ("cuda:3", ("cuda", 3))],
)
def test_device_names(name, parsed):
    assert parse_device(name) == parsed


@pytest.mark.parametrize("name", ["gpu", "cpu:0", "cuda:", "cuda:one", "auto:1", ""])
def test_a_bad_device_name_is_one_line_naming_it(name):
    with pytest.raises(ValueError, match=rf"device={name!r}: expected auto, cpu, cuda or cuda:N"):
        check_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_index_out_of_range_is_a_clear_error():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"sees {n} GPU"):
        pick_device(f"cuda:{n}")
    assert pick_device(f"cuda:{n - 1}") == torch.device("cuda", n - 1)


def test_one_process_broadcast_is_the_value_itself():
    value = {"out": "runs/nightly-1"}
    assert Dist().broadcast(value) is value
