"""The report's header: the device and the versions every GPU number depends on (1 GPU)."""


def test_environment_is_probed_and_recorded(gpu_env, gpu_record):
    """The probe ran in its own interpreter and saw this node's GPUs; its JSON heads
    report.json, and the fields docs/benchmarks.md quotes are all present."""
    import torch

    assert gpu_env.get("cuda_available"), gpu_env
    assert gpu_env.get("gpu_count") == torch.cuda.device_count(), gpu_env
    for key in ("device", "torch", "cuda", "nccl", "megatron_core"):
        assert gpu_env.get(key), f"{key} missing from {gpu_env}"
    gpu_record(**{k: gpu_env.get(k) for k in ("device", "gpu_count", "torch", "cuda", "nccl", "te_version", "fp8")})
