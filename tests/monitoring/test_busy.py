"""monitoring/busy.py: which profiler events count as busy and as communication (hand-made events
and a real CPU profile with a gloo all_reduce inside), and the StepProfiler window."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from lightning_adaptiveload.monitoring.busy import StepProfiler, busy_and_comm_ms, is_communication


def _event(name, device_type=DeviceType.CPU, cpu_us=0.0, device_us=0.0, annotation=False):
    return SimpleNamespace(name=name, device_type=device_type, self_cpu_time_total=cpu_us,
                           self_device_time_total=device_us, is_user_annotation=annotation)


def test_event_classification_by_hand():
    events = [
        _event("aten::mm", cpu_us=1200.0, device_us=0.0),
        _event("c10d::allreduce_", cpu_us=300.0),
        _event("DistributedDataParallel.forward", cpu_us=5000.0, annotation=True),  # Python between ops
        _event("sm90_xmma_gemm_bf16", DeviceType.CUDA, device_us=900.0),
        _event("ncclDevKernel_AllGather_RING_LL", DeviceType.CUDA, device_us=450.0),
        _event("void at::native::vectorized_elementwise_kernel", DeviceType.CUDA, device_us=100.0),
        _event("gpu_user_annotation_range", DeviceType.CUDA, device_us=7000.0, annotation=True),
        _event("aten::copy_", cpu_us=50.0, device_us=20.0),
    ]
    assert busy_and_comm_ms(events, "cpu") == pytest.approx((1.25, 0.3))
    assert busy_and_comm_ms(events, "cuda") == pytest.approx((1.0, 0.45))  # device kernels only
    for name in ("ncclKernel_ReduceScatter", "gloo:all_reduce", "c10d::broadcast_", "fsdp::all_gather_copy_in",
                 "record_param_comms", "AllReduce", "nccl:all_to_all"):
        assert is_communication(name) == (name != "record_param_comms"), name
    assert not is_communication("aten::scaled_dot_product_attention")


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_real_cpu_profile_splits_ops_and_collectives(one_process_group):
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = torch.tanh(a @ a)
        dist.all_reduce(a)
        with torch.profiler.record_function("user_range_with_a_sleep"):
            time.sleep(0.02)
    events = prof.events()
    busy_ms, comm_ms = busy_and_comm_ms(events, "cpu")
    ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_user_annotation]
    comm = [e for e in ops if "allreduce" in e.name or "c10d" in e.name or "gloo" in e.name]
    assert comm, [e.name for e in ops]  # the collective is visible to the profiler
    assert comm_ms == pytest.approx(sum(e.self_cpu_time_total for e in comm) / 1e3, rel=1e-9)
    assert busy_ms == pytest.approx(sum(e.self_cpu_time_total for e in ops if e not in comm) / 1e3, rel=1e-9)
    assert any(e.name == "aten::mm" for e in ops) and busy_ms > 0
    assert any(e.name == "user_range_with_a_sleep" and e.is_user_annotation for e in events)


def test_step_profiler_window(one_process_group):
    profiler = StepProfiler("cpu")
    profiler.warm_up()
    assert not profiler.active
    profiler.start()
    assert profiler.active
    x = torch.randn(64, 64)
    dist.all_reduce(x @ x)
    busy_ms, comm_ms = profiler.stop()
    assert busy_ms > 0 and comm_ms > 0 and not profiler.active
    with pytest.raises(RuntimeError, match="without start"):
        profiler.stop()
