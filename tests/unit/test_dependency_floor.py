"""The node's dependency floor: pyproject.toml's `node` ranges against the stacks they must admit and the APIs
the package really uses.

The floors are the GPU machine's stack (../shared/notes/gpu-machine.md: Python 3.12.3, torch 2.11.0+cu130,
transformers 5.17.0, safetensors 0.8.0). A floor is only honest if the code uses nothing newer, so:

- every ``torch.X`` the package names (an AST scan of include/eagleflow with import aliases resolved, plus
  ``-m torch.X`` module strings) must be in TORCH_APIS with a version that has it, no newer than the floor,
  and must resolve in the installed torch. Tensor methods (``x.view``) are not scanned;
- every name taken from transformers, and every keyword given to ``apply_chat_template``, ``from_pretrained``
  and ``LlamaConfig``, must be one transformers 5.17.0 has (measured: ``dir(transformers)`` and
  ``inspect.signature`` with 5.17.0 installed beside this venv's torch). ``apply_chat_template`` passes an
  unknown keyword to the template as a variable, so a newer keyword would be ignored there, not refused;
- LATE_APIS, named APIs absent from the floor versions (facts cited), must not appear at all.

A use this table does not know fails the test: add it with the version that introduced it, or raise the floor.
"""
from __future__ import annotations

import ast
import inspect
import pkgutil
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "include" / "eagleflow"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# Stacks the ranges must admit. The GPU machine: ../shared/notes/gpu-machine.md. sglang 0.5.23's own
# (requirements-node.txt installs it into .venv-node): torch 2.14.1, transformers 5.19.0.
GPU_MACHINE = {"python": "3.12.3", "torch": "2.11.0", "transformers": "5.17.0", "safetensors": "0.8.0"}
SGLANG_0_5_23 = {"torch": "2.14.1", "transformers": "5.19.0"}

# Every torch API the package names, with a version that has it. "2.0": in torch 2.0's API reference;
# scaled_dot_product_attention is new in 2.0 (PyTorch 2.0 release notes), the others are older.
_IN_2_0 = """Generator Tensor arange autocast bfloat16 bincount bool cat cuda.get_rng_state cuda.is_available
    cuda.is_initialized cuda.set_device cuda.set_rng_state device distributed.all_reduce distributed.barrier
    distributed.init_process_group distributed.is_initialized distributed.run dtype eye finfo float16 float32 float64
    full get_num_threads get_rng_state inference_mode int64 is_tensor long manual_seed nn nn.Embedding nn.Linear
    nn.Module nn.Parameter nn.functional nn.functional.log_softmax nn.functional.scaled_dot_product_attention
    nn.functional.silu nn.parallel.DistributedDataParallel nn.utils.clip_grad_norm_ no_grad ones optim.AdamW
    optim.Optimizer randint rsqrt set_num_threads set_rng_state softmax sort stack tensor uint8 where zeros
    zeros_like"""
TORCH_APIS = {f"torch.{name}": "2.0" for name in _IN_2_0.split()}
# sampling in the hf server's serving mode, the FP8 store's scales, its packed integer columns
TORCH_APIS.update({f"torch.{name}": "2.0" for name in "cumsum empty full_like int8 int16 int32 isfinite multinomial "
                   "ones_like".split()})
TORCH_APIS["torch.float8_e4m3fn"] = "2.1"   # PyTorch 2.1 release notes: float8_e4m3fn and float8_e5m2 dtypes
TORCH_APIS["torch.from_numpy"] = "2.0"      # the training reader's reused host buffers (in torch 2.0's API reference)
TORCH_APIS["torch.frombuffer"] = "2.0"      # a RawTensor's bytes as a tensor (in torch 2.0's API reference; since 1.10)
TORCH_APIS["torch.randperm"] = "2.0"       # the learnable target's block order (in torch 2.0's API reference)
# the training step's fast path (train.fast_step, train.compile): in torch 2.0's API reference; torch.compile is new
# in 2.0 (PyTorch 2.0 release notes)
TORCH_APIS.update({f"torch.{name}": "2.0" for name in "autograd.Function baddbmm compile empty_like is_grad_enabled".split()})
# is_autocast_enabled(device_type) and get_autocast_dtype(device_type): new in 2.4 (PyTorch 2.4 release notes:
# the device-generic autocast API)
TORCH_APIS.update({"torch.is_autocast_enabled": "2.4", "torch.get_autocast_dtype": "2.4"})

# Measured with transformers 5.17.0 (wheel from PyPI installed beside this venv's torch 2.13.0).
TRANSFORMERS_NAMES_5_17 = {"AutoModelForCausalLM", "AutoTokenizer", "DynamicCache", "LlamaConfig", "LlamaForCausalLM",
                           "PreTrainedTokenizerFast", "__version__"}
TRANSFORMERS_KEYWORDS_5_17 = {
    # inspect.signature(PreTrainedTokenizerBase.apply_chat_template), 5.17.0
    "apply_chat_template": {"add_generation_prompt", "chat_template", "continue_final_message", "conversation",
                            "documents", "max_length", "padding", "return_assistant_tokens_mask", "return_dict",
                            "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation"},
    # from_pretrained(**kwargs): dtype replaced torch_dtype in 4.56.0 (huggingface/transformers#39782)
    "from_pretrained": {"dtype"},
    # inspect.signature(DynamicCache.__init__), 5.17.0 (its crop() is there too)
    "DynamicCache": {"ddp_cache_data", "config", "offloading", "offload_only_non_sliding"},
    # inspect.signature(LlamaConfig.__init__), 5.17.0, plus torch_dtype, which PretrainedConfig.__init__ still
    # maps onto dtype there (configuration_utils.py, "BC for the `torch_dtype` argument")
    "LlamaConfig": {"attention_bias", "attention_dropout", "bos_token_id", "dtype", "eos_token_id", "head_dim",
                    "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
                    "mlp_bias", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id",
                    "pretraining_tp", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "use_cache",
                    "vocab_size", "torch_dtype"},
}

# Named APIs absent from the floor versions: (package, version that introduced it, what, the source).
LATE_APIS = [
    ("torch", "2.12", "torch.accelerator.Graph", "PyTorch 2.12 release blog: new device-agnostic graph capture API"),
    ("torch", "2.12", "torch.optim.Adagrad(fused=...)", "PyTorch 2.12 release blog: Adagrad gains fused=True"),
    ("torch", "2.12", ".is_capturing()", "PyTorch 2.12 release blog: torch.Stream.is_capturing()"),
    ("transformers", "5.20.0", "apply_chat_template(sanitize_control_tokens=...)",
     "absent from tokenization_utils_base.py in the 5.17.0, 5.18.0 and 5.19.0 wheels, present in 5.20.0"),
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _ranges() -> dict[str, SpecifierSet]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["node"]]
    return {_norm(r.name): r.specifier for r in reqs}


def _floor(spec: SpecifierSet) -> Version:
    floors = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert floors, f"pyproject.toml states no lower bound in {spec!s}"
    return max(floors)


# --- what the code uses -----------------------------------------------------------------------------------

def _aliases(tree: ast.AST, pkg: str) -> dict[str, str]:
    """Local name -> dotted path, for every import of ``pkg`` in a module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == pkg or a.name.startswith(pkg + "."):
                    out[a.asname or pkg] = a.name if a.asname else pkg
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == pkg or node.module.startswith(pkg + ".")):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def uses(source: str, pkg: str) -> tuple[set[str], list[tuple[str, set[str]]]]:
    """(dotted paths of ``pkg`` named in ``source``, [(callee name, keywords)] for every call)."""
    tree = ast.parse(source)
    alias = _aliases(tree, pkg)
    parent = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    paths = set(alias.values())
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(parent.get(node), ast.Attribute):
            chain, n = [], node
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id in alias:
                paths.add(".".join([alias[n.id], *reversed(chain)]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                re.fullmatch(rf"{pkg}(\.\w+)+", node.value):
            paths.add(node.value)        # `python -m torch.distributed.run`
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name:
                calls.append((name, {k.arg for k in node.keywords if k.arg}))
    return paths, calls


def _package_uses(pkg: str) -> tuple[dict[str, set[str]], list[tuple[str, set[str], str]]]:
    paths: dict[str, set[str]] = {}
    calls = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = str(f.relative_to(REPO))
        p, c = uses(f.read_text(), pkg)
        for path in p:
            paths.setdefault(path, set()).add(rel)
        calls += [(name, kw, rel) for name, kw in c]
    return paths, calls


def torch_problems(paths: dict[str, set[str]], calls, floor: Version) -> list[str]:
    out = []
    for path, files in sorted(paths.items()):
        if path == "torch":
            continue
        if path not in TORCH_APIS:
            out.append(f"{path} (in {', '.join(sorted(files))}) is not in TORCH_APIS: add it with the torch "
                       "version that introduced it, or stop using it")
        elif Version(TORCH_APIS[path]) > floor:
            out.append(f"{path} needs torch {TORCH_APIS[path]}, above the stated floor {floor}")
    if "torch.accelerator.Graph" in paths:
        out.append("torch.accelerator.Graph is new in torch 2.12")
    for name, kws, where in calls:
        if name == "Adagrad" and "fused" in kws:
            out.append(f"{where}: torch.optim.Adagrad(fused=...) is new in torch 2.12")
        if name == "is_capturing":
            out.append(f"{where}: Stream.is_capturing() is new in torch 2.12")
    return out


def transformers_problems(paths: dict[str, set[str]], calls) -> list[str]:
    out = []
    for path, files in sorted(paths.items()):
        if path == "transformers":
            continue
        name, _, attr = path.removeprefix("transformers.").partition(".")
        if name not in TRANSFORMERS_NAMES_5_17 or attr not in ("", "from_pretrained"):
            out.append(f"{path} (in {', '.join(sorted(files))}) is not a transformers name known in 5.17.0: "
                       "check it there and add it to TRANSFORMERS_NAMES_5_17, or raise the floor")
    for name, kws, where in calls:
        if name in TRANSFORMERS_KEYWORDS_5_17:
            extra = kws - TRANSFORMERS_KEYWORDS_5_17[name]
            if extra:
                out.append(f"{where}: {name}({', '.join(sorted(extra))}=...) is not a keyword transformers 5.17.0 "
                           "takes")
    return out


# --- the tests ---------------------------------------------------------------------------------------------

def test_the_ranges_admit_the_gpu_machine_and_sglangs_stack():
    ranges = _ranges()
    assert SpecifierSet(PROJECT["requires-python"]).contains(GPU_MACHINE["python"])
    for stack in (GPU_MACHINE, SGLANG_0_5_23):
        for name, version in stack.items():
            if name != "python":
                assert ranges[name].contains(version), f"pyproject.toml's {name}{ranges[name]} refuses {version}"
    # the floors are that machine's versions, not the newest ones tested here
    assert _floor(ranges["torch"]) == Version("2.11") and _floor(ranges["transformers"]) == Version("5.17")
    assert "pydantic" in ranges    # eagleflow.config needs it; the GPU machine gets it as a carried wheel


def test_the_installed_versions_satisfy_the_ranges():
    for name, spec in _ranges().items():
        have = metadata.version(name).split("+")[0]        # torch 2.13.0+cpu
        assert spec.contains(have, prereleases=True), f"installed {name} {have} is outside pyproject's {spec}"


def test_the_torch_the_code_uses_is_in_the_floor():
    paths, calls = _package_uses("torch")
    assert "torch.nn.functional.scaled_dot_product_attention" in paths and "torch.distributed.run" in paths
    assert torch_problems(paths, calls, _floor(_ranges()["torch"])) == []
    for path in paths:      # the table is about this torch too: nothing it lists has gone
        pkgutil.resolve_name(path)


def test_the_transformers_the_code_uses_is_in_the_floor():
    from transformers import DynamicCache, LlamaConfig
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    paths, calls = _package_uses("transformers")
    assert "transformers.AutoModelForCausalLM.from_pretrained" in paths
    assert any(name == "apply_chat_template" and "return_assistant_tokens_mask" in kw for name, kw, _ in calls)
    assert transformers_problems(paths, calls) == []
    assert Version("4.56.0") <= _floor(_ranges()["transformers"])    # from_pretrained(dtype=...)
    # the 5.17.0 facts still hold in the installed transformers (nothing used was removed since)
    have = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    assert TRANSFORMERS_KEYWORDS_5_17["apply_chat_template"] <= have
    assert TRANSFORMERS_KEYWORDS_5_17["LlamaConfig"] - {"torch_dtype"} <= set(inspect.signature(LlamaConfig).parameters)
    assert TRANSFORMERS_KEYWORDS_5_17["DynamicCache"] <= set(inspect.signature(DynamicCache).parameters)
    assert callable(DynamicCache.crop)      # evaluate/decoder.py crops the target's cache after each verify


def test_late_apis_are_newer_than_the_floors():
    ranges = _ranges()
    for pkg, since, what, source in LATE_APIS:
        assert Version(since) > _floor(ranges[pkg]), f"{what} ({source}) is within {pkg}'s floor: drop it here"
    assert "sanitize_control_tokens" not in TRANSFORMERS_KEYWORDS_5_17["apply_chat_template"]


@pytest.mark.parametrize("source, found", [
    ("import torch\ng = torch.accelerator.Graph()", "torch.accelerator.Graph is new in torch 2.12"),
    ("import torch\nopt = torch.optim.Adagrad(ps, fused=True)", "Adagrad(fused=...) is new in torch 2.12"),
    ("import torch\ns = torch.cuda.current_stream()\ns.is_capturing()", "is_capturing() is new in torch 2.12"),
    ("from torch import nn\nx = nn.attention.varlen_attn", "torch.nn.attention.varlen_attn (in x.py) is not in"),
])
def test_the_torch_check_catches_a_late_api(source, found):
    paths, calls = uses(source, "torch")
    problems = torch_problems({p: {"x.py"} for p in paths}, [(n, k, "x.py") for n, k in calls], Version("2.11"))
    assert any(found in p for p in problems), problems


@pytest.mark.parametrize("source, found", [
    ("def f(tok, m):\n    return tok.apply_chat_template(m, sanitize_control_tokens=True)",
     "apply_chat_template(sanitize_control_tokens=...) is not a keyword transformers 5.17.0 takes"),
    ("from transformers import Dots3NoteForCausalLM", "transformers.Dots3NoteForCausalLM (in x.py) is not"),
])
def test_the_transformers_check_catches_a_late_api(source, found):
    paths, calls = uses(source, "transformers")
    problems = transformers_problems({p: {"x.py"} for p in paths}, [(n, k, "x.py") for n, k in calls])
    assert any(found in p for p in problems), problems
