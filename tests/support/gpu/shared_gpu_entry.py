"""`python -m tests.support.gpu.shared_gpu_entry ARGS` under torchrun: several
ranks of one job on one GPU, each its own NCCL "host".

NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected") because
both report the same host hash and bus id; the host hash comes from NCCL_HOSTID where it
is set. With a distinct NCCL_HOSTID per rank each rank is a host of its own and NCCL
carries their traffic over its socket transport on the loopback interface. Every rank
binds GPU 0 (Megatron binds LOCAL_RANK). On a machine without CUDA nothing here applies
and the job runs on gloo, as the CPU dry run of `make test-gpu-ranks` does. Then runs
tests.support.step_end_entry (its test switches included) with ARGS.
"""

import os
import runpy


def shared_gpu_environment(rank: str) -> dict:
    return {"NCCL_HOSTID": f"megatron-async-rank{rank}", "LOCAL_RANK": "0", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


if __name__ == "__main__":
    import torch

    if torch.cuda.is_available():
        os.environ.update(shared_gpu_environment(os.environ.get("RANK", "0")))
    runpy.run_module("tests.support.step_end_entry", run_name="__main__", alter_sys=True)
