"""Fault suite, hostile files: paths out of the dataset, code-running loaders, remote code, unknown keys.

The static checks parse every product module (extract/, train/, eval/) with `ast`, so a new
`torch.load` without ``weights_only=True`` or a new `from_pretrained(..., trust_remote_code=True)`
fails here with its file and line.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers_paths import ROOT
from helpers_store import make_dataset as make_store_dataset
from helpers_train import base_args, make_dataset, make_target, run_main

from extract.config import ExtractConfig, load_yaml
from extract.verify import verify_dataset
from redraft.core.config import ConfigError as ExtractConfigError
from redraft.core.dataset.format import DatasetError
from redraft.core.dataset.reader import DatasetReader
from train.config import ConfigError as TrainConfigError
from train.config import load_config

PRODUCT = [p for d in ("extract", "train", "eval") for p in sorted((ROOT / d).rglob("*.py"))]


# ----------------------------------------------------------------------------- paths leaving the dataset


def _point_shard_outside(ds: Path, outside: Path, how: str) -> None:
    """Make manifest entry 0 reach ``outside`` (a real, valid shard) in one of four ways."""
    outside.mkdir(parents=True, exist_ok=True)
    real = ds / "shards" / "shard-000000.safetensors"
    stolen = outside / "shard-000000.safetensors"
    shutil.copy(real, stolen)
    manifest = json.loads((ds / "manifest.json").read_text())
    if how == "dotdot":
        manifest["shards"][0]["path"] = os.path.relpath(stolen, ds)
    elif how == "absolute":
        manifest["shards"][0]["path"] = str(stolen)
    elif how == "symlinked_file":
        real.unlink()
        real.symlink_to(stolen)
    elif how == "symlinked_folder":
        shutil.rmtree(ds / "shards")
        for p in (ds.parent / "ds_src" / "shards").iterdir():
            shutil.copy(p, outside / p.name)
        (ds / "shards").symlink_to(outside, target_is_directory=True)
    (ds / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def store_ds(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hostile") / "ds_src"
    make_store_dataset(src)
    return src


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked_file", "symlinked_folder"])
def test_shard_paths_leaving_the_dataset_are_refused(store_ds, tmp_path, how):
    ds = tmp_path / "ds"
    shutil.copytree(store_ds, ds)
    shutil.copytree(store_ds, tmp_path / "ds_src")
    _point_shard_outside(ds, tmp_path / "elsewhere", how)
    problems = verify_dataset(ds)
    assert problems and "shard-000000" in problems[0] and ("leaves the dataset root" in problems[0]
                                                            or "outside" in problems[0]), problems
    with pytest.raises(DatasetError, match="leaves the dataset root|outside"):
        DatasetReader(ds)


def test_trainer_refuses_a_manifest_pointing_outside(tmp_path):
    target, vocab = make_target(tmp_path / "target")
    ds = make_dataset(tmp_path / "ds", target, vocab, num_samples=16, per_shard=8)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][1]["path"] = "shards/../../etc/passwd"
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"shard path 'shards/\.\./\.\./etc/passwd' leaves the dataset root"):
        run_main(base_args(ds, tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("step-*"))


# ----------------------------------------------------------------------------- static checks


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.expr) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    parts.append(func.id if isinstance(func, ast.Name) else "<expr>")  # x().eval() is not the builtin eval
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _parsed():
    for path in PRODUCT:
        yield path.relative_to(ROOT), ast.parse(path.read_text(), filename=str(path))


def test_nothing_unpickles_untrusted_data():
    bad = []
    for rel, tree in _parsed():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{rel}:{node.lineno}: imports {m}" for m in mods
                        if m.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "shelve", "marshal")]
        for call in _calls(tree):
            name = _name(call.func)
            where = f"{rel}:{call.lineno}: {name}"
            if name.endswith("torch.load") or name == "load" and _kw(call, "map_location") is not None:
                if not _is_const(_kw(call, "weights_only"), True):
                    bad.append(f"{where} without weights_only=True")
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "eval", "exec"):
                bad.append(where)
            if name.endswith(("np.load", "numpy.load")) and not _is_const(_kw(call, "allow_pickle"), False):
                if _kw(call, "allow_pickle") is not None:
                    bad.append(f"{where} with allow_pickle")
            if name.endswith("register_for_checkpointing"):  # accelerate unpickles these with weights_only=False
                bad.append(where)
    assert bad == []


def test_trust_remote_code_is_off_unless_asked():
    bad, calls = [], 0
    for rel, tree in _parsed():
        for call in _calls(tree):
            value = _kw(call, "trust_remote_code")
            if _is_const(value, True):
                bad.append(f"{rel}:{call.lineno}: trust_remote_code=True")
            if _name(call.func).endswith("from_pretrained"):
                calls += 1
                if value is not None and not (_is_const(value, False) or isinstance(value, ast.Name | ast.Attribute)):
                    bad.append(f"{rel}:{call.lineno}: trust_remote_code={ast.unparse(value)}")
        for node in ast.walk(tree):  # defaults of parameters and config fields named trust_remote_code
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "trust_remote_code":
                default = node.value
                if isinstance(default, ast.Call) and default.args:
                    default = default.args[0]
                if not _is_const(default, False):
                    bad.append(f"{rel}:{node.lineno}: field trust_remote_code defaults to {ast.unparse(node.value)}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
                defaults += node.args.kw_defaults
                for arg, default in zip(args, defaults, strict=True):
                    if arg.arg == "trust_remote_code" and default is not None and not _is_const(default, False):
                        bad.append(f"{rel}:{node.lineno}: {node.name}(trust_remote_code={ast.unparse(default)})")
    assert calls >= 3  # the scan really saw the loaders
    assert bad == []
    assert ExtractConfig().trust_remote_code is False


# ----------------------------------------------------------------------------- unknown config keys


def test_extract_config_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "extract.yaml"
    path.write_text("target: t\ndata: [a.jsonl]\nout: o\ntrust_remote: true\n")
    with pytest.raises(ExtractConfigError, match=r"extract.yaml: unknown key 'trust_remote'"):
        load_yaml(path)


def test_train_config_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("data: d\nout: o\nlearning_rate: 0.1\n")
    with pytest.raises(TrainConfigError, match="learning_rate"):
        load_config(str(path))
