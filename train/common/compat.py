"""Version guards: the dependency versions longsft is tested with, and one wrapper per private API.

Each wrapper checks that the private API it uses is there, in the shape longsft calls it, and
otherwise raises :class:`UnsupportedVersion` naming the installed version and the supported range
(``SUPPORTED``, which ``pyproject.toml`` repeats and ``tests/test_compat.py`` holds equal):

- :func:`aten_op`: PyTorch's private fused attention ops, called positionally by the ring
  (the positional argument names are checked against the op's schema);
- :func:`torch_dispatch_mode`, :func:`tree_leaves`, :func:`storage_id`: the private PyTorch utilities
  the memory planner traces with;
- :func:`zero3_full_state_dict`: DeepSpeed's ``_zero3_consolidated_16bit_state_dict``;
- :func:`routes_attention`: transformers' ``_supports_attention_backend`` class flag;
- :func:`without_zero3_init`: transformers' ``HfDeepSpeedConfig`` reference, set aside;
- :func:`set_deepspeed_world_group`: DeepSpeed's clone of the world group, made by longsft with its timeout;
- :func:`release_deepspeed_groups`: DeepSpeed's references to destroyed groups, dropped;
- :func:`import_bare`: a ring-flash-attn module imported without the package's ``__init__``.
- :func:`mkldnn_bf16`: PyTorch's own test of whether oneDNN takes bf16 matmuls on this CPU (returns
  None, not an error, where it is missing).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys

from longsft.train.common.errors import ConfigError

# distribution -> the versions tested (pyproject.toml states the same ranges)
SUPPORTED = {
    "torch": ">=2.11,<2.14",
    "deepspeed": ">=0.19,<0.20",
    "transformers": ">=5.24,<6",
    "ring-flash-attn": "==0.1.8",
    "openai": ">=3.57,<4",
}


class UnsupportedVersion(ConfigError):
    """An installed dependency lacks (or changed) a private API longsft uses."""


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(dist: str, version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) of ``dist`` is in ``SUPPORTED``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = installed(dist) if version is None else version
    if version is None:
        return False
    return Version(Version(version).base_version) in SpecifierSet(SUPPORTED[dist])


def unsupported(dist: str, what: str) -> UnsupportedVersion:
    """The error for a private API ``what`` of ``dist`` that is missing or changed."""
    have = installed(dist) or "not installed"
    return UnsupportedVersion(f"{dist} {have}: {what}; longsft supports {dist}{SUPPORTED[dist]} "
                              f"(pip install '{dist}{SUPPORTED[dist]}')")


# ---------------------------------------------------------------------------------------- PyTorch

# The private aten ops the ring calls, with the names of the arguments it passes by position and
# by keyword. Positional names are checked in order: a reordered schema would otherwise feed a
# tensor or flag into the wrong slot without any error.
ATEN_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        ("query", "key", "value", "dropout_p", "is_causal"), ("attn_mask", "scale")),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"), ("attn_mask", "scale")),
    "_scaled_dot_product_flash_attention": (
        ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), ("scale",)),
    "_scaled_dot_product_flash_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
         "dropout_p", "is_causal", "philox_seed", "philox_offset"), ("scale",)),
    "_scaled_dot_product_cudnn_attention": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask"),
        ("scale",)),
    "_scaled_dot_product_cudnn_attention_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
         "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"), ("scale",)),
    "_scaled_dot_product_efficient_attention": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"), ("scale",)),
    "_scaled_dot_product_efficient_attention_backward": (
        ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
         "dropout_p", "grad_input_mask", "is_causal"), ("scale",)),
}
# outputs read by position: (output, logsumexp) first
_ATEN_OUTPUTS = 2


def check_schema(name: str, schema) -> None:
    """Raise :class:`UnsupportedVersion` unless ``schema`` (a ``torch._C.FunctionSchema``) takes the
    arguments ``ATEN_OPS[name]`` passes, positional ones in that order, and returns at least two values."""
    positional, keywords = ATEN_OPS[name]
    args = [a for a in schema.arguments if not a.kwarg_only]
    names = tuple(a.name for a in args[: len(positional)])
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    if names != positional or not set(keywords) <= kw or len(schema.returns) < _ATEN_OUTPUTS:
        raise unsupported("torch", f"aten::{name} changed (schema now {schema}; longsft passes "
                                   f"{', '.join(positional)} by position and {', '.join(keywords)} by keyword)")


@functools.cache
def aten_op(name: str):
    """``torch.ops.aten.<name>.default``, its schema checked once against what the ring passes."""
    import torch

    try:
        op = getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):
        raise unsupported("torch", f"aten::{name} is missing") from None
    check_schema(name, op._schema)
    return op


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (the planner's allocation tracer subclasses it)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        raise unsupported("torch", "torch.utils._python_dispatch.TorchDispatchMode is missing") from None
    return TorchDispatchMode


def tree_leaves(tree) -> list:
    """The tensors (and other leaves) of a nested output (``torch.utils._pytree``)."""
    try:
        from torch.utils._pytree import tree_flatten
    except ImportError:
        raise unsupported("torch", "torch.utils._pytree.tree_flatten is missing") from None
    return tree_flatten(tree)[0]


def storage_id(storage) -> int:
    """A key identifying an untyped storage while it lives (``UntypedStorage._cdata``)."""
    try:
        return storage._cdata
    except AttributeError:
        raise unsupported("torch", "UntypedStorage._cdata is missing (the planner counts storages by it)") from None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread, as when a checkpoint
    recomputes a layer (``torch._C._current_graph_task_id``, which torch.utils.checkpoint reads too)."""
    import torch

    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:
        raise unsupported("torch", "torch._C._current_graph_task_id is missing (model.keep_attention needs it)") \
            from None


def mkldnn_bf16() -> bool | None:
    """Whether PyTorch sends this CPU's bf16 matmuls to oneDNN (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
    avx512bw/vl/dq or avx_ne_convert; native dot products with avx512_bf16 or AMX). None where the op is
    missing: its one caller is a hint, not worth failing a run for."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


# -------------------------------------------------------------------------------------- DeepSpeed


def zero3_full_state_dict(engine) -> dict | None:
    """The full 16-bit state dict of a ZeRO-3 engine on rank 0 (None elsewhere); every rank must call."""
    gather = getattr(engine, "_zero3_consolidated_16bit_state_dict", None)
    if gather is None:
        raise unsupported("deepspeed", "DeepSpeedEngine._zero3_consolidated_16bit_state_dict is missing "
                                       "(longsft exports the best checkpoint through it)")
    return gather()


def zero3_gathered(param) -> bool:
    """Whether a ZeRO-3 parameter is whole on this rank now (``ds_status`` AVAILABLE)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    status = getattr(param, "ds_status", None)
    if status is None:
        raise unsupported("deepspeed", "a ZeRO-3 parameter has no ds_status")
    return status == ZeroParamStatus.AVAILABLE


def full_shape(param) -> torch.Size:
    """A parameter's whole shape, also while ZeRO-3 holds only this rank's partition (``ds_shape``)."""
    return param.ds_shape if hasattr(param, "ds_id") else param.shape


def skip_inference_comm_build() -> None:
    """Keep ``deepspeed.init_distributed`` from JIT-compiling its shared-memory comm op on CPU (about a
    minute on every fresh extension cache); only inference all-reduce uses it, training never does.
    Marks the op incompatible in ``deepspeed.ops.__compatible_ops__``, which ``comm/torch.py``
    ``build_shm_op`` reads before building."""
    import deepspeed.ops

    try:
        ops = deepspeed.ops.__compatible_ops__
    except AttributeError:
        raise unsupported("deepspeed", "deepspeed.ops.__compatible_ops__ is missing") from None
    if "deepspeed_shm_comm" not in ops:
        raise unsupported("deepspeed", "deepspeed.ops.__compatible_ops__ has no deepspeed_shm_comm entry")
    ops["deepspeed_shm_comm"] = False


def set_deepspeed_world_group(group) -> None:
    """Make ``group`` (a whole-world group made with longsft's timeout) the world clone DeepSpeed would
    otherwise make itself with torch's default timeout (``deepspeed.utils.groups._clone_world_group``,
    the group ZeRO-3 reduces gradients over without an mpu): every rank calls it, once per default group."""
    from deepspeed.utils import groups

    if not hasattr(groups, "_WORLD_GROUP") or not hasattr(groups, "_clone_world_group"):
        raise unsupported("deepspeed", "deepspeed.utils.groups._WORLD_GROUP / _clone_world_group are missing")
    groups._WORLD_GROUP = group


def release_deepspeed_groups() -> None:
    """Drop DeepSpeed's references to process groups destroyed with torch's ``destroy_process_group``
    (``deepspeed.comm.destroy_process_group`` does this itself: ``groups._release_process_group_references``)."""
    import sys

    if "deepspeed" not in sys.modules:
        return
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is None:
        raise unsupported("deepspeed", "deepspeed.utils.groups._release_process_group_references is missing")
    release(group=None)


# ----------------------------------------------------------------------------------- transformers


def routes_attention(model_cls: type) -> bool:
    """Whether ``model_cls`` sends attention through transformers' attention registry
    (``PreTrainedModel._supports_attention_backend``)."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "_supports_attention_backend"):
        raise unsupported("transformers", "PreTrainedModel._supports_attention_backend is missing (longsft checks "
                                          "with it that a model's attention can be sequence-parallel)")
    return bool(getattr(model_cls, "_supports_attention_backend", False))


@contextlib.contextmanager
def without_zero3_init():
    """Inside, transformers builds models whole on this rank: while an ``HfDeepSpeedConfig`` of ZeRO-3 is
    alive (``integrations.deepspeed._hf_deepspeed_config_weak_ref``), ``from_config`` would partition
    the weights inside ``deepspeed.zero.Init``, a collective, which a model only one rank builds (the
    planner's meta-device trace) must not enter."""
    import transformers.integrations.deepspeed as hf_ds

    if not hasattr(hf_ds, "_hf_deepspeed_config_weak_ref"):
        raise unsupported("transformers", "transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref is "
                                          "missing (the planner sets it aside to build its meta-device model)")
    ref, hf_ds._hf_deepspeed_config_weak_ref = hf_ds._hf_deepspeed_config_weak_ref, None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


# -------------------------------------------------------------------------------- ring-flash-attn


def import_bare(package: str, module: str, dist: str):
    """``package.module`` imported without running ``package/__init__.py`` (registered as a bare package).

    For ring-flash-attn 0.1.8, whose ``__init__`` imports its Hugging Face adapter, which imports a
    helper transformers 5 moved (``is_flash_attn_greater_or_equal_2_10``). Only the supported
    version is imported this way: another one may need its ``__init__``.
    """
    name = f"{package}.{module}"
    if name in sys.modules:
        return sys.modules[name]
    if not supported(dist):
        raise unsupported(dist, f"{name} is imported without the package's __init__, which is checked only for "
                                "the supported version")
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        bare = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(package, None, is_package=True))
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = bare
    return importlib.import_module(name)
