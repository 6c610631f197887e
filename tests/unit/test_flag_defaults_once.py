"""A flag's default is written once in rlhfkit/ (issue #44): by its declaration (`flag(...)`, rlhfkit.config.declare),
or, where a command has its own default, by one named constant that the command's parser and the
component's config both read. A dataclass mirroring a flag takes the default from there
(`default_of(Decl, "name")`, or the constant), never as a literal written again.

Two checks:
- the source (AST) of every rlhfkit module: a field of a dataclass whose name is the dest of a flag of
  some command, with a literal default (`2048`, `"input"`, `(-10.0, 10.0)`, `32 * 2**20`,
  `field(default=...)` of one), fails the test unless `LEFT` names it with the reason it is left; an
  entry of `LEFT` that the walker no longer finds fails too, so the list only shrinks;
- the values: each dataclass a command builds from its parsed flags (`from_args(Config, args)` in
  rlhfkit/cli, and BUILT_BY_POSITION) has, for every field that is a dest of that command's parser, the
  parser's default."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import os

from helpers import ROOT

from rlhfkit.cli.main import COMMANDS
from rlhfkit.config.declare import declared_default

# Fields named like a flag dest that still write a literal default, with why. Each key: "Class.field".
NOT_THE_FLAG = "not the flag's setting: the same name for another value"
RESOLVED = "the value a command resolves the flag to, not the flag's default (resolved in rl_run/resolve.py)"
DIFFERS = "a direct constructor's default that differs from the flag's (keeping it keeps behaviour)"
LEFT: dict[str, str] = {
    **dict.fromkeys([
        "SamplingParams.temperature", "SamplingParams.top_p", "SamplingParams.top_k", "SamplingParams.max_new_tokens",
        "SamplingParams.seed", "SamplingParams.repetition_penalty",  # one request's sampling (rlhfkit.types)
        "BackendConfig.max_ckpt_mem",  # GB, None: no limit (the flag is CheckpointFlags')
        "Placement.backend",  # the process-group backend (nccl / gloo), not --backend
        "ParallelizeConfig.device", "DistInfo.device", "DistInfo.local_rank", "MeshGroups.tp_size",
        "RequestLimits.max_query_chars",  # a resolved limit; --max_query_chars 0 means automatic
        "ConfigFields.num_key_value_heads", "ConfigFields.tie_word_embeddings",  # a Hugging Face config's fields
        "RLCheckpointer.best_metric_key", "RLCheckpointer.run_dir",
        "RMTask.device", "KTOTask.device", "DPOTask.device", "KDTask.device", "PRMTask.device", "SFTTask.device",
        "LaunchedRoles.weight_sync", "BuiltinEngineConfig.seed", "BuiltinEngineConfig.max_num_seqs",
        "TRLRLNames.learning_rate",  # TRL's name, None: the command's --actor_learning_rate
        "ChatSession.csft_prompt",  # None: no suffix (--enable_csft off), not --csft_prompt's text
    ], NOT_THE_FLAG),
    "RewardShapingConfig.generate_max_len": RESOLVED,
    **dict.fromkeys([
        "RLLoopConfig.init_kl_coef", "RLLoopConfig.ckpt_path", "LoopConfig.max_epochs", "LoopConfig.ckpt_path",
        "UpdateConfig.max_epochs", "UpdateConfig.ptx_coef", "ParallelizeConfig.ring_head_stride",
    ], DIFFERS),
}
# a module outside rlhfkit/cli that builds configs from a command's flags: the command whose parser they mirror
HELPER_OF = {"rlhfkit.rl_run.builders": "train_ppo"}
# configs a command builds from its flags by position rather than with from_args (ScoreConfig is not here: its
# output_key is the column scored when --output_key is not given)
BUILT_BY_POSITION = [("batch_inference", "rlhfkit.inference.generate", "GenerateConfig"),
                     ("interactive_chat", "rlhfkit.inference.chat", "ReplyConfig")]


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def is_literal(node: ast.AST) -> bool:
    """A value written out: a constant, a tuple / list / set of them, arithmetic on them, `field(default=...)` or
    `field(default_factory=lambda: ...)` of one. A name (a constant defined once) or a call is not."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(is_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    if isinstance(node, ast.Lambda):
        return is_literal(node.body)
    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "field":
        return any(kw.arg in ("default", "default_factory") and is_literal(kw.value) for kw in node.keywords)
    return False


def literal_fields_in(source: str, dests: set[str], where: str = "<string>") -> dict[str, str]:
    """"Class.field" -> "where:line" for each dataclass field named like a flag dest with a literal default."""
    out = {}
    for cls in ast.walk(ast.parse(source)):
        if isinstance(cls, ast.ClassDef) and _is_dataclass(cls):
            for node in cls.body:
                if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
                        and node.target.id in dests and is_literal(node.value)):
                    out[f"{cls.name}.{node.target.id}"] = f"{where}:{node.lineno}"
    return out


def _sources():
    pkg = os.path.join(ROOT, "rlhfkit")
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, fn)
            with open(path, encoding="utf-8") as f:
                yield os.path.relpath(path, ROOT), f.read()


@functools.lru_cache(maxsize=None)
def parsers() -> dict[str, object]:
    return {mod: importlib.import_module(f"rlhfkit.cli.{mod}").build_parser() for mod in sorted(set(COMMANDS.values()))}


def dests_of(parser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings}


def flag_dests() -> set[str]:
    return set().union(*(dests_of(p) for p in parsers().values()))


def literal_fields(dests: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for where, source in _sources():
        out.update(literal_fields_in(source, dests, where))
    return out


def test_no_flag_default_is_written_again():
    dests = flag_dests()
    assert len(dests) > 250 and {"max_len", "seed", "input_key", "batch_size"} <= dests  # the parsers were read
    found = literal_fields(dests)
    written = {k: v for k, v in sorted(found.items()) if k not in LEFT}
    assert not written, ("a flag's default written out again (take it with default_of(Decl, name), or name the "
                         "command's own default once):\n" + "\n".join(f"  {k} ({v})" for k, v in written.items()))
    stale = sorted(set(LEFT) - set(found))
    assert not stale, f"LEFT names fields that no longer write a literal default; remove them: {stale}"


def test_walker_finds_planted_literal_defaults():
    source = '''
@dataclass
class A:
    max_len: int = 2048
    seed: int = SEED
    input_key: str = default_of(DataFlags, "input_key")
    clip: tuple[float, float] = (-10.0, 10.0)
    size: int = 32 * 2**20
    keys: list[str] = field(default_factory=lambda: ["a"])
    other: int = 3


class NotADataclass:
    max_len: int = 2048


@dataclasses.dataclass(frozen=True)
class B:
    seed: int = field(default=-1)
    max_len: int = field(default_factory=list)
'''
    found = literal_fields_in(source, {"max_len", "seed", "input_key", "clip", "size", "keys"}, "planted.py")
    assert found == {"A.max_len": "planted.py:4", "A.clip": "planted.py:7", "A.size": "planted.py:8",
                     "A.keys": "planted.py:9", "B.seed": "planted.py:19"}


def built_from_flags() -> list[tuple[str, str, str]]:
    """(command, module, class) for each `from_args(Class, ...)` in rlhfkit/ of a class outside rlhfkit.config
    (whose classes are the declarations); the command: the calling module's (rlhfkit.cli.<command>) or HELPER_OF's."""
    out = []
    for where, source in _sources():
        if where.startswith(os.path.join("rlhfkit", "config")):
            continue
        tree = ast.parse(source)
        imported = {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    for a in n.names}
        mod = os.path.splitext(where)[0].replace(os.sep, ".")
        for call in ast.walk(tree):
            if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "from_args" and call.args
                    and isinstance(call.args[0], ast.Name)):
                home = imported.get(call.args[0].id, "")
                if not home.startswith("rlhfkit.config"):
                    out.append((HELPER_OF.get(mod, mod.removeprefix("rlhfkit.cli.")), home, call.args[0].id))
    return sorted(set(out))


def drift(cls: type, parser) -> dict[str, tuple[object, object]]:
    """Field -> (the dataclass's default, the parser's) where they differ, over the fields that are the parser's
    dests (a tuple default compares as the list the flag gives); required fields and RESOLVED ones are skipped."""
    dests = dests_of(parser)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in dests or LEFT.get(f"{cls.__name__}.{f.name}") == RESOLVED:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue
        mine = declared_default(cls, f.name)
        mine = list(mine) if isinstance(mine, tuple) else mine
        if mine != parser.get_default(f.name):
            out[f.name] = (mine, parser.get_default(f.name))
    return out


def test_configs_built_from_flags_have_the_parsers_defaults():
    built = built_from_flags()
    assert {c for _, _, c in built} >= {"SFTDataConfig", "PreferenceDataConfig", "UnpairedDataConfig",
                                         "PRMDataConfig", "ServeConfig", "TinyModelSpec", "AdvantageConfig",
                                         "RewardShapingConfig"}
    wrong = {}
    for command, module, name in built + BUILT_BY_POSITION:
        assert command in parsers(), f"{name} is built in {command}, not a command's module (see HELPER_OF)"
        cls = getattr(importlib.import_module(module), name)
        if d := drift(cls, parsers()[command]):
            wrong[f"{command}: {name}"] = d
    assert not wrong, f"defaults that differ from the command's parser: {wrong}"


def test_drift_is_found():
    from rlhfkit.config.flag_parser import FlagParser

    @dataclasses.dataclass
    class Planted:
        max_len: int = 1024
        seed: int = 42
        unrelated: int = 7

    p = FlagParser("planted")
    p.flag("--max_len", type=int, default=2048)
    p.flag("--seed", type=int, default=42)
    assert drift(Planted, p) == {"max_len": (1024, 2048)}
