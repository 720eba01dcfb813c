"""GPTQ 4-bit models without a GPTQ library: a linear layer, a round-to-nearest model quantizer, and a
checkpoint writer and loader for the "gptq" (v1) and "gptq_v2" safetensors layouts.

- :class:`GPTQLinear` holds the packed tensors under the names GPTQ checkpoints use (``qweight``, ``qzeros``,
  ``scales``, ``g_idx``, plus a frozen ``bias``) and computes ``x W^T + b`` with
  :func:`foak.ops.gptq_matmul.gptq_linear`: for few rows (decoding) one Triton GEMM that dequantizes in its
  inner loop, otherwise ``W`` dequantized by :mod:`foak.ops.gptq` for cuBLAS; the backward dequantizes again
  (no dense weight is kept in between).
- Storage (FSDP2): the packed tensors are frozen *integer* ``nn.Parameter`` s, not buffers, so
  ``torch.distributed.fsdp.fully_shard`` shards them along dim 0 and all-gathers them bit-exactly: FSDP2's
  ``MixedPrecisionPolicy`` casts floating-point parameters only, and a group of mixed dtypes is all-gathered
  as raw bytes. ``qweight``, ``qzeros`` and ``g_idx`` are int32 (``g_idx`` int64 if assigned so); the float
  ``scales`` are held as their bits in an int32 parameter ``scales_bits`` (two fp16/bf16 scales per word,
  ``[groups, out / 2]``; fp32 ``[groups, out]``) and ``module.scales`` is the free ``.view`` back to the
  float dtype. No float view of packed integers exists anywhere, so no mixed-precision cast can meet (and
  canonicalise) a NaN bit pattern, and int32 is a dtype both NCCL and gloo collectives take (int16 is
  not). The state dict is the checkpoint's: key ``scales`` in its float dtype (the bits parameter is renamed
  on save and load). ``model.to(dtype)``, ``.half()`` and PEFT's ``prepare_model_for_kbit_training`` (which
  casts fp16/bf16 parameters to fp32) leave the weight's bits alone; the parameters never require grad
  (``model.requires_grad_(True)`` raises torch's error for integer tensors, as on bitsandbytes' 4-bit
  layers).
- :func:`quantize_model_gptq` replaces a model's ``nn.Linear`` layers by GPTQLinear (round to nearest, no
  calibration data) and records the ``quantization_config``; :func:`gptq_error_report_model` gives the
  per-layer relative error of the dequantized weights.
- :func:`save_gptq` writes ``config.json`` (with the ``quantization_config``) and ``model.safetensors`` (and
  the tokenizer when given); :func:`load_gptq` reads such a directory (sharded ones too) and builds the model
  with its parameters on the meta device first, so no dense weight of a quantized layer is ever allocated. It
  refuses, with a ValueError, what it cannot read exactly: other methods or bit widths, repacked formats
  (marlin, exllama, ...), per-module ("dynamic") configs, missing or unexpected tensors and shapes that do not
  match the model. With ``adapter`` (or given the output directory of ``foak train --peft lora`` on a GPTQ
  checkpoint) it returns the PEFT model with the saved LoRA adapter over the GPTQ base
  (:mod:`foak.quant.gptq_peft`): PEFT's own loaders cannot build it (``AutoPeftModelForCausalLM`` sends a
  GPTQ config to transformers' GPTQ path, ``PeftModel.from_pretrained`` has no LoRA layer for GPTQLinear).
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from foak.ops.gptq import GPTQWeight, gptq_error_report, gptq_group_index, gptq_quantize_rtn
from foak.ops.gptq_matmul import gptq_linear

BITS = 4
PACK = 8
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> zero_offset
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PACKED_NAMES = ("qweight", "qzeros", "scales", "g_idx")  # the checkpoint names of a quantized layer's tensors
SCALES_BITS = "scales_bits"  # the parameter holding the scales' bits (int32)
INDEX_DTYPES = (torch.int32, torch.int64)
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"  # PEFT's
GPTQ_BASE_NAME = "foak_gptq_base.json"  # foak train's record of an adapter's GPTQ base (load_gptq reads it)


def _n_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


# 1. the layer -------------------------------------------------------------------------------------
class GPTQLinear(nn.Module):
    """A linear layer with a frozen GPTQ 4-bit weight (see :mod:`foak.ops.gptq` for the format).

    Tensors (the names of GPTQ checkpoints): ``qweight`` int32 ``[in/8, out]``, ``qzeros`` int32
    ``[groups, out/8]``, ``scales`` ``[groups, out]`` (fp16, bf16 or fp32), ``g_idx`` int32 ``[in]``; ``bias``
    is an optional parameter with ``requires_grad=False``. All are frozen parameters, the integers stored as
    integers and the scales as their bits (the ``scales_bits`` int32 parameter; ``scales`` reads it as the float
    view), so FSDP2 shards them and gathers them bit-exactly (module docstring). Assigning a tensor to one of
    the four names replaces it (as for a buffer). ``state_dict()`` / ``load_state_dict()`` use the checkpoint
    keys and dtypes (``scales`` float). ``zero_offset`` is 1 for "gptq" (v1) checkpoints and 0 for "gptq_v2";
    ``compute_dtype`` is the dtype the weight dequantizes to and the GEMM runs in (the input is cast to it, the
    output back to the input's dtype). ``module.to(dtype)`` changes ``compute_dtype`` and the bias but never the
    packed tensors, so the weight's values never change.
    """

    bits = BITS

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group_size: int = 128,
                 zero_offset: int = 1, compute_dtype: torch.dtype = torch.bfloat16,
                 scales_dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value <= 0 or value % PACK:
                raise ValueError(f"GPTQLinear: {name} must be a positive multiple of 8 (GPTQ packs eight 4-bit "
                                 f"values per int32), got {value!r}")
        if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
            raise ValueError(f"GPTQLinear: group_size must be a positive int or -1 (one group), got {group_size!r}")
        if zero_offset not in (0, 1):
            raise ValueError(f"GPTQLinear: zero_offset must be 1 (\"gptq\" v1) or 0 (\"gptq_v2\"), got {zero_offset!r}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"GPTQLinear: compute_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {compute_dtype!r}")
        if scales_dtype not in SCALE_DTYPES:
            raise ValueError(f"GPTQLinear: scales_dtype must be torch.float16, torch.bfloat16 or torch.float32, "
                             f"got {scales_dtype!r}")
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.zero_offset, self.compute_dtype = group_size, zero_offset, compute_dtype
        groups = _n_groups(in_features, group_size)
        packed = (in_features // PACK, out_features)
        self.qweight = torch.zeros(packed, dtype=torch.int32, device=device)
        self.qzeros = torch.zeros(groups, out_features // PACK, dtype=torch.int32, device=device)
        self.scales = torch.zeros(groups, out_features, dtype=scales_dtype, device=device)
        self.g_idx = gptq_group_index(in_features, group_size, device=device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._weight_cache = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, *, sym: bool = True, act_order: bool = False,
                    zero_offset: int = 1) -> GPTQLinear:
        """Round-to-nearest quantization of ``linear`` (:func:`foak.ops.gptq.gptq_quantize_rtn`); the compute
        dtype is the linear's weight dtype; the bias is copied (frozen)."""
        weight = linear.weight
        compute_dtype = weight.dtype if weight.dtype in COMPUTE_DTYPES else torch.float32
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size=group_size,
                     zero_offset=zero_offset, compute_dtype=compute_dtype, device=weight.device)
        packed = gptq_quantize_rtn(weight, group_size, sym=sym, act_order=act_order, zero_offset=zero_offset)
        with torch.no_grad():
            for name in PACKED_NAMES:
                getattr(module, name).copy_(packed[name])
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    # storage: frozen integer parameters, the scales as their bits ----------------------------------
    @property
    def scales(self) -> torch.Tensor:
        """The scales ``[groups, out]`` in their stored float dtype: a view of the ``scales_bits`` parameter."""
        return self._parameters[SCALES_BITS].view(self._scales_dtype)

    @property
    def scales_dtype(self) -> torch.dtype:
        return self._scales_dtype

    def __setattr__(self, name, value):
        if name in PACKED_NAMES and "_parameters" in self.__dict__:
            self._set_packed(name, value)
        else:
            super().__setattr__(name, value)

    def _set_packed(self, name: str, value) -> None:
        """Store ``value`` as the packed tensor ``name`` (a checkpoint name): a frozen parameter sharing its
        storage (the scales: their bits, in ``scales_bits``)."""
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"GPTQLinear.{name} must be a torch.Tensor, got {type(value).__name__}")
        if name == "scales":
            if value.dtype not in SCALE_DTYPES:
                raise ValueError(f"GPTQLinear.scales must be torch.float16, torch.bfloat16 or torch.float32, got "
                                 f"{value.dtype}")
            if value.dim() != 2 or (value.element_size() == 2 and value.shape[-1] % 2):
                raise ValueError(f"GPTQLinear.scales must be 2-D [groups, out_features] (out_features a multiple of "
                                 f"8), got shape {tuple(value.shape)}")
            value = value.detach().contiguous()
            if value.storage_offset() % 2:  # a view into the middle of a word cannot be read as int32
                value = value.clone()
            self._scales_dtype = value.dtype
            name, value = SCALES_BITS, value.view(torch.int32)
        else:
            allowed = INDEX_DTYPES if name == "g_idx" else (torch.int32,)
            if value.dtype not in allowed:
                raise ValueError(f"GPTQLinear.{name} must be " + " or ".join(str(d) for d in allowed)
                                 + f", got {value.dtype}")
        if not (isinstance(value, nn.Parameter) and not value.requires_grad):
            value = nn.Parameter(value.detach(), requires_grad=False)
        super().__setattr__(name, value)  # (weight_object() sees the new tensor; FSDP2 swaps its own in here)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # the checkpoint's layout: "scales" in its float dtype where the bits parameter is
        names = [n for n, p in self._parameters.items() if p is not None]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in names:  # this module's entries again, in order, the scales read back as floats
            value = destination.pop(prefix + name)
            if name == SCALES_BITS:
                name, value = "scales", value.view(self._scales_dtype)
            destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # "scales" (float) -> the bits parameter; a dtype or shape other than this layer's is an error
        key, bits_key = prefix + "scales", prefix + SCALES_BITS
        refused = False
        if key in state_dict:
            value = state_dict[key]
            state_dict = {k: v for k, v in state_dict.items() if k != key}
            if not isinstance(value, torch.Tensor) or value.dtype != self._scales_dtype:
                dtype = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(f"{key}: the state dict holds {dtype} scales but this GPTQLinear stores "
                                  f"{self._scales_dtype} (a conversion would change the weight); build the layer "
                                  f"with scales_dtype={dtype} or assign module.scales")
                refused = True
            elif tuple(value.shape) != tuple(self.scales.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is {tuple(self.scales.shape)}.")
                refused = True
            else:
                value = value.detach().contiguous()
                state_dict[bits_key] = (value.clone() if value.storage_offset() % 2 else value).view(torch.int32)
        n_missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[n_missing:] = [key if k == bits_key else k for k in missing_keys[n_missing:]
                                    if not (refused and k == bits_key)]

    def weight_object(self) -> GPTQWeight:
        """The frozen :class:`foak.ops.gptq.GPTQWeight` over this layer's tensors (what foak's LoRA ops take),
        built (and validated: one host synchronisation) once, and again when a tensor is replaced, changes
        storage, device or version, or the compute dtype changes. The key is the storage object, not its
        address: FSDP2 frees the gathered storage after each forward and re-allocates it in place (the address
        may change, the storage and its tensors stay), which needs no rebuild."""
        tensors = [self._parameters[n] for n in ("qweight", "qzeros", SCALES_BITS, "g_idx")]
        cache = self._weight_cache
        if torch.compiler.is_compiling() and cache is not None and all(a is b for a, b in zip(cache[0], tensors)) \
                and cache[1].device == tensors[0].device \
                and cache[2][-3:] == [self._scales_dtype, self.compute_dtype, self.zero_offset]:
            # storages and versions cannot be read while dynamo traces: the weight an eager call built over these
            # same tensors on this device (building one here reads g_idx on the host: a graph break)
            return cache[1]
        key = [(t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, t._version)
               for t in tensors] + [self._scales_dtype, self.compute_dtype, self.zero_offset]
        if cache is None or cache[2] != key or any(a is not b for a, b in zip(cache[0], tensors)):
            weight = GPTQWeight(self.qweight, self.qzeros, self.scales, self.g_idx, self.compute_dtype,
                                zero_offset=self.zero_offset, bits=self.bits)
            self._weight_cache = cache = (tensors, weight, key)
        return cache[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A dense ``[out, in]`` copy of the weight (default dtype: ``compute_dtype``)."""
        return self.weight_object().dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"GPTQLinear: input has {x.shape[-1]} features in its last dimension; this layer takes "
                             f"in_features={self.in_features}")
        # under autocast the GEMM runs in the autocast dtype, as nn.Linear's would (the weight dequantized to
        # it directly); the result has x's dtype, as bitsandbytes' 4-bit layers return
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.compute_dtype
        bias = self.bias
        if bias is not None and bias.dtype != dtype:
            bias = bias.to(dtype)
        with torch.autocast(device_type, enabled=False):
            y = gptq_linear(x.to(dtype), self.weight_object(), bias)
        return y.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # Float casts reach compute_dtype and the bias; the packed tensors (all integers) keep their dtype
        # (even under module.type(...), which would cast them) and only follow the device.
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.qweight.device))

        def keep_integers(t):
            moved = fn(t)
            if moved.dtype != t.dtype and not (t.is_floating_point() or t.is_complex()):
                moved = t.to(device=moved.device)
            return moved

        super()._apply(keep_integers, recurse)
        self._weight_cache = None  # (it would keep the storages left behind alive)
        if probe.dtype in COMPUTE_DTYPES:
            self.compute_dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}, zero_offset={self.zero_offset}, "
                f"compute_dtype={self.compute_dtype}")


# 2. quantizing a model ----------------------------------------------------------------------------
def _excluded(name: str, modules_to_not_convert) -> bool:
    for entry in modules_to_not_convert or ():
        if name == entry or name.endswith("." + entry) or name.startswith(entry + "."):
            return True
    return False


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model_gptq(model: nn.Module, group_size: int = 128, sym: bool = True, act_order: bool = False,
                        modules_to_not_convert=("lm_head",), *, report: dict | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place; those named in ``modules_to_not_convert`` stay dense)
    by a :class:`GPTQLinear` quantized to nearest (v1 "gptq" layout) and set
    ``model.config.quantization_config``. ``report``: a dict to fill with each layer's relative error
    ``||W - dequant||_F / ||W||_F``. Returns ``model``."""
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantize_model_gptq: group_size must be a positive int or -1 (one group), "
                         f"got {group_size!r}")
    modules_to_not_convert = list(modules_to_not_convert or ())
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not _excluded(n, modules_to_not_convert)]
    bad = [f"{n} [{m.out_features}, {m.in_features}]" for n, m in targets
           if m.in_features % PACK or m.out_features % PACK]
    if bad:
        raise ValueError(f"quantize_model_gptq: GPTQ needs in_features and out_features that are multiples of 8; "
                         f"these linears are not: {', '.join(bad)}. Add them to modules_to_not_convert.")
    if not targets:
        raise ValueError("quantize_model_gptq: the model has no nn.Linear to quantize (all excluded or none present)")
    for name, linear in targets:
        quantized = GPTQLinear.from_linear(linear, group_size, sym=sym, act_order=act_order)
        if report is not None:
            report[name] = gptq_error_report(linear.weight, {n: getattr(quantized, n) for n in PACKED_NAMES})
        _replace(model, name, quantized)
    config = getattr(model, "config", None)
    if config is not None:
        config.quantization_config = {
            "quant_method": "gptq", "bits": BITS, "group_size": group_size, "desc_act": bool(act_order),
            "sym": bool(sym), "checkpoint_format": "gptq", "modules_to_not_convert": modules_to_not_convert,
        }
    return model


def gptq_error_report_model(dense_model: nn.Module, quantized_model: nn.Module) -> dict[str, float]:
    """Per-layer relative error ``||W - dequant(W_q)||_F / ||W||_F`` of each GPTQLinear of ``quantized_model``
    against the ``nn.Linear`` of the same name in ``dense_model`` (calibration-free)."""
    dense = dict(dense_model.named_modules())
    out = {}
    for name, module in quantized_model.named_modules():
        if not isinstance(module, GPTQLinear):
            continue
        linear = dense.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"gptq_error_report_model: dense_model has no nn.Linear named {name!r}")
        out[name] = gptq_error_report(linear.weight, {n: getattr(module, n) for n in PACKED_NAMES},
                                      zero_offset=module.zero_offset)
    if not out:
        raise ValueError("gptq_error_report_model: quantized_model has no GPTQLinear layers")
    return out


# 3. saving ----------------------------------------------------------------------------------------
def _unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent state, each tensor once (tied parameters under their first name), contiguous, on CPU."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def save_gptq(model: nn.Module, path: str | os.PathLike, tokenizer=None) -> None:
    """Write ``config.json`` (with ``quantization_config``) and ``model.safetensors`` (the GPTQLinear tensors
    under their checkpoint names and dtypes, every other parameter and persistent buffer once) to the directory
    ``path``; with ``tokenizer`` (anything with ``save_pretrained``, e.g. the dense model's tokenizer) its files
    too, so the directory is a complete ``--model`` for ``foak train`` / ``foak verify``."""
    from safetensors.torch import save_file

    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None)
    if not isinstance(qc, dict) or qc.get("quant_method") != "gptq":
        raise ValueError("save_gptq: model.config.quantization_config must be a GPTQ config dict; quantize the "
                         "model with quantize_model_gptq first")
    if not any(isinstance(m, GPTQLinear) for m in model.modules()):
        raise ValueError("save_gptq: the model has no GPTQLinear layers")
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f).get("quantization_config")
    if written != json.loads(json.dumps(qc)):
        raise ValueError(f"save_gptq: config.json did not keep the quantization_config (wrote {written!r})")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    save_file(_unique_state_dict(model), os.path.join(path, SAFETENSORS_NAME), metadata={"format": "pt"})
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise ValueError(f"save_gptq: tokenizer must have save_pretrained (a transformers tokenizer), got "
                             f"{type(tokenizer).__name__}")
        tokenizer.save_pretrained(path)


# 4. loading ---------------------------------------------------------------------------------------
def _read_quantization_config(config) -> dict:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        raise ValueError("load_gptq: config.json has no quantization_config; this is not a GPTQ checkpoint")
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method != "gptq":
        raise ValueError(f"load_gptq: quantization_config.quant_method is {qc.get('quant_method')!r}; foak reads "
                         "GPTQ checkpoints only (quant_method \"gptq\")")
    if qc.get("bits") != BITS:
        raise ValueError(f"load_gptq: quantization_config.bits is {qc.get('bits')!r}; foak reads 4-bit GPTQ only "
                         "(2-, 3- and 8-bit checkpoints are not supported)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    fmt = "gptq" if fmt is None else str(fmt).lower()
    if fmt not in CHECKPOINT_FORMATS or qc.get("is_marlin_format"):
        shown = "marlin (is_marlin_format)" if qc.get("is_marlin_format") else repr(fmt)
        raise ValueError(f"load_gptq: checkpoint_format {shown} is not supported: foak reads the plain \"gptq\" "
                         "(v1) and \"gptq_v2\" layouts, not repacked ones (marlin, exllama, bitblas, ...); "
                         "re-export the checkpoint in the gptq format")
    group_size = qc.get("group_size", 128)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"load_gptq: quantization_config.group_size must be a positive int or -1, got {group_size!r}")
    if qc.get("dynamic"):
        raise ValueError("load_gptq: quantization_config.dynamic (per-module bits/group sizes) is not supported")
    not_convert = qc.get("modules_to_not_convert")
    if not_convert is None:
        not_convert = [] if qc.get("lm_head") else ["lm_head"]
    return {"group_size": group_size, "desc_act": bool(qc.get("desc_act", False)),
            "zero_offset": CHECKPOINT_FORMATS[fmt], "modules_to_not_convert": list(not_convert), "raw": qc}


@contextmanager
def _parameters_on_meta():
    """Inside: every parameter a module registers goes to the meta device (buffers stay where they are
    made, so non-persistent ones such as rotary frequencies are computed for real)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


class _Checkpoint:
    """The tensors of a safetensors checkpoint directory (one file or an index of shards), opened lazily."""

    def __init__(self, path):
        from safetensors import safe_open

        index = os.path.join(path, SAFETENSORS_INDEX_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(path, SAFETENSORS_NAME)):
            files = [SAFETENSORS_NAME]
        else:
            raise ValueError(f"load_gptq: {path} has neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}")
        self.handles, self.where = [], {}
        for file in files:
            handle = safe_open(os.path.join(path, file), framework="pt")
            self.handles.append(handle)
            for key in handle.keys():
                self.where[key] = handle

    def keys(self):
        return self.where.keys()

    def shape(self, key):
        return tuple(self.where[key].get_slice(key).get_shape())

    def dtype(self, key):
        return self.where[key].get_slice(key).get_dtype()

    def get(self, key):
        return self.where[key].get_tensor(key)


_ST_DTYPES = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
              "F32": torch.float32}


def _adapter_base(adapter: str) -> tuple[str, dict]:
    """(the GPTQ base an adapter directory was trained on, foak train's record or {}): foak train's
    ``foak_gptq_base.json``, else PEFT's ``adapter_config.json`` ``base_model_name_or_path``."""
    record = {}
    record_path = os.path.join(adapter, GPTQ_BASE_NAME)
    if os.path.isfile(record_path):
        with open(record_path) as f:
            record = json.load(f)
    base = record.get("base_model_name_or_path")
    if not base:
        with open(os.path.join(adapter, ADAPTER_CONFIG_NAME)) as f:
            base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"load_gptq: {adapter} does not name its base model (no base_model_name_or_path in "
                         f"{ADAPTER_CONFIG_NAME}); pass the GPTQ checkpoint: load_gptq(<gptq dir>, "
                         f"adapter={adapter!r})")
    return base, record


def _local_base(base: str, adapter: str) -> str:
    """The directory of the base an adapter names: a local path, or a hub id (downloaded / from the cache)."""
    if os.path.isdir(base):
        return base
    from foak.model_source import _looks_like_path, resolve_model

    if _looks_like_path(base):
        raise ValueError(f"load_gptq: the base model {base} that {adapter} was trained on is not a directory "
                         f"(moved?); pass the GPTQ checkpoint: load_gptq(<gptq dir>, adapter={adapter!r})")
    return str(resolve_model(base, flag="load_gptq: base model", need_tokenizer=False).local_dir())


def _load_adapter(model: nn.Module, adapter: str, is_trainable: bool, adapter_name: str):
    try:
        from peft import LoraConfig, PeftConfig, PeftModel
    except ImportError:
        raise ValueError("load_gptq(adapter=...) needs peft: pip install peft (foak's train extra has it)") from None
    from foak.quant.gptq_peft import register_gptq_lora

    peft_type = str(PeftConfig.from_pretrained(adapter).peft_type).rsplit(".", 1)[-1]
    if peft_type != "LORA":
        raise ValueError(f"load_gptq: {adapter} holds a {peft_type} adapter; GPTQ bases take LoRA adapters only")
    config = register_gptq_lora(LoraConfig.from_pretrained(adapter))  # the mapping is not saved with the adapter
    return PeftModel.from_pretrained(model, adapter, adapter_name=adapter_name, is_trainable=is_trainable,
                                     config=config)


def load_gptq(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None, *, model_class=None,
              adapter: str | os.PathLike | None = None, is_trainable: bool = False,
              adapter_name: str = "default") -> nn.Module:
    """Load a GPTQ 4-bit checkpoint directory (``config.json`` with a ``quantization_config`` + safetensors)
    as a transformers model whose quantized linears are :class:`GPTQLinear` computing in ``dtype`` (default
    bfloat16).

    The model is built from its config with parameters on the meta device; each linear not in the config's
    ``modules_to_not_convert`` (default ``lm_head``) becomes a GPTQLinear; then every tensor is read (to
    ``device``, default CPU; float parameters cast to ``dtype``, scales kept as stored). ``model_class``:
    default ``transformers.AutoModelForCausalLM``. Raises ValueError for anything it cannot read exactly.

    ``adapter``: a PEFT LoRA adapter directory trained on this base (e.g. ``foak train --peft lora``'s output
    directory); the result is then the ``peft.PeftModel`` with the adapter loaded over the GPTQ base (its
    targets :class:`foak.quant.gptq_peft.GPTQLoraLinear`), frozen and in eval mode unless ``is_trainable``.
    ``path`` may also be the adapter directory itself: the base is the one it was trained on (foak train's
    ``foak_gptq_base.json``, else ``base_model_name_or_path`` in ``adapter_config.json``) and ``dtype``
    defaults to the one foak train computed in.
    """
    path = os.fspath(path)
    if adapter is None and os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME)) \
            and not os.path.isfile(os.path.join(path, "config.json")):
        adapter = path
        base, record = _adapter_base(adapter)
        path = _local_base(base, adapter)
        if dtype is None and record.get("dtype"):
            dtype = getattr(torch, str(record["dtype"]).removeprefix("torch."), None)
            if dtype is None:
                raise ValueError(f"load_gptq: {os.path.join(adapter, GPTQ_BASE_NAME)} names an unknown dtype "
                                 f"{record['dtype']!r}")
    elif adapter is not None:
        adapter = os.fspath(adapter)
        if not os.path.isfile(os.path.join(adapter, ADAPTER_CONFIG_NAME)):
            raise ValueError(f"load_gptq: adapter {adapter} has no {ADAPTER_CONFIG_NAME}; pass the directory a "
                             "PEFT adapter was saved to (foak train --peft lora's --output_dir)")
    dtype = torch.bfloat16 if dtype is None else dtype
    model = _load_base(path, dtype, device, model_class)
    if adapter is None:
        return model
    return _load_adapter(model, adapter, is_trainable, adapter_name)


def _load_base(path: str, dtype: torch.dtype, device, model_class) -> nn.Module:
    import transformers

    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"load_gptq: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"load_gptq: {path} has no config.json; pass a GPTQ checkpoint directory (or the "
                         "adapter directory foak train wrote)")
    device = torch.device("cpu" if device is None else device)
    config = transformers.AutoConfig.from_pretrained(path)
    qc = _read_quantization_config(config)
    group_size, zero_offset = qc["group_size"], qc["zero_offset"]
    checkpoint = _Checkpoint(path)

    build_config = copy.deepcopy(config)
    if hasattr(build_config, "quantization_config"):
        del build_config.quantization_config  # build a plain model: transformers' own GPTQ path needs gptqmodel
    model_class = model_class or transformers.AutoModelForCausalLM
    with _parameters_on_meta():
        model = model_class.from_config(build_config, dtype=dtype)
    model.config.quantization_config = qc["raw"]

    # the quantized linears
    errors, expected = [], {}
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not _excluded(n, qc["modules_to_not_convert"])]
    for name, linear in targets:
        in_f, out_f = linear.in_features, linear.out_features
        if in_f % PACK or out_f % PACK:
            errors.append(f"{name}: [{out_f}, {in_f}] is not a multiple of 8 in both dimensions, so it cannot be "
                          "a GPTQ layer (list it in modules_to_not_convert if the checkpoint stores it dense)")
            continue
        groups = _n_groups(in_f, group_size)
        shapes = {"qweight": (in_f // PACK, out_f), "qzeros": (groups, out_f // PACK), "scales": (groups, out_f),
                  "g_idx": (in_f,)}
        if linear.bias is not None:
            shapes["bias"] = (out_f,)
        has_g_idx = f"{name}.g_idx" in checkpoint.keys()
        if not has_g_idx:
            if qc["desc_act"]:
                errors.append(f"{name}: desc_act is true but the checkpoint has no {name}.g_idx")
            del shapes["g_idx"]
        scales_key = f"{name}.scales"
        scales_dtype = torch.float16
        if scales_key in checkpoint.keys():
            scales_dtype = _ST_DTYPES.get(checkpoint.dtype(scales_key))
            if scales_dtype not in SCALE_DTYPES:
                errors.append(f"{scales_key}: dtype {checkpoint.dtype(scales_key)} is not fp16, bf16 or fp32")
                scales_dtype = torch.float16
        module = GPTQLinear(in_f, out_f, linear.bias is not None, group_size=group_size, zero_offset=zero_offset,
                            compute_dtype=dtype, scales_dtype=scales_dtype, device="meta")
        _replace(model, name, module)
        for key, shape in shapes.items():
            expected[f"{name}.{key}"] = shape

    # every other parameter and persistent buffer, each once (tied parameters under their first name)
    quantized = {n for n, _ in targets}
    for name, param in model.named_parameters(remove_duplicate=True):
        if name.rpartition(".")[0] not in quantized:
            expected[name] = tuple(param.shape)
    for module_name, module in model.named_modules():
        if isinstance(module, GPTQLinear):
            continue
        for buf_name, buf in module._buffers.items():
            if buf is not None and buf_name not in module._non_persistent_buffers_set:
                expected[f"{module_name}.{buf_name}" if module_name else buf_name] = tuple(buf.shape)

    keys = set(checkpoint.keys())
    missing = sorted(k for k in expected if k not in keys)
    unexpected = sorted(k for k in keys - expected.keys() if not k.endswith("rotary_emb.inv_freq"))
    mismatched = [f"{k}: checkpoint {checkpoint.shape(k)}, model expects {s}" for k, s in expected.items()
                  if k in keys and checkpoint.shape(k) != s]
    if missing:
        errors.append(f"missing tensors ({len(missing)}): {', '.join(missing[:12])}"
                      + (" ..." if len(missing) > 12 else ""))
    if unexpected:
        errors.append(f"tensors the model has no place for ({len(unexpected)}): {', '.join(unexpected[:12])}"
                      + (" ..." if len(unexpected) > 12 else ""))
    if mismatched:
        errors.append(f"shape mismatches (group_size={group_size}): " + "; ".join(mismatched[:12]))
    for key in expected:
        if key in keys and key.rpartition(".")[2] in ("qweight", "qzeros") and checkpoint.dtype(key) != "I32":
            errors.append(f"{key}: dtype {checkpoint.dtype(key)}, expected int32 (packed 4-bit values)")
        if key in keys and key.endswith(".g_idx") and key.rpartition(".")[0] in quantized \
                and checkpoint.dtype(key) not in ("I32", "I64"):
            errors.append(f"{key}: dtype {checkpoint.dtype(key)}, expected int32 or int64")
    if errors:
        raise ValueError(f"load_gptq: {path} does not match the model its config describes:\n  " + "\n  ".join(errors))

    # read the tensors
    modules = dict(model.named_modules())
    for key in expected:
        module_name, _, attr = key.rpartition(".")
        module = modules[module_name] if module_name else model
        tensor = checkpoint.get(key)
        if isinstance(module, GPTQLinear) and attr in PACKED_NAMES:
            if attr == "g_idx":
                tensor = tensor.to(torch.int32)
            setattr(module, attr, tensor.to(device))  # a frozen parameter (the scales: their bits)
        elif attr in module._parameters:
            old = module._parameters[attr]
            value = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            frozen = isinstance(module, GPTQLinear)  # the bias of a quantized layer
            module._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad and not frozen)
        else:
            value = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
            module._buffers[attr] = value
    for module in model.modules():
        if isinstance(module, GPTQLinear) and module.g_idx.device.type == "meta":  # no g_idx stored: plain
            module.g_idx = gptq_group_index(module.in_features, group_size, device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise ValueError(f"load_gptq: no tensor was loaded for {', '.join(still_meta[:12])}")
    model.to(device)
    for module in model.modules():
        if isinstance(module, GPTQLinear):
            module.weight_object()  # validates every layer's tensors now (g_idx range, shapes, dtypes)
    model.eval()
    return model
