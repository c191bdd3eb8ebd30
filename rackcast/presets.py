"""Model presets: YAML files in rackcast/model_presets/, one model each, named by file.

    load_model("marin-535b-a23b")          # a preset by name
    load_model("path/to/my-model.yaml")    # or any YAML file holding a ModelSpec
    list_models()                          # preset names, sorted
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.strict import from_data, load_yaml

MODEL_PRESET_DIR = Path(__file__).parent / "model_presets"


def list_models() -> list[str]:
    return sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def _load_file(path: str) -> ModelSpec:
    return from_data(ModelSpec, load_yaml(path), where=path)


def load_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a preset name or a YAML path; unknown names list the presets."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.exists():
        return _load_file(str(candidate))
    preset = MODEL_PRESET_DIR / f"{name_or_path}.yaml"
    if not preset.exists():
        raise RackcastError(f"unknown model preset {name_or_path!r} (known: {', '.join(list_models())})")
    return _load_file(str(preset))
