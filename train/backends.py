"""Accelerate set-up for the trainer: which back end runs (single process, DDP, FSDP2, DeepSpeed ZeRO)
and the workarounds each needs, so the loop in ``trainer.py`` never branches on the back end.

:func:`make_accelerator` builds this process's Accelerator; :func:`prepare` wraps the drafter and its
optimizer; :func:`describe`, :func:`precision` and :func:`owned_weight_fraction` say what the run got.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from draftlab.errors import DraftlabError


def resolve_precision(precision: str) -> str:
    """The recipe's ``train.precision`` on this machine: ``auto`` is bf16 on CUDA and fp32 elsewhere (CPU
    bf16 matmuls are far slower than fp32 ones)."""
    return "bf16" if precision == "bf16" or (precision == "auto" and torch.cuda.is_available()) else "fp32"


def make_accelerator(precision: str):
    """This process's Accelerator, honouring ``accelerate launch --config_file`` on a CPU-only machine too.
    ``precision`` is the recipe's ``train.precision``: it overrides the launch config's ``mixed_precision``
    (the recipe owns the numerics, as it owns accumulation and clipping)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, parse_flag_from_env

    cuda = torch.cuda.is_available()
    bf16 = resolve_precision(precision) == "bf16"
    fsdp, deepspeed = parse_flag_from_env("ACCELERATE_USE_FSDP"), parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    # DeepSpeed's own bf16 mode would keep bf16 weights in the module: there ``prepare`` autocasts instead
    mixed = "bf16" if bf16 and not deepspeed else "no"
    if cuda:
        # TF32 for the fp32 matmuls autocast leaves (bf16) and none at all for an explicit fp32 run
        torch.set_float32_matmul_precision("high" if bf16 else "highest")
        accelerator = Accelerator(mixed_precision=mixed)
    elif fsdp or deepspeed:
        # cpu=True would silently drop DeepSpeed and FSDP, and cpu=False alone leaves each process on its
        # own (no backend, world size 1): ask for a gloo process group explicitly.
        accelerator = Accelerator(mixed_precision=mixed, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        if fsdp:
            _enable_fsdp2_on_cpu()
    else:
        accelerator = Accelerator(cpu=True, mixed_precision=mixed)  # gloo DDP under torchrun / MULTI_CPU configs
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # Accelerate registers its DeepSpeed config with transformers, which under ZeRO-3 then builds every
        # from_pretrained model partitioned (deepspeed.zero.Init). The frozen target must stay whole on each
        # rank (and its load under main_process_first deadlocks on zero.Init's broadcast).
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return accelerator


def _enable_fsdp2_on_cpu() -> None:
    """Accelerate switches FSDP on only for accelerator devices, yet torch's FSDP2 (``fully_shard``) runs on
    a gloo CPU group: set the state Accelerate would have set, so ``accelerator.prepare`` shards the drafter.
    There is no public setter; PartialState's shared state must agree with AcceleratorState's."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch exported
    if plugin.fsdp_version != 2:
        raise DraftlabError("FSDP on CPU needs fsdp_version: 2 in the Accelerate config (FSDP1 is not supported here)")
    state = AcceleratorState()
    state.fsdp_plugin = plugin
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def prepare(accelerator, train, drafter, optimizer):
    """``accelerator.prepare`` of the drafter and its optimizer under the recipe's ``train`` section:
    the recipe owns gradient accumulation and clipping whatever the back end's own config says."""
    # accumulate() turns gradient sync (DDP), the micro-step boundary (DeepSpeed) and the loss scaling on
    # and off per micro-batch.
    accelerator.gradient_accumulation_steps = train.grad_accum
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _reconcile_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, train)
        if resolve_precision(train.precision) == "bf16":
            # Accelerate's autocast for the other back ends, by hand: bf16 compute over DeepSpeed's fp32 weights
            from accelerate.utils import convert_outputs_to_fp32

            drafter.forward = convert_outputs_to_fp32(torch.autocast(accelerator.device.type, torch.bfloat16)(drafter.forward))
    if accelerator.is_fsdp2 and accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
        raise DraftlabError("Accelerate config fsdp_cpu_ram_efficient_loading must be false: Accelerate's FSDP2 "
                            "loader then takes the drafter's buffers (d2t, t2d) for sharded parameters and fails")
    if accelerator.is_fsdp2:
        _wrap_decoder_layers(accelerator.state.fsdp_plugin, drafter)
    return accelerator.prepare(drafter, optimizer)


def _wrap_decoder_layers(plugin, drafter) -> None:
    """One Accelerate config serves every family: where its fsdp_transformer_layer_cls_to_wrap names a
    class the drafter lacks (the shipped configs name draftlab's DecoderLayer; a draft LM's layers are
    HF's LlamaDecoderLayer, Qwen2DecoderLayer, ...), wrap the drafter's own decoder layers instead."""
    names = plugin.transformer_cls_names_to_wrap
    if not names:
        return
    present = {type(m).__name__ for m in drafter.modules()}
    if set(names) <= present:
        return
    layers = sorted(n for n in present if n.endswith("DecoderLayer"))
    if not layers:
        raise DraftlabError(f"Accelerate config fsdp_transformer_layer_cls_to_wrap: {', '.join(names)} is not a class of "
                            f"the {type(drafter).__name__} drafter, which has no decoder layers to wrap instead")
    plugin.transformer_cls_names_to_wrap = layers


def _reconcile_deepspeed_config(cfg: dict, train) -> None:
    """A DeepSpeed JSON may leave accumulation and clipping "auto" (filled in here) or repeat the
    recipe's values, never contradict them."""
    for key, want, field in (
        ("gradient_accumulation_steps", train.grad_accum, "train.grad_accum"),
        ("gradient_clipping", train.clip_grad_norm, "train.clip_grad_norm"),
    ):
        have = cfg.get(key, "auto")
        if have == "auto":
            cfg[key] = want
        elif float(have) != float(want):
            raise DraftlabError(f"DeepSpeed config {key}={have} contradicts the recipe's {field}={want}; set it to \"auto\"")
    # Micro-batches are token-budgeted, so DeepSpeed's batch-size bookkeeping only needs a consistent value.
    if cfg.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        cfg["train_micro_batch_size_per_gpu"] = 1
    for key in ("bf16", "fp16"):  # DeepSpeed's mixed precision keeps 16-bit weights in the module
        if cfg.get(key, {}).get("enabled", "auto") not in ("auto", False):
            raise DraftlabError(f"DeepSpeed config {key}.enabled must be \"auto\" or false: train.precision sets the precision "
                                "(bf16 autocast over fp32 weights)")
    if cfg.get("zero_optimization", {}).get("elastic_checkpoint"):
        raise DraftlabError("DeepSpeed config zero_optimization.elastic_checkpoint is not supported (checkpoints are per rank)")


def zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage, or None when DeepSpeed does not run."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def describe(accelerator) -> str:
    """The back end as the run reports it: ``NO``, ``MULTI_CPU``, ``FSDP``, ``DEEPSPEED ZeRO-2``, ..."""
    stage = zero_stage(accelerator)
    return accelerator.distributed_type.value + (f" ZeRO-{stage}" if stage is not None else "")


def precision(accelerator, train) -> dict:
    """The numerics the run got, as checkpoints record them: ``train`` ``bf16`` (bf16 autocast, fp32 master
    weights) or ``fp32``, and whether CUDA fp32 matmuls use TF32."""
    tf32 = accelerator.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return {"train": resolve_precision(train.precision), "tf32": tf32}


def owned_weight_fraction(model) -> float:
    """Share of the drafter's parameter elements in this rank's own partition: 1 when replicated, about
    1/world under ZeRO-3 / FSDP (ZeRO-3 also caches parameters under its persistence threshold whole)."""
    owned = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition (padded to equal sizes)
            owned, total = owned + p.ds_tensor.numel(), total + p.ds_numel
        elif hasattr(p, "to_local"):  # FSDP2 DTensor shard
            owned, total = owned + p.to_local().numel(), total + p.numel()
        else:
            owned, total = owned + p.numel(), total + p.numel()
    return owned / total
