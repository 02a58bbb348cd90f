"""The host-work counter (bench/host_work.py): what it calls a launch, a host -> device
copy and a host sync, on a CPU run where placement is inferred."""

import torch

from embodied_kv.bench.host_work import HostWork, count
from embodied_kv.engine.graph_emulation import record


def test_device_ops_launch_host_reads_of_them_sync_host_tensors_cross_once():
    weight = torch.randn(4, 4)  # "device": a seed, as model weights are
    hw = HostWork(seed=[weight])
    with hw, hw.region("step") as c:
        idx = torch.tensor([0, 2])  # built from Python data: host memory
        rows = weight.index_select(0, idx)  # one launch; idx crosses to the device
        again = weight.index_select(0, idx)  # the same host tensor: no second copy
        total = (rows + again).sum()  # two launches
        float(total)  # a host read of device memory: a sync
        idx.tolist()  # a host read of host memory: free
        (idx + 1).tolist()  # host arithmetic: no launch, no sync
        rows.nonzero()  # its output shape is data: the host waits
    assert (c.launches, c.h2d, c.syncs) == (5, 1, 2)  # 2 gathers, add, sum, nonzero
    assert c.h2d_bytes == 2 * 8 and c.d2h == 0
    assert sorted(c.sites) == ["h2d@?", "syncs@?"]  # sites are the package's own lines only


def test_copies_to_and_from_device_memory():
    dev = torch.zeros(8)
    hw = HostWork(seed=[dev])
    with hw, hw.region("copies") as c:
        dev[:4].copy_(torch.tensor([1.0, 2, 3, 4]))  # host -> device
        back = dev.detach().to("cpu", copy=True)  # device -> host: a blocking copy
        float(back[0])  # back is host memory now: no sync
        staged = torch.empty(8)  # a factory takes the side of what is written into it
        staged.copy_(dev)
        staged.sum()  # a device op
    assert (c.h2d, c.d2h, c.syncs, c.launches) == (1, 1, 1, 3)


def test_a_graph_replay_is_one_launch_whatever_it_holds():
    x = torch.randn(16)

    def fn():
        y = x * 2
        for _ in range(10):
            y = y + 1
        return y

    replay, _ = record(fn)
    per_call = count(replay, seed=[x], repeats=3)
    assert per_call["launches"] == 1 and per_call["graph_replays"] == 1
    assert count(fn, seed=[x])["launches"] == 11  # the same ops eager: eleven launches
