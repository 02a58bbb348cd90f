"""Session-wide test settings.

ROS 2 isolation: every test process gets its own DDS domain and discovers only
on this host, so parallel test runs and other ROS traffic on the machine neither
see nor disturb each other. Set at import, before any test initialises rclpy
(rclpy reads both when a context is initialised; subprocesses inherit them).
"""

import os

# Domains 1..101: 0 is the default a real robot uses; 232 and up fail here
# (the PyPI ROS 2 wheels), and each domain takes its own UDP port range.
os.environ["ROS_DOMAIN_ID"] = str(1 + os.getpid() % 101)
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # kilted ignores ROS_LOCALHOST_ONLY

# Triton kernels run under the Triton interpreter on CPU tensors when there is no
# GPU. Triton reads this when first imported, so it must be set before any test
# module imports it (see test/kernels).
try:
    import torch
except ImportError:
    torch = None
if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread, as every bench and the robot process run: the suite's ops are small,
# and on a 2-core machine two OpenMP workers waiting on each other made test_graphs 40x slower
# (172 s vs 4.3 s measured here). Subprocesses inherit it through OMP_NUM_THREADS.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if torch is not None:
    torch.set_num_threads(1)


if torch is not None:
    import pytest

    @pytest.fixture
    def one_thread():
        """One intra-op thread for a test that must not inherit another test's setting
        (the product runs torch on one CPU thread: docs/ros.md)."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)
