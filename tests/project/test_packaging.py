"""pyproject.toml's dependencies: every lower bound covers the APIs used (by a table of the first
releases that have them, checked against the source so that it cannot rot), every declared
dependency is used, every third-party import is declared, and the installed versions satisfy
the bounds."""

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

# (distribution, what is used, regex that finds the use in the source, the release it needs).
# "Needs" is the first release that has it where the releases around it were inspected (the
# wheels downloaded with `pip download --no-deps` and grepped); where marked "(oldest checked)"
# it is the oldest release inspected, which has it, so the bound is sufficient for it.
APIS = [
    # jax 0.6.0 has no jax.shard_map (0.6.1 has it, with check_vma).
    ("jax", "jax.shard_map", r"\bjax\.shard_map\(", "0.6.1"),
    ("jax", "shard_map(..., check_vma=...)", r"\bcheck_vma=", "0.6.1"),
    # 0.6.1 has only TritonCompilerParams; 0.6.2 renames it CompilerParams.
    ("jax", "jax.experimental.pallas.triton.CompilerParams", r"\bpl(gpu|triton)\.CompilerParams\(", "0.6.2"),
    ("jax", "plgpu.elementwise_inline_asm (oldest checked)", r"\bplgpu\.elementwise_inline_asm\(", "0.6.0"),
    ("jax", "pl.next_power_of_2 (oldest checked)", r"\bpl\.next_power_of_2\(", "0.6.0"),
    ("jax", "jax.make_mesh(axis_types=(jax.sharding.AxisType.Auto, ...)) (oldest checked)",
     r"axis_types=\(jax\.sharding\.AxisType\.Auto", "0.6.0"),
    ("jax", "jax.lax.platform_dependent (oldest checked)", r"\bjax\.lax\.platform_dependent\(", "0.6.0"),
    ("jax", "jax.export.DisabledSafetyCheck (oldest checked)", r"\bjax\.export\.DisabledSafetyCheck\.", "0.6.0"),
    # flax 0.11.2 has no nnx.List.
    ("flax", "nnx.List", r"\bnnx\.List\(", "0.12.0"),
    ("flax", "nnx.to_pure_dict (oldest checked)", r"\bnnx\.to_pure_dict\(", "0.11.0"),
    ("flax", "nnx.eval_shape (oldest checked)", r"\bnnx\.eval_shape\(", "0.11.0"),
    ("flax", "nnx.Optimizer(..., wrt=...) (oldest checked)", r"\bnnx\.Optimizer\(.*\bwrt=", "0.11.0"),
    # optax 0.2.4 has no optax.tree.
    ("optax", "optax.tree.norm", r"\boptax\.tree\.norm\(", "0.2.5"),
    # 0.11.13's PyTreeRestoreArgs has no partial_restore.
    ("orbax-checkpoint", "ocp.args.PyTreeRestore(partial_restore=...)",
     r"ocp\.args\.PyTreeRestore\([^)]*\bpartial_restore=", "0.11.14"),
    # 0.11.14 to 0.11.23 fail to restore partially a tree with integer keys (nnx.List's
    # layers): "Missing 2 keys in structure path ('params', 'blocks')"; run, not read.
    ("orbax-checkpoint", "PyTreeRestore(partial_restore=True) of nnx.List's integer keys",
     r"ocp\.args\.PyTreeRestore\([^)]*\bpartial_restore=True", "0.11.24"),
    # 0.11.24 to 0.11.32 refuse to restore onto arrays without a sharding ("sharding passed to
    # deserialization should be specified") a checkpoint saved over 8 devices; run, not read
    # (tests/lab/test_train.py::test_sharded_training_on_8_devices_matches_one_device).
    ("orbax-checkpoint", "restore onto abstract arrays without a sharding", r"\bconstruct_restore_args\(", "0.11.33"),
    ("orbax-checkpoint", "ocp.args.Composite, StandardSave, JsonSave (oldest checked)",
     r"ocp\.args\.Composite\(", "0.11.14"),
    # grain 0.2.7 has grain.MapDataset at the top level but not grain.ReadOptions.
    ("grain", "grain.ReadOptions", r"\bgrain\.ReadOptions\(", "0.2.8"),
    ("grain", "grain.MapDataset, IterDataset, DatasetIterator at the top level", r"\bgrain\.MapDataset\b", "0.2.6"),
    ("tensorflow-datasets", "tfds.data_source (oldest checked)", r"\btfds\.data_source\(", "4.9.0"),
    # 4.9.8 and 4.9.9 read DatasetInfo through FieldDescriptor.label, which protobuf 7 no
    # longer has (AttributeError on reading a prepared data set); 4.9.10 does without it.
    ("tensorflow-datasets", "prepared data sets read back with protobuf 7", r"\btfds\.data_source\(", "4.9.10"),
    ("etils", "etils.epath.Path (oldest checked)", r"\bepath\.Path\(", "1.0.0"),
    # 1.9.1 to 1.12.2 (the wheels inspected) define is_file() as `not is_dir()`: True for a
    # missing file; 1.13.0 checks exists() first. Run: training on 1.9.1 failed at its start.
    ("etils", "epath.Path.is_file() False for a missing file", r"\bfiles\.path\([^)]*\)\.is_file\(\)", "1.13.0"),
    # ml-collections 0.1.0 has neither (0.1.1 is a source release only).
    ("ml-collections", "config_flags.DEFINE_config_file(accept_new_attributes=...)",
     r"\baccept_new_attributes=", "1.0.0"),
    ("ml-collections", "config_flags.get_override_values", r"\bconfig_flags\.get_override_values\(", "1.0.0"),
    ("sentencepiece", "SentencePieceTrainer.train(sentence_iterator=..., model_writer=...) (oldest checked)",
     r"\bmodel_writer=", "0.1.99"),
    ("pyarrow", "pyarrow.parquet.ParquetFile.iter_batches", r"\.iter_batches\(", "3.0"),
    # 0.15.0 has no encode_special_tokens; up to 0.19.1 a tokenizer.json whose merges are pairs
    # (as 0.20 and later write them: the fixtures, recent checkpoints) does not parse.
    ("tokenizers", "Tokenizer.encode_special_tokens", r"\.encode_special_tokens = ", "0.15.1"),
    ("tokenizers", "Tokenizer.from_file of a tokenizer.json with merges as pairs", r"\bTokenizer\.from_file\(",
     "0.20.0"),
    ("tiktoken", "tiktoken.Encoding(pat_str=..., mergeable_ranks=..., special_tokens=...), encode_ordinary "
     "(oldest checked)", r"\btiktoken\.Encoding\(", "0.3.0"),
]

# Bounds raised above the APIs' needs so that the declared minimums install together:
# (distribution, needs, why, regex that finds the use of the package that requires it).
REQUIRED_BY = [
    ("jax", "0.7.1", "flax 0.12.0 requires jax>=0.7.1", r"\bnnx\.List\("),
    # The oldest JAX tested (`make test-min`), the lent GPU machine's; Pallas asks an abstract
    # mesh's device which chip it lowers for (lab.lowering.target).
    ("jax", "0.11.2", "the GPU machine's jax, tested by make test-min", r"\bjax\.sharding\.use_abstract_mesh\("),
    # flax 0.12.0 to 0.12.7 use jax APIs that jax 0.11 removed; 0.12.8 and 0.12.9 need a newer jax.
    ("flax", "0.12.10", "the first flax that imports with jax 0.11.2", r"\bnnx\.List\("),
    # Older releases have no wheels for Python 3.12 (the oldest Python the project takes) and
    # fail to build from source here.
    ("pyarrow", "14.0", "the first pyarrow with Python 3.12 wheels", r"\.iter_batches\("),
    # 14.0 declares no upper bound on numpy but is built against NumPy 1: beside numpy 2 (which
    # a resolver may pick with it) its import fails; 15.0 declares numpy<2, 16.0 is built for 2.
    ("pyarrow", "16.0", "the first pyarrow built for NumPy 2", r"\.iter_batches\("),
    ("tiktoken", "0.5.2", "the first tiktoken with Python 3.12 wheels", r"\btiktoken\.Encoding\("),
    # 1.0.0's config_dict.py has an invalid escape, a SyntaxWarning on Python 3.12 at its first
    # import: a stray line before a command's one-line error.
    ("ml-collections", "1.1.0", "no SyntaxWarning on Python 3.12", r"\baccept_new_attributes="),
    # 0.11.14 to 0.11.16 use jax.experimental.layout.DeviceLocalLayout, which jax 0.7 removed.
    ("orbax-checkpoint", "0.11.17", "importable with jax 0.7.1", r"^import orbax\.checkpoint as ocp\b"),
    ("numpy", "1.26", "jax 0.7.1 requires numpy>=1.26", r"^import numpy as np\b"),
    ("scipy", "1.12", "jax 0.7.1 requires scipy>=1.12", r"^from scipy import stats\b"),
    ("etils", "1.9.1", "tensorflow-datasets 4.9.10 requires etils>=1.9.1 on Python 3.11+", r"^from etils import epath\b"),
]

# Declared distribution -> the module it is imported as.
IMPORT_NAMES = {
    "jax": "jax",
    "flax": "flax",
    "optax": "optax",
    "orbax-checkpoint": "orbax.checkpoint",
    "tensorflow-datasets": "tensorflow_datasets",
    "grain": "grain",
    "etils": "etils",
    "ml-collections": "ml_collections",
    "absl-py": "absl",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "tensorboardX": "tensorboardX",
    "sentencepiece": "sentencepiece",
    "tqdm": "tqdm",
    "pyarrow": "pyarrow",
    "pytest": "pytest",
    "scipy": "scipy",
    "torch": "torch",  # the fixtures extra: tests/data/hf/make_fixtures.py
    "transformers": "transformers",
    "tokenizers": "tokenizers",  # the hf extra: data/tokenizers.py
    "tiktoken": "tiktoken",
    "fla-core": "fla",  # the gpu-bench extra: benchmarks/path_kernel.py
    "triton": "triton",
}

# Declared but never imported: (file, regex) where each is needed.
NOT_IMPORTED = {
    # tfds writes and reads ArrayRecord files (file_format="array_record", tfds.data_source)
    # through array_record, which tfds declares only on Linux.
    "array-record": ("data/local_text.py", r'file_format="array_record"'),
    "ruff": ("Makefile", r"\$\(PY\) -m ruff check"),  # `make lint`, run by `make test`
    "pytest-xdist": ("Makefile", r"\$\(PY\) -m pytest -q -n 2"),  # `make test`'s two workers
    # The cuda-compile extra: the CUDA compilers XLA's GPU compiler calls (ptxas, libdevice), which
    # lab.lowering points it at.
    "nvidia-cuda-nvcc": ("lab/lowering.py", r'"nvidia", "cu13"'),
    "nvidia-nvvm": ("lab/lowering.py", r'"nvidia", "cu13"'),
    "nvidia-cuda-crt": ("lab/lowering.py", r'"nvidia", "cu13"'),
}

REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9_,\s-]*\])?\s*>=\s*([0-9][0-9.]*)$")


def version(text: str) -> tuple[int, ...]:
    """The release part of a version string as a tuple of ints ("0.11.14" -> (0, 11, 14)); trailing zeros
    are dropped so that 1.0 == 1.0.0."""
    release = [int(part) for part in re.match(r"\d+(?:\.\d+)*", text).group().split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return tuple(release)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, str]:
    """{distribution: lower bound} of the dependencies and of every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    bounds = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement.strip())
        assert match, f"{requirement!r}: every dependency needs exactly one lower bound, `name>=version`"
        bounds[match.group(1)] = match.group(3)
    return bounds


def python_files() -> list[Path]:
    skip = {"__pycache__", "build", "dist", "runs"}
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                             for part in p.relative_to(ROOT).parts))


def source() -> str:
    """Every Python file of the tree but this one (whose table would match itself)."""
    return "\n".join(p.read_text() for p in python_files() if p.resolve() != THIS)


def imported_modules() -> set[str]:
    """Every module the tree imports, at any depth (imports inside functions too)."""
    modules = set()
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module)
                modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_bounds_cover_the_apis_used():
    bounds = {normalize(name): bound for name, bound in declared().items()}
    needs = [(dist, what, need) for dist, what, _, need in APIS]
    needs += [(dist, why, need) for dist, need, why, _ in REQUIRED_BY]
    low = [f"{dist}>={bounds.get(normalize(dist))}, but {what} needs {dist} {need}"
           for dist, what, need in needs
           if normalize(dist) not in bounds or version(bounds[normalize(dist)]) < version(need)]
    assert not low, "pyproject.toml bounds below what the code needs:\n" + "\n".join(low)


def test_the_table_names_apis_that_are_used():
    text = source()
    unused = [f"{dist}: {what} ({pattern})" for dist, what, pattern, _ in APIS
              if not re.search(pattern, text, re.MULTILINE)]
    unused += [f"{dist}: {why} ({pattern})" for dist, _, why, pattern in REQUIRED_BY
               if not re.search(pattern, text, re.MULTILINE)]
    assert not unused, "table rows whose use is gone from the source (update the table and the bounds):\n" + \
        "\n".join(unused)


def test_every_declared_dependency_is_used():
    modules = imported_modules()
    unused = []
    for dist in declared():
        if dist in NOT_IMPORTED:
            file, pattern = NOT_IMPORTED[dist]
            if not re.search(pattern, (ROOT / file).read_text()):
                unused.append(f"{dist} (not found in {file}: {pattern})")
            continue
        assert dist in IMPORT_NAMES, f"{dist}: add its import name to IMPORT_NAMES"
        name = IMPORT_NAMES[dist]
        if not any(m == name or m.startswith(name + ".") for m in modules):
            unused.append(f"{dist} (no `import {name}`)")
    assert not unused, "declared but never used:\n" + "\n".join(unused)


def test_every_third_party_import_is_declared():
    files = python_files()
    # Local: a module, a top-level folder, or a package anywhere (tests/helpers, imported as
    # `helpers` with tests/ on the path).
    local = ({p.stem for p in files} | {p.relative_to(ROOT).parts[0] for p in files}
             | {p.parent.name for p in files if p.name == "__init__.py"})
    third_party = {m.split(".")[0] for m in imported_modules()} - set(sys.stdlib_module_names) - local
    third_party.discard("__future__")
    declared_names = {IMPORT_NAMES[d].split(".")[0] for d in declared() if d in IMPORT_NAMES}
    assert third_party <= declared_names, f"imported but not declared in pyproject.toml: {third_party - declared_names}"


@pytest.mark.parametrize("dist", sorted(declared()))
def test_installed_version_satisfies_the_bound(dist):
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    try:
        installed = metadata.version(dist)
    except metadata.PackageNotFoundError:
        if any(REQUIREMENT.match(r.strip()).group(1) == dist for r in core):
            raise
        pytest.skip(f"{dist} (an extra) is not installed")
    assert version(installed) >= version(declared()[dist]), f"{dist} {installed} < {declared()[dist]}"


def test_a_users_own_folders_do_not_shadow_the_packages(tmp_path):
    """From a working directory holding its own data/ and models/ folders (no __init__.py), the
    installed project's packages are the ones imported (the editable install is a path entry,
    pyproject's package-dir, not an import hook that such folders would come before)."""
    for name in ("data", "models", "configs", "lab"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("a user's own files")
    code = "import data.tasks, models.lm, configs, lab.runs; print(data.__file__, models.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1]
    assert str(tmp_path) not in out.stdout, out.stdout
