"""Reading LoRA adapters from disk: our own .safetensors files (service.model.lora.Adapter.save) and Hugging Face
PEFT's directories (adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them).

load_adapter(path) reads either kind; the engine core and every tensor-parallel rank read an adapter through it, from
the path kept in Adapter.source. A PEFT adapter becomes an Adapter of our module names, whose update is PEFT's:
(lora_alpha / r) * B A x, or (lora_alpha / sqrt(r)) * B A x with use_rslora, with each module's own rank
(rank_pattern). What PEFT can express but we cannot serve (DoRA, biases, embedding or LM-head targets, fully trained
modules_to_save, a lora_alpha per module) is refused with a message naming it, never served as something else.
"""
import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from service.model.fingerprint import describe
from service.model.lora import TARGETS, Adapter, AdapterMismatch, LoRAConfig, saved_base

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.<our module name>.lora_A.weight; some PEFT versions keep the adapter's name: lora_A.default.weight
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
# Options that change what the adapter computes beyond B A x, with the values that leave it plain LoRA.
_PLAIN = {"use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False, "modules_to_save": None,
          "layer_replication": None, "trainable_token_indices": None, "target_parameters": None,
          "alora_invocation_tokens": None}


class AdapterFileError(ValueError):
    """The path holds no adapter that can be served; the message says what is wrong with it."""


class AdapterNotFound(AdapterFileError):
    """Nothing at the path."""


def load_adapter(path, device, dtype, base: dict | None = None) -> Adapter:
    """The adapter at path: a PEFT directory, or one of our .safetensors files. AdapterFileError if it is neither.
    base: the fingerprint of the model it is for (service.model.fingerprint); one of our files made for another is
    refused (AdapterMismatch) before its tensors load. A PEFT adapter names its base only (base_model_name_or_path):
    add_adapter's check of its shapes is what refuses one made for another model."""
    p = Path(path)
    if not p.exists():
        raise AdapterNotFound(f"No adapter found for {path}: no such file or directory")
    if p.is_dir():
        return load_peft(p, device, dtype)
    try:
        made_for = saved_base(p)
        if base is not None and made_for is not None and made_for != base:
            raise AdapterMismatch(f"its base model is {describe(made_for)}; this server's is {describe(base)}")
        return Adapter.load(p, device, dtype)
    except AdapterMismatch:
        raise
    except SafetensorError as e:
        raise AdapterFileError(f"{path} is not a safetensors file ({e})") from None
    except OSError as e:  # unreadable: permissions, say
        raise AdapterFileError(f"{path} cannot be read ({e})") from None
    except (TypeError, KeyError, ValueError) as e:  # no metadata, none of ours, or a broken one
        raise AdapterFileError(f"{path} is a safetensors file but not one of our adapters ({type(e).__name__}: {e}); "
                               "a PEFT adapter is loaded from its directory") from None


def peft_base_model(path) -> str | None:
    """The base model a PEFT adapter names (base_model_name_or_path), for messages; None for our files."""
    try:
        return json.loads((Path(path) / CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None


def load_peft(directory, device, dtype) -> Adapter:
    """A PEFT LoRA adapter's directory as an Adapter (source: the directory). Modules of different ranks
    (rank_pattern) are zero-padded to the largest, their scale folded into B: the update is unchanged."""
    directory = Path(directory)
    config = _read_config(directory)
    weights = directory / WEIGHTS
    if not weights.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        raise AdapterFileError(f"{directory} has no {WEIGHTS}" + (
            " (only adapter_model.bin, a pickle, which is never loaded: save the adapter with "
            "safe_serialization=True)" if pickled else ""))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt", device=str(device)) as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise AdapterFileError(f"{weights}: tensor {key!r} is not a LoRA A or B weight; only LoRA on "
                                           f"{', '.join(TARGETS)} is served")
                if m["module"].rsplit(".", 1)[-1] not in TARGETS:
                    raise AdapterFileError(f"{weights}: tensor {key!r} adapts {m['module']}; only LoRA on "
                                           f"{', '.join(TARGETS)} is served")
                pairs.setdefault(m["module"], {})[m["which"]] = f.get_tensor(key).float()
    except (SafetensorError, OSError) as e:
        raise AdapterFileError(f"{weights} cannot be read as safetensors ({e})") from None
    if not pairs:
        raise AdapterFileError(f"{weights} holds no LoRA weights")
    ranks = {}
    for module, ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            shapes = {k: list(t.shape) for k, t in ab.items()}
            raise AdapterFileError(f"{weights}: {module} needs lora_A [r, in] and lora_B [out, r], got {shapes}")
        ranks[module] = a.shape[0]
    r, allowed = config["r"], {config["r"], *config["rank_pattern"].values()}
    if not set(ranks.values()) <= allowed:
        module = next(m for m, rank in ranks.items() if rank not in allowed)
        raise AdapterFileError(f"{weights}: {module} has rank {ranks[module]}, but adapter_config.json says r={r}"
                               + (f" and rank_pattern {config['rank_pattern']}" if config["rank_pattern"] else ""))

    def scale(rank: int) -> float:
        return config["lora_alpha"] / (math.sqrt(rank) if config["use_rslora"] else rank)

    top = max(ranks.values())
    out = {}
    for module, ab in pairs.items():
        a, b, rank = ab["A"], ab["B"], ranks[module]
        if rank < top:
            a = torch.cat([a, a.new_zeros(top - rank, a.shape[1])])
            b = torch.cat([b * (scale(rank) / scale(top)), b.new_zeros(b.shape[0], top - rank)], dim=1)
        out[module] = (a.to(dtype), b.to(dtype))
    # Our scale is alpha / rank: rsLoRA's alpha / sqrt(rank) is that with alpha * sqrt(rank).
    alpha = config["lora_alpha"] * (math.sqrt(top) if config["use_rslora"] else 1.0)
    targets = sorted({module.rsplit(".", 1)[-1] for module in out})
    try:
        lora = LoRAConfig(rank=top, alpha=alpha, targets=targets)
    except ValueError as e:
        raise AdapterFileError(f"{directory}: {e}") from None
    return Adapter(lora, out, str(directory))


def _read_config(directory: Path) -> dict:
    """adapter_config.json, checked to describe plain LoRA on the projections we serve."""
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterFileError(f"{directory} is not a PEFT adapter: it has no {CONFIG}") from None
    except (OSError, ValueError) as e:
        raise AdapterFileError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterFileError(f"{path} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterFileError(f"{path}: peft_type {config['peft_type']!r} is not served; only LoRA adapters are")
    for option, plain in _PLAIN.items():
        value = config.get(option, plain)
        if value != plain and (value or plain):  # where the plain value is None or False, any empty one is too
            raise AdapterFileError(f"{path}: {option}={json.dumps(value)} is not supported (only plain LoRA on "
                                   f"{', '.join(TARGETS)} is served)")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regular expression (or "all-linear"): the tensors tell
        other = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
        if other:
            raise AdapterFileError(f"{path}: target_modules {other} are not served; only LoRA on "
                                   f"{', '.join(TARGETS)} is")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r < 1 or type(alpha) not in (int, float) or not alpha > 0:
        raise AdapterFileError(f"{path}: needs an integer r >= 1 and a positive lora_alpha, got r={r!r}, "
                               f"lora_alpha={alpha!r}")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(type(v) is int and v >= 1 for v in rank_pattern.values()):
        raise AdapterFileError(f"{path}: rank_pattern must map module names to ranks >= 1")
    # The ranks of a rank_pattern are in the tensors' shapes; its alphas would need PEFT's name matching.
    if not isinstance(alpha_pattern, dict) or any(v != alpha for v in alpha_pattern.values()):
        raise AdapterFileError(f"{path}: alpha_pattern {alpha_pattern} is not supported (a lora_alpha per module)")
    return {"r": r, "lora_alpha": float(alpha), "use_rslora": bool(config.get("use_rslora")),
            "rank_pattern": rank_pattern}
