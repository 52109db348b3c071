"""The floors pyproject.toml declares (Python, torch) are at least what the code uses.

Each entry names a feature, the first version that has it and how to find it in the source; a
feature found in the code raises the floor it needs. Lowering a floor below a feature in use, or
using a newer feature without raising the floor (once it is in this table), fails here.
"""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]

PYTHON_FEATURES = {  # feature -> (first Python version, pattern in the source)
    "code.co_qualname": ((3, 11), r"\bco_qualname\b"),
    "tomllib": ((3, 11), r"^\s*import tomllib\b"),
    "except*": ((3, 11), r"^\s*except\*"),
    "match statement": ((3, 10), r"^\s*match .+:\s*$"),
    "X | Y in isinstance": ((3, 10), r"isinstance\([^)]*\|"),
}
TORCH_FEATURES = {  # feature -> (first torch version, pattern in the source)
    "SDPA enable_gqa": ((2, 5), r"\benable_gqa\s*="),
    "nn.RMSNorm": ((2, 4), r"\bnn\.RMSNorm\b"),
    "float8 dtypes": ((2, 1), r"\bfloat8_e4m3fn\b"),
}


def _sources():
    dirs = ("megafp8", "data_tools", "bench")
    files = [p for d in dirs for p in (ROOT / d).rglob("*.py")] + [ROOT / "pretrain_gpt.py"]
    return {p: p.read_text() for p in files}


def _floor(spec: str) -> tuple[int, ...]:
    m = re.search(r">=\s*([0-9]+(?:\.[0-9]+)*)", spec)
    assert m, spec
    return tuple(int(x) for x in m.group(1).split("."))


def _needed(table, sources):
    found = {}
    for name, (version, pattern) in table.items():
        rx = re.compile(pattern, re.M)
        hits = [str(p.relative_to(ROOT)) for p, text in sources.items() if rx.search(text)]
        if hits:
            found[name] = (version, hits)
    return found


def test_declared_floors_cover_what_the_code_uses():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python_floor = _floor(meta["requires-python"])
    torch_spec = next(d for d in meta["dependencies"] if re.match(r"torch\b", d))
    torch_floor = _floor(torch_spec)
    sources = _sources()
    py = _needed(PYTHON_FEATURES, sources)
    th = _needed(TORCH_FEATURES, sources)
    assert py and th  # the scan sees the code (these features are in use today)
    for name, (version, hits) in py.items():
        assert python_floor >= version, f"{name} needs Python {version} ({hits[:3]})"
    for name, (version, hits) in th.items():
        assert torch_floor >= version, f"{name} needs torch {version} ({hits[:3]})"


def test_ruff_targets_the_python_floor():
    """ruff's target version is the declared floor, so its upgrades and checks match it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = _floor(pyproject["project"]["requires-python"])
    assert pyproject["tool"]["ruff"]["target-version"] == f"py{floor[0]}{floor[1]}"
