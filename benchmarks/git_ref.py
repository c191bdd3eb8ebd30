"""Load one self-contained module of this repository as it was at a git ref, so a benchmark can time the previous
implementation beside the current one in the same process (same machine load, same inputs).

    old = load_module_at("main", "planner/forecast_sim.py")

The module is written to a private temporary folder (numba's on-disk cache sits beside it) and imported under a
name of its own; it may import installed rackcast modules, which are the current ones.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_module_at(ref: str, path: str) -> ModuleType:
    """The module at `path` (relative to the repository root) as of git `ref`."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    tag = hashlib.sha256(f"{ref}:{path}".encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"rackcast-ref-{tag}"
    folder.mkdir(exist_ok=True)
    name = f"ref_{tag}_{Path(path).stem}"
    file = folder / f"{name}.py"
    if not file.exists() or file.read_text() != source:
        file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Top-level folders of the repository and the rackcast package each installs as (pyproject.toml package-dir).
PACKAGE_DIRS = {"topologies": "topologies", "simulator": "simulator", "planner": "planner", "backend": "backend",
                "validation": "validation"}


def package_at(ref: str) -> Path:
    """A folder to put on PYTHONPATH so that `import rackcast` gives the package as of git `ref` (the tree is
    exported once per commit; the rackcast namespace is laid out as pyproject.toml's package-dir maps it)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True,
                         text=True).stdout.strip()
    base = Path(tempfile.gettempdir()) / f"rackcast-tree-{sha[:12]}"
    pkg = base / "pkg"
    if not (pkg / "rackcast" / "__init__.py").exists():
        src = base / "src"
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        pkg.mkdir(exist_ok=True)
        (pkg / "rackcast").symlink_to(src / "rackcast")
        for folder, name in PACKAGE_DIRS.items():
            link = src / "rackcast" / name
            if not link.exists():
                link.symlink_to(src / folder)
    return pkg
