"""``foak bench`` scenario files: the schema, its validation and the expansion into experiments.

```yaml
name: headline                       # names the results; default: the file's stem
description: the README's full fine-tuning table
models:                              # optional: built-in shapes (foak.bench.models) are usable by name
  mine: {path: ./my-llama}           # a local directory (relative to this file), or {hub: org/name};
                                     # init: pretrained (default) | random (config.json only, no weights)
  llama1b-4l: {builtin: llama1b, overrides: {num_hidden_layers: 4}}
frameworks:                          # the comparison axis: none (HF as is) | foak | liger, or a mapping
  - none
  - liger                            # skipped (recorded as such) when liger-kernel is not installed
  - foak                             # every kernel foak has for the model (foak.api.default_config)
  - {name: foak-norm, kind: foak, switches: {fast_rms_layernorm: true}}   # or config: foak.yaml
  - {name: mine, kind: python, callable: my_pkg.accel:apply, requires: [my_pkg]}   # any other peer:
                                     # fn(model, experiment) patches the model (skipped without my_pkg)
baseline: none                       # the framework the plots and ratios compare with (default: kind none)
defaults: {precision: bf16, warmup_steps: 3, timed_steps: 8}
sweeps:                              # each one: a value or a list per training argument; lists are swept
  - {model: llama1b, packing: [false, true]}
  - {model: llama8b-8l, batch_size: 2, gradient_checkpointing: [false, true]}
repeats: 1                           # runs of each experiment (its own process each); noise band from them
```

Training arguments (in ``defaults`` and in each sweep): model, frameworks (a subset of the names, for one
sweep), batch_size, seq_length (default: the built-in model's), packing, precision (bf16: bf16 weights |
fp32 | bf16-autocast: fp32 weights under bf16 autocast | fp16-autocast: with a GradScaler), peft (none | lora |
qlora-nf4 | gptq-lora), gradient_checkpointing, gpus, warmup_steps, timed_steps, seed, device (auto | cuda |
cpu), lora_r, lora_alpha, lora_dropout, target_modules, learning_rate, attn_implementation, env (variables for
the experiment's process), timeout_s. Every mistake is a ValueError naming the key's full path
(``sweeps[1].batch_sise``) and, for an unknown key, the closest valid one."""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import field_validator, model_validator

from foak.bench.models import BUILTIN_MODELS

PRECISIONS = ("bf16", "fp32", "bf16-autocast", "fp16-autocast")
PEFT_METHODS = ("none", "lora", "qlora-nf4", "gptq-lora")
FRAMEWORK_KINDS = ("none", "foak", "liger", "python")
DEVICES = ("auto", "cuda", "cpu")
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUNDLED_DIR = Path(__file__).resolve().parent / "scenarios"

# training arguments: name -> (default, what a value must be); the axes in the order they are expanded
ARGUMENTS: dict[str, tuple[Any, str]] = {
    "model": (None, "a model name (a built-in shape or a key of models)"),
    "batch_size": (None, "a positive integer"),
    "seq_length": (None, "a positive integer"),
    "packing": (False, "a boolean (true or false)"),
    "precision": ("bf16", "one of " + ", ".join(PRECISIONS)),
    "peft": ("none", "one of " + ", ".join(PEFT_METHODS)),
    "gradient_checkpointing": (False, "a boolean (true or false)"),
    "gpus": (1, "a positive integer"),
    "warmup_steps": (3, "a non-negative integer"),
    "timed_steps": (8, "a positive integer"),
    "seed": (0, "an integer"),
    "device": ("auto", "one of " + ", ".join(DEVICES)),
    "lora_r": (16, "a positive integer"),
    "lora_alpha": (16, "a positive number"),
    "lora_dropout": (0.0, "a number in [0, 1)"),
    "learning_rate": (1e-5, "a positive number"),
    "attn_implementation": ("sdpa", "a transformers attention implementation (sdpa, eager, flash_attention_2, ...)"),
}
# not swept (their value is itself a list / mapping, or a per-run limit)
PLAIN_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "frameworks": (None, "a list of framework names"),
    "target_modules": (DEFAULT_TARGETS, "a list of module names"),
    "env": ({}, "a mapping of environment variable names to strings"),
    "timeout_s": (1800, "a positive number of seconds"),
}
# the experiment's id names a non-axis argument when it differs from its default
ID_EXTRAS = ("lora_r", "lora_alpha", "lora_dropout", "warmup_steps", "timed_steps", "seed", "learning_rate",
             "attn_implementation")  # not the device: where a run was made is its environment, not its identity


def _check_keys(data: Any, valid: list[str]) -> None:
    """Unknown keys of a mapping: one line each, ``@key: ...`` (the location is prefixed by :func:`_message`),
    naming the closest valid key."""
    if not isinstance(data, Mapping):
        return
    errors = []
    for key in data:
        if key in valid:
            continue
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        errors.append(f"@{key}: unknown key; {hint}valid keys here: {', '.join(valid)}")
    if errors:
        raise ValueError("\n".join(errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    builtin: StrictStr | None = None
    path: StrictStr | None = None
    hub: StrictStr | None = None
    init: Literal["pretrained", "random"] = "pretrained"
    overrides: dict[StrictStr, Any] = {}
    batch_size: StrictInt | None = None
    seq_length: StrictInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data):
        if isinstance(data, str):  # `mine: ./dir` or `mine: org/name`
            return {"builtin": data} if data in BUILTIN_MODELS else {"path" if _looks_local(data) else "hub": data}
        _check_keys(data, list(cls.model_fields))
        return data

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("builtin", "path", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"needs exactly one of builtin, path or hub, got {', '.join(given) or 'none'}")
        if self.builtin is not None and self.builtin not in BUILTIN_MODELS:
            raise ValueError(f"builtin: unknown built-in model {self.builtin!r}; built-in models: "
                             f"{', '.join(BUILTIN_MODELS)}")
        return self

    def describe(self) -> str:
        if self.builtin is not None:
            return f"built-in {self.builtin}" + (f" with {self.overrides}" if self.overrides else "")
        return (self.path or self.hub) + (" (config only, random weights)" if self.init == "random" else "")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or os.path.exists(name)


class FrameworkSpec(_Strict):
    name: StrictStr
    kind: Literal["none", "foak", "liger", "python"] | None = None
    config: StrictStr | None = None          # foak: an acceleration YAML (relative to the scenario file)
    switches: dict[StrictStr, StrictBool] | None = None  # foak: keyword switches
    options: dict[StrictStr, Any] = {}       # liger: arguments of apply_liger_kernel_to_<model_type>
    callable: StrictStr | None = None        # python: "module:function", called as fn(model, experiment)
    requires: list[StrictStr] = []           # modules that must be importable, else the rows are "skipped"
    env: dict[StrictStr, StrictStr] = {}

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data):
        if isinstance(data, str):
            return {"name": data}
        _check_keys(data, list(cls.model_fields))
        return data

    @model_validator(mode="after")
    def _consistent(self):
        kind = self.kind or (self.name if self.name in FRAMEWORK_KINDS else None)
        if kind is None:
            raise ValueError(f"framework {self.name!r}: give its kind ({', '.join(FRAMEWORK_KINDS)}); a plain name "
                             f"must be one of {', '.join(k for k in FRAMEWORK_KINDS if k != 'python')}")
        object.__setattr__(self, "kind", kind)
        if kind == "python" and (self.callable is None or ":" not in self.callable):
            raise ValueError(f"framework {self.name!r} (kind python) needs callable: 'module:function'")
        if kind != "python" and self.callable is not None:
            raise ValueError(f"framework {self.name!r}: callable is for kind python only")
        if kind != "foak" and (self.config is not None or self.switches is not None):
            raise ValueError(f"framework {self.name!r}: config and switches are for kind foak only")
        if self.config is not None and self.switches is not None:
            raise ValueError(f"framework {self.name!r}: give config (a YAML) or switches, not both")
        if kind != "liger" and self.options:
            raise ValueError(f"framework {self.name!r}: options are for kind liger only")
        return self


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


class RunArgs(_Strict):
    """One sweep (or the defaults): every argument a list of values (a scalar is a list of one)."""

    model: list[StrictStr] | None = None
    batch_size: list[StrictInt] | None = None
    seq_length: list[StrictInt] | None = None
    packing: list[StrictBool] | None = None
    precision: list[Literal["bf16", "fp32", "bf16-autocast", "fp16-autocast"]] | None = None
    peft: list[Literal["none", "lora", "qlora-nf4", "gptq-lora"]] | None = None
    gradient_checkpointing: list[StrictBool] | None = None
    gpus: list[StrictInt] | None = None
    warmup_steps: list[StrictInt] | None = None
    timed_steps: list[StrictInt] | None = None
    seed: list[StrictInt] | None = None
    device: list[Literal["auto", "cuda", "cpu"]] | None = None
    lora_r: list[StrictInt] | None = None
    lora_alpha: list[StrictInt | StrictFloat] | None = None
    lora_dropout: list[StrictInt | StrictFloat] | None = None
    learning_rate: list[StrictInt | StrictFloat] | None = None
    attn_implementation: list[StrictStr] | None = None
    frameworks: list[StrictStr] | None = None
    target_modules: list[StrictStr] | None = None
    env: dict[StrictStr, StrictStr] | None = None
    timeout_s: StrictInt | StrictFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data):
        _check_keys(data, list(cls.model_fields))
        if isinstance(data, Mapping):
            data = {k: (_as_list(v) if k in ARGUMENTS or k in ("frameworks", "target_modules") else v)
                    for k, v in data.items()}
        return data

    @field_validator("batch_size", "seq_length", "gpus", "timed_steps", "lora_r")
    @classmethod
    def _positive(cls, values):
        bad = [v for v in values if v <= 0]
        if bad:
            raise ValueError(f"must be positive, got {bad[0]}")
        return values

    @field_validator("warmup_steps")
    @classmethod
    def _non_negative(cls, values):
        if any(v < 0 for v in values):
            raise ValueError(f"must be >= 0, got {min(values)}")
        return values

    @field_validator("lora_dropout")
    @classmethod
    def _probability(cls, values):
        bad = [v for v in values if not 0 <= v < 1]
        if bad:
            raise ValueError(f"must be in [0, 1), got {bad[0]}")
        return values

    @field_validator("learning_rate", "lora_alpha")
    @classmethod
    def _positive_number(cls, values):
        bad = [v for v in values if v <= 0]
        if bad:
            raise ValueError(f"must be positive, got {bad[0]}")
        return values

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, value):
        if value is not None and value <= 0:
            raise ValueError(f"must be positive, got {value}")
        return value

    def given(self) -> dict:
        return {k: getattr(self, k) for k in self.model_fields_set}


class Scenario(_Strict):
    name: StrictStr
    description: StrictStr = ""
    models: dict[StrictStr, ModelSpec] = {}
    frameworks: list[FrameworkSpec]
    baseline: StrictStr | None = None
    defaults: RunArgs = RunArgs()
    sweeps: list[RunArgs] = [RunArgs()]
    repeats: StrictInt = 1
    source: StrictStr | None = None  # the file it was read from (set by load_scenario)

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data):
        _check_keys(data, [k for k in cls.model_fields if k != "source"])
        return data

    @field_validator("frameworks")
    @classmethod
    def _frameworks(cls, values):
        if not values:
            raise ValueError("needs at least one framework")
        names = [f.name for f in values]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"framework names must be unique, {', '.join(dupes)} repeated")
        return values

    @field_validator("sweeps")
    @classmethod
    def _sweeps(cls, values):
        if not values:
            raise ValueError("needs at least one sweep (or leave sweeps out: the defaults alone are one)")
        return values

    @field_validator("repeats")
    @classmethod
    def _repeats(cls, value):
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _references(self):
        names = [f.name for f in self.frameworks]
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline: {self.baseline!r} is not one of the frameworks ({', '.join(names)})")
        for where, args in [("defaults", self.defaults)] + [(f"sweeps[{i}]", s) for i, s in enumerate(self.sweeps)]:
            for fw in args.frameworks or []:
                if fw not in names:
                    raise ValueError(f"{where}.frameworks: {fw!r} is not one of the frameworks ({', '.join(names)})")
            for model in args.model or []:
                if model not in self.models and model not in BUILTIN_MODELS:
                    close = difflib.get_close_matches(model, [*self.models, *BUILTIN_MODELS], n=1)
                    hint = f"did you mean {close[0]!r}? " if close else ""
                    raise ValueError(f"{where}.model: unknown model {model!r}; {hint}models: "
                                     f"{', '.join([*self.models, *BUILTIN_MODELS])} (built-in or under models:)")
        return self

    @property
    def baseline_name(self) -> str | None:
        if self.baseline is not None:
            return self.baseline
        return next((f.name for f in self.frameworks if f.kind == "none"), None)

    def framework(self, name: str) -> FrameworkSpec:
        return next(f for f in self.frameworks if f.name == name)


# ---- validation messages -----------------------------------------------------------------------------------
def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _clean_loc(loc: tuple) -> tuple:
    """Pydantic's location without its union / literal branch tags, and without the index of a value that was
    a scalar in the file (RunArgs wraps scalars in lists)."""
    return tuple(p for p in loc if not (isinstance(p, str) and (p.startswith(("function-", "literal[", "list[",
                                                                              "dict[", "json-or-python"))
                                                                 or p in ("str", "int", "float", "bool",
                                                                          "StrictStr", "StrictInt", "StrictFloat",
                                                                          "StrictBool", "none", "FrameworkSpec",
                                                                          "ModelSpec"))))


def _expected(loc: tuple) -> str | None:
    names = [p for p in loc if isinstance(p, str)]
    for name in reversed(names):
        if name in ARGUMENTS:
            return ARGUMENTS[name][1]
        if name in PLAIN_ARGUMENTS:
            return PLAIN_ARGUMENTS[name][1]
    return None


def _scalar_index(loc: tuple, data: Any) -> tuple:
    """``loc`` without the list indices of values that the file gave as scalars (RunArgs wraps those)."""
    out, node = [], data
    for part in loc:
        if isinstance(part, int) and not isinstance(node, list):
            continue
        out.append(part)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return tuple(out)


def _message(err: ValidationError, data: Any) -> str:
    lines, seen = [], set()
    for e in err.errors():
        loc = _scalar_index(_clean_loc(e["loc"]), data)
        where = _path(loc)
        if e["type"] == "value_error":
            texts = str(e["ctx"]["error"]).splitlines()
            found = []
            for text in texts:
                if text.startswith("@"):  # an unknown key: its own path
                    found.append((f"{where}." if where else "") + text[1:])
                else:
                    found.append(text if not where or text.startswith(where) else f"{where}: {text}")
        else:
            expected = _expected(loc)
            value = e.get("input")
            got = f"got {'null' if value is None else type(value).__name__} {value!r}"
            if e["type"] == "missing":
                found = [f"{where}: required key missing"]
            elif expected is not None:
                found = [f"{where}: expected {expected}, {got}"]
            else:
                found = [f"{where}: {e['msg'][0].lower() + e['msg'][1:]}, {got}"]
        for line in found:
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return "\n".join(lines)


def parse_scenario(data: Any, origin: str = "the scenario", base_dir: Path | None = None,
                   name: str | None = None) -> Scenario:
    """A :class:`Scenario` from parsed YAML; ValueError (``origin: key.path: what is wrong``) otherwise.
    ``base_dir``: where relative paths (model directories, foak YAMLs) are resolved."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{origin} must be a mapping (name, frameworks, sweeps, ...), got {type(data).__name__}")
    data = dict(data)
    if "name" not in data and name is not None:
        data["name"] = name
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        raise ValueError(f"{origin}: " + _message(err, data).replace("\n", f"\n{origin}: ")) from None
    base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    # relative paths resolved against the scenario file; files that must exist checked now
    models = {}
    for key, spec in scenario.models.items():
        if spec.path is not None:
            path = Path(os.path.expanduser(spec.path))
            path = path if path.is_absolute() else (base_dir / path)
            if not path.is_dir():
                raise ValueError(f"{origin}: models.{key}.path: {spec.path!r} is not a directory (looked for {path}; "
                                 "a relative path is relative to the scenario file)")
            spec = spec.model_copy(update={"path": str(path.resolve())})
        models[key] = spec
    frameworks = []
    for fw in scenario.frameworks:
        if fw.config is not None:
            path = Path(os.path.expanduser(fw.config))
            path = path if path.is_absolute() else (base_dir / path)
            if not path.is_file():
                raise ValueError(f"{origin}: frameworks: {fw.name!r}: config {fw.config!r} is not a file "
                                 f"(looked for {path})")
            from foak.config import load_config

            try:
                load_config(path)
            except ValueError as e:
                raise ValueError(f"{origin}: frameworks: {fw.name!r}: config {fw.config!r}: {e}") from None
            fw = fw.model_copy(update={"config": str(path.resolve())})
        if fw.switches is not None:
            from foak.config import SWITCH_TO_RULE

            unknown = [s for s in fw.switches if s not in SWITCH_TO_RULE]
            if unknown:
                close = difflib.get_close_matches(unknown[0], list(SWITCH_TO_RULE), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"{origin}: frameworks: {fw.name!r}: switches: unknown switch {unknown[0]!r}; {hint}"
                                 f"switches: {', '.join(SWITCH_TO_RULE)}")
        frameworks.append(fw)
    return scenario.model_copy(update={"models": models, "frameworks": frameworks})


def bundled_scenarios() -> dict[str, Path]:
    """The scenario files that come with foak, by name (file stem)."""
    return {p.stem: p for p in sorted(BUNDLED_DIR.glob("*.yaml"))}


def load_scenario(source: str | os.PathLike | Mapping) -> Scenario:
    """A scenario from a YAML file, the name of a bundled one (:func:`bundled_scenarios`) or a parsed dict."""
    if isinstance(source, Mapping):
        return parse_scenario(source)
    path = Path(source)
    if not path.is_file():
        bundled = bundled_scenarios()
        if str(source) in bundled:
            path = bundled[str(source)]
        else:
            raise ValueError(f"no scenario file {str(source)!r} (and no bundled scenario of that name; bundled: "
                             f"{', '.join(bundled)})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"scenario file {str(path)!r} is not valid YAML: {err}") from None
    if data is None:
        raise ValueError(f"scenario file {str(path)!r} is empty")
    scenario = parse_scenario(data, f"scenario file {str(path)!r}", base_dir=path.resolve().parent, name=path.stem)
    return scenario.model_copy(update={"source": str(path)})


# ---- expansion ---------------------------------------------------------------------------------------------
def experiment_id(exp: dict) -> str:
    """A stable, readable key of an experiment (what ``foak bench compare`` matches rows by)."""
    parts = [exp["model"]]
    if exp["peft"] != "none":
        parts.append(exp["peft"])
    parts.append(f"b{exp['batch_size']}xs{exp['seq_length']}")
    parts.append(exp["precision"])
    if exp["packing"]:
        parts.append("packed")
    if exp["gradient_checkpointing"]:
        parts.append("ckpt")
    if exp["gpus"] != 1:
        parts.append(f"{exp['gpus']}gpu")
    for key in ID_EXTRAS:
        if exp[key] != ARGUMENTS[key][0]:
            parts.append(f"{key}={exp[key]}")
    if exp["target_modules"] != DEFAULT_TARGETS and exp["peft"] != "none":
        parts.append("targets=" + "+".join(exp["target_modules"]))
    return "/".join(map(str, parts))


def framework_unavailable(fw: FrameworkSpec) -> str | None:
    """Why a framework cannot run here (a module it requires is not installed), or None. liger requires
    liger_kernel; any framework may list more modules under ``requires``."""
    needed = (["liger_kernel"] if fw.kind == "liger" else []) + list(fw.requires)
    for module in needed:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            package = "liger-kernel" if module == "liger_kernel" else module
            return f"{package} is not installed (framework {fw.name!r} requires it)"
    return None


def expand(scenario: Scenario) -> list[dict]:
    """Every experiment of the scenario, in order: sweep by sweep, the product of its list-valued arguments
    (in the order of ARGUMENTS), each point once per framework. An experiment is a plain dict (JSON-able)."""
    defaults = scenario.defaults.given()
    experiments, seen = [], {}
    for index, sweep in enumerate(scenario.sweeps):
        where = f"sweeps[{index}]"
        merged = {**defaults, **sweep.given()}
        if "model" not in merged:
            raise ValueError(f"{where}: no model (set model in this sweep or in defaults)")
        frameworks = merged.pop("frameworks", None) or [f.name for f in scenario.frameworks]
        plain = {k: merged.pop(k, PLAIN_ARGUMENTS[k][0]) for k in ("target_modules", "env", "timeout_s")}
        axes = [k for k in ARGUMENTS if k in merged]
        for combo in itertools.product(*(merged[k] for k in axes)):
            point = {k: ARGUMENTS[k][0] for k in ARGUMENTS}
            point.update(dict(zip(axes, combo)))
            spec = scenario.models.get(point["model"]) or ModelSpec(builtin=point["model"])
            builtin = BUILTIN_MODELS.get(spec.builtin) if spec.builtin else None
            for key in ("batch_size", "seq_length"):
                if point[key] is None:
                    point[key] = getattr(spec, key) or (getattr(builtin, key) if builtin else None)
                    if point[key] is None:
                        raise ValueError(f"{where}: {key} is required for model {point['model']!r} (only built-in "
                                         "models have a default)")
            point.update(plain)
            point["target_modules"] = list(point["target_modules"])
            point["model_spec"] = spec.model_dump()
            for name in frameworks:
                fw = scenario.framework(name)
                exp = {"scenario": scenario.name, "framework": name, **point, "framework_spec": fw.model_dump()}
                exp["env"] = {**point["env"], **fw.env}
                exp["experiment"] = experiment_id(exp) + "/" + name
                exp["point"] = experiment_id(exp)
                if exp["experiment"] in seen:
                    raise ValueError(f"{where} repeats experiment {exp['experiment']} of {seen[exp['experiment']]}")
                seen[exp["experiment"]] = where
                experiments.append(exp)
    return experiments
