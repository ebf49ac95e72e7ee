"""Megatron's GPT for a checkpoint's saved arguments: in one process, or as one rank of the saved layout.

Megatron's own derivation (`gpt_config_from_args`) and builder (`GPTModelBuilder`) make the
model, with Megatron-Core's local layers (no Transformer Engine, no fused CUDA kernels) and,
for the one process that holds the whole model, every parallel size set to 1.
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from megatron_async.megatron_lm.export import ExportError

# the layout one process reads: every parallel size 1, Megatron-Core's local layers, no fused CUDA kernels
ONE_STAGE = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                 virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                 expert_tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False,
                 decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                 num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                 pipeline_model_parallel_layout=None, account_for_embedding_in_pipeline_split=False,
                 account_for_loss_in_pipeline_split=False, tp_comm_overlap=False)
# (Megatron derives the layer norm's `persist_layer_norm` from --no-persist-layer-norm, which a GPU run leaves off)
LOCAL = dict(transformer_impl="local", use_cpu_initialization=True, perform_initialization=False,
             gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
             apply_rope_fusion=False, persist_layer_norm=False, no_persist_layer_norm=True, fp8=None)


def saved_args(directory: str):
    """The arguments Megatron saved with the checkpoint, or a refusal."""
    from megatron_async.megatron_lm.checkpoint.marker import saved_megatron_args

    args = saved_megatron_args(directory)
    if args is None:
        raise ExportError(f"--load: {directory} holds no readable Megatron arguments (a torn or foreign checkpoint)")
    return args


def layout_args(args):
    """The saved arguments at their own layout, with Megatron's local layers unless the run's
    Transformer Engine layers can be built here (a torch-format file holds the modules' own names)."""
    args = copy.deepcopy(args)
    local = LOCAL
    if args.transformer_impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise ExportError("--transformer-impl transformer_engine with --ckpt-format torch: the per-rank files "
                              "hold Transformer Engine's modules; export where Transformer Engine is installed, "
                              "or from a torch_dist checkpoint")
        local = {k: v for k, v in LOCAL.items() if k != "transformer_impl"}
    for key, value in local.items():
        setattr(args, key, value)
    args.context_parallel_size = 1  # each context-parallel rank holds the same weights
    return args


def one_stage_args(args):
    """The saved arguments for one process holding the whole model (Megatron's local layers)."""
    args = copy.deepcopy(args)
    for key, value in {**ONE_STAGE, **LOCAL}.items():
        setattr(args, key, value)
    return args


def model_config(args):
    """Megatron's GPT config for these arguments (its own derivation from the command line)."""
    from megatron.training.argument_utils import gpt_config_from_args

    config = gpt_config_from_args(args)
    config.finalize()
    return config


def start_process_group(tensor_parallel: int = 1, pipeline_parallel: int = 1, virtual: int | None = None,
                        expert_parallel: int = 1) -> None:
    """torch.distributed and Megatron's model-parallel groups (one rank unless launched with more)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_async.cpu import setup_device

    setup_device("auto")
    if parallel_state.model_parallel_is_initialized():
        return
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel, virtual,
                                             expert_model_parallel_size=expert_parallel)
    model_parallel_cuda_manual_seed(0)


def build_model(config, vp_stage: int | None = None):
    """Megatron's GPT for `config`, its weights in the dtype training saves them in: a bf16 or
    fp16 run trains the model inside Megatron's Float16Module, which casts every weight (the
    norms' too), so the checkpoint holds them all in that dtype."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    model = GPTModelBuilder(config).build_model(ProcessGroupCollection.use_mpu_process_groups(), vp_stage=vp_stage)
    if config.transformer.bf16:
        return model.bfloat16()
    return model.half() if config.transformer.fp16 else model
