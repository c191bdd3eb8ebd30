"""Model presets: YAML files in rackcast/model_presets/, one model each, named by file.

    load_model("marin-535b-a23b")          # a preset by name
    load_model("path/to/my-model.yaml")    # or any YAML file holding a ModelSpec
    list_models()                          # preset names, sorted
"""

from __future__ import annotations

from pathlib import Path

from rackcast.modelspec import ModelSpec
from rackcast.strict import load_preset, preset_names

MODEL_PRESET_DIR = Path(__file__).parent / "model_presets"


def list_models() -> list[str]:
    return preset_names(MODEL_PRESET_DIR)


def load_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec from a preset name or a YAML path; unknown names list the presets."""
    return load_preset(ModelSpec, MODEL_PRESET_DIR, name_or_path, "model preset")
